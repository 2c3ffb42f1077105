"""A transformer block's forward + backward on a CUDA GPU (part 'block' of the training benchmark).

Pre-norm causal attention + 4C GELU MLP in bf16, 4 sequences x 4096 tokens, joined by a plain residual or by an
mHC connection around each of its two sub-layers. Kinds (BLOCK_KINDS): the plain residual; the copy floor (the
plain block plus copies of the bytes our chained sites move beyond it, mhc_lab.bench.copy_floor); ours (chained
sites: the first post projects for the second pre, mhc_lab.ops.run_sites); ours with the mHC ops recomputed in
backward; TileKernels; torch.compile of the reference. Each kind's step is timed launched op by op and as a CUDA
graph, each in interleaved rounds (every kind once per round, so that a drift of the GPU's clocks reaches all
alike), with its overhead over the plain residual taken round by round.
"""

from __future__ import annotations

import functools
import math

import torch
from torch import nn

from mhc_lab.bench.common import N, graph_replay, interleaved_rounds, overheads, rel, tilekernels_ops
from mhc_lab.bench.copy_floor import CopyFloor, copy_floor_plan

BLOCK_KINDS = ("residual", "copy_floor", "mhc_ours", "mhc_ours_recompute", "mhc_tilekernels", "mhc_compiled")
# Not captured as CUDA graphs: a failed capture of torch.compile's code left the process's CUDA generator
# unusable on the H200, and the compiled block is host-bound enough that its launched time is what a user gets.
NOT_GRAPHED = ("mhc_compiled",)
GRAPH_TOLERANCE = 1e-2  # a block's replayed input gradient against its launched one (relative); bf16 matmuls that
# cuBLAS chose differently under capture differ by about 1e-3, a replay that reads freed memory by far more


class Block(nn.Module):
    """Pre-norm causal attention + 4C GELU MLP, joined by a plain residual ("residual"), the copy floor's copies
    ("copy_floor"), our chained mHC sites ("mhc_ours"), the reference's ("mhc_reference") or TileKernels'
    ("mhc_tilekernels")."""

    def __init__(self, width: int, heads: int, connection: str):
        super().__init__()
        from mhc_lab.models import MLP, CausalSelfAttention, PreNorm

        self.connection = connection
        self.layers = nn.ModuleList([PreNorm(width, CausalSelfAttention(width, heads)), PreNorm(width, MLP(width))])
        self.layers.to(torch.bfloat16)
        if connection == "copy_floor":
            self.copy_floor = CopyFloor(copy_floor_plan(N, len(self.layers)))
        if connection in ("mhc_ours", "mhc_tilekernels"):
            from mhc_lab.ops import MHCConnection

            self.sites = nn.ModuleList(MHCConnection(N, width, backend="kernels") for _ in self.layers)
            for site in self.sites:  # away from the identity, so every coefficient path carries gradient
                with torch.no_grad():
                    site.phi.normal_(0, 1 / math.sqrt(N * width))
        if connection == "mhc_reference":
            from mhc_lab.reference import ManifoldHyperConnection

            self.sites = nn.ModuleList(ManifoldHyperConnection(N, width) for _ in self.layers)
        if connection == "mhc_tilekernels":
            self.tk = tilekernels_ops()

    def forward(self, h):
        if self.connection == "residual":
            for layer in self.layers:
                h = h + layer(h)
            return h
        if self.connection == "copy_floor":
            for i, layer in enumerate(self.layers):
                h = self.copy_floor(h, i, "pre")
                h = self.copy_floor(h + layer(h), i, "post")
            return h
        if self.connection == "mhc_tilekernels":
            tk_pre, tk_post = self.tk
            for site, layer in zip(self.sites, self.layers):
                y, (post_mix, comb_mix) = tk_pre(h, site.phi, site.alpha, site.bias, post_mult_value=2.0,
                                                 sinkhorn_repeat=20)
                h = tk_post(layer(y), h, post_mix, comb_mix)
            return h
        if self.connection == "mhc_ours":
            from mhc_lab.ops import run_sites

            return run_sites(h, self.sites, self.layers)
        for site, layer in zip(self.sites, self.layers):
            h = site(h, layer)
        return h


