"""A stack of MLP layers trained as a user's loop trains it (part 'stack' of the training benchmark, not among its
default parts): the host's time and the kernel count beside the GPU's.

``layers`` pre-norm sub-layers F(h) = Linear(4C -> C)(GELU(Linear(C -> 4C)(RMSNorm(h)))), bf16 weights and
activations, joined by one of STACK_KINDS: the plain residual (h + F(h)); MHCResidualStream with the fused kernels
(backend "kernels"); MHCResidualStream with the reference backend (PyTorch); DeepSeek's TileKernels mhc_pre and
mhc_post around the same layers with the same parameters. The three mHC kinds have n lanes, the same
parameters (phi drawn away from the identity, so that every coefficient path carries gradient) and compute the
same function. One training step (LOSS): the gradients set to None, as a training loop's zero_grad does, then the
forward, the scalar loss sum(output * w) for a fixed random w of the output's shape, and its backward.

Per kind: the step launched from Python, wall clock per step with the GPU synchronised at both ends after
warm-up, in interleaved rounds (every kind once per round, so that a drift of the machine reaches all alike); the
GPU time of its kernels per step and their count (torch.profiler); the step captured as a CUDA graph and replayed
(the GPU's time alone), timed by the suite's timer in interleaved rounds too, the replay's input gradient checked
against the launched step's; each figure's ratio to the plain residual's, and what each mHC kind adds per site.
For the fused stream alone, launched and (where measured) under torch.compile, where its host time goes: the
forward's and the backward's wall time per step, cProfile's functions by own and by cumulative time per step, and
torch.profiler's host events.
"""

from __future__ import annotations

import math
import statistics
import time

import torch
from torch import nn

from mhc_lab.bench.block import GRAPH_TOLERANCE
from mhc_lab.bench.common import (
    N,
    graph_replay,
    interleaved_rounds,
    rel,
    round_ratios,
    tilekernels_ops,
)
from mhc_lab.bench.host import event_profile, python_profile, wall_ms
from mhc_lab.bench.kernels import kernel_times, kernel_totals
from mhc_lab.measure.schemas import (
    STACK_ALL_KINDS,
    STACK_COMPILE_MODES,
    STACK_COMPILED_KINDS,
    STACK_KINDS,
)

# The same steps under torch.compile are not among the default kinds (each compiles for tens of seconds): kind
# "<kind>_compiled" in the default mode, "<kind>_reduce_overhead" in mode "reduce-overhead" (torch.compile's own
# CUDA graphs). TileKernels' ops are not compiled.
COMPILE_MODES = STACK_COMPILE_MODES
COMPILED_KINDS = STACK_COMPILED_KINDS
ALL_KINDS = STACK_ALL_KINDS
STACK_SHAPES = ((4096, 768), (8192, 2048))  # tokens x C: a small model's width, and a larger one's
PROFILED = "mhc_kernels"  # the kind whose host time is profiled function by function (key "host")
# and where measured, the same stream under torch.compile (key "host_compiled")
HOST_PROFILES = {"host": PROFILED, "host_compiled": "mhc_kernels_compiled"}
LOSS = "sum(output * w), w a fixed random bf16 tensor of the output's shape"
LAUNCHED_TIMER = ("wall clock per step (time.perf_counter), the GPU synchronised at both ends, after three "
                  "warm-up steps")
TARGET_MS = 300.0  # what each launched timing aims to last: its steps are that over one step's time, 5 to 200
TOP = 30  # functions listed per ordering in the host profile


class Stack(nn.Module):
    """``layers`` pre-norm MLP sub-layers (bf16) joined as ``kind`` (one of STACK_KINDS)."""

    def __init__(self, width: int, layers: int, kind: str, n: int = N):
        super().__init__()
        from mhc_lab.models import MLP, PreNorm
        from mhc_lab.ops import MHCResidualStream

        if kind not in STACK_KINDS:
            raise ValueError(f"kind: expected one of {', '.join(STACK_KINDS)}, got {kind!r}")
        self.kind, self.n = kind, n
        sublayers = [PreNorm(width, MLP(width)).to(torch.bfloat16) for _ in range(layers)]
        if kind == "residual":
            self.layers = nn.ModuleList(sublayers)
            return
        # the TileKernels stack keeps its parameters in a stream of ours, which it does not call
        backend = "reference" if kind == "mhc_reference" else "kernels"
        self.stream = MHCResidualStream(sublayers, n, width, backend=backend)
        for connection in self.stream.connections:
            with torch.no_grad():
                connection.phi.normal_(0, 1 / math.sqrt(n * width))
        if kind == "mhc_tilekernels":
            self.tk = tilekernels_ops()

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.kind == "residual":
            for layer in self.layers:
                h = h + layer(h)
            return h
        if self.kind == "mhc_tilekernels":
            from mhc_lab.reference.hyper_connections import collapse_lanes, expand_lanes

            tk_pre, tk_post = self.tk
            x = expand_lanes(h, self.n)  # [sequences, tokens, n, C], as TileKernels wants its lanes
            for connection, layer in zip(self.stream.connections, self.stream.layers):
                y, (post_mix, comb_mix) = tk_pre(x, connection.phi, connection.alpha, connection.bias,
                                                 post_mult_value=2.0, sinkhorn_repeat=20)
                x = tk_post(layer(y), x, post_mix, comb_mix)
            return collapse_lanes(x)
        return self.stream(h)


