"""Where a block's extra time goes (part 'block_kernels' of the training benchmark): the plain block and one other
kind profiled kernel by kernel, side by side, and that kind's connections alone (identity layers)."""

from __future__ import annotations

import torch

from mhc_lab.bench.block import block_step


def kernel_times(step, repeat: int = 5) -> dict:
    """{kernel name: (GPU ms per step, launches per step)} of step(), from torch.profiler over ``repeat`` steps."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(repeat):
            step()
        torch.cuda.synchronize()
    return {e.key: (e.device_time_total / repeat / 1e3, e.count / repeat) for e in prof.key_averages()
            if e.device_type.name == "CUDA"}


def kernel_totals(times: dict) -> tuple[float, float]:
    """(GPU ms, launches) per step of all of kernel_times' kernels together."""
    return sum(ms for ms, _ in times.values()), sum(count for _, count in times.values())


def compare_kernel_times(base: dict, other: dict, top: int = 8) -> dict:
    """Two steps' kernel times ({name: ms per step}) side by side: totals; the kernels both launch, each step's
    time in them; the kernels only one launches; and the ``top`` largest differences among the shared ones
    (other's time less base's) and the ``top`` largest of other's own."""
    shared = base.keys() & other.keys()
    differences = sorted(((other[k] - base[k], k) for k in shared), reverse=True)
    own = sorted(((ms, k) for k, ms in other.items() if k not in base), reverse=True)
    return {"base_ms": sum(base.values()), "other_ms": sum(other.values()),
            "shared_base_ms": sum(base[k] for k in shared), "shared_other_ms": sum(other[k] for k in shared),
            "only_base_ms": sum(ms for k, ms in base.items() if k not in other),
            "only_other_ms": sum(ms for ms, _ in own),
            "largest_differences": [{"kernel": k[:160], "ms": d, "base_ms": base[k], "other_ms": other[k]}
                                    for d, k in differences[:top]],
            "largest_own": [{"kernel": k[:160], "ms": ms} for ms, k in own[:top]]}


def bench_block_kernels(width: int, bench, *, batch: int = 4, seq: int = 4096, kind: str = "mhc_ours",
                        log=print) -> dict:
    """The plain residual block and ``kind`` each timed (wall clock per step, launched op by op) and profiled
    kernel by kernel: the wall time less the kernels' is the time the GPU waited for the host or between kernels;
    the layers' kernels (launched by both) show whether they run slower beside the connections. Then ``kind``
    with identities for layers, its connections alone at the block's shapes: its kernels against the same
    kernels inside the block show what the layers between them cost (a cold L2, the clock under the power cap)."""
    out = {"C": width, "tokens": batch * seq, "kind": kind}
    kernels = {}
    for key, name, layers in (("residual_block", "residual", True), ("kind_block", kind, True),
                              ("kind_without_layers", kind, False)):
        step = block_step(width, name, batch, seq, layers=layers)
        step()
        torch.cuda.synchronize()
        times = kernel_times(step)
        kernels[key] = {k: ms for k, (ms, _) in times.items()}
        wall = bench(step, warmup_ms=100, rep_ms=500) * 1e3
        busy, launches = kernel_totals(times)
        out[key] = {"wall_ms": wall, "kernel_ms": busy, "idle_ms": wall - busy, "launches": launches,
                    "kernels": {k[:160]: {"ms": ms, "launches": count} for k, (ms, count) in times.items()}}
        log(f"  block C={width} {key:20s} ({name}) {wall:7.2f} ms per step, {busy:7.2f} of kernels, "
            f"{wall - busy:5.2f} idle, {launches:.0f} launches")
        del step
        torch.cuda.empty_cache()
    out["comparison"] = compare_kernel_times(kernels["residual_block"], kernels["kind_block"])
    own = {k: ms for k, ms in kernels["kind_block"].items() if k not in kernels["residual_block"]}
    out["own_against_alone"] = compare_kernel_times(kernels["kind_without_layers"], own, top=12)
    c, a = out["comparison"], out["own_against_alone"]
    log(f"  block C={width}: the kernels both launch {c['shared_base_ms']:.2f} -> {c['shared_other_ms']:.2f} ms, "
        f"{kind}'s own {c['only_other_ms']:.2f} ms; in the block {a['shared_other_ms']:.3f} ms, without layers "
        f"{a['shared_base_ms']:.3f} ms")
    return out
