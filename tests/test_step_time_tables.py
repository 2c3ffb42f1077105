"""Lab 08's tables (mhc_lab.course.step_time): each figure is the arithmetic of the section it is given, the byte
counts are the byte model's, and the shipped recordings render."""

import pytest

from mhc_lab.bench.copy_floor import copy_floor_counts, copy_floor_plan
from mhc_lab.course import stack_clocks, step_time
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


# ---- section 2: the stack of layers on two clocks -----------------------------------------------------------


def test_host_per_site_shares_the_launched_growth_beyond_the_gpu_growth():
    host, bound = step_time.host_per_site(27.5, 3.5, 8.0, 2.3, 8)
    assert host == pytest.approx((19.5 - 1.2) / 8) and bound is True
    host, bound = step_time.host_per_site(10.2, 4.0, 10.0, 3.2, 1)  # the sites' kernels filled the plain step's waits
    assert host == pytest.approx(-0.6) and bound is True
    assert step_time.host_per_site(4.0, 2.0, 3.0, 1.5, 2) == (0.25, False)  # a wait of exactly half: not host-bound
    assert step_time.host_per_site(41.0, 39.2, 33.5, 32.6, 12)[1] is False


def _stack_shape():
    """A stack section's shape with figures no other figure equals, a compiled variant, a kind of no known name, and
    recorded ratios that are not the quotients of the medians (the table must read them, not recompute them)."""
    return {
        "tokens": 2048, "C": 512, "n": 4, "layers": 6, "hidden": 2048,
        "launched_ms": {"residual": 5.11, "mhc_kernels": 17.33, "mhc_kernels_compiled": 9.87, "mystery": 6.66},
        "gpu_ms": {"residual": 1.21, "mhc_kernels": 1.94, "mhc_kernels_compiled": 1.77, "mystery": 1.31},
        "kernels_per_step": {"residual": 101.0, "mhc_kernels": 163.0, "mhc_kernels_compiled": 131.0, "mystery": 107.0},
        "graph_ms": {"residual": 1.29, "mhc_kernels": 2.04},
        "over_residual": {"launched": {"mhc_kernels": {"median": 3.47}, "mhc_kernels_compiled": {"median": 1.93},
                                       "mystery": {"median": 1.31}},
                          "graph": {"mhc_kernels": {"median": 1.59}},
                          "gpu": {"mhc_kernels": 1.62, "mhc_kernels_compiled": 1.46, "mystery": 1.08},
                          "kernels": {"mhc_kernels": 1.61}},
        "errors": {"mhc_kernels_compiled.graph": "RuntimeError('capture failed')"},
    }


def test_stack_table_reads_every_ratio_and_labels_every_kind():
    stack = {"shapes": [_stack_shape()]}
    rows = {r["kind"]: r for r in stack_clocks.stack_rows(stack)}
    assert list(rows) == ["residual", "mhc_kernels", "mhc_kernels_compiled", "mystery"]
    assert rows["mhc_kernels"]["launched_ratio"] == 3.47 and rows["mhc_kernels"]["graph_ratio"] == 1.59
    assert rows["mhc_kernels_compiled"]["graph_ms"] is None and rows["mhc_kernels_compiled"]["graph_ratio"] is None
    host, bound = step_time.host_per_site(17.33, 1.94, 5.11, 1.21, 6)
    assert rows["mhc_kernels"]["host_ms"] == host and rows["mhc_kernels"]["host_bound"] is bound
    assert rows["mhc_kernels"]["site_kernels"] == pytest.approx((163 - 101) / 6)
    text = stack_clocks.stack_table(stack)
    for label in ("plain residual", "mHC, fused kernels", "mHC, fused kernels, compiled", "mystery"):
        assert f"  {label} " in text
    for shown in ("17.33 ms", "3.47x", "1.59x", "1.62x", "163", f"{host:+.3f} ms", "capture failed"):
        assert shown in text
    assert stack_clocks.stack_table(None) == "(no stack measurements)"


