"""The bytes model reproduces mHC Table 2 and the fused plans, checked against counts written out by hand."""

import pytest
import torch

from mhc_lab.measure import bytes_model
from mhc_lab.measure.bytes_model import Elements

NS = (1, 2, 4, 8)
WIDTHS = (1, 7, 2560, 4096)


def table2_hc_by_hand(n, C):
    """mHC Table 2, HC rows, one entry per operation, per token: compute the coefficients, apply H_pre,
    apply H_post, apply H_res, merge."""
    reads = [n * C, n * C + n, C + n, n * C + n * n, 2 * n * C]
    writes = [n * n + 2 * n, C, n * C, n * C, n * C]
    return sum(reads), sum(writes)


@pytest.mark.parametrize("n", NS)
@pytest.mark.parametrize("C", WIDTHS)
def test_hc_forward_reproduces_table2(n, C):
    read, write = table2_hc_by_hand(n, C)
    total = bytes_model.total("hc", n)
    assert total.read.at(C) == read
    assert total.write.at(C) == write
    # the closed forms printed in Table 2
    assert read == (5 * n + 1) * C + n * n + 2 * n
    assert write == (3 * n + 1) * C + n * n + 2 * n
    assert bytes_model.hc_forward_elements(n, C) == read + write


@pytest.mark.parametrize("n", NS)
def test_mhc_unfused_moves_what_hc_moves(n):
    assert bytes_model.total("mhc", n).read == bytes_model.total("hc", n).read
    assert bytes_model.total("mhc", n).write == bytes_model.total("hc", n).write
    if n > 1:  # mHC projects the whole nC stream onto n^2 + 2n outputs, HC each lane onto n + 2
        assert bytes_model.total("mhc", n).flops.per_C > bytes_model.total("hc", n).flops.per_C


@pytest.mark.parametrize("C", WIDTHS)
def test_residual_reads_2C_writes_C(C):
    total = bytes_model.total("residual", 4)
    assert (total.read.at(C), total.write.at(C)) == (2 * C, C)
    assert bytes_model.flops_per_token("residual", 1, C) == C


def test_worked_numbers_n4():
    # n = 4, C = 2560 (the 27B model): 21C + 24 read, 13C + 24 written, vs 3C for the residual.
    assert bytes_model.total("hc", 4).read == Elements(21, 24)
    assert bytes_model.total("hc", 4).write == Elements(13, 24)
    assert bytes_model.elements_per_token("hc", 4, 2560) == 87_088
    assert bytes_model.elements_per_token("residual", 4, 2560) == 7_680
    ratio = bytes_model.total("hc", 4).moved.per_C / bytes_model.total("residual", 4).moved.per_C
    assert ratio == pytest.approx(11.3, abs=0.05)
    assert 87_088 / 7_680 == pytest.approx(11.3, abs=0.05)


@pytest.mark.parametrize("n", NS)
def test_fused_post_row(n):
    """mHC Sec. 4.3.1: fusing H_post, H_res and the merge takes the reads from (3n+1)C to (n+1)C and the
    writes from 3nC to nC."""
    unfused = bytes_model.rows("hc", n)[2:]  # H_post, H_res, merge
    assert sum(r.read.per_C for r in unfused) == 3 * n + 1
    assert sum(r.write.per_C for r in unfused) == 3 * n
    fused = bytes_model.rows("mhc_fused", n)[-1]
    assert fused.read == Elements(n + 1, n + n * n)
    assert fused.write == Elements(n, 0)


@pytest.mark.parametrize("n", NS)
def test_fused_plans_forward(n):
    # the paper's plan: (3n+1)C read, (n+1)C written, plus O(n^2) coefficient traffic
    assert bytes_model.total("mhc_fused", n).read.per_C == 3 * n + 1
    assert bytes_model.total("mhc_fused", n).write.per_C == n + 1
    # the fewest bytes: (2n+1)C read, (n+1)C written
    assert bytes_model.total("mhc_minimal", n).read.per_C == 2 * n + 1
    assert bytes_model.total("mhc_minimal", n).write.per_C == n + 1
    assert bytes_model.minimal_site_forward_elements(n, 7) == (3 * n + 2) * 7 + 2 * n * n + 2 * n


@pytest.mark.parametrize("n", NS)
def test_backward_counts_derived(n):
    hc = bytes_model.total("hc", n, "backward")
    # by hand: H_res bwd 2nC/nC, H_post bwd (n+1)C/C, H_pre bwd (n+1)C/nC, coefficients bwd nC/nC, sum 3nC/nC
    assert hc.read.per_C == 2 * n + (n + 1) + (n + 1) + n + 3 * n
    assert hc.write.per_C == n + 1 + n + n + n
    minimal = bytes_model.total("mhc_minimal", n, "backward")
    assert (minimal.read.per_C, minimal.write.per_C) == (4 * n + 2, 2 * n + 1)
    assert all(r.source.startswith("derived") for r in bytes_model.rows("mhc", n, "backward"))
    residual = bytes_model.total("residual", n, "backward")
    assert (residual.read.per_C, residual.write.per_C) == (2, 1)