def compile_mode(kind: str) -> tuple[str, str | None]:
    """(the kind of stack, torch.compile's mode or None) of one of ALL_KINDS."""
    for suffix, mode in COMPILE_MODES.items():
        if kind.endswith("_" + suffix) and kind in COMPILED_KINDS:
            return kind.removesuffix("_" + suffix), mode
    return kind, None


def stack_step(width: int, tokens: int, kind: str, *, layers: int = 8, n: int = N, seed: int = 0):
    """One of ALL_KINDS as a training step on one sequence of ``tokens``: step() runs forward, loss and
    backward; step.loss() the gradients' reset, the forward and the loss (what the backward then follows);
    step.stack (the module, uncompiled), step.inputs (h, w). The stacks of every kind share their layers' weights
    and inputs (seeded)."""
    torch.manual_seed(seed)
    h = torch.randn(1, tokens, width, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(1, tokens, width, device="cuda", dtype=torch.bfloat16)
    base, mode = compile_mode(kind)
    stack = Stack(width, layers, base, n).cuda()
    model = stack if mode is None else torch.compile(stack, mode=mode)

    def loss():
        h.grad = None
        stack.zero_grad(set_to_none=True)
        return (model(h) * w).sum()

    def step():
        loss().backward()

    step.loss, step.stack, step.inputs = loss, stack, (h, w)
    return step


def host_profile(step, steps: int, *, top: int = TOP) -> dict:
    """Where the host's time of ``steps`` launched steps goes: the wall time per step of the forward (with the
    loss) and of the backward, timed apart without synchronising between them; then cProfile over ``steps``
    steps: the wall time per step under it, the Python functions' own time per step in all, and the ``top``
    functions by own time and by cumulative time per step; then torch.profiler's host events (events)."""
    step()
    torch.cuda.synchronize()
    forward = backward = 0.0
    for _ in range(steps):
        t0 = time.perf_counter()
        loss = step.loss()
        t1 = time.perf_counter()
        loss.backward()
        forward, backward = forward + t1 - t0, backward + time.perf_counter() - t1
    torch.cuda.synchronize()
    return {"steps": steps, "forward_ms": forward / steps * 1e3, "backward_ms": backward / steps * 1e3,
            **python_profile(step, steps, top=top), "events": event_profile(step, steps, top=top)}


def compile_every_stack() -> None:
    """Every compiled kind compiles the same Stack.forward for a module of its own: let Dynamo keep a compiled
    graph for each (by default it stops compiling a function after 8) so that none falls back to eager."""
    import torch._dynamo

    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, max(getattr(torch._dynamo.config, name), 256))


def _medians(rounds_ms: dict) -> dict:
    return {kind: statistics.median(times) for kind, times in rounds_ms.items()}


