"""The recorded training benchmark's tables, as lab 07 prints them (mhc_lab.course.training_recorded), and the
block breakdown's arithmetic (mhc_lab.bench.kernels)."""

import pytest

from mhc_lab.bench.kernels import compare_kernel_times, kernel_totals
from mhc_lab.course import training_lab


def _site(graph: dict, launched: dict, **extra) -> dict:
    # least bytes of a 16384 x 4096 site: 41 C bf16 elements per token
    shape = {"tokens": 16384, "C": 4096, "n": 4, "bytes": {"least": 41 * 4096 * 2 * 16384}, "graph_ms": graph,
             "launched_ms": launched, **extra}
    return {"copy_gbps": 4000.0, "shapes": [shape]}


def test_site_table_gives_the_gpu_time_first_and_the_chained_ratio_per_clock():
    rounds = {"ratios": [0.5, 0.51], "median": 0.505, "least": 0.5, "most": 0.51}
    site = _site({"ours_chained": 1.5, "tilekernels": 3.0},
                 {"ours_chained": 2.4, "tilekernels": 3.0, "compiled": 18.0},
                 chained_vs_tilekernels_graph_rounds=rounds)
    graph, launched, in_rounds = training_lab.site_table(site).split("\n\n")
    assert graph.startswith("GPU time (CUDA graph replay):") and launched.startswith("launched op by op:")
    assert "0.50x" in graph and "0.80x" in launched
    assert "torch.compile" in launched and "torch.compile" not in graph  # only what each clock timed
    # 41 C x 2 bytes x 16384 tokens in 1.5 ms against 4000 GB/s of copy
    assert f"{41 * 4096 * 2 * 16384 / 1.5e-3 / 1e9 / 4000:.0%} of copy" in graph
    assert "median 0.505x over 2 rounds (0.500x to 0.510x)" in in_rounds


def test_site_table_without_graph_times_shows_the_launched_ones_only():
    text = training_lab.site_table(_site({}, {"ours_chained": 2.0, "tilekernels": 2.5}))
    assert "CUDA graph" not in text and "0.80x" in text and text.count("launched op by op:") == 1
    assert training_lab.site_table(None) == "(no site measurements)"


def _block(**kinds) -> dict:
    """One width whose kinds took these launched rounds (and as graphs the same, 1 ms less each)."""
    from mhc_lab.bench.common import overheads

    launched = {k: list(v) for k, v in kinds.items()}
    graph = {k: [t - 1 for t in v] for k, v in kinds.items()}
    return {"widths": [{"C": 64, "tokens": 128, "peak_gib": {"residual": 1.0, "mhc_ours": 1.5},
                        "launched": {"rounds_ms": launched, "overhead_pct": overheads(launched)},
                        "graph": {"rounds_ms": graph, "overhead_pct": overheads(graph)},
                        "errors": {"mhc_tilekernels": "not installed"}}]}


def test_block_table_gives_each_kinds_median_and_overhead_launched_and_as_graph():
    lines = training_lab.block_table(_block(residual=[10.0, 11.0, 12.0], mhc_ours=[11.0, 12.1, 13.2])).splitlines()
    assert lines[0].startswith("C = 64, 128 tokens")
    assert lines[1].split()[2:] == ["11.00", "ms", "10.00", "ms", "1.00", "GiB"]  # the plain residual: no overhead
    ours = lines[2].split()
    assert ours[-8:] == ["12.10", "ms", "+10.0%", "11.10", "ms", "+11.0%", "1.50", "GiB"]
    assert "not measured: not installed" in lines[3] and "5 rounds" not in lines[-1]
    assert lines[-1].startswith("  (medians of 3 rounds launched, 3 as graphs")
    assert training_lab.block_table(None) == "(no block measurements)"


def test_block_figure_draws_each_kinds_median_per_mode():
    bars = {bar.name: list(bar.y) for bar in
            training_lab.block_figure(_block(residual=[10.0, 10.0], mhc_ours=[11.0, 11.0]), "x").data}
    assert bars["mHC, ours (chained) (launched)"] == [pytest.approx(10.0)]
    assert bars["mHC, ours (chained) (graph)"] == [pytest.approx(100 * (10 / 9 - 1))]


