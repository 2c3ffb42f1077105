"""The recorded forward benchmark's part-by-part table, as lab 06 prints it."""

from mhc_lab.course import forward_lab


def _shape(tokens: int, C: int, whole: float, post: float, variants=()) -> dict:
    """One shape of a forward recording: the fused kernel's time, the post's, and (tuning, ms) variants."""
    return {"tokens": tokens, "C": C, "time_ms": {"stream.post_project": whole, "post": post},
            "stream_variants": [{"tuning": tuning, "time_ms": {"stream.post_project": ms}}
                                for tuning, ms in variants]}


def _recording(shapes: list, fixed: list | None = None, read_once: list | None = None) -> dict:
    results = {"leave_out_run_O": {"environment": {"gpu": "Some GPU", "date": "2026-01-02"}, "shapes": shapes}}
    if fixed is not None:
        results["phi_first_run_P"] = {"shapes": fixed}
    if read_once is not None:
        results["lanes_once_run_AS"] = {"shapes": read_once}
    return {"environment": {"gpu": "Other GPU"}, "results": results}


def test_leave_out_table_gives_each_step_per_shape_and_the_fix():
    steps = {("gemm",): 0.35, ("gemm", "phi"): 0.34, ("gemm", "phi", "out_tile"): 0.33,
             ("gemm", "phi", "out_tile", "mix"): 0.32}
    shapes = [_shape(16384, 4096, 0.43, 0.30, [({"leave_out": list(k)}, ms) for k, ms in steps.items()]),
              _shape(8192, 7168, 0.37, 0.27)]  # this shape's steps were not timed
    fixed = [_shape(16384, 4096, 0.44, 0.31, [({"phi_first": True}, 0.39)])]
    read_once = [_shape(16384, 4096, 0.366, 0.31)]  # run AS: the kernel's own time at one shape
    lines = forward_lab.leave_out_table(_recording(shapes, fixed, read_once)).splitlines()
    assert lines[0].startswith("RECORDED on Some GPU, 2026-01-02")  # the run's own tags, not the file's
    assert lines[1].split()[-6:] == ["16384", "x", "4096", "8192", "x", "7168"]
    values = [line.split()[-2:] for line in lines[2:]]
    assert values == [["0.430", "0.370"], ["0.350", "-"], ["0.340", "-"], ["0.330", "-"], ["0.320", "-"],
                      ["0.300", "0.270"], ["0.390", "-"], ["0.366", "-"]]
    assert "read once" in lines[-1]


def test_leave_out_table_without_the_runs_says_so():
    assert forward_lab.leave_out_table({"results": {}}).startswith("(no leave_out recording")
    text = forward_lab.leave_out_table(_recording([_shape(16384, 2560, 0.28, 0.2)]))
    assert "A operand" not in text and "read once" not in text  # no fix row without its run


def test_the_recorded_leave_out_table_renders_every_recorded_step():
    recording = forward_lab.recorded_or_none(forward_lab.STREAM_RECORDING)
    text = forward_lab.leave_out_table(recording)
    for shape in recording["results"]["leave_out_run_O"]["shapes"]:
        for row in shape["stream_variants"]:
            assert f"{row['time_ms']['stream.post_project']:.3f}" in text
    shapes = len(recording["results"]["leave_out_run_O"]["shapes"])
    # every cell measured, but run AS's (cut off before 8192 x 7168)
    assert all("-" not in line.split()[-shapes:] for line in text.splitlines()[2:] if "run AS" not in line)


STRIPPED = ["gemm", "phi", "out_tile", "mix"]


def test_row_length_table_gives_each_box_shape_stripped_per_shape():
    boxes = [({}, 0.34, 0.30), ({"linear_tiles": True, "block_m": 32, "block_k": 128}, 0.31, 0.27),
             ({"linear_tiles": True, "block_m": 32, "block_k": 128, "stages": 3}, 0.311, None)]
    shapes = []
    for k, (tokens, C) in enumerate([(16384, 4096), (8192, 7168)]):
        variants = [({**box, "leave_out": STRIPPED}, times[k]) for box, *times in boxes if times[k] is not None]
        variants.append(({"linear_tiles": True}, 0.5))  # a whole kernel, not stripped: not a row of the table
        shapes.append(_shape(tokens, C, (0.39, 0.34)[k], (0.309, 0.275)[k], variants))
    recording = {"results": {"row_length_run_AA": {"environment": {"gpu": "Some GPU", "date": "2026-01-02"},
                                                   "shapes": shapes}}}
    lines = forward_lab.row_length_table(recording).splitlines()
    assert lines[0].startswith("RECORDED on Some GPU, 2026-01-02")
    assert lines[1].split()[-6:] == ["16384", "x", "4096", "8192", "x", "7168"]
    assert lines[2].split()[-2:] == ["0.390", "0.340"] and lines[3] == "stripped to a plain copy, boxes of"
    assert "64 tokens x 64 columns (128-byte rows), swizzled" in lines[4] and lines[4].split()[-2:] == ["0.340",
                                                                                                       "0.300"]
    assert "32 tokens x 128 columns (256-byte rows), unswizzled" in lines[5]
    assert lines[5].split()[-2:] == ["0.310", "0.270"]
    assert "3 stages" in lines[6] and lines[6].split()[-2:] == ["0.311", "-"]  # not timed at the second shape
    assert lines[7].split()[-2:] == ["0.309", "0.275"] and len(lines) == 8


def test_the_recorded_row_length_table_renders_every_stripped_variant():
    recording = forward_lab.recorded_or_none(forward_lab.STREAM_RECORDING)
    text = forward_lab.row_length_table(recording)
    shapes = recording["results"]["row_length_run_AA"]["shapes"]
    stripped = [row for s in shapes for row in s["stream_variants"] if row["tuning"].get("leave_out") == STRIPPED]
    assert len(stripped) == 14
    for row in stripped:
        assert f"{row['time_ms']['stream.post_project']:.3f}" in text
    assert "-" not in " ".join(line[-30:] for line in text.splitlines()[2:])  # every cell measured
    assert forward_lab.row_length_table({"results": {}}).startswith("(no row-length recording")