def bench_stack(width: int, tokens: int, bench, *, layers: int = 8, n: int = N, kinds=STACK_KINDS, rounds: int = 3,
                log=print) -> dict:
    """Every one of ``kinds`` (the plain residual among them: the ratios' base) trained one step at a time at
    tokens x width: launched (wall clock, ``rounds`` interleaved rounds), its kernels' GPU time and count
    (profiler), as a CUDA graph (``bench``, ``rounds`` interleaved rounds), the ratios to the plain residual, what
    each mHC kind adds per site, and the fused stream's host profiles. A kind that cannot be built or run, whose
    graph cannot be captured or replays something else, or whose host profile fails, is recorded in "errors" with
    the reason; the others are still measured."""
    kinds = tuple(kinds)
    if "residual" not in kinds or set(kinds) - set(ALL_KINDS):
        raise ValueError(f"kinds: expected kinds among {', '.join(ALL_KINDS)}, the plain residual among them, "
                         f"got {kinds!r}")
    from torch._dynamo.utils import counters

    if set(kinds) & set(COMPILED_KINDS):
        compile_every_stack()
        counters.clear()
    out = {"tokens": tokens, "C": width, "n": n, "layers": layers, "hidden": 4 * width, "steps_per_timing": {},
           "launched_ms": {}, "launched_rounds_ms": {}, "gpu_ms": {}, "kernels_per_step": {}, "kernels": {},
           "graph_ms": {}, "graph_rounds_ms": {}, "graph_rel_diff": {}, "first_step_s": {}, "errors": {}}
    steps, launched_grads = {}, {}
    for kind in (k for k in ALL_KINDS if k in kinds):
        try:
            step = stack_step(width, tokens, kind, layers=layers, n=n)
            start = time.perf_counter()
            step()  # the first step builds the kernels (TileLang compiles on first use), and compiles a compiled kind
            torch.cuda.synchronize()
            out["first_step_s"][kind] = time.perf_counter() - start
            repeat = max(5, min(200, math.ceil(TARGET_MS / max(wall_ms(step, 1), 1e-3))))
            times = kernel_times(step)
            grad = step.inputs[0].grad.detach().clone()
        except Exception as e:  # noqa: BLE001 - recorded, the other kinds still measured
            out["errors"][kind] = repr(e)[:500]
            log(f"  stack {tokens}x{width} {kind:16s} FAILED {repr(e)[:300]}")
        else:
            steps[kind], launched_grads[kind], out["steps_per_timing"][kind] = step, grad, repeat
            out["gpu_ms"][kind], out["kernels_per_step"][kind] = kernel_totals(times)
            out["kernels"][kind] = {k[:160]: {"ms": ms, "launches": count} for k, (ms, count) in times.items()}
        torch.cuda.empty_cache()

    def launched(timed):  # (step, steps per timing) -> seconds per step
        step, repeat = timed
        return wall_ms(step, repeat) * 1e-3

    out["launched_rounds_ms"] = interleaved_rounds(
        {kind: (step, out["steps_per_timing"][kind]) for kind, step in steps.items()}, launched, rounds)
    out["launched_ms"] = _medians(out["launched_rounds_ms"])
    for key, kind in HOST_PROFILES.items():
        if kind not in steps:
            continue
        try:
            out[key] = host_profile(steps[kind], out["steps_per_timing"][kind])
        except Exception as e:  # noqa: BLE001 - the profile is recorded as missing, the timings stand
            out["errors"][f"{kind}.host"] = repr(e)[:500]
            log(f"  stack {tokens}x{width} {kind:16s} host profile FAILED {repr(e)[:300]}")

    if set(kinds) & set(COMPILED_KINDS):
        out["dynamo"] = {"graph_breaks": sum(counters["graph_break"].values()),
                         "recompiles": sum(counters["recompiles"].values()),
                         "unique_graphs": counters["stats"]["unique_graphs"]}
    replays = {}
    for kind, step in steps.items():
        if compile_mode(kind)[1] is not None:  # timed launched only: reduce-overhead is torch.compile's own graph
            continue
        try:
            replays[kind] = graph_replay(step)
        except Exception as e:  # noqa: BLE001 - a capture that fails is recorded, not fatal
            out["errors"][f"{kind}.graph"] = repr(e)[:500]
            log(f"  stack {tokens}x{width} {kind:16s} graph FAILED {repr(e)[:300]}")
    graph_rounds = interleaved_rounds(replays, lambda fn: bench(fn, warmup_ms=100, rep_ms=500), rounds)
    torch.cuda.synchronize()  # after the timer's runs, which would have overwritten memory a graph no longer holds
    for kind in replays:
        diff = rel(steps[kind].inputs[0].grad, launched_grads[kind])
        out["graph_rel_diff"][kind] = diff
        if not diff <= GRAPH_TOLERANCE:
            out["errors"][f"{kind}.graph"] = (f"refused: the replay's input gradient is {diff:.2e} (relative) off "
                                              f"the launched step's, where {GRAPH_TOLERANCE} was allowed")
            graph_rounds.pop(kind)
    out["graph_rounds_ms"] = graph_rounds
    out["graph_ms"] = _medians(graph_rounds)

    out["over_residual"] = _over_residual(out)
    out["per_site_over_residual"] = _per_site(out, layers)
    _log_table(out, log)
    replays.clear()
    steps.clear()
    torch.cuda.empty_cache()
    return out