def test_the_recorded_tables_render_every_recorded_row():
    recording = training_lab.load_recorded()
    site = training_lab.section(recording, "site")
    text = training_lab.site_table(site)
    for row in site["shapes"]:
        assert f"{row['graph_ms']['ours_chained']:.2f} ms" in text
    block = training_lab.section(recording, "block")
    text = training_lab.block_table(block)
    for row in block["widths"]:
        for o in row["launched"]["overhead_pct"].values():
            assert f"{o['median']:+.1f}%" in text
    inputs = training_lab.floor_inputs(recording)
    assert inputs["copy_gbps"] == site["copy_gbps"] and set(inputs["block_ms"]) == {r["C"] for r in block["widths"]}


def test_compare_kernel_times_splits_shared_and_own_kernels():
    """The block breakdown's arithmetic on made-up kernel times: totals, the shared kernels' times on each side,
    each side's own, the largest differences (other less base) and other's largest own kernels, in order."""
    base = {"gemm": 10.0, "attention": 6.0, "add": 0.5}
    other = {"gemm": 10.4, "attention": 5.9, "mhc_post": 0.8, "mhc_pre": 1.1}
    c = compare_kernel_times(base, other, top=1)
    assert c["base_ms"] == 16.5 and abs(c["other_ms"] - 18.2) < 1e-12
    assert c["shared_base_ms"] == 16.0 and abs(c["shared_other_ms"] - 16.3) < 1e-12
    assert c["only_base_ms"] == 0.5 and abs(c["only_other_ms"] - 1.9) < 1e-12
    assert [r["kernel"] for r in c["largest_differences"]] == ["gemm"]
    assert abs(c["largest_differences"][0]["ms"] - 0.4) < 1e-12
    assert (c["largest_differences"][0]["base_ms"], c["largest_differences"][0]["other_ms"]) == (10.0, 10.4)
    assert c["largest_own"] == [{"kernel": "mhc_pre", "ms": 1.1}]
    assert compare_kernel_times(base, other)["largest_differences"][-1]["kernel"] == "attention"


def test_kernel_totals_sums_every_kernels_time_and_launches():
    assert kernel_totals({"gemm": (10.0, 4.0), "add": (0.5, 11.0)}) == (10.5, 15.0)
    assert kernel_totals({}) == (0, 0)


def _step(wall: float, kernels: dict) -> dict:
    busy = sum(kernels.values())
    return {"wall_ms": wall, "kernel_ms": busy, "idle_ms": wall - busy, "launches": len(kernels),
            "kernels": {k: {"ms": ms, "launches": 1} for k, ms in kernels.items()}}


def test_block_breakdown_table_sets_the_blocks_and_the_connections_alone_side_by_side():
    from mhc_lab.course.training_recorded import kernel_label

    plain = {"gemm": 10.0, "add": 0.5}
    chained = {"gemm": 10.2, "add": 0.3, "lanes_kernel": 1.2, "post_kernel": 0.3}
    alone = {"lanes_kernel": 1.0, "post_kernel": 0.3, "add": 0.1}
    own = {k: v for k, v in chained.items() if k not in plain}
    entry = {"C": 64, "tokens": 128, "kind": "mhc_ours", "residual_block": _step(12.0, plain),
             "kind_block": _step(13.0, chained), "kind_without_layers": _step(1.5, alone),
             "comparison": compare_kernel_times(plain, chained, top=16),
             "own_against_alone": compare_kernel_times(alone, own, top=16)}
    lines = training_lab.block_breakdown_table({"widths": [entry]}).splitlines()
    assert lines[1].split()[-4:] == ["12.00", "10.50", "1.50", "2"]
    assert lines[2].split()[-4:] == ["13.00", "12.00", "1.00", "4"] and lines[3].startswith("    its connections")
    assert "10.50 ms plain, 10.50 with mHC; mHC's own 1.50 ms" in lines[4]
    assert "1.500 ms in the block, 1.300 with identity layers" in lines[5]
    assert lines[6].split()[0] == "lanes" and lines[6].endswith("(1.20x)")
    assert training_lab.block_breakdown_table(None) == "(no block breakdown of mhc_ours recorded)"
    assert kernel_label("void at::native::reduce_kernel<128, 4, at::native::ReduceOp<float>>") == "torch reduce_kernel"


