"""The operation tracer, the profiler wrapper, the naive layers and the memory-wall bench (small, CPU)."""

import json

import pytest
import torch

from mhc_lab.bench import memory_wall as bench_memory_wall
from mhc_lab.measure import bytes_model, profiling
from mhc_lab.models import naive_layers
from mhc_lab.reference import sinkhorn_deepseek_v4


def test_trace_counts_one_add_and_its_bytes():
    x, f = torch.randn(64, 32), torch.randn(64, 32)
    trace = profiling.trace_ops(lambda: x + f)
    assert trace.launches == 1 and trace.syncs == 0
    assert trace.bytes_read == 2 * 64 * 32 * 4
    assert trace.bytes_written == 64 * 32 * 4
    assert trace.by_group() == {"elementwise": {"launches": 1, "bytes": 3 * 64 * 32 * 4}}


def test_views_launch_nothing_and_a_broadcast_is_read_once():
    x, b = torch.randn(8, 16), torch.randn(16)
    assert profiling.trace_ops(lambda: x.t().unsqueeze(0).view(1, 16, 8)).launches == 0
    trace = profiling.trace_ops(lambda: x + b.expand(8, 16))
    assert trace.bytes_read == (8 * 16 + 16) * 4


def test_reading_a_value_back_is_a_sync():
    x = torch.randn(10)
    trace = profiling.trace_ops(lambda: bool(x.sum() > 0))
    assert trace.syncs == 1 and trace.launches == 2


@pytest.mark.parametrize("t", [1, 2, 3, 5, 20])
def test_sinkhorn_launch_formula_matches_the_trace(t):
    trace = profiling.trace_ops(sinkhorn_deepseek_v4, torch.randn(2, 4, 4), t)
    assert trace.launches == profiling.sinkhorn_launches(t) == 6 * t + 1


def test_groups():
    assert profiling.op_group("aten::bmm") == "matmul"
    assert profiling.op_group("aten.sum.dim_IntList") == "reduction"
    assert profiling.op_group("add") == "elementwise"
    assert profiling.op_group("aten::_to_copy") == "copy / cast"
    assert profiling.kernel_group("triton_poi_fused_add_mul_0") == "compiled (fused)"
    assert profiling.kernel_group("sm90_xmma_gemm_bf16bf16_bf16f32") == "matmul"
    assert profiling.kernel_group("void at::native::reduce_kernel<512, 1>") == "reduction"
    assert profiling.kernel_group("void at::native::vectorized_elementwise_kernel<4>") == "elementwise"
    assert profiling.kernel_group("Memcpy DtoH (Device -> Pinned)") == "copy / cast"


def test_profile_run_on_cpu_times_groups():
    x = torch.randn(256, 256)
    p = profiling.profile_run(lambda: (x @ x).sum(), "cpu")
    assert p.launches is None
    assert p.group_seconds.get("matmul", 0) > 0 and p.total_seconds > 0


def test_compare_compile_without_compiling():
    x = torch.randn(128)
    out = profiling.compare_compile(lambda: x * 2 + 1, "cpu", compile=False, warmup=1, repeat=2)
    assert out["eager"]["launches"] == 2 and out["eager"]["timing"]["median_s"] > 0 and out["compiled"] is None


def test_naive_layers_launches_do_not_grow_with_n():
    counts = {}
    for n in (1, 2, 4):
        layers = naive_layers.make_layers(16, n, 8)
        counts[n] = {k: profiling.trace_ops(v.forward).launches for k, v in layers.items()}
    assert all(c["residual"] == 1 for c in counts.values())
    assert counts[1]["mhc"] == counts[2]["mhc"] == counts[4]["mhc"] > 6 * 20
    assert counts[1]["hc"] == counts[4]["hc"] > 1


def test_naive_layer_counted_bytes_and_backward():
    layer = naive_layers.make_layer("mhc", 32, 4, 16, dtype=torch.float32)
    per_token = bytes_model.bytes_per_token("mhc", 4, 16, stream_dtype=torch.float32)
    assert layer.counted_bytes() == 32 * per_token
    assert layer.forward().shape == (32, 4, 16)
    layer.forward_backward()
    with pytest.raises(ValueError, match="name: expected one of"):
        naive_layers.make_layer("dense", 4, 4, 4)


def test_bench_small_cpu_run_writes_a_tagged_recording(tmp_path, capsys):
    code = bench_memory_wall.main(["--device", "cpu", "--tokens", "64", "--widths", "8", "16", "--no-compile",
                                   "--repeat", "1", "--out", str(tmp_path), "--name", "wall_test"])
    assert code == 0
    saved = json.loads((tmp_path / "wall_test.json").read_text())
    assert {"date", "torch", "tilelang", "gpu"} <= set(saved["environment"])
    assert saved["command"].startswith("python -m mhc_lab.bench memory-wall --device cpu")
    assert saved["results"]["copy_bandwidth_gbs"] > 0 and saved["results"]["config"]["n"] == 4
    rows = saved["results"]["rows"]
    assert {(r["layer"], r["pass"], r["C"]) for r in rows} == {
        (layer, p, C) for layer in ("residual", "hc", "mhc") for p in ("forward", "forward+backward")
        for C in (8, 16)}
    assert all(r["median_s"] > 0 and r["counted_bytes"] > 0 for r in rows)
    loaded = bench_memory_wall.load_memory_wall("wall_test", directory=tmp_path)
    assert "RECORDED" in bench_memory_wall.recording_label(loaded)
    assert bench_memory_wall.slowdown(rows)["residual merge (eager)"] == 1.0
    bench_memory_wall.recorded_roofline(loaded)
    assert "mHC site" in bench_memory_wall.results_table(rows)
    assert bench_memory_wall.load_memory_wall("nothing_here", directory=tmp_path) is None
    bench_memory_wall.comparison_figure(rows, loaded)


def test_bench_merges_an_earlier_recording(tmp_path):
    common = ["--device", "cpu", "--tokens", "32", "--no-compile", "--no-backward", "--repeat", "1",
              "--name", "wall_merge"]
    bench_memory_wall.main(common + ["--widths", "8", "--out", str(tmp_path / "a")])
    bench_memory_wall.main(common + ["--widths", "16", "--out", str(tmp_path / "b"),
                                     "--merge-with", str(tmp_path / "a" / "wall_merge.json")])
    merged = json.loads((tmp_path / "b" / "wall_merge.json").read_text())
    assert sorted({r["C"] for r in merged["results"]["rows"]}) == [8, 16]
    assert merged["results"]["config"]["widths"] == [8, 16]