def test_minimal_forward_and_backward_is_41C_at_n4():
    moved = bytes_model.total("mhc_minimal", 4).moved + bytes_model.total("mhc_minimal", 4, "backward").moved
    assert moved.per_C == 41


def test_bytes_split_stream_and_coefficients():
    # lanes in bf16 (2 bytes), coefficients in float32 (4 bytes)
    assert bytes_model.bytes_per_token("hc", 4, 2560) == 34 * 2560 * 2 + 48 * 4
    assert bytes_model.bytes_per_token("hc", 4, 2560, stream_dtype=torch.float32) == 34 * 2560 * 4 + 48 * 4
    assert bytes_model.bytes_per_token("residual", 4, 4096) == 3 * 4096 * 2


def test_exercise_solutions():
    assert bytes_model.memory_bound_seconds(16384, 4, 4096, 4800.0) == pytest.approx(16384 * 278_720 / 4.8e12)
    assert bytes_model.res_apply_intensity(4, 4096, 2, 4) == pytest.approx(2 * 16 * 4096 / (2 * 4 * 4096 * 2 + 64))


def test_formulas_and_table_read_well():
    assert str(Elements(21, 24)) == "21C + 24"
    assert str(Elements(1, 0)) == "C"
    assert str(Elements(0, 24)) == "24"
    text = bytes_model.table("hc", 4, C=2560)
    assert "total" in text and "21C + 24" in text and "53,784" in text


def test_bad_arguments_are_clear():
    with pytest.raises(ValueError, match="method: expected one of"):
        bytes_model.rows("dense", 4)
    with pytest.raises(ValueError, match="n: expected the number of lanes"):
        bytes_model.rows("hc", 0)
    with pytest.raises(ValueError, match="direction"):
        bytes_model.rows("hc", 4, "sideways")


def test_figures_build():
    assert len(bytes_model.traffic_figure(2560).data) == len(bytes_model.METHODS)
    for method in bytes_model.METHODS:
        bytes_model.chef_figure(method, 4, C=2560)


@pytest.mark.parametrize("n", [1, 2, 4, 8])
def test_our_kernels_lane_wide_elements_per_token(n):
    # counted by hand from the kernels: the split pre reads x twice (project, apply), post reads x and f and
    # writes the lanes; backward: post reads g, x, f and writes dx, df; kernel 1 reads x, dy; kernel 2 reads
    # x, dy (and the post's dx when linked) and writes dx; the separate ops leave autograd a sum of two dx
    forward = {"ours": 4 * n + 2, "ours_linked": 4 * n + 2, "ours_chained": 3 * n + 2}
    backward = {"ours": 9 * n + 4, "ours_linked": 7 * n + 4, "ours_chained": 7 * n + 4}
    for method in bytes_model.IMPLEMENTATIONS:
        assert bytes_model.total(method, n, "forward").moved.per_C == forward[method], method
        assert bytes_model.total(method, n, "backward").moved.per_C == backward[method], method
    # chained sites move the fewest forward bytes there are; no design of ours moves fewer than the least
    least = bytes_model.total("mhc_minimal", n, "forward").moved.per_C
    assert forward["ours_chained"] == least
    assert min(forward[m] + backward[m] for m in forward) >= least + bytes_model.total(
        "mhc_minimal", n, "backward").moved.per_C


def test_partial_splits_are_the_kernels():
    pytest.importorskip("tilelang")
    from mhc_lab.kernels.pre_split import PROJECTION_SPLITS
    from mhc_lab.ops.dispatch import CHAIN_SPLITS

    assert bytes_model.PARTIAL_SPLITS == PROJECTION_SPLITS

    assert bytes_model.CHAIN_PARTIAL_SPLITS == CHAIN_SPLITS


@pytest.mark.parametrize("n", [1, 2, 4, 8])
def test_site_elements_count_the_post_gradient_path(n):
    """The training benchmark's elements per site and token: at n = 4 the least design 41C, ours as separate ops
    58C, the linked site 50C and the chained one 46C; with the post's output gradient handed to the pre
    (post_grad) the post's backward writes no dx, n C fewer for the linked and chained sites only."""
    from mhc_lab.bench.site import site_elements

    plain, handed = site_elements(n, post_grad=False), site_elements(n, post_grad=True)
    if n == 4:
        assert [plain[k] for k in ("least", "ours_separate", "ours_linked", "ours_chained")] == [41, 58, 50, 46]
        assert (handed["ours_linked"], handed["ours_chained"]) == (46, 42)
    for key in ("least", "ours_separate"):
        assert handed[key] == plain[key]
    for key in ("ours_linked", "ours_chained"):
        assert plain[key] - handed[key] == n