def test_floor_kernels_table_puts_each_own_kernel_against_its_bytes_at_the_copies_pace():
    """The copy floor's copies give the pace in the block; each of the chained block's own kernels (those the plain
    block does not launch) is set against its lane-wide bytes at that pace, the small ones against none."""
    from mhc_lab.course.training_recorded import CHAINED_KERNEL_ELEMENTS, COPY_KERNEL, floor_kernels_table
    from mhc_lab.measure import bytes_model

    C, tokens = 100, 1000
    pace = 4e12  # bytes per second: the copies take 76C's bytes / pace
    copies_ms = 76 * C * 2 * tokens / pace * 1e3
    k2_ms = 2 * 13 * C * 2 * tokens / pace * 1e3 + 0.5  # 0.5 ms beyond its bytes
    floor = {"C": C, "tokens": tokens, "kind": "copy_floor", "residual_block": _step(10.0, {"gemm": 9.0}),
             "kind_block": _step(11.0, {"gemm": 9.0, COPY_KERNEL: copies_ms})}
    chained = {"C": C, "tokens": tokens, "kind": "mhc_ours", "residual_block": _step(10.0, {"gemm": 9.0}),
               "kind_block": _step(11.0, {"gemm": 9.1, "lanes_backward_cuda_post_grad_kernel": k2_ms,
                                          "token_coefficients_kernel": 0.25})}
    chained["kind_block"]["kernels"]["lanes_backward_cuda_post_grad_kernel"]["launches"] = 2
    lines = floor_kernels_table({"widths": [chained, floor]}).splitlines()
    assert lines[0].endswith("for 76C per token (4.00 TB/s in the block)")
    assert lines[2].startswith("  pre backward 2: dx, dphi")  # the kernel's plain name, not the profiler's
    k2 = lines[2].split()
    assert k2[-5:] == [f"{k2_ms:.3f}", "2", "13C", f"{k2_ms - 0.5:.3f}", "0.500"]
    assert lines[3].split()[-3:] == ["-", "0.000", "0.250"]
    assert lines[4].split()[-1] == "0.750"
    assert floor_kernels_table({"widths": [chained]}) == "(no copy floor breakdown recorded)"
    # the per-launch counts are bytes_model's: kernel 2 (pre backward 2 with the post's gradient handed over)
    # reads 2n + 1 and writes n; the post backward loses the n C of dx it no longer writes
    backward = {r.operation.split(" (")[0]: r.moved.per_C for r in bytes_model.rows("ours_chained", 4, "backward")}
    assert CHAINED_KERNEL_ELEMENTS["lanes_backward_cuda_post_grad_kernel"] == backward["pre backward 2: dx, dphi"]
    assert CHAINED_KERNEL_ELEMENTS["post_backward_without_dx_kernel"] == (
        backward["post backward"] - bytes_model.post_gradient_saving(4))


@pytest.mark.parametrize("n", [1, 2, 4, 8])
def test_designs_table_gives_the_chained_site_with_and_without_the_post_gradient_handed(n):
    """The chained site's row and, under it, the same with the post's output gradient handed to the pre (its
    backward writes no dx: n C fewer in the backward, the forward the same); 46C and 42C at n = 4."""
    rows = training_lab.designs_table(n).splitlines()
    at = next(k for k, line in enumerate(rows) if line.startswith("ours: run_sites"))
    assert "output gradient to the pre" in rows[at + 1]
    chained, handed = ([int(v[:-1]) for v in rows[k].split()[-3:]] for k in (at, at + 1))
    assert handed == [chained[0], chained[1] - n, chained[2] - n]
    if n == 4:
        assert (chained[2], handed[2]) == (46, 42)


def _floor_and_chained(C=100, tokens=1000, beyond=None):
    """A copy floor whose copies run at 4 TB/s, and a chained block whose own kernels take their bytes at that pace
    plus ``beyond`` ms each."""
    from mhc_lab.course.training_recorded import CHAINED_KERNEL_ELEMENTS, COPY_KERNEL

    pace = 4e12
    floor = {"C": C, "tokens": tokens, "kind": "copy_floor", "residual_block": _step(10.0, {"gemm": 9.0}),
             "kind_block": _step(11.0, {"gemm": 9.0, COPY_KERNEL: 76 * C * 2 * tokens / pace * 1e3})}
    own = {name: CHAINED_KERNEL_ELEMENTS[name] * C * 2 * tokens / pace * 1e3 + extra for name, extra in beyond.items()}
    chained = {"C": C, "tokens": tokens, "kind": "mhc_ours", "residual_block": _step(10.0, {"gemm": 9.0}),
               "kind_block": _step(11.0, {"gemm": 9.0, **own, "token_coefficients_kernel": 0.02})}
    return {"widths": [chained, floor]}


