"""The recorded forward benchmark's tables, as lab 06 prints them: its two parts (sites, reference) as one view."""

import pytest

from mhc_lab.course import forward_lab


def _shape(tokens: int, C: int, time_ms: dict, kernel_ms: dict | None = None) -> dict:
    out = {"tokens": tokens, "C": C, "n": 4, "min_bytes": 14 * C * 2 * tokens, "time_ms": time_ms,
           "rel_err": {k: 1e-4 for k in time_ms}, "errors": {}}
    if kernel_ms is not None:
        out["kernel_ms"] = kernel_ms
    return out


def _recording() -> dict:
    env = {"gpu": "Some GPU", "date": "2026-01-02"}
    sites = {"environment": env, "copy_gbps": 4000.0,
             "shapes": [_shape(16384, 4096, {"tilekernels": 0.70, "ours": 0.63},
                               {"post": 0.30, "pre": 0.33, "pre.project": 0.16, "pre.apply": 0.18}),
                        _shape(8192, 7168, {"tilekernels": 0.62, "ours": 0.55, "ours_chained": 0.49}, {})]}
    reference = {"environment": {"gpu": "Some GPU", "date": "2026-01-01"}, "copy_gbps": 4100.0,
                 "shapes": [_shape(16384, 4096, {"eager": 12.6, "compile": 7.9})]}
    return {"name": "forward_h200", "environment": env, "results": {"sites": sites, "reference": reference}}


def test_the_two_parts_make_one_view_judged_by_the_sites_copy_bandwidth():
    results = forward_lab.recorded_results(_recording())
    assert results["copy_gbps"] == 4000.0
    first, second = results["shapes"]
    assert (first["tokens"], first["C"]) == (16384, 4096) and set(first["time_ms"]) == {
        "eager", "compile", "tilekernels", "ours"}
    assert second["time_ms"] == {"tilekernels": 0.62, "ours": 0.55, "ours_chained": 0.49}
    labels = forward_lab.recorded_labels(_recording()).splitlines()
    assert labels[0].startswith("TileKernels, ours and our kernels: RECORDED on Some GPU, 2026-01-02")
    assert labels[1].startswith("eager and torch.compile: RECORDED on Some GPU, 2026-01-01")
    assert forward_lab.recorded_results(None) is None and forward_lab.recorded_results({"results": {}}) is None


def test_site_table_gives_every_implementation_against_tilekernels_and_says_what_is_missing():
    lines = forward_lab.site_table(forward_lab.recorded_results(_recording())).splitlines()
    ours = next(line for line in lines if line.startswith("16384 x 4096  ours (split"))
    assert ours.split()[-1] == "0.90x" and "0.630 ms" in ours
    assert any(line.startswith("16384 x 4096  ours, chained") and "not measured" in line for line in lines)
    eager = next(line for line in lines if line.startswith("16384 x 4096  eager"))
    assert eager.split()[-1] == "18.00x"
    assert any(line.startswith("8192 x 7168   eager") and "not measured" in line for line in lines)


def test_kernel_table_and_reading_use_each_kernels_own_bytes():
    results = forward_lab.recorded_results(_recording())
    lines = forward_lab.kernel_table(results).splitlines()
    post = next(line for line in lines if line.startswith("16384 x 4096  post"))
    assert "0.300 ms" in post and post.split()[-1] == f"{16384 * 73808 / 0.3e-3 / 1e9 / 4000:.1%}"
    assert sum("not measured" in line for line in lines) == 3 + 7  # phi split and the chained kernels, all at 7168
    facts = forward_lab.reading(results)
    assert facts["chained_over_tilekernels"] == (0.49 / 0.62, 0.49 / 0.62)
    assert facts["eager_over_ours"] == (12.6 / 0.63, 12.6 / 0.63)
    assert "our chained site / TileKernels:               0.79x" in forward_lab.reading_text(results)


def test_reading_compares_each_kernels_share_of_copy_on_its_own_bytes():
    facts = forward_lab.reading(forward_lab.recorded_results(_recording()))
    project, apply, post = 16384 * 4096 * 4 * 2 / 0.16, 16384 * 4096 * 5 * 2 / 0.18, 16384 * 73808 / 0.30
    assert facts["projection_over_apply"] == pytest.approx((project / apply,) * 2)
    assert facts["projection_over_post"] == pytest.approx((project / post,) * 2)
    assert facts["chained_post_over_post"] is None  # the chained kernels were not measured
    assert facts["eager_over_tilekernels"] == (12.6 / 0.70, 12.6 / 0.70) and facts["compile_over_tilekernels"]
    text = forward_lab.reading_text(forward_lab.recorded_results(_recording()))
    assert f"  projection pass / apply pass:               {project / apply:.2f}x" in text
    assert "  chained post + projection / post kernel:    not measured" in text


def test_the_recorded_tables_render_every_recorded_time():
    recording = forward_lab.load_recorded()
    results = forward_lab.recorded_results(recording)
    text = forward_lab.site_table(results) + forward_lab.kernel_table(results)
    for section in recording["results"].values():
        for shape in section["shapes"]:
            for ms in list(shape["time_ms"].values()) + list(shape.get("kernel_ms", {}).values()):
                assert f"{ms:.3f} ms" in text
    forward_lab.reading_text(results)
    assert forward_lab.recorded_roof(recording).bandwidth_gbs == results["copy_gbps"]
