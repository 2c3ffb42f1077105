"""The roofline figure places every kernel where it belongs, a copy (no FLOPs) included."""

import math

import pytest
import torch

from mhc_lab.measure import roofline

ROOF = roofline.Roof("CPU (test, 1 thread)", bandwidth_gbs=20.0, matmul_tflops=0.05, matmul_dtype="float32")
COPY = {"name": "copy", "flops": 0.0, "bytes": 2 * 2**26, "seconds": 0.005}  # 26.8 GB/s
MATMUL = {"name": "matmul 512", "flops": 2 * 512**3, "bytes": 3 * 512 * 512 * 4, "seconds": 0.01}


def _trace(fig, starts):
    return next(t for t in fig.data if t.name.startswith(starts))


def _x_range(fig):
    lo, hi = fig.layout.xaxis.range
    return 10**lo, 10**hi


def test_a_copy_is_drawn_at_the_left_edge_labelled_zero_intensity():
    fig = roofline.roofline_figure(ROOF, [COPY, MATMUL])
    lo, hi = _x_range(fig)
    copy = _trace(fig, "copy")
    x, y = copy.x[0], copy.y[0]
    assert lo <= x <= hi and x == pytest.approx(lo), "the copy must sit inside the plotted range, at its left edge"
    assert "0 FLOP/byte" in copy.text[0] and "0 FLOP/byte" in copy.name
    assert copy.marker.symbol == "triangle-left"
    gbs = COPY["bytes"] / COPY["seconds"] / 1e9
    assert f"{gbs:.1f} GB/s" in copy.text[0]
    # its height: its own bytes per second on the bandwidth slope, at the edge's intensity
    assert y == pytest.approx(gbs * x)
    # the roof line starts where the copy is drawn, so the two can be compared
    roof_line = fig.data[0]
    assert roof_line.x[0] == pytest.approx(lo) and roof_line.x[-1] == pytest.approx(hi)


def test_a_copy_is_not_given_a_made_up_flop():
    fig = roofline.roofline_figure(ROOF, [COPY])
    copy = _trace(fig, "copy")
    # the old figure turned 0 FLOPs into 1: intensity 1 / 134 MB ~ 7e-9, six decades left of the axis
    assert copy.x[0] >= 1e-3
    assert "0 FLOPs" in copy.hovertext[0]


def test_points_with_flops_keep_their_intensity_and_stay_in_range():
    tiny = {"name": "residual add", "flops": 1e6, "bytes": 12e8, "seconds": 0.1}  # 8e-4 FLOP/byte
    fig = roofline.roofline_figure(ROOF, [MATMUL, tiny])
    lo, hi = _x_range(fig)
    for point in (MATMUL, tiny):
        trace = _trace(fig, point["name"])
        intensity = point["flops"] / point["bytes"]
        assert trace.x[0] == pytest.approx(intensity)
        assert lo <= trace.x[0] <= hi
        assert trace.y[0] == pytest.approx(point["flops"] / point["seconds"] / 1e9)
    assert math.log10(lo) < math.log10(tiny["flops"] / tiny["bytes"])


def test_a_cpu_roof_names_its_threads():
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        roof = roofline.measure_roof("cpu", small=True)
    finally:
        torch.set_num_threads(before)
    assert roof.device.endswith(", 1 thread)") and roof.bandwidth_gbs > 0 and roof.matmul_tflops > 0


def test_position_is_the_share_of_the_roof_above_a_point():
    assert roofline.position(ROOF, COPY) == pytest.approx(COPY["bytes"] / COPY["seconds"] / 1e9 / 20.0)
    # the matmul: 85 FLOP/byte, past the ridge (2.5), so the roof above it is the compute roof
    assert roofline.position(ROOF, MATMUL) == pytest.approx(2 * 512**3 / 0.01 / 1e9 / 50.0)
    slow = dict(MATMUL, seconds=0.1)
    assert roofline.position(ROOF, slow) == pytest.approx(roofline.position(ROOF, MATMUL) / 10)


def test_position_lines_say_where_each_point_lands():
    on_roof = dict(COPY, seconds=COPY["bytes"] / 20.0e9)
    below = dict(MATMUL, name="slow matmul", seconds=0.1)
    lines = roofline.position_lines(ROOF, [on_roof, below])
    assert lines[0] == "copy: 100% of the roof above it (on the roof)"
    assert lines[1].startswith("slow matmul: 5% of the roof above it (below the roof)")


def test_position_lines_explain_a_point_above_the_roof_by_what_it_measured():
    above = dict(COPY, seconds=COPY["bytes"] / 30.0e9)  # 150% of a 20 GB/s roof
    from_memory = roofline.position_lines(ROOF, [above], cache_bytes=32 * 2**20)[0]
    assert "150% of the roof above it (ABOVE the roof)" in from_memory
    assert "differ by its noise" in from_memory and "cache" not in from_memory  # 256 MiB cannot sit in 32 MiB
    small = dict(above, bytes=2 * 2**20, seconds=2 * 2**20 / 30.0e9)
    in_cache = roofline.position_lines(ROOF, [small], cache_bytes=32 * 2**20)[0]
    assert "its 2.0 MiB fit in the 32 MiB cache" in in_cache
    unknown = roofline.position_lines(ROOF, [small], cache_bytes=None)[0]
    assert "differ by its noise" in unknown
    # a matmul past the ridge sits under the compute roof: fitting in the cache does not lift it
    fast_matmul = dict(MATMUL, seconds=2 * 512**3 / 60e9)  # 60 GFLOP/s against 50
    line = roofline.position_lines(ROOF, [fast_matmul], cache_bytes=32 * 2**20)[0]
    assert "120% of the roof above it (ABOVE the roof)" in line and "differ by its noise" in line
    assert "cache" not in line


def test_a_measured_roof_is_warm_and_says_how():
    assert "warm" in roofline.measure_roof.__doc__ and "median over rounds" in roofline.measure_roof.__doc__