def plain_of(kind: str, measured) -> str:
    """The plain residual a kind is compared with: the plain residual run the same way (compiled in the same
    mode) where it was measured, else the eager one."""
    _, mode = compile_mode(kind)
    same = next((f"residual_{suffix}" for suffix, m in COMPILE_MODES.items() if m == mode), None)
    return same if same in measured else "residual"


def _over_residual(out: dict) -> dict:
    """Each other kind's figures over its plain residual's (plain_of): launched and graph per round, GPU time and
    kernels."""
    ratios = {"launched": {}, "graph": {}, "gpu": {}, "kernels": {}}
    for kind in out["launched_ms"]:
        plain = plain_of(kind, out["launched_ms"])
        if kind == plain or kind.startswith("residual"):
            continue
        for mode in ("launched", "graph"):
            r = round_ratios(out[f"{mode}_rounds_ms"].get(kind), out[f"{mode}_rounds_ms"].get(plain))
            if r:
                ratios[mode][kind] = r
        if out["gpu_ms"].get(plain):
            ratios["gpu"][kind] = out["gpu_ms"][kind] / out["gpu_ms"][plain]
        if out["kernels_per_step"].get(plain):
            ratios["kernels"][kind] = out["kernels_per_step"][kind] / out["kernels_per_step"][plain]
    return ratios


def _per_site(out: dict, layers: int) -> dict:
    """What each mHC kind adds to its plain residual's step (plain_of) per site (its figure less the plain
    one's, over the layers): launched ms, GPU ms, kernels, and graph ms where both graphs were timed."""
    per_site = {}
    for kind in out["launched_ms"]:
        plain = plain_of(kind, out["launched_ms"])
        if kind.startswith("residual") or plain not in out["launched_ms"]:
            continue
        row = {key: (out[figure][kind] - out[figure][plain]) / layers for key, figure in (
            ("launched_ms", "launched_ms"), ("gpu_ms", "gpu_ms"), ("kernels", "kernels_per_step"))}
        if kind in out["graph_ms"] and plain in out["graph_ms"]:
            row["graph_ms"] = (out["graph_ms"][kind] - out["graph_ms"][plain]) / layers
        per_site[kind] = row
    return per_site


def _log_table(out: dict, log) -> None:
    log(f"  stack {out['tokens']}x{out['C']}, {out['layers']} layers, n = {out['n']}: launched | GPU time | "
        f"kernels per step | as a CUDA graph")
    for kind, ms in out["launched_ms"].items():
        launched = out["over_residual"]["launched"].get(kind)
        graph = out["over_residual"]["graph"].get(kind)
        graph_ms = out["graph_ms"].get(kind)
        log(f"    {kind:28s} {ms:8.2f} ms" + (f" ({launched['median']:.2f}x)" if launched else " " * 8)
            + f" | {out['gpu_ms'][kind]:8.2f} ms | {out['kernels_per_step'][kind]:6.0f} | "
            + (f"{graph_ms:8.2f} ms" if graph_ms is not None else "       -")
            + (f" ({graph['median']:.2f}x)" if graph else ""))
    for kind, row in out["per_site_over_residual"].items():
        log(f"    {kind:28s} per site over the residual: {row['launched_ms']:+.3f} ms launched, "
            f"{row['gpu_ms']:+.3f} ms GPU, {row['kernels']:+.1f} kernels")
    if "dynamo" in out:
        d = out["dynamo"]
        log(f"    torch.compile: {d['unique_graphs']} graphs, {d['graph_breaks']} graph breaks, {d['recompiles']} "
            f"recompiles; first steps " + ", ".join(f"{k} {v:.1f} s" for k, v in out["first_step_s"].items()
                                                    if compile_mode(k)[1]))
    for key, kind in HOST_PROFILES.items():
        host = out.get(key)
        if not host:
            continue
        log(f"    {kind} host: forward {host['forward_ms']:.2f} ms, backward {host['backward_ms']:.2f} ms per "
            f"step; functions by own time per step:")
        for row in host["by_own_time"][:10]:
            log(f"      {row['us']:8.1f} us {row['calls']:6.1f} calls  {row['function']}")
        log("      host events by own time per step (torch.profiler; us inside, us own, calls):")
        for row in host["events"]["by_own_time"][:20]:
            log(f"      {row['us']:8.1f} {row['own_us']:8.1f} {row['calls']:6.1f}  {row['event']}")
