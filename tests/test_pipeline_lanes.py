"""Lab 08, section 6 (mhc_lab.course.pipeline): the n lanes across a pipeline stage boundary, computed and measured
between two CPU processes over gloo."""

import pytest
import torch

from mhc_lab.course import pipeline


@pytest.mark.parametrize("compute_ms, link_gbit_s, tokens, C, n, itemsize", [
    (3.0, 400.0, 4096, 7168, 4, 2),
    (3.0, 400.0, 4096, 7168, 1, 2),
    (0.0, 200.0, 512, 2560, 4, 2),
    (0.05, 25.0, 77, 333, 8, 1),
    (40.0, 3200.0, 16384, 4096, 4, 4),
    (1, 8, 1000, 1000, 1, 1),
])
def test_boundary_exposed_against_an_independent_formula(compute_ms, link_gbit_s, tokens, C, n, itemsize):
    # bytes per second of the link, then seconds of the transfer, in exact fractions
    from fractions import Fraction

    seconds = Fraction(tokens * n * C * itemsize) / (Fraction(link_gbit_s) * 10**9 / 8)
    want_transfer = float(seconds * 1000)
    want_exposed = float(max(Fraction(0), seconds * 1000 - Fraction(compute_ms)))
    transfer, exposed = pipeline.boundary_exposed(compute_ms, link_gbit_s, tokens, C, n, itemsize)
    assert transfer == pytest.approx(want_transfer, rel=1e-12)
    assert exposed == pytest.approx(want_exposed, rel=1e-9, abs=1e-12 * want_transfer)
    assert pipeline.boundary_bytes(tokens, n, C, itemsize) == tokens * n * C * itemsize


def test_boundary_exposed_grows_n_fold_and_hides_behind_enough_compute():
    one, _ = pipeline.boundary_exposed(0.0, 400.0, 4096, 7168, 1)
    four, exposed = pipeline.boundary_exposed(one * 2, 400.0, 4096, 7168, 4)
    assert four == pytest.approx(4 * one) and exposed == pytest.approx(2 * one)
    assert pipeline.boundary_exposed(four, 400.0, 4096, 7168, 4)[1] == 0.0


def test_overlap_table_rows():
    table = pipeline.overlap_table(tokens=4096, C=7168, compute_ms=3.0, link_gbit_s=400.0)
    lines = table.splitlines()
    assert len(lines) == 2 + 3
    assert lines[2].startswith("| 1 | 58.7 MB | 1.17 ms | 0.00 ms |")
    assert lines[4].startswith("| 4 | 235 MB | 4.70 ms | 1.70 ms |")


def test_measure_boundary_two_stages():
    tokens, C = 16, 8
    rows = pipeline.measure_boundary((1, 2), tokens=tokens, C=C, warmup=1, repeats=3, timeout=90.0)
    assert [r["n"] for r in rows] == [1, 2]
    for r in rows:
        assert r["bytes"] == tokens * r["n"] * C * torch.float32.itemsize
        assert r["ms"] > 0 and r["gb_per_s"] > 0 and r["intact"] is True
    table = pipeline.boundary_table(rows)
    assert table.count("\n") == 3 and "| 2 | [16, 2, 8], 32-bit | 1.02 kB | 2 |" in table