def test_a_live_stack_without_recorded_ratios_shows_the_quotients():
    shape = _stack_shape()
    del shape["over_residual"]
    (row,) = [r for r in stack_clocks.stack_rows({"shapes": [shape]}) if r["kind"] == "mhc_kernels"]
    assert row["launched_ratio"] == pytest.approx(17.33 / 5.11) and row["graph_ratio"] == pytest.approx(2.04 / 1.29)


def _numbers(text: str) -> list[str]:
    import re

    return re.findall(r"[+-]?\d+(?:\.\d+)?", text)


def test_every_figure_of_the_shipped_stack_table_is_the_recordings():
    recorded = step_time.load_recorded()
    stack = step_time.section(recorded, "training", "stack")
    if not stack:
        pytest.skip("no stack section recorded")
    allowed = set()
    for shape in stack["shapes"]:
        allowed |= {str(shape[k]) for k in ("tokens", "C", "n", "layers")}
        allowed |= {str(v) for v in (shape.get("dynamo") or {}).values()}
        over, per_site = shape["over_residual"], shape["per_site_over_residual"]
        for kind in stack_clocks.stack_kinds(shape):
            for figure in ("launched_ms", "gpu_ms", "graph_ms"):
                if kind in shape[figure]:
                    allowed.add(f"{shape[figure][kind]:.2f}")
            if kind in shape["kernels_per_step"]:
                allowed.add(f"{shape['kernels_per_step'][kind]:.0f}")
            for mode in ("launched", "graph"):
                if kind in over[mode]:
                    allowed.add(f"{over[mode][kind]['median']:.2f}")
            if kind in over["gpu"]:
                allowed.add(f"{over['gpu'][kind]:.2f}")
            if kind in per_site:
                site = per_site[kind]
                allowed |= {f"{site['gpu_ms']:+.3f}", f"{site['kernels']:+.1f}",
                            f"{site['launched_ms'] - site['gpu_ms']:+.3f}"}
    text = stack_clocks.stack_table(stack)
    shown = _numbers(text.split("\n(x:")[0])  # the legend below the table holds no figure
    assert shown and set(shown) <= allowed, sorted(set(shown) - allowed)
    for row in stack_clocks.stack_rows(stack):
        if row["host_ms"] is not None:  # exercise 8.3's host per site is the benchmark's per-site figures' difference
            site = next(s for s in stack["shapes"] if s["C"] == row["C"] and s["tokens"] == row["tokens"])
            per_site = site["per_site_over_residual"][row["kind"]]
            assert row["host_ms"] == pytest.approx(per_site["launched_ms"] - per_site["gpu_ms"])
            assert row["site_gpu_ms"] == pytest.approx(per_site["gpu_ms"])
    host = stack_clocks.stack_host_table(stack)
    assert not host.startswith("(no")
    for shape in stack["shapes"]:
        if shape.get("host"):
            assert f"{shape['host']['forward_ms']:.2f} ms" in host
            assert f"{shape['host']['by_own_time'][0]['us'] / 1e3:.2f} ms" in host


def test_the_host_of_a_tiny_reference_stack_is_profiled_on_the_cpu():
    profile = stack_clocks.profile_host_cpu(width=16, tokens=8, layers=2, steps=1)
    assert set(profile["ms"]) == {"residual", "mhc_reference"}
    assert any("mhc_lab/" in row["function"] for row in profile["functions"])
    assert not any("stack_clocks.py" in row["function"] for row in profile["functions"])
    text = stack_clocks.cpu_host_table(profile)
    assert "by cumulative time" in text and "by own time" in text