def test_floor_kernels_reading_sorts_the_kernels_by_their_distance_from_the_copies_pace():
    """Within 10% of its time beyond its bytes at the copies' pace: at that pace; more: above it, by how much; the
    small kernels, which move no lane-wide bytes, summed. Each by its plain name."""
    reading = training_lab.floor_kernels_reading(_floor_and_chained(
        beyond={"post_backward_without_dx_kernel": -0.001, "lanes_backward_cuda_post_grad_kernel": 0.1}))
    near, above = reading.split("; above it: ")
    assert near.startswith("C = 100: at their bytes' pace (within 10%): post backward") and "pre backward 2" not in near
    assert above.startswith("pre backward 2: dx, dphi (+0.100 ms,") and "post backward" not in above
    assert reading.endswith("the small kernels, no lane-wide bytes: 0.020 ms")
    assert training_lab.floor_kernels_reading(None) == "(no copy floor breakdown recorded)"


def test_breakdown_reading_splits_the_extra_wall_time():
    """The mHC step's extra wall time = its own kernels - the plain block's own + the shared kernels' change + the
    change of idle time."""
    plain = {"gemm": 10.0, "add": 0.5}
    chained = {"gemm": 10.2, "lanes_kernel": 1.2}
    entry = {"C": 64, "tokens": 128, "kind": "mhc_ours", "residual_block": _step(12.0, plain),
             "kind_block": _step(13.0, chained), "comparison": compare_kernel_times(plain, chained, top=4)}
    line = training_lab.breakdown_reading({"widths": [entry]})
    assert line == ("C = 64: the mHC, ours (chained) step is 1.00 ms longer than the plain one: mHC's own kernels "
                    "+1.20 ms, the plain block's own (its residual adds) -0.50 ms, the kernels both launch +0.20 ms, "
                    "the GPU's idle time +0.10 ms")


def test_clocks_reading_names_the_farthest_pair_of_each_part():
    site = _site({"ours_chained": 1.0, "tilekernels": 3.0}, {"ours_chained": 1.1, "tilekernels": 3.03})
    block = _block(residual=[10.0, 10.0, 10.0], mhc_ours=[11.0, 11.0, 11.0])  # as graphs 1 ms less each
    site_line, block_line = training_lab.clocks_reading(site, block).splitlines()
    assert site_line.startswith("launched against as a CUDA graph, every site: at most 10.0% apart (ours, chained, "
                                "16384 x 4096: 1.10 against 1.00 ms)")
    assert "every block: at most 11.1% apart (plain residual, C = 64: 10.00 against 9.00 ms)" in block_line
    assert training_lab.clocks_reading(None, None) == "(no timings on both clocks)"


def _runs(**losses):
    return {name: {"loss": list(values)} for name, values in losses.items()}


def test_curves_reading_tells_a_gap_from_the_curves_wiggle():
    """Apart only when the mean gap on the same batches over the last quarter exceeds the plotted curve's wiggle
    (the residual's spread over those steps over sqrt(5) for the mean of 5 the figure draws)."""
    import statistics

    residual = [3.0, 2.0] * 20  # last 10 steps: spread about 0.53, wiggle about 0.24
    wiggle = statistics.stdev(residual[-10:]) / 5 ** 0.5
    close = training_lab.curves_reading(_runs(residual=residual, mhc=[v + 0.5 * wiggle for v in residual]))
    assert "too close to tell apart" in close and close.endswith("the figure cannot tell mHC from the residual")
    far = training_lab.curves_reading(_runs(residual=residual, mhc=[v - 2 * wiggle for v in residual]))
    assert f"{-2 * wiggle:+.4f} nats per byte" in far and ": apart" in far
    assert far.endswith("mHC and the residual train apart")


def test_kernel_labels_are_plain_names_for_our_kernels():
    from mhc_lab.course.training_recorded import CHAINED_KERNEL_ELEMENTS, KERNEL_NAMES, kernel_label

    assert set(CHAINED_KERNEL_ELEMENTS) <= set(KERNEL_NAMES)
    for name, plain in KERNEL_NAMES.items():
        assert kernel_label(name) == plain != name.removesuffix("_kernel")
