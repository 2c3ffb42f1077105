"""Lab 08's tables (mhc_lab.course.step_time): each figure is the arithmetic of the section it is given, the byte
counts are the byte model's, and the shipped recordings render."""

import pytest

from mhc_lab.bench.copy_floor import copy_floor_counts, copy_floor_plan
from mhc_lab.course import step_time
from mhc_lab.course.training_recorded import CHAINED_KERNEL_ELEMENTS


def test_floor_elements_are_the_copy_floor_plan_halved():
    read, written = step_time.floor_elements()
    assert read + written == sum(copy_floor_counts(copy_floor_plan(4))) == 76
    assert read == written


def test_forward_kernel_bytes_are_the_byte_model_and_the_block_breakdown_agrees():
    elements = step_time.forward_kernel_elements()
    assert elements == {"post": 9, "pre.project": 4, "pre.apply": 5, "chained.apply": 5, "chained.post_project": 9}
    for profiled, key in (("post_cuda_kernel", "post"), ("project_kernel", "pre.project"),
                          ("mix_lanes_kernel", "chained.apply"), ("post_project_cuda_kernel", "chained.post_project")):
        assert CHAINED_KERNEL_ELEMENTS[profiled] == elements[key]


def _timing(plain, floor, ours):
    from mhc_lab.bench.common import overheads

    rounds = {"residual": plain, "copy_floor": floor, "mhc_ours": ours}
    return {"rounds_ms": rounds, "overhead_pct": overheads(rounds)}


def test_floor_table_computes_the_floor_from_the_median_plain_block():
    block = {"copy_gbps": 4000.0, "widths": [{
        "C": 4096, "tokens": 16384, "launched": _timing([10.0, 12.0, 11.0], [11.0, 12.6, 11.55], [12.0, 13.2, 11.0]),
        "graph": _timing([10.0, 10.0, 10.0], [10.5, 10.6, 10.7], [11.0, 11.0, 11.0])}]}
    extra, pct = step_time.copy_floor_overhead(38, 38, 4096, 16384, 4000.0, 11.0)
    text = step_time.floor_table(block)
    assert f"{pct:+.1f}% ({extra:.2f} ms)" in text  # the launched plain block's median is 11 ms
    assert "+10.0% (+10.0 to +10.0)" in text  # ours as graphs: 11 / 10 every round
    assert "+4.0 points" in text  # ours 10.0% above the floor's median 6.0% as graphs
    assert step_time.floor_table(None) == "(no block measurements)"


def _kernels(**ms):
    return {name: {"ms": value, "launches": 1.0} for name, value in ms.items()}


def _step(kernels):
    total = sum(k["ms"] for k in kernels.values())
    return {"wall_ms": total + 1.0, "kernel_ms": total, "idle_ms": 1.0, "launches": float(len(kernels)),
            "kernels": kernels}


def test_power_cap_threshold_is_the_largest_change_of_a_shared_kernel():
    plain = _kernels(gemm=2.0, norm=0.2, tiny=0.01)
    block = {"copy_gbps": 4000.0, "widths": [{
        "C": 2560, "tokens": 16384, "kind": "mhc_ours",
        "residual_block": _step(plain),
        "kind_block": _step({**_kernels(gemm=2.04, norm=0.199, tiny=0.02),
                             **_kernels(post_cuda_kernel=0.2, lanes_backward_cuda_post_grad_kernel=0.55,
                                        phi_split_kernel=0.004)}),
        "kind_without_layers": _step(_kernels(post_cuda_kernel=0.201, lanes_backward_cuda_post_grad_kernel=0.5,
                                              phi_split_kernel=0.002)),
    }]}
    (row,) = step_time.power_cap_rows(block)
    assert row["threshold"] == pytest.approx(0.02)  # the GEMM's 2%; the tiny kernel is under 0.1 ms and not read
    verdicts = {k["kernel"]: k["verdict"] for k in row["kernels"]}
    assert verdicts == {"lanes_backward_cuda_post_grad_kernel": "slowed: instruction-bound",
                        "post_cuda_kernel": "unchanged: memory-bound", "phi_split_kernel": "too short to read"}
    assert "pre backward 2: dx, dphi" in step_time.power_cap_table(block)


def test_site_clocks_clamp_a_launched_time_below_its_graph():
    site = {"shapes": [{"tokens": 16, "C": 8, "launched_ms": {"ours_chained": 2.0, "tilekernels": 2.9, "eager": 9.0},
                        "graph_ms": {"ours_chained": 1.5, "tilekernels": 3.0}}]}
    rows = {r["name"]: r["host_share"] for r in step_time.site_clocks(site)}
    assert rows == {"ours_chained": pytest.approx(0.25), "tilekernels": 0.0}  # eager has no graph: not a row


def test_the_shipped_recordings_render():
    recorded = step_time.load_recorded()
    if recorded["training"] is None or recorded["forward"] is None:
        pytest.skip("no recordings shipped")
    block = step_time.section(recorded, "training", "block")
    breakdown = step_time.section(recorded, "training", "block_kernels")
    forward = step_time.section(recorded, "forward", "sites")
    for text in (step_time.floor_table(block), step_time.site_clocks_table(step_time.section(recorded, "training",
                                                                                              "site")),
                 step_time.step_profile_table(breakdown), step_time.power_cap_table(breakdown),
                 step_time.bytes_table(forward, breakdown), step_time.bytes_reading(forward, breakdown)):
        assert text and not text.startswith("(no")
    assert "RECORDED on" in step_time.section_label(recorded, "training", "block")