def test_the_live_stack_times_each_kind_and_replays_only_the_uncompiled_ones(monkeypatch):
    """measure_stack_live with stand-ins for the GPU's clocks: every kind is timed launched and profiled on its
    own step; the eager kinds are replayed as CUDA graphs, the compiled ones are not (Dynamo told to keep a graph
    per stack first); a kind that fails is listed in its shape's errors and the others are still measured; the
    table shows them."""
    import torch

    import mhc_lab.bench.common as common
    import mhc_lab.bench.host as host
    import mhc_lab.bench.kernels as kernels
    import mhc_lab.bench.stack as stack

    built, replayed, told = [], [], []

    def stack_step(width, tokens, kind, layers):
        if kind == "mhc_reference":
            raise RuntimeError("out of memory")
        step = lambda: None  # noqa: E731 - a stand-in step
        step.kind = kind
        built.append((tokens, width, kind, layers))
        return step

    def graph_replay(step):
        replayed.append(step.kind)
        replay = lambda: None  # noqa: E731
        replay.kind, replay.graphed = step.kind, True
        return replay

    times = {"residual": 2.0, "mhc_kernels": 3.0, "mhc_kernels_compiled": 2.5, "residual_compiled": 1.5}
    monkeypatch.setattr(stack, "stack_step", stack_step)
    monkeypatch.setattr(stack, "compile_every_stack", lambda: told.append(True))
    monkeypatch.setattr(common, "graph_replay", graph_replay)
    monkeypatch.setattr(host, "wall_ms", lambda fn, steps: times[fn.kind] / (2 if hasattr(fn, "graphed") else 1))
    monkeypatch.setattr(kernels, "kernel_times", lambda step: {f"k {step.kind}": (times[step.kind] / 3, 10.0)})
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda: "a stand-in GPU")
    kinds = ("residual", "mhc_kernels", "mhc_reference", "residual_compiled", "mhc_kernels_compiled")
    live = stack_clocks.measure_stack_live([(64, 32)], kinds=kinds, layers=2, steps=3, log=lambda line: None)
    (shape,) = live["stack"]["shapes"]
    assert told == [True] and [b[2] for b in built] == ["residual", "mhc_kernels", "residual_compiled",
                                                        "mhc_kernels_compiled"]
    assert replayed == ["residual", "mhc_kernels"] and shape["graph_ms"] == {"residual": 1.0, "mhc_kernels": 1.5}
    assert shape["launched_ms"] == {k: times[k] for k in times} and shape["kernels_per_step"]["mhc_kernels"] == 10
    assert shape["errors"] == {"mhc_reference": "RuntimeError: out of memory"}
    text = stack_clocks.stack_table(live["stack"])
    assert "mHC, fused kernels, compiled" in text and "1.67x" in text  # 2.5 ms over the compiled plain 1.5 ms


def test_profile_reading_says_whether_the_added_kernels_filled_the_waits():
    def step(kernel_ms, idle_ms):
        return {"wall_ms": kernel_ms + idle_ms, "kernel_ms": kernel_ms, "idle_ms": idle_ms, "launches": 1.0,
                "kernels": {}}

    block_kernels = {"widths": [
        {"C": 2560, "tokens": 8, "kind": "mhc_ours", "residual_block": step(10.0, 1.0), "kind_block": step(11.0, 0.4)},
        {"C": 4096, "tokens": 8, "kind": "copy_floor", "residual_block": step(10.0, 1.0), "kind_block": step(11.0, 1.3)},
    ]}
    first, second = step_time.profile_reading(block_kernels).splitlines()
    assert first.startswith("C = 2560, mHC, ours (chained): the idle time shrank by 0.60 ms")
    assert second.startswith("C = 4096, copy floor (mHC's bytes): the idle time grew by 0.30 ms")


def test_power_cap_reading_groups_the_kernels_by_the_widths_that_slowed_them():
    def width(C, post_block_ms, kernel2_block_ms):
        plain = _kernels(gemm=2.0)
        return {"C": C, "tokens": 16, "kind": "mhc_ours", "residual_block": _step(plain),
                "kind_block": _step({**_kernels(gemm=2.02), **_kernels(post_cuda_kernel=post_block_ms,
                                                                      lanes_backward_cuda_post_grad_kernel=kernel2_block_ms,
                                                                      coefficients_backward_tokens_kernel=0.06)}),
                "kind_without_layers": _step(_kernels(post_cuda_kernel=0.2, lanes_backward_cuda_post_grad_kernel=0.5,
                                                      coefficients_backward_tokens_kernel=0.05))}

    reading = step_time.power_cap_reading({"widths": [width(2560, 0.2, 0.5), width(4096, 0.2, 0.6)]})
    assert reading.splitlines() == ["slowed at every width: pre backward 1: per token",
                                    "slowed at C = 4096 only: pre backward 2: dx, dphi",
                                    "slowed at no width: post (the last site)"]