def block_step(width: int, kind: str, batch: int = 4, seq: int = 4096, layers: bool = True):
    """One of BLOCK_KINDS as a training step (forward + backward of a fresh block on random lanes): step(), with
    step.block and step.inputs (h, g). With layers=False the block's attention and MLP are identities: its
    connections alone, at the block's shapes and in its order."""
    if kind not in BLOCK_KINDS:
        raise ValueError(f"kind: expected one of {', '.join(BLOCK_KINDS)}, got {kind!r}")
    torch.manual_seed(0)
    connection = {"mhc_ours_recompute": "mhc_ours", "mhc_compiled": "mhc_reference"}.get(kind, kind)
    block = Block(width, width // 128, connection).cuda()
    if not layers:
        block.layers = nn.ModuleList(nn.Identity() for _ in block.layers)
    shape = (batch, seq, width) if kind in ("residual", "copy_floor") else (batch, seq, N, width)
    h = torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    if kind == "mhc_ours_recompute":
        from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

        from mhc_lab.ops import recompute_policy

        context = functools.partial(create_selective_checkpoint_contexts, recompute_policy)

        def fn(h):
            return checkpoint(block, h, use_reentrant=False, context_fn=context)
    else:
        fn = torch.compile(block) if kind == "mhc_compiled" else block

    def step():
        # as a training loop's zero_grad(set_to_none=True): each step's gradients are written, not added to the
        # last step's (which would cost every weight an add, and mHC's lanes an add of 12C per token)
        h.grad = None
        block.zero_grad(set_to_none=True)
        fn(h).backward(g)

    step.block, step.inputs = block, (h, g)
    return step


def bench_block(width: int, bench, *, batch: int = 4, seq: int = 4096, skip=(), rounds: int = 5, log=print) -> dict:
    """Every kind's training step at one width: its peak memory launched, then its time launched and as a CUDA
    graph, each in ``rounds`` interleaved rounds, with its overhead over the plain residual per round. After the
    graphs' timing, each replay's input gradient is checked against the launched step's (GRAPH_TOLERANCE): a
    graph that read memory it no longer held would be refused rather than timed."""
    def timed(fn):
        return bench(fn, warmup_ms=100, rep_ms=500)

    out = {"C": width, "tokens": batch * seq, "batch": batch, "seq": seq, "heads": width // 128, "peak_gib": {},
           "launched": {}, "graph": {}, "errors": {}}
    steps, launched_grads = {}, {}
    for kind in BLOCK_KINDS:
        if kind == "mhc_tilekernels" and "tilekernels" in skip or kind == "mhc_compiled" and "compile" in skip:
            continue
        try:
            step = block_step(width, kind, batch, seq)
            step()
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            step()
            torch.cuda.synchronize()
            out["peak_gib"][kind] = (torch.cuda.max_memory_allocated() - base) / 2**30
            launched_grads[kind] = step.inputs[0].grad.detach().clone()
            steps[kind] = step
            log(f"  block C={width} {kind:20s} peak {out['peak_gib'][kind]:.2f} GiB")
        except Exception as e:  # noqa: BLE001
            out["errors"][kind] = repr(e)[:500]
            log(f"  block C={width} {kind:20s} FAILED {repr(e)[:300]}")
    rounds_ms = interleaved_rounds(steps, timed, rounds)
    out["launched"] = {"rounds_ms": rounds_ms, "overhead_pct": overheads(rounds_ms)}
    replays = {}
    for kind, step in steps.items():
        if kind in NOT_GRAPHED:
            out["errors"][f"{kind}.graph"] = "not captured as a CUDA graph (torch.compile's capture is not reliable)"
            continue
        try:
            replays[kind] = graph_replay(step)
        except Exception as e:  # noqa: BLE001
            out["errors"][f"{kind}.graph"] = repr(e)[:500]
    graph_ms = interleaved_rounds(replays, timed, rounds)
    # after the timer's runs, which would have overwritten any memory a graph reads but no longer holds
    torch.cuda.synchronize()
    rel_diff = {kind: rel(steps[kind].inputs[0].grad, launched_grads[kind]) for kind in replays}
    for kind, diff in rel_diff.items():
        if not diff <= GRAPH_TOLERANCE:
            out["errors"][f"{kind}.graph"] = (f"refused: the replay's input gradient is {diff:.2e} (relative) off the "
                                              f"launched step's, where {GRAPH_TOLERANCE} was allowed")
            graph_ms.pop(kind)
    out["graph"] = {"rounds_ms": graph_ms, "overhead_pct": overheads(graph_ms), "rel_diff": rel_diff}
    for mode in ("launched", "graph"):
        for kind, o in out[mode]["overhead_pct"].items():
            log(f"  block C={width} {kind:20s} {mode:8s}: median {o['median']:+.1f}% over the plain residual "
                f"({o['least']:+.1f}% to {o['most']:+.1f}%, {rounds} rounds)")
    replays.clear()
    steps.clear()
    torch.cuda.empty_cache()
    return out
