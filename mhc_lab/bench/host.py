"""What the host costs per site (part 'host' of the training benchmark, not among its default parts): a chain of
sites (run_sites, identity layers) forward + backward at a small shape, where the GPU's work is a few
microseconds per kernel, timed launched (wall clock per step) and as a CUDA graph (the GPU alone), with its
kernels (profiler), the Python functions that take the host's time (cProfile, own time) and the host's events
under torch.profiler (ATen ops, autograd nodes, CUDA launches, the C++ ops of native.cpp and their kernels'
launches), each per site."""

from __future__ import annotations

import cProfile
import pstats
import time

import torch

from mhc_lab.bench.common import N, graph_replay, site_inputs
from mhc_lab.bench.kernels import kernel_times, kernel_totals


def wall_ms(step, repeat: int) -> float:
    """Wall-clock milliseconds per call of step(), after three warm-up calls, the GPU synchronised at both ends."""
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(repeat):
        step()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / repeat * 1e3


def where(key) -> str:
    """cProfile's (file, line, function) as a short place: the path from site-packages or mhc_lab on."""
    path, line, name = key
    if path == "~":
        return name
    path = path.split("site-packages/")[-1]
    if "/mhc_lab/" in path:
        path = "mhc_lab/" + path.split("/mhc_lab/")[-1]
    return f"{path}:{line}({name})"


def python_profile(step, steps: int, *, top: int, synchronize: bool = True) -> dict:
    """cProfile over ``steps`` calls of step(), the GPU synchronised at the end (unless not synchronize: a CPU
    step): the wall time per step under it (ms, its own cost included), the Python functions' own time per step
    in all (us), and the ``top`` functions by own time and by cumulative time per step (us, cumulative_us,
    calls, function)."""
    profiler = cProfile.Profile()
    start = time.perf_counter()
    profiler.enable()
    try:
        for _ in range(steps):
            step()
        if synchronize:
            torch.cuda.synchronize()
    finally:
        profiler.disable()  # an error in step() must not leave the profiler installed
    profiled_ms = (time.perf_counter() - start) / steps * 1e3
    stats = pstats.Stats(profiler).stats
    rows = [{"us": round(v[2] / steps * 1e6, 1), "cumulative_us": round(v[3] / steps * 1e6, 1),
             "calls": v[1] / steps, "function": where(k)} for k, v in stats.items()]
    return {"profiled_ms": profiled_ms, "own_us": round(sum(v[2] for v in stats.values()) / steps * 1e6, 1),
            "by_own_time": sorted(rows, key=lambda r: -r["us"])[:top],
            "by_cumulative_time": sorted(rows, key=lambda r: -r["cumulative_us"])[:top]}


def event_profile(step, steps: int, *, top: int) -> dict:
    """torch.profiler's host events over ``steps`` calls of step(): for each event name (an ATen op, an autograd
    node, a CUDA runtime or driver call such as cudaLaunchKernel or cuLaunchKernel, native.cpp's ops
    "mhc_lab_native::*" and its kernels' launches "mhc_lab launch: *") the host time per step inside it (us,
    nested events included), its own time (us, nested events excluded) and its calls per step; the ``top`` by
    own time, and every native.cpp event. The profiler's own cost is in these times (about a microsecond per
    event): they say where the time goes, wall_ms says how much there is."""
    from torch.profiler import ProfilerActivity, profile

    supported = torch.profiler.supported_activities()
    activities = [a for a in (ProfilerActivity.CPU, ProfilerActivity.CUDA) if a in supported]
    with profile(activities=activities) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    rows = [{"us": round(e.cpu_time_total / steps, 1), "own_us": round(e.self_cpu_time_total / steps, 1),
             "calls": e.count / steps, "event": e.key}
            for e in prof.key_averages() if e.device_type.name == "CPU" and e.key != "cudaDeviceSynchronize"]
    return {"by_own_time": sorted(rows, key=lambda r: -r["own_us"])[:top],
            "native": sorted((r for r in rows if r["event"].startswith("mhc_lab")), key=lambda r: -r["us"])}


SITES = 8  # the stack's layers (part 'stack'): the chain's two ends weigh in a site's mean as they do there


def chain_step(tokens: int, C: int, sites: int = SITES):
    """One training step's mHC work without the layers': run_sites over ``sites`` connections with identity
    layers on random lanes [tokens, N, C], forward and backward (autograd.grad of the lanes and every parameter;
    the parameters are the bench's site inputs, the same for every site)."""
    from mhc_lab.ops import MHCConnection, run_sites

    x, phi, bias, alpha = site_inputs(tokens, C)
    connections = [MHCConnection(N, C, backend="kernels").to(x.device) for _ in range(sites)]
    with torch.no_grad():
        for c in connections:
            for parameter, value in zip(c.parameters(), (phi, bias, alpha)):
                parameter.copy_(value)
    lanes = x.detach().clone().requires_grad_()
    leaves = [lanes, *(p for c in connections for p in c.parameters())]
    g = torch.randn(x.shape, device="cuda", generator=torch.Generator(device="cuda").manual_seed(7)).bfloat16()
    layers = [_identity] * sites

    def step():
        return torch.autograd.grad(run_sites(lanes, connections, layers), leaves, g)

    return step


def _identity(y):
    return y


def _per_site(rows: list, sites: int, keys) -> list:
    return [{**row, **{k: round(row[k] / sites, 2) for k in keys}} for row in rows]


def bench_host(tokens: int = 256, C: int = 768, *, sites: int = SITES, steps: int = 200, top: int = 25,
               log=print) -> dict:
    """A chain of ``sites`` sites at tokens x C (chain_step), per site: launched and graph wall times, its
    kernels' GPU time and count, the ``top`` Python functions by own time and the host's events."""
    step = chain_step(tokens, C, sites)
    out = {"tokens": tokens, "C": C, "sites": sites, "launched_ms": wall_ms(step, steps) / sites,
           "graph_ms": wall_ms(graph_replay(step), steps) / sites}
    kernel_ms, kernels = kernel_totals(kernel_times(step))
    out["kernel_ms"], out["kernels_per_site"] = kernel_ms / sites, kernels / sites
    profile = python_profile(step, steps, top=top)
    out["host_us_by_function"] = _per_site([{k: row[k] for k in ("us", "calls", "function")}
                                            for row in profile["by_own_time"]], sites, ("us", "calls"))
    events = event_profile(step, steps, top=top)
    out["host_us_by_event"] = {part: _per_site(rows, sites, ("us", "own_us", "calls"))
                               for part, rows in events.items()}
    log(f"  host: {sites} chained sites at {tokens}x{C}, per site: {out['launched_ms']:.3f} ms launched, "
        f"{out['graph_ms']:.3f} ms as a CUDA graph, {out['kernels_per_site']:.2f} kernels ({out['kernel_ms']:.3f} ms "
        "of kernel time)")
    for row in out["host_us_by_function"]:
        log(f"    {row['us']:8.1f} us  {row['calls']:6.2f} calls  {row['function']}")
    log("  host events by own time per site (torch.profiler; us inside, us own, calls):")
    events = out["host_us_by_event"]
    for row in events["by_own_time"] + [r for r in events["native"] if r not in events["by_own_time"]]:
        log(f"    {row['us']:8.1f} {row['own_us']:8.1f} {row['calls']:6.2f}  {row['event']}")
    return {"site": out}
