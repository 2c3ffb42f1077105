"""Benchmark of mHC training on a CUDA GPU: one site forward + backward, and a transformer block.

    python -m mhc_lab.bench training                       # everything, records JSON
    python -m mhc_lab.bench training --parts site --shapes 16384x4096 --no-save

Site (n = 4, bf16 lanes, float32 coefficients, 20 Sinkhorn rounds, layer F = identity): forward and the
gradients of x, phi, bias and alpha for a random upstream gradient, timed as medians (L2 flushed between
runs) for ours (the fused kernels through mhc_lab.ops.training: mhc_pre then mhc_post, and mhc_site, which
links them so that the lanes' two gradients are summed in the pre's backward pass, and the same site chained
inside a stack: its pre takes x's projection from the previous post, its post projects for the next pre),
DeepSeek's TileKernels (tile-kernels 1.0.0, its autograd path), torch.compile of the reference and the eager
reference; every gradient is compared with the float32 reference on the same inputs. Each is timed twice:
launched op by op from Python (times_ms), and captured once as a CUDA graph and replayed (graph_ms), which
is the GPU's time alone, without the host's per-op work. --graph-rounds K times the graphs again in K rounds,
each implementation in turn within a round (graph_rounds_ms), and records the chained site's ratio to
TileKernels per round, its median, least and most: a ratio near a target reads better against its spread.

Block (pre-norm causal attention + 4C GELU MLP, bf16, 4 sequences x 4096 tokens): forward + backward of one
block with a plain residual and with mHC around each of its two sub-layers (ours as linked sites, ours as
chained sites where the first post projects for the second pre, ours with the mHC ops recomputed in
backward, TileKernels, torch.compile of the reference), with peak memory above the inputs, and the copy floor:
the plain residual block plus device-to-device copies of the bytes our chained sites move beyond it, where they
move them (copy_floor_plan; 76C per token at n = 4), what the block would cost if every mHC kernel streamed at
the copy's pace and the small ones took no time. --block-rounds K
times the blocks again in K interleaved rounds and records each kind's overhead per round and its median.
--block-graphs times each block's step as a CUDA graph, the GPU's time without the host's waits.
--weight-grads-beside gives every block's layers (the plain residual's too) weight gradients computed on a second
stream, beside what follows on the lanes' path: where the GPU runs a connection's streaming kernels beside those
GEMMs, the block's extra time can go below the copy floor (part "overlap" measures whether it does).
Block kernels (part "block_kernels"): the plain and the chained block profiled kernel by kernel, and the chained
block's connections with identities for layers, to say where the block's extra time goes (--block-kernels-kinds:
other kinds in the chained block's place, the copy floor among them). Behind GEMMs (part
"behind_gemms"): the chained site's kernels profiled alone and behind matmuls that bring the GPU to its power cap.
Overlap (part "overlap"): kernel 2, the post + projection and a copy each launched beside one of the MLP's
weight-gradient GEMMs on a second stream, against the two one after another: how much of a connection's time a
second stream could hide (bench_overlap).
Host (part "host", not in the default parts): what the host costs per site, at a small shape where the GPU's
work is tiny, and lab 07's model's step against the GPU time of its kernels (bench_host). Profile (part
"profile_kernels", records nothing): kernel 2 of the pre backward and the post + projection once each between
cudaProfilerStart and cudaProfilerStop, for `ncu --profile-from-start off`.
Results go to mhc_lab/recorded/training_h200.json unless --no-save.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import statistics
import sys
import time

import torch
from torch import nn

from mhc_lab.measure import bytes_model
from mhc_lab.bench.forward import _inputs, _rel, _tilekernels, _timer, copy_bandwidth, hashable_tuning
from mhc_lab.measure import save_recording
from mhc_lab.ops import training as _training_ops  # noqa: F401  (registers torch.ops.mhc_lab.*)
from mhc_lab.reference import mhc_coefficients, mhc_post, mhc_pre

SHAPES = ((16384, 2560), (16384, 4096), (8192, 7168))
BLOCK_WIDTHS = (2560, 4096)
N = 4


def site_bytes_fwd_bwd(tokens: int, C: int, n: int = N, itemsize: int = 2, post_grad: bool = False) -> dict:
    """Bytes per site, forward + backward, of the lane-wide tensors (mhc_lab.measure.bytes_model): the least
    any design moves (mhc_minimal: 41 C elements per token at n = 4) and what ours moves as separate ops
    (58 C), as the linked site (50 C) and as chained sites (46 C). post_grad (the linked and chained sites'
    post hands its output gradient to the pre's kernel 2, mhc_lab.ops.training.post_gradient_to_pre): their
    post backward writes no dx, n C fewer (46 C and 42 C at n = 4; kernel 2 reads g where it read dx_post)."""
    out = {}
    for key, method in (("least", "mhc_minimal"), ("ours", "ours"), ("ours_linked", "ours_linked"),
                        ("ours_chained", "ours_chained")):
        per_C = sum(bytes_model.total(method, n, d).moved.per_C for d in bytes_model.DIRECTIONS)
        per_C -= bytes_model.post_gradient_saving(n) if post_grad and key in ("ours_linked", "ours_chained") else 0
        out[key] = tokens * per_C * C * itemsize
        out[f"{key}_elements_per_token"] = f"{per_C} C"
    return out


# ---------------------------------------------------------------------------------------------------------
# site


def _handed_partial(x, own):
    """The partial sums a previous post hands to this pre (partial_splits(chained=True) of them), made from the
    pre's own projection: its splits summed into the first."""
    from mhc_lab.ops.training import partial_splits

    handed = torch.zeros((partial_splits("kernels", x, chained=True), *own.shape[1:]), dtype=own.dtype,
                         device=own.device)
    handed[0] = own.sum(0)
    return handed


def _site_impls(skip):
    from mhc_lab.ops.training import chaining_on_cuda, mhc_post as ours_post, mhc_pre as ours_pre, mhc_site
    from mhc_lab.ops.training import mhc_site_chained

    made = {}

    def chain_partial(x, phi, bias, alpha):
        """x's projection with phi as a previous post hands it over, made once per input (outside the timing)."""
        key = (x.data_ptr(), phi.data_ptr(), x.shape)
        if key not in made:
            made.clear()
            with torch.no_grad():
                own = torch.ops.mhc_lab.pre_forward(x.detach(), phi.detach(), bias.detach(), alpha.detach(),
                                                    "kernels")[4]
                made[key] = _handed_partial(x, own)
        return made[key]

    def ours(x, phi, bias, alpha):
        y, post, res = ours_pre(x, phi, bias, alpha, backend="kernels")
        return ours_post(x, y, post, res, backend="kernels")

    def ours_linked(x, phi, bias, alpha):  # the site as one call: the post's lanes gradient left to the pre
        return mhc_site(x, phi, bias, alpha, lambda y: y, backend="kernels")

    def ours_chained(x, phi, bias, alpha):  # a site inside a stack: the previous post projected x for this pre,
        # and this post projects its lanes for the next pre (the same phi here; untimed, made once below)
        with chaining_on_cuda(True):
            partial = chain_partial(x, phi, bias, alpha)
            return mhc_site_chained(x, phi, bias, alpha, lambda y: y, partial=partial, next_phi=phi,
                                    backend="kernels")[0]

    def reference(x, phi, bias, alpha):
        pre, post, res = mhc_coefficients(x, phi, bias, alpha)
        return mhc_post(x, mhc_pre(x, pre), post, res)

    impls = {"ours": ours, "ours_linked": ours_linked, "ours_chained": ours_chained}
    errors = {}
    if "tilekernels" not in skip:
        try:
            _tilekernels()  # the tolerant first import of tile_kernels 1.0.0
            from tile_kernels.modeling.mhc import mhc_pre as tk_pre
            from tile_kernels.modeling.mhc.ops.post import mhc_post as tk_post

            def tilekernels(x, phi, bias, alpha):
                r = x.unsqueeze(0)
                y, (post_mix, comb_mix) = tk_pre(r, phi, alpha, bias, post_mult_value=2.0, sinkhorn_repeat=20)
                return tk_post(y, r, post_mix, comb_mix).squeeze(0)

            impls["tilekernels"] = tilekernels
        except Exception as e:  # noqa: BLE001 - record why the baseline is missing
            errors["tilekernels"] = repr(e)[:500]
    if "compile" not in skip:
        impls["compiled"] = torch.compile(reference)
    if "eager" not in skip:
        impls["eager"] = reference
    return impls, errors, reference


# The sites also timed as CUDA graphs. Not the eager reference and torch.compile's code: on the H200
# (2026-11-30) capturing the compiled site failed, and a failed capture left the process's CUDA generator
# unusable (every later torch.randn_like raised "Offset increment outside graph capture"). Both are host-bound
# at 10-20 ms anyway, and their launched time is what a user of them gets.
GRAPHED_SITES = ("ours", "ours_linked", "ours_chained", "tilekernels")


def _site_operands(tokens, C):
    """A site's inputs (bench_forward._inputs), autograd leaves made from them, and the random upstream
    gradient of its output (seed 7)."""
    x, phi, bias, alpha = _inputs(tokens, C)
    g = torch.randn(x.shape, device="cuda", generator=torch.Generator(device="cuda").manual_seed(7)).bfloat16()
    leaves = [t.detach().clone().requires_grad_() for t in (x, phi, bias, alpha)]
    return (x, phi, bias, alpha), leaves, g


def interleaved_rounds(replays: dict, bench, rounds: int) -> dict[str, list[float]]:
    """Each of ``replays`` (name -> callable) timed by ``bench`` (seconds) in ``rounds`` rounds, the names in
    turn within each round, so that a drift of the GPU's clocks or temperature over the run reaches every
    implementation alike: name -> [ms per round]."""
    if not isinstance(rounds, int) or rounds < 1:
        raise ValueError(f"interleaved_rounds: expected rounds >= 1, got {rounds!r}")
    times = {name: [] for name in replays}
    for _ in range(rounds):
        for name, replay in replays.items():
            times[name].append(bench(replay) * 1e3)
    return times


def round_ratios(rounds_ms: dict[str, list[float]], ours: str = "ours_chained", base: str = "tilekernels") -> dict:
    """The per-round ratio ours / base of interleaved_rounds' times, with its median, least and most (an empty
    dict when either is missing)."""
    a, b = rounds_ms.get(ours), rounds_ms.get(base)
    if not a or not b:
        return {}
    ratios = [x / y for x, y in zip(a, b)]
    return {"ratios": ratios, "median": statistics.median(ratios), "least": min(ratios), "most": max(ratios)}


def bench_site(tokens, C, bench, *, skip=(), log=print, graph_rounds: int = 1) -> dict:
    """One site's forward + backward per implementation: launched op by op, and as a CUDA graph; with
    graph_rounds > 1 the graphs are then timed again in that many interleaved rounds (graph_rounds_ms, and the
    chained site's ratio to TileKernels per round)."""
    (x, phi, bias, alpha), leaves, g = _site_operands(tokens, C)
    impls, errors, reference = _site_impls(skip)
    post_grad = _training_ops.post_gradient_to_pre_for(x, "kernels")
    out = {"tokens": tokens, "C": C, "n": N, "bytes": site_bytes_fwd_bwd(tokens, C, post_grad=post_grad),
           "post_gradient_to_pre": post_grad, "times_ms": {},
           "graph_ms": {}, "rel_err": {}, "errors": errors}
    want = torch.autograd.grad(reference(*leaves), leaves, g)
    names = ("x", "phi", "bias", "alpha")
    replays = {}  # kept for the interleaved rounds
    for name, fn in impls.items():
        def step(fn=fn):
            return torch.autograd.grad(fn(*leaves), leaves, g)
        try:
            got = step()
            torch.cuda.synchronize()
            out["rel_err"][name] = {k: _rel(a, b) for k, a, b in zip(names, got, want)}
            out["times_ms"][name] = bench(step) * 1e3
            errs = " ".join(f"{k} {v:.1e}" for k, v in out["rel_err"][name].items())
            if name not in GRAPHED_SITES:
                graphed = "not captured as a CUDA graph"
            else:
                try:
                    replay = _graph_replay(step)
                    out["graph_ms"][name] = bench(replay) * 1e3
                    if graph_rounds > 1:
                        replays[name] = replay
                    del replay
                    graphed = f"{out['graph_ms'][name]:8.3f} ms as a CUDA graph"
                except Exception as e:  # noqa: BLE001 - the launched timing stands; say why there is no graph
                    out["errors"][f"{name}.graph"] = repr(e)[:500]
                    graphed = f"no CUDA graph ({repr(e)[:120]})"
            log(f"  site {tokens}x{C} {name:12s} {out['times_ms'][name]:8.3f} ms launched, {graphed}  rel err {errs}")
        except Exception as e:  # noqa: BLE001
            out["errors"][name] = repr(e)[:500]
            log(f"  site {tokens}x{C} {name:12s} FAILED {repr(e)[:300]}")
    for name in ("ours", "ours_linked", "ours_chained"):
        for key, suffix in (("times_ms", ""), ("graph_ms", "_graph")):
            if name in out[key] and "tilekernels" in out[key]:
                out[f"{name}_vs_tilekernels{suffix}"] = out[key][name] / out[key]["tilekernels"]
    if replays:
        out["graph_rounds_ms"] = interleaved_rounds(replays, bench, graph_rounds)
        replays.clear()
        ratio = round_ratios(out["graph_rounds_ms"])
        if ratio:
            out["ours_chained_vs_tilekernels_graph_rounds"] = ratio
            log(f"  site {tokens}x{C} chained / TileKernels as CUDA graphs over {graph_rounds} interleaved rounds: "
                f"median {ratio['median']:.4f}x ({ratio['least']:.4f}-{ratio['most']:.4f})")
    out["times_ms"].update(_site_components(x, phi, bias, alpha, g, bench))
    return out


def _graph_replay(step):
    """step captured as a CUDA graph (after warm-up runs on a side stream): its replay, timed, is the GPU's time
    for the step alone. Launched op by op, a site's forward + backward can take longer than its kernels run,
    when the host's per-op work (Python, dispatch, allocation, launches) outlasts them: at 16384 x 2560 two
    runs of the same code timed the linked site at 1.51 and 2.05 ms, while the sum of its ops timed alone
    was 1.53 (H200, 2026-11-30)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    torch.cuda.synchronize()

    def replay():
        graph.replay()

    # the graph reads and writes the tensors that step's closure holds (a block's parameters, its inputs):
    # the replay keeps them alive, or their memory would go to whatever is allocated next
    replay.step = step
    return replay


def _site_components(x, phi, bias, alpha, g, bench) -> dict:
    """Each of our kernels alone (forward ops and backward ops), for the byte accounting; the *_chained ops are
    those of a site inside a chain (its pre takes the previous post's partial sums, its post projects for the
    next pre)."""
    from mhc_lab.ops.training import chaining_on_cuda

    ops = torch.ops.mhc_lab
    y, post, res, pre, partial, link = ops.pre_forward(x, phi, bias, alpha, "kernels")
    f = y
    dy, dpost, dres = torch.randn_like(y), torch.randn_like(post), torch.randn_like(res)
    handed = _handed_partial(x, partial)

    def post_project():
        with chaining_on_cuda(True):
            return ops.post_forward_linked(x, link, f, post, res, "kernels", phi)

    return {
        "fwd.pre": bench(lambda: ops.pre_forward(x, phi, bias, alpha, "kernels")) * 1e3,
        "fwd.post": bench(lambda: ops.post_forward(x, f, post, res, "kernels")) * 1e3,
        "bwd.post": bench(lambda: ops.post_backward(x, f, post, res, g, "kernels")) * 1e3,
        "bwd.pre": bench(lambda: ops.pre_backward(x, phi, bias, alpha, pre, partial, res, dy, dpost, dres, None,
                                                  "kernels")) * 1e3,
        "bwd.add_dx": bench(lambda: x + x) * 1e3,
        # the linked site's pre backward: the post's dx (here g stands in for it) added to dx in the same pass
        "bwd.pre_linked": bench(lambda: ops.pre_backward(x, phi, bias, alpha, pre, partial, res, dy, dpost, dres,
                                                         g, "kernels")) * 1e3,
        "fwd.pre_chained": bench(lambda: ops.pre_forward(x, phi, bias, alpha, "kernels", handed)) * 1e3,
        "fwd.post_chained": bench(post_project) * 1e3,
        "bwd.pre_chained": bench(lambda: ops.pre_backward(x, phi, bias, alpha, pre, handed, res, dy, dpost, dres,
                                                          g, "kernels")) * 1e3,
    }


def sweep_pre_backward(tokens, C, bench, variants, log=print, coefficient_variants=()) -> dict:
    """Time the pre backward's two kernels alone: kernel 1 as the ops run it (``coefficients_phases`` in the
    result) and in each of ``coefficient_variants`` ({"block_tokens", "block_c", "threads", "stages",
    "warp_specialized"} for the fused kernel, or {"phases": "fused", "split" or "spread", "spread":
    {"threads"}}; the two kernels of "split" and "spread" are also timed each alone), kernel 2 for each tuning
    variant (keys of training.LANE_TUNABLE, "lane_splits" among them, and "add_dx", "post_grad", "leave_out");
    every variant's outputs are compared with the first's of the same add_dx and post_grad without leave_out (a timing
    experiment's differ by design). A variant without "lane_splits" runs the token splits a site runs
    (lane_splits_for on this GPU, for the variant's lanes, columns and CTAs per SM), recorded in its row as
    "token_splits". A variant with "joined": true times the joined kernel (kernel 2 with dx_post joined with the
    post backward of a site before, random operands of its own) against the two kernels apart, and compares
    every output with theirs."""
    from mhc_lab.kernels.pre_backward import (
        coef_width,
        dphi_from_partial,
        dphi_partial_shape,
        gemm_depth,
        pre_backward_kernels,
        two_phase_coefficients,
    )

    x, phi, bias, alpha = _inputs(tokens, C, seed=2)
    ops = torch.ops.mhc_lab
    y, post, res, pre, partial, _ = ops.pre_forward(x, phi, bias, alpha, "kernels")
    dy, dpost, dres = torch.randn_like(y), torch.randn_like(post), torch.randn_like(res)
    n, m = N, N * N + 2 * N
    f32 = dict(dtype=torch.float32, device="cuda")
    dpre, dlogit, dmix, extra = (torch.empty((tokens, k), **f32) for k in (n, m, m, 4))
    phases = _training_ops._coefficient_phases_for(n)
    coefficients, _ = pre_backward_kernels(n, C, "bfloat16", "cuda", splits=partial.shape[0], phases=phases)
    dsplit = torch.empty((tokens, 3, 2 * gemm_depth(n)), dtype=torch.bfloat16, device="cuda")
    coef = torch.empty((tokens, coef_width(n)), **f32)
    args1 = (x, dy, partial, bias, alpha, dpost, dres, pre, dpre, dlogit, dmix, extra, dsplit, coef)
    coefficients(*args1)
    out = {"tokens": tokens, "C": C, "coefficients_phases": phases,
           "coefficients_ms": bench(lambda: coefficients(*args1)) * 1e3, "lanes": [], "coefficients": []}
    log(f"  pre backward {tokens}x{C}: kernel 1 ({phases}) {out['coefficients_ms']:.3f} ms")
    first = [t.clone() for t in (dmix, dsplit, coef)]
    for cfg in coefficient_variants:
        row = dict(cfg)
        try:
            from mhc_lab.kernels._target import NO_WARP_SPECIALIZATION, compile_program
            from mhc_lab.kernels.pre_backward import pre_backward_coefficients_program

            two = cfg.get("phases") in ("split", "spread")
            if two:  # two kernels: the streaming dH_pre, then the per-token part
                kernel = two_phase_coefficients(n, C, "bfloat16", "cuda", splits=partial.shape[0],
                                                phases=cfg["phases"], spread=cfg.get("spread"))
            else:
                tiling = {k: v for k, v in cfg.items() if k != "warp_specialized"}
                kernel = compile_program(
                    pre_backward_coefficients_program(n, C, "bfloat16", "cuda", splits=partial.shape[0], **tiling),
                    "cuda", pass_configs=None if cfg.get("warp_specialized", True) else NO_WARP_SPECIALIZATION)
            kernel(*args1)
            row["rel_dmix"] = _rel(dmix, first[0])
            row["equal_operands"] = bool(torch.equal(dsplit, first[1]) and torch.equal(coef, first[2]))
            row["ms"] = bench(lambda: kernel(*args1)) * 1e3
            if two:  # and each of the two alone
                row["dpre_ms"] = bench(lambda: kernel.reduce(x, dy, dpre)) * 1e3
                row["tokens_ms"] = bench(lambda: kernel.tokens(*args1[2:])) * 1e3
            log(f"    kernel 1 {cfg}: {row['ms']:.3f} ms"
                + (f" (dH_pre {row['dpre_ms']:.3f}, per token {row['tokens_ms']:.3f})" if two else "")
                + f", dmix vs default {row['rel_dmix']:.1e}, operands equal {row['equal_operands']}")
        except Exception as e:  # noqa: BLE001
            row["error"] = repr(e)[:400]
            log(f"    kernel 1 {cfg}: FAILED {repr(e)[:300]}")
        out["coefficients"].append(row)
    references = {}  # the first variant's outputs, per extra operand (the linked site's kernel adds dx_post,
    # or with post_grad H_res^T g)
    dx_post, res_post = torch.randn_like(x), torch.rand((tokens, n, n), **f32)
    previous = None  # the site before's operands and the two kernels' outputs apart, for "joined" variants
    for cfg in variants:
        row = dict(cfg)
        if cfg.get("joined"):
            try:
                previous = previous or _previous_site_apart(x, dy, dsplit, coef, phi, dx_post, bench, log)
                row.update(_time_joined(cfg, previous, x, dy, dsplit, coef, phi, dx_post, bench, log))
            except Exception as e:  # noqa: BLE001
                row["error"] = repr(e)[:400]
                log(f"    {cfg}: FAILED {repr(e)[:300]}")
            out["lanes"].append(row)
            continue
        try:
            add_dx, post_grad = bool(cfg.get("add_dx", False)), bool(cfg.get("post_grad", False))
            splits = row["token_splits"] = _training_ops._lane_splits(n, C, x.device, add_dx, post_grad, cfg)
            _, lanes = pre_backward_kernels(n, C, "bfloat16", "cuda", splits=partial.shape[0],
                                            **{**hashable_tuning(cfg), "lane_splits": splits})
            dx = torch.empty_like(x)
            dphi_partial = torch.empty(dphi_partial_shape(splits, n, C), **f32)
            more = [dx_post] if add_dx else [dx_post, res_post] if post_grad else []
            args = (x, dy, dsplit, coef, phi, *more, dx, dphi_partial)
            lanes(*args)
            dphi = dphi_from_partial(dphi_partial, n)
            key = (add_dx, post_grad)
            if not cfg.get("leave_out"):  # a timing experiment's outputs are wrong: never the reference
                references.setdefault(key, (dx.clone(), dphi.clone()))
            reference = references.get(key, (dx, dphi))
            row["rel_dx"], row["rel_dphi"] = _rel(dx, reference[0]), _rel(dphi, reference[1])
            row["ms"] = bench(lambda: lanes(*args)) * 1e3
            moved = 13 if add_dx or post_grad else 9
            row[f"gbps_{moved}C"] = tokens * moved * C * 2 / (row["ms"] * 1e-3) / 1e9
            log(f"    {cfg}: {row['ms']:.3f} ms, {row[f'gbps_{moved}C']:.0f} GB/s on {moved}C, "
                f"vs first: dx {row['rel_dx']:.1e} dphi {row['rel_dphi']:.1e}")
        except Exception as e:  # noqa: BLE001
            row["error"] = repr(e)[:400]
            log(f"    {cfg}: FAILED {repr(e)[:300]}")
        out["lanes"].append(row)
    return out


def _previous_site_apart(x, dy, dsplit, coef, phi, dx_post, bench, log) -> dict:
    """The site before's operands (random lanes and f, H_post, row-stochastic H_res) and what the two kernels
    the joined one replaces give and take: kernel 2 with dx_post (its default tuning) writes dx, the post backward
    reads it as its g."""
    from mhc_lab.kernels.post_backward import post_backward_kernel
    from mhc_lab.kernels.pre_backward import dphi_from_partial, dphi_partial_shape, pre_backward_kernels

    tokens, n, C = x.shape
    f32 = dict(dtype=torch.float32, device=x.device)
    gen = torch.Generator(device=x.device).manual_seed(11)
    x_prev = torch.randn(x.shape, generator=gen, device=x.device).to(x.dtype)
    f_prev = torch.randn(dy.shape, generator=gen, device=x.device).to(x.dtype)
    post_prev = torch.rand((tokens, n), generator=gen, **f32) * 2
    res_prev = torch.softmax(torch.randn((tokens, n, n), generator=gen, **f32), -1)
    splits = _training_ops._lane_splits(n, C, x.device, True)
    _, lanes = pre_backward_kernels(n, C, "bfloat16", "cuda", add_dx=True, lane_splits=splits)
    dx, dphi_partial = torch.empty_like(x), torch.empty(dphi_partial_shape(splits, n, C), **f32)
    post = post_backward_kernel(n, C, "bfloat16", "cuda")
    dx_prev, df_prev = torch.empty_like(x), torch.empty_like(dy)
    dpost_prev, dres_prev = torch.empty((tokens, n), **f32), torch.empty((tokens, n, n), **f32)

    def kernel2():
        lanes(x, dy, dsplit, coef, phi, dx_post, dx, dphi_partial)

    def post_backward():
        post(x_prev, f_prev, dx, post_prev, res_prev, dx_prev, df_prev, dpost_prev, dres_prev)

    kernel2()
    post_backward()
    apart = {"kernel2_ms": bench(kernel2) * 1e3, "post_backward_ms": bench(post_backward) * 1e3}
    log(f"    apart: kernel 2 with dx_post {apart['kernel2_ms']:.3f} ms + the post backward "
        f"{apart['post_backward_ms']:.3f} ms")
    return {"operands": (x_prev, f_prev, post_prev, res_prev), "timings": apart,
            "outputs": {"dx_prev": dx_prev, "df_prev": df_prev, "dres": dres_prev, "dpost": dpost_prev,
                        "dphi": dphi_from_partial(dphi_partial, n)}}


def _time_joined(cfg, previous, x, dy, dsplit, coef, phi, dx_post, bench, log) -> dict:
    """The joined kernel (kernel 2 of this site with the post backward of the site before) timed alone, its
    outputs compared with the two kernels' apart (previous)."""
    from mhc_lab.kernels.joined_backward import coef_blocks, coefficients_from_partial
    from mhc_lab.kernels.pre_backward import dphi_from_partial, dphi_partial_shape, pre_backward_kernels

    tokens, n, C = x.shape
    f32 = dict(dtype=torch.float32, device=x.device)
    row = {**previous["timings"], "token_splits": _training_ops._lane_splits(n, C, x.device, True, tiling=cfg)}
    tuning = {k: v for k, v in hashable_tuning(cfg).items() if k not in ("joined", "add_dx")}
    _, lanes = pre_backward_kernels(n, C, "bfloat16", "cuda", add_dx=True, lane_splits=row["token_splits"],
                                    joined=True, **tuning)
    dx_prev, df_prev = torch.empty_like(x), torch.empty_like(dy)
    dphi_partial = torch.empty(dphi_partial_shape(row["token_splits"], n, C), **f32)
    coef_partial = torch.empty((tokens, coef_blocks(C, "cuda", cfg.get("block_c")), n * n + n), **f32)
    args = (x, dy, dsplit, coef, phi, dx_post, *previous["operands"], dx_prev, df_prev, dphi_partial, coef_partial)
    lanes(*args)
    dres, dpost = coefficients_from_partial(coef_partial, n)
    got = {"dx_prev": dx_prev, "df_prev": df_prev, "dres": dres, "dpost": dpost,
           "dphi": dphi_from_partial(dphi_partial, n)}
    for name, want in previous["outputs"].items():
        row[f"rel_{name}"] = _rel(got[name], want)
    row["ms"] = bench(lambda: lanes(*args)) * 1e3
    row["sums_ms"] = bench(lambda: coefficients_from_partial(coef_partial, n)) * 1e3
    row["gbps_19C"] = tokens * 19 * C * 2 / (row["ms"] * 1e-3) / 1e9
    apart = row["kernel2_ms"] + row["post_backward_ms"]
    log(f"    {cfg}: {row['ms']:.3f} ms (+ {row['sums_ms']:.3f} for the row sums) against {apart:.3f} apart, "
        f"{row['gbps_19C']:.0f} GB/s on 19C; vs apart: "
        + " ".join(f"{k} {row[f'rel_{k}']:.1e}" for k in previous["outputs"]))
    return row


# ---------------------------------------------------------------------------------------------------------
# block


def copy_floor_plan(n: int = N, sites: int = 2) -> list[dict]:
    """Per site of a chained block, the lane-wide elements per token (units of C, read + written) that its mHC
    kernels move beyond the plain residual's, as bytes_model counts our chained kernels: at the pre (forward:
    the first site's projection, the pre apply; backward: kernel 1's dpre_reduce and kernel 2) and at the post
    (forward: post + next projection, backward: the post backward with the post's gradient handed to the pre),
    the residual's add (forward) and gradient add (backward) taken off the post's. At n = 4: 76C for two sites."""
    from mhc_lab.course.training_lab import residual_elements

    forward = [r.moved.per_C for r in bytes_model.rows("ours_chained", n, "forward")]  # pre apply, post + proj
    post_bwd, dpre, lanes = (r.moved.per_C for r in bytes_model.rows("ours_chained", n, "backward"))
    post_bwd -= bytes_model.post_gradient_saving(n)
    projection = bytes_model.rows("ours", n, "forward")[0].moved.per_C
    add_fwd, add_bwd = (r + w for r, w in residual_elements().values())
    return [{"pre": {"forward": ([projection] if i == 0 else []) + [forward[0]], "backward": [dpre, lanes]},
             "post": {"forward": [forward[1] - add_fwd], "backward": [post_bwd - add_bwd]}} for i in range(sites)]


def copy_floor_counts(plan: list[dict]) -> list[int]:
    """Every count of a copy_floor_plan (units of C per token), site by site, place by place, forward then
    backward."""
    return [k for site in plan for place in site.values() for ks in place.values() for k in ks]


class _MovesBytes(torch.autograd.Function):
    """h unchanged, forward and backward; each pass runs its device-to-device copies (dst.copy_(src) pairs)."""

    @staticmethod
    def forward(ctx, h, forward_copies, backward_copies):
        for dst, src in forward_copies:
            dst.copy_(src)
        ctx.backward_copies = backward_copies
        return h.view_as(h)

    @staticmethod
    def backward(ctx, grad):
        for dst, src in ctx.backward_copies:
            dst.copy_(src)
        return grad, None, None


class _CopyFloor:
    """The copies that move copy_floor_plan's elements for a plain h of some tokens and width C: a copy of k C / 2
    elements per token moves k C (read + written). One source and one destination buffer, as large as the
    largest copy, made for the first h and again when h's size or device changes."""

    def __init__(self, plan: list[dict]):
        self.plan, self.buffers = plan, None
        self.largest = max(copy_floor_counts(plan))

    def copies(self, h: torch.Tensor, counts: list[int]) -> list:
        per_k = h.numel()  # tokens x C
        if per_k % 2:
            raise ValueError(f"copy floor: tokens x C must be even to halve into read + written, got {per_k}")
        if self.buffers is None or self.buffers[0].numel() != self.largest * per_k // 2 \
                or self.buffers[0].device != h.device:
            self.buffers = tuple(torch.empty(self.largest * per_k // 2, dtype=h.dtype, device=h.device)
                                 for _ in range(2))
        src, dst = self.buffers
        return [(dst[: k * per_k // 2], src[: k * per_k // 2]) for k in counts]

    def __call__(self, h: torch.Tensor, site: int, place: str) -> torch.Tensor:
        moves = self.plan[site][place]
        return _MovesBytes.apply(h, self.copies(h, moves["forward"]), self.copies(h, moves["backward"]))


class SideStream:
    """A second CUDA stream for work off the lanes' path, joined into the caller's stream when each backward pass
    ends: the tensors that work reads are held until then, so the caching allocator cannot hand their memory to
    the main stream while the side stream still reads it. ``stream``, ``on`` (the context that makes it current)
    and ``current`` (the caller's current stream) are CUDA's unless given (the CPU tests give stand-ins). With
    ``carveout`` the matmuls launched on the side stream leave that many SMs to the main stream's kernels
    (torch._C._set_sm_carveout_experimental, read by cuBLAS when each matmul is launched)."""

    def __init__(self, stream=None, on=None, current=None, carveout: int = 0):
        self.carveout = carveout
        self.stream = torch.cuda.Stream() if stream is None else stream
        self.on = torch.cuda.stream if on is None else on
        self.current = torch.cuda.current_stream if current is None else current
        self.held: list = []
        self.joins = None  # the backward pass whose end joins the side stream (its graph task's id)

    @contextlib.contextmanager
    def beside(self, *held):
        """Within this block (inside a backward pass), work runs on the side stream after what the main stream has
        queued so far; the pass's end joins it. Each pass queues its own join, so a pass that failed before its
        end leaves the next one joined all the same."""
        self.stream.wait_stream(self.current())
        self.held.extend(held)
        task = torch._C._current_graph_task_id()
        if self.joins != task:
            torch.autograd.Variable._execution_engine.queue_callback(self.join)
            self.joins = task
        with self.on(self.stream), sm_carveout(self.carveout):
            yield

    def join(self):
        self.current().wait_stream(self.stream)
        self.held.clear()
        self.joins = None


@contextlib.contextmanager
def sm_carveout(sms: int):
    """Within this block, the matmuls launched leave ``sms`` SMs to other kernels (0: none left, the default);
    the setting before is restored after. A torch without the setting refuses sms > 0."""
    if not sms:
        yield
        return
    carve = getattr(torch._C, "_set_sm_carveout_experimental", None)
    if carve is None:
        raise RuntimeError(f"an SM carve-out of {sms} needs torch._C._set_sm_carveout_experimental, which torch "
                           f"{torch.__version__} does not have")
    before = torch._C._get_sm_carveout_experimental()
    carve(sms)
    try:
        yield
    finally:
        carve(before)


class _LinearWeightGradBeside(torch.autograd.Function):
    """y = x W^T + b. The backward writes dx on the main stream, then W's and b's gradients on the side stream
    (after dx, so that the GEMM on the lanes' path is not slowed by its own weight gradient), straight into their
    .grad (set, or added to where a gradient is there), returning none to autograd: so the weight-gradient GEMM
    runs beside what follows dx on the lanes' path, the connection's kernels among it."""

    @staticmethod
    def forward(ctx, x, weight, bias, linear, side):
        ctx.save_for_backward(x)
        ctx.linear, ctx.side = linear, side
        return nn.functional.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, dy):
        (x,), linear = ctx.saved_tensors, ctx.linear
        dx = dy @ linear.weight if ctx.needs_input_grad[0] else None
        with ctx.side.beside(x, dy):
            dy2, x2 = dy.reshape(-1, dy.shape[-1]), x.reshape(-1, x.shape[-1])
            for param, grad in ((linear.weight, lambda: dy2.t() @ x2), (linear.bias, lambda: dy2.sum(0))):
                if param is None:
                    continue
                if param.grad is None:
                    param.grad = grad()
                else:
                    param.grad.add_(grad())
        return dx, None, None, None, None


class LinearWeightGradBeside(nn.Module):
    """An nn.Linear's parameters, with their gradients computed on a side stream (_LinearWeightGradBeside)."""

    def __init__(self, linear: nn.Linear, side: SideStream):
        super().__init__()
        self.weight, self.bias, self.side = linear.weight, linear.bias, side

    def forward(self, x):
        return _LinearWeightGradBeside.apply(x, self.weight, self.bias, self, self.side)


def weight_grads_beside(module: nn.Module, side: SideStream) -> nn.Module:
    """module with every nn.Linear inside it replaced by a LinearWeightGradBeside on the same parameters."""
    for name, child in module.named_children():
        if isinstance(child, nn.Linear):
            setattr(module, name, LinearWeightGradBeside(child, side))
        else:
            weight_grads_beside(child, side)
    return module


WEIGHT_GRADS_BESIDE = None  # None, or the SMs the side stream's matmuls leave (a block's layers' weight gradients)


@contextlib.contextmanager
def layers_weight_grads_beside(enabled: bool, carveout: int = 0):
    """Within this block, the blocks built (_Block) compute their layers' weight gradients on a side stream, each
    of those matmuls leaving ``carveout`` SMs to the kernels on the lanes' path."""
    global WEIGHT_GRADS_BESIDE
    if carveout < 0:
        raise ValueError(f"carveout: expected a number of SMs >= 0, got {carveout}")
    before, WEIGHT_GRADS_BESIDE = WEIGHT_GRADS_BESIDE, (carveout if enabled else None)
    try:
        yield
    finally:
        WEIGHT_GRADS_BESIDE = before


class _Block(nn.Module):
    """Pre-norm causal attention + 4C GELU MLP, joined by a plain residual or by an mHC connection each."""

    def __init__(self, width: int, heads: int, connection: str):
        super().__init__()
        from mhc_lab.models import MLP, CausalSelfAttention, PreNorm

        self.connection = connection
        self.layers = nn.ModuleList([PreNorm(width, CausalSelfAttention(width, heads)), PreNorm(width, MLP(width))])
        self.layers.to(torch.bfloat16)
        if WEIGHT_GRADS_BESIDE is not None:  # each replaced layer holds the one side stream
            weight_grads_beside(self.layers, SideStream(carveout=WEIGHT_GRADS_BESIDE))
        if connection == "copy_floor":
            self._copy_floor = _CopyFloor(copy_floor_plan(N, len(self.layers)))
        if connection.startswith("mhc"):
            from mhc_lab.ops.training import MHCConnection

            self.sites = nn.ModuleList(MHCConnection(N, width, backend="kernels") for _ in self.layers)
            for site in self.sites:  # away from the identity, so every coefficient path carries gradient
                with torch.no_grad():
                    site.phi.normal_(0, 1 / math.sqrt(N * width))
        if connection == "mhc_reference":
            from mhc_lab.reference import ManifoldHyperConnection

            self.sites = nn.ModuleList(ManifoldHyperConnection(N, width) for _ in self.layers)
        if connection == "mhc_tilekernels":
            _tilekernels()  # the tolerant first import of tile_kernels 1.0.0
            from tile_kernels.modeling.mhc import mhc_pre as tk_pre
            from tile_kernels.modeling.mhc.ops.post import mhc_post as tk_post

            self._tk = (tk_pre, tk_post)

    def forward(self, h):
        if self.connection == "residual":
            for layer in self.layers:
                h = h + layer(h)
            return h
        if self.connection == "copy_floor":
            for i, layer in enumerate(self.layers):
                h = self._copy_floor(h, i, "pre")
                h = self._copy_floor(h + layer(h), i, "post")
            return h
        if self.connection == "mhc_tilekernels":
            tk_pre, tk_post = self._tk
            for site, layer in zip(self.sites, self.layers):
                y, (post_mix, comb_mix) = tk_pre(h, site.phi, site.alpha, site.bias, post_mult_value=2.0,
                                                 sinkhorn_repeat=20)
                h = tk_post(layer(y), h, post_mix, comb_mix)
            return h
        if self.connection == "mhc_ours":
            from mhc_lab.ops.training import run_sites

            return run_sites(h, self.sites, self.layers)  # the first site's post projects for the second's pre
        for site, layer in zip(self.sites, self.layers):
            h = site(h, layer)
        return h


GRAPH_TOLERANCE = 1e-2  # a block's replayed input gradient against its launched one (relative); bf16 matmuls that
# cuBLAS chose differently under capture would differ by about 1e-3, a replay that reads freed memory by far more
INLINE_RESIDUAL = "residual_weight_grads_inline"  # the plain block without a side stream, beside ones that have it
BLOCK_KINDS = ("residual", "copy_floor", "mhc_ours", "mhc_ours_chained", "mhc_ours_joined", "mhc_ours_recompute",
               "mhc_tilekernels", "mhc_compiled")


def _block_step(width: int, kind: str, batch: int, seq: int, layers: bool = True):
    """One of BLOCK_KINDS as a training step (forward + backward of a fresh block on random lanes): step().
    With layers=False the block's attention and MLP are identities: its connections' kernels alone, at the
    block's shapes and in its order."""
    from mhc_lab.ops.training import chaining_on_cuda, join_sites_backward

    # chained or not, joined or not; the others: the library's defaults (CHAIN_ON_CUDA, JOIN_SITES_BACKWARD)
    how = {"mhc_ours": (False, False), "mhc_ours_chained": (True, False), "mhc_ours_joined": (True, True)}.get(kind)
    torch.manual_seed(0)
    connection = {"mhc_ours_recompute": "mhc_ours", "mhc_ours_chained": "mhc_ours",
                  "mhc_ours_joined": "mhc_ours", "mhc_compiled": "mhc_reference"}.get(kind, kind)
    block = _Block(width, width // 128, connection).cuda()
    if not layers:
        block.layers = nn.ModuleList(nn.Identity() for _ in block.layers)
    shape = (batch, seq, width) if kind in ("residual", "copy_floor") else (batch, seq, N, width)
    h = torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    if kind == "mhc_ours_recompute":
        import functools

        from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

        from mhc_lab.ops.training import recompute_policy

        context = functools.partial(create_selective_checkpoint_contexts, recompute_policy)

        def fn(h):
            return checkpoint(block, h, use_reentrant=False, context_fn=context)
    else:
        fn = torch.compile(block) if kind == "mhc_compiled" else block

    def step():
        # as a training loop's zero_grad(set_to_none=True): each step's gradients are written, not added to the
        # last step's (which cost every block an add per weight, and mHC's lanes an add of 12C per token)
        h.grad = None
        block.zero_grad(set_to_none=True)
        with contextlib.ExitStack() as options:
            if how is not None:
                options.enter_context(chaining_on_cuda(how[0]))
                options.enter_context(join_sites_backward(how[1]))
            fn(h).backward(g)

    step.block, step.inputs = block, (h, g)  # what the step reads, for bench_block_zeroed
    return step


def bench_block_zeroed(width, bench, *, batch=4, seq=4096, log=print) -> dict:
    """The plain block's step as a CUDA graph, timed on its random tensors and then with every tensor it reads
    (parameters, input lanes, upstream gradient) zeroed in place: under the H200's power cap, matmuls on zeros
    draw less power and run faster, so a graph that reads memory overwritten with zeros (a freed tensor's, say)
    times too fast."""
    step = _block_step(width, "residual", batch, seq)
    step()
    torch.cuda.synchronize()
    replay = _graph_replay(step)
    out = {"C": width, "tokens": batch * seq, "timed": "as CUDA graphs",
           "random_ms": [bench(replay, warmup_ms=100, rep_ms=500) * 1e3 for _ in range(2)]}
    with torch.no_grad():
        for t in (*step.inputs, *step.block.parameters()):
            t.zero_()
    out["zeroed_ms"] = [bench(replay, warmup_ms=100, rep_ms=500) * 1e3 for _ in range(2)]
    out["zeroed_faster_pct"] = 100 * (1 - min(out["zeroed_ms"]) / min(out["random_ms"]))
    log(f"  block C={width} plain residual as a CUDA graph: {min(out['random_ms']):.2f} ms on random tensors, "
        f"{min(out['zeroed_ms']):.2f} ms on zeros ({out['zeroed_faster_pct']:.0f}% faster)")
    return out


def bench_block(width, bench, *, batch=4, seq=4096, skip=(), log=print, rounds: int = 1, graphs: bool = False) -> dict:
    """Each of BLOCK_KINDS' training step timed, with its peak memory; with rounds > 1 the steps are then timed
    again in that many interleaved rounds (rounds_ms), each kind's overhead over the plain residual taken per
    round and its median recorded (overhead_pct_rounds), so that a drift of the GPU between kinds reaches both
    sides of each ratio. With graphs, each step is captured once as a CUDA graph and its replay is what is timed
    (recorded as timed "as CUDA graphs"): the GPU's time alone, without the moments it waits for the host's
    launches, which a step launched op by op has and which added kernels can fill (run CC); after its timing each
    replay's input gradient is checked against the launched step's (graph_rel_diff, GRAPH_TOLERANCE), so that a
    graph whose tensors were freed (run CD) is refused rather than timed."""
    heads = width // 128
    out = {"C": width, "tokens": batch * seq, "batch": batch, "seq": seq, "heads": heads, "times_ms": {},
           "peak_gib": {}, "overhead_pct": {}, "errors": {}}
    if graphs:
        out["timed"], out["graph_rel_diff"] = "as CUDA graphs", {}
    kept = {}  # the steps, for the interleaved rounds
    beside = WEIGHT_GRADS_BESIDE is not None
    # with the weight gradients beside, the plain block as it is without them too: a second stream that made the
    # plain block slower would flatter every ratio to the plain block with them
    for kind in BLOCK_KINDS + ((INLINE_RESIDUAL,) if beside else ()):
        if kind == "mhc_tilekernels" and "tilekernels" in skip or kind == "mhc_compiled" and "compile" in skip:
            continue
        if kind == "mhc_compiled" and beside:
            out["errors"][kind] = "not timed: torch.compile does not trace the side stream's weight gradients"
            continue
        try:
            if kind == INLINE_RESIDUAL:
                with layers_weight_grads_beside(False):
                    step = _block_step(width, "residual", batch, seq)
            else:
                step = _block_step(width, kind, batch, seq)
            step()
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            step()
            torch.cuda.synchronize()
            out["peak_gib"][kind] = (torch.cuda.max_memory_allocated() - base) / 2**30  # launched: a graph's pool
            if graphs:  # is allocated once, at capture
                h = step.inputs[0]
                launched = h.grad.detach().clone()
                step = _graph_replay(step)
            ms = bench(step, warmup_ms=100, rep_ms=500) * 1e3
            if graphs:  # after the timer's runs, which would have overwritten any memory the graph reads but no
                # longer holds: the replay's input gradient against the launched step's
                torch.cuda.synchronize()
                out["graph_rel_diff"][kind] = diff = _rel(h.grad, launched)
                if not diff <= GRAPH_TOLERANCE:
                    raise RuntimeError(f"the CUDA graph's input gradient is {diff:.2e} (relative) off the launched "
                                       f"step's, where {GRAPH_TOLERANCE} was expected: its time is not of the same "
                                       "work")
            out["times_ms"][kind] = ms
            log(f"  block C={width} {kind:20s} {out['times_ms'][kind]:8.2f} ms  peak {out['peak_gib'][kind]:.2f} GiB"
                + ("  (CUDA graph)" if graphs else ""))
            if rounds > 1:
                kept[kind] = step
            del step
        except Exception as e:  # noqa: BLE001
            out["errors"][kind] = repr(e)[:500]
            log(f"  block C={width} {kind:20s} FAILED {repr(e)[:300]}")
        if not kept:
            torch.cuda.empty_cache()
    plain = out["times_ms"].get("residual")
    if plain:
        for kind, ms in out["times_ms"].items():
            if kind != "residual":
                out["overhead_pct"][kind] = 100 * (ms / plain - 1)
    if kept:
        out["rounds_ms"] = interleaved_rounds(kept, lambda fn: bench(fn, warmup_ms=100, rep_ms=500), rounds)
        kept.clear()
        torch.cuda.empty_cache()
        rounds_ms = out["rounds_ms"]

        def overheads(base_ms, kinds, against):  # each kind's overhead over base_ms, taken round by round
            found = {}
            for kind in kinds:
                ratio = round_ratios({"_base": base_ms, kind: rounds_ms[kind]}, ours=kind, base="_base")
                if ratio:
                    o = found[kind] = {k: 100 * (v - 1) for k, v in ratio.items() if k != "ratios"}
                    log(f"  block C={width} {kind:20s} {against}: median {o['median']:+.1f}% "
                        f"({o['least']:+.1f}% to {o['most']:+.1f}%)")
            return found

        out["overhead_pct_rounds"] = overheads(rounds_ms.get("residual"), [k for k in rounds_ms if k != "residual"],
                                               f"over {rounds} interleaved rounds")
        if INLINE_RESIDUAL in rounds_ms:  # each kind against the faster of the two plain blocks, round by round
            best = [min(a, b) for a, b in zip(rounds_ms["residual"], rounds_ms[INLINE_RESIDUAL])]
            out["overhead_pct_rounds_vs_best_plain"] = overheads(
                best, [k for k in rounds_ms if k not in ("residual", INLINE_RESIDUAL)],
                "against the faster plain block per round")
    return out


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


def _log_differences(comparison: dict, other: str, base: str, log) -> None:
    """compare_kernel_times' largest differences, one line each: the difference, both times, the kernel."""
    for row in comparison["largest_differences"]:
        log(f"    {row['ms']:+7.3f} ms  {row['other_ms']:7.3f} {other}, {row['base_ms']:7.3f} {base}  "
            f"{row['kernel'][:70]}")


def bench_block_kernels(width, bench, *, batch=4, seq=4096, kind="mhc_ours_chained", log=print) -> dict:
    """Where a block's extra time goes: the plain residual block and ``kind`` each timed (wall clock per step,
    launched op by op as the block benchmark runs them) and profiled, kernel by kernel. The wall time less the
    kernels' is the time the GPU waited for the host or between kernels; the layers' kernels (launched by both)
    show whether they run slower beside mHC's; mHC's own kernels are what the site benchmark times alone. Then
    ``kind`` with identities for layers (its connections alone, at the block's shapes): its kernels against
    the same kernels inside the block show what the layers between them cost mHC's kernels (a cold L2, lower
    clocks after the GEMMs)."""
    out = {"C": width, "tokens": batch * seq, "kind": kind, "kernels": {}}
    kernels = {}
    sites_alone = f"{kind} without layers"
    for name, layers in (("residual", True), (kind, True), (sites_alone, False)):
        step = _block_step(width, name if layers else kind, batch, seq, layers=layers)
        step()
        torch.cuda.synchronize()
        times = kernel_times(step)
        kernels[name] = {k: ms for k, (ms, _) in times.items()}
        out["kernels"][name] = {k[:160]: {"ms": ms, "launches": count} for k, (ms, count) in times.items()}
        wall = bench(step, warmup_ms=100, rep_ms=500) * 1e3
        busy, launches = kernel_totals(times)
        out[name] = {"wall_ms": wall, "kernel_ms": busy, "idle_ms": wall - busy, "launches": launches}
        log(f"  block C={width} {name:34s} {wall:7.2f} ms per step, {busy:7.2f} of kernels, "
            f"{wall - busy:5.2f} idle, {out[name]['launches']:.0f} launches")
        del step
        torch.cuda.empty_cache()
    out["comparison"] = compare_kernel_times(kernels["residual"], kernels[kind])
    c = out["comparison"]
    log(f"  block C={width}: the kernels both launch {c['shared_base_ms']:.2f} -> {c['shared_other_ms']:.2f} ms, "
        f"{kind}'s own {c['only_other_ms']:.2f} ms, the residual's own {c['only_base_ms']:.2f} ms")
    for row in c["largest_differences"][:4] + c["largest_own"][:6]:
        log(f"    {row['ms']:+7.3f} ms  {row['kernel'][:90]}")
    own = {k: ms for k, ms in kernels[kind].items() if k not in kernels["residual"]}
    out["own_against_alone"] = compare_kernel_times(kernels[sites_alone], own, top=12)
    c = out["own_against_alone"]
    log(f"  block C={width}: {kind}'s own kernels {c['shared_other_ms']:.3f} ms in the block, "
        f"{c['shared_base_ms']:.3f} ms without layers; kernels only in the block {c['only_other_ms']:.3f} ms, "
        f"only without layers {c['only_base_ms']:.3f} ms")
    _log_differences(c, "in the block", "without layers", log)
    return out


def sm_clock_mhz() -> int | None:
    """The GPU's SM clock now, from nvidia-smi (None where it cannot be read)."""
    import subprocess

    try:
        got = subprocess.run(["nvidia-smi", "--query-gpu=clocks.sm", "--format=csv,noheader,nounits",
                              f"--id={torch.cuda.current_device()}"], capture_output=True, text=True, timeout=10)
        return int(got.stdout.split()[0])
    except Exception:  # noqa: BLE001 - no nvidia-smi, or output not as expected: no reading
        return None


def bench_behind_gemms(tokens, C, *, gemm: int = 8192, gemms: int = 8, repeat: int = 20, log=print) -> dict:
    """The chained site's kernels (forward + backward, F = identity) profiled alone and behind ``gemms`` bf16
    matmuls of ``gemm`` x ``gemm`` before each step: the state a training step leaves the GPU in (its power
    near the cap, its SM clock lowered) without its other kernels. A kernel that streams at its bytes' pace keeps
    its time; one that issues near its SMs' limit takes longer as their clock falls."""
    (x, phi, bias, alpha), leaves, g = _site_operands(tokens, C)
    site = _site_impls({"tilekernels"})[0]["ours_chained"]

    def step():
        torch.autograd.grad(site(*leaves), leaves, g)

    a, b = (torch.randn(gemm, gemm, device="cuda", dtype=torch.bfloat16) for _ in range(2))

    def loaded():
        for _ in range(gemms):
            a @ b
        step()

    gemm_names = set(kernel_times(lambda: a @ b, repeat=1))
    for _ in range(3):  # compiled
        step()
    torch.cuda.synchronize()
    time.sleep(2)  # the GPU's power and clock back to idle
    alone = {k: ms for k, (ms, _) in kernel_times(step, repeat).items()}
    clock_alone = sm_clock_mhz()
    for _ in range(repeat):  # the GPU brought to its loaded state
        loaded()
    behind = {k: ms for k, (ms, _) in kernel_times(loaded, repeat).items() if k not in gemm_names}
    clock_behind = sm_clock_mhz()
    out = {"tokens": tokens, "C": C, "gemm": gemm, "gemms_per_step": gemms, "repeat": repeat,
           # read once after each profile; the clock recovers within a fraction of a second once the GPU idles,
           # so these bound it from above (an nvidia-smi trace beside the run shows it throughout)
           "sm_clock_mhz_after": {"alone": clock_alone, "behind_gemms": clock_behind},
           "comparison": compare_kernel_times(alone, behind, top=16)}
    c = out["comparison"]
    log(f"  site {tokens}x{C} chained: its kernels {c['shared_base_ms']:.3f} ms alone (SM clock after: "
        f"{clock_alone} MHz), {c['shared_other_ms']:.3f} behind {gemms} GEMMs of {gemm}^3 per step "
        f"({clock_behind} MHz)")
    _log_differences(c, "behind GEMMs", "alone", log)
    return out


def hot_kernel_calls(tokens: int, C: int, n: int = N) -> dict:
    """The two kernels whose instructions set their pace, built with the ops' defaults on CUDA, each as a call on
    random operands: kernel 2 of the pre backward on the 42C path (the post's output gradient g and its H_res)
    and the fused post + projection. For a profiler; their outputs are not checked here (their CUDA tests do)."""
    from mhc_lab.kernels.post_project import post_project_kernel
    from mhc_lab.kernels.pre_backward import coef_width, dphi_partial_shape, gemm_depth, pre_backward_kernels
    from mhc_lab.kernels.pre_split import phi_rows, phi_split_kernel

    gen = torch.Generator(device="cuda").manual_seed(tokens + C)
    bf16, f32 = dict(dtype=torch.bfloat16, device="cuda"), dict(dtype=torch.float32, device="cuda")

    def rand(*shape, kind=f32, scale=1.0):
        return (torch.randn(*shape, generator=gen, **f32) * scale).to(kind["dtype"])

    m = n * n + 2 * n
    x, f = rand(tokens, n, C, kind=bf16), rand(tokens, C, kind=bf16)
    phi = rand(m, n * C, scale=1 / math.sqrt(n * C))
    res = torch.rand(tokens, n, n, generator=gen, **f32)
    lane_splits = _training_ops._lane_splits(n, C, x.device, False, True)
    _, lanes = pre_backward_kernels(n, C, "bfloat16", "cuda", lane_splits=lane_splits, post_grad=True,
                                    **_training_ops.lane_program_tuning())
    dy, g = rand(tokens, C, kind=bf16), rand(tokens, n, C, kind=bf16)
    dsplit, coef = rand(tokens, 3, 2 * gemm_depth(n), kind=bf16), rand(tokens, coef_width(n))
    dx, dphi_partial = torch.empty_like(x), torch.empty(dphi_partial_shape(lane_splits, n, C), **f32)
    phi_hl = torch.empty((phi_rows(n), n * C), **bf16)
    phi_split_kernel(n, C, "cuda")(phi, phi_hl)
    post = torch.rand(tokens, n, generator=gen, **f32) * 2
    # the column splits a chained post projects into, as post_forward_linked's
    splits = _training_ops.partial_splits("kernels", x, chained=True)
    project = post_project_kernel(n, C, "bfloat16", "cuda", splits=splits, **_training_ops.POST_PROJECT_TUNING)
    out, partial = torch.empty_like(x), torch.empty((splits, tokens, m + 1), **f32)
    return {"kernel 2 (42C path)": lambda: lanes(x, dy, dsplit, coef, phi, g, res, dx, dphi_partial),
            "post + projection": lambda: project(x, f, post, res, phi_hl, out, partial)}


def hidden_pct(gemm_ms: float, alone_ms: float, beside_ms: float) -> float:
    """How much of a kernel's time alone a GEMM beside it hides: 100 when the pair takes the GEMM's time, 0 when
    it takes the two one after another (below 0 when running them together costs more than that)."""
    return 100 * (gemm_ms + alone_ms - beside_ms) / alone_ms


OVERLAP_MODES = ("graph", "launched", "launched_priority")


def bench_overlap(tokens: int, C: int, bench, *, carveouts=(0, 16, 32, 64), calls=None, device="cuda",
                  log=print) -> dict:
    """Whether mHC's streaming kernels can hide beside a layer's matmuls. A block runs its connections' kernels
    one after another with the layers', so their bytes add to its time at the copy's pace (the copy floor). A
    layer's weight-gradient GEMMs lie off the lanes' path, and the connection's backward could run beside them on
    a second stream. Here one of them, the MLP's dW [4C, C] summed over ``tokens``, is timed alone and with each of
    ``calls`` (default: kernel 2 on the 42C path and the post + projection, hot_kernel_calls) and a copy of 8C per
    token launched beside it on a second stream (hidden_pct), in OVERLAP_MODES: the pair captured as one CUDA graph
    of two branches; launched; and launched with the kernel's stream at the highest priority, so that SMs the
    GEMM frees go to the kernel first. With ``carveouts`` the GEMM is also run with that many SMs left to the
    kernel beside it, where torch can ask cuBLAS for that (torch._C._set_sm_carveout_experimental)."""
    bf16 = dict(dtype=torch.bfloat16, device=device)
    a, b = torch.randn(4 * C, tokens, **bf16), torch.randn(tokens, C, **bf16)
    dw = torch.empty(4 * C, C, **bf16)
    calls = dict(hot_kernel_calls(tokens, C) if calls is None else calls)
    src = torch.randn(tokens, N, C, **bf16)
    dst = torch.empty_like(src)
    calls["copy of 8C per token"] = lambda: dst.copy_(src)
    side, high = torch.cuda.Stream(), torch.cuda.Stream(priority=min(torch.cuda.Stream.priority_range()))
    sides = {"graph": side, "launched": side, "launched_priority": high}

    def gemm():
        torch.mm(a, b, out=dw)

    def beside(fn, side):
        def step():
            main = torch.cuda.current_stream()
            side.wait_stream(main)
            with torch.cuda.stream(side):
                fn()
            gemm()
            main.wait_stream(side)
        return step

    def timed(step, mode):
        return bench(_graph_replay(step) if mode == "graph" else step, warmup_ms=50, rep_ms=300) * 1e3

    carves = hasattr(torch._C, "_set_sm_carveout_experimental")
    out = {"tokens": tokens, "C": C, "gemm": f"dW [{4 * C}, {C}] = [{4 * C}, {tokens}] @ [{tokens}, {C}], bf16",
           "modes": list(OVERLAP_MODES),
           "alone_ms": {mode: {name: timed(fn, mode) for name, fn in calls.items()} for mode in OVERLAP_MODES[:2]},
           "carveouts": {}}
    out["alone_ms"]["launched_priority"] = out["alone_ms"]["launched"]  # alone, a stream's priority changes nothing
    if not carves:
        out["carveout_note"] = "torch._C._set_sm_carveout_experimental is not in this torch: no carve-outs timed"
    for k in carveouts if carves else (0,):
        row = {}
        with sm_carveout(k):  # read by the GEMM's launches, within the captures too
            gemm_ms = {"graph": timed(gemm, "graph"), "launched": timed(gemm, "launched")}
            gemm_ms["launched_priority"] = gemm_ms["launched"]
            for mode in OVERLAP_MODES:
                r = row[mode] = {"gemm_ms": gemm_ms[mode], "beside_ms": {}, "hidden_pct": {}}
                for name, fn in calls.items():
                    r["beside_ms"][name] = timed(beside(fn, sides[mode]), mode)
                    r["hidden_pct"][name] = hidden_pct(r["gemm_ms"], out["alone_ms"][mode][name],
                                                       r["beside_ms"][name])
        out["carveouts"][str(k)] = row
        for mode in OVERLAP_MODES:
            r = row[mode]
            log(f"  overlap {tokens}x{C} {mode}, {k} SMs left out of the GEMM: GEMM {r['gemm_ms']:.3f} ms; "
                + "; ".join(f"{name} {out['alone_ms'][mode][name]:.3f} alone, {r['beside_ms'][name]:.3f} with the "
                            f"GEMM ({r['hidden_pct'][name]:.0f}% hidden)" for name in calls))
    if "0" in out["carveouts"]:
        # what the pair saves against the GEMM without a carve-out and the kernel one after the other: a carve-out
        # that hides the kernel but slows the GEMM by more saves nothing
        for k, row in out["carveouts"].items():
            for mode, r in row.items():
                r["saved_ms"] = {name: out["carveouts"]["0"][mode]["gemm_ms"] + out["alone_ms"][mode][name] - ms
                                 for name, ms in r["beside_ms"].items()}
        for name in calls:
            best = max(((r["saved_ms"][name], k, mode) for k, row in out["carveouts"].items()
                        for mode, r in row.items()))
            log(f"  overlap {tokens}x{C} {name}: at best {best[0]:+.3f} ms saved against the two in turn "
                f"({best[2]}, {best[1]} SMs left out of the GEMM)")
    return out


def profile_hot_kernels(tokens: int, C: int, log=print) -> None:
    """hot_kernel_calls at tokens x C: two warm-up calls of each, then one of each between cudaProfilerStart and
    cudaProfilerStop, for a profiler that starts there (ncu --profile-from-start off)."""
    calls = hot_kernel_calls(tokens, C)
    for _ in range(2):
        for call in calls.values():
            call()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    for call in calls.values():
        call()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
    log(f"  profiled once each at {tokens}x{C}: {', '.join(calls)}")


def _op_host_costs(x, phi, bias, alpha, wall_ms, steps) -> dict:
    """Microseconds per call, launched back to back at a small shape (so the host's time, not the GPU's): our
    forward ops through torch.ops (the custom op's dispatch) and as their implementations called directly
    (CustomOpDef._init_fn, private to torch, for this measurement only); the backward ops through torch.ops;
    the post's kernel through its autograd-free wrapper and called bare (the compiled TileLang kernel: its
    own host cost per launch); an empty custom op, and a torch.empty; all on x's device."""
    from mhc_lab.kernels.post import post_kernel
    from mhc_lab.ops import training as ops_training
    from mhc_lab.ops.forward import _DTYPE_NAMES, mhc_post_fused

    if not hasattr(torch.ops.mhc_lab_bench, "nothing"):
        @torch.library.custom_op("mhc_lab_bench::nothing", mutates_args=())
        def nothing(x: torch.Tensor) -> torch.Tensor:
            return torch.empty((1,), device=x.device)

    y, post, res, pre, partial, link = torch.ops.mhc_lab.pre_forward(x, phi, bias, alpha, "kernels")
    post_out = torch.empty_like(x)
    g = torch.randn_like(x)
    dy, dpost, dres = torch.randn_like(y), torch.randn_like(post), torch.randn_like(res)
    # the kernel mhc_post_fused launches: the lanes' dtype on CUDA, float32 on the C target
    post_kernel_compiled = post_kernel(x.shape[1], x.shape[2], *((_DTYPE_NAMES[x.dtype], "cuda") if x.is_cuda
                                                                 else ("float32", "c")))
    calls = {
        "pre_forward through torch.ops": lambda: torch.ops.mhc_lab.pre_forward(x, phi, bias, alpha, "kernels"),
        "pre_forward called directly": lambda: ops_training.pre_forward._init_fn(x, phi, bias, alpha, "kernels"),
        "post_forward through torch.ops": lambda: torch.ops.mhc_lab.post_forward(x, y, post, res, "kernels"),
        "post_forward called directly": lambda: ops_training.post_forward._init_fn(x, y, post, res, "kernels"),
        "pre_backward through torch.ops": lambda: torch.ops.mhc_lab.pre_backward(
            x, phi, bias, alpha, pre, partial, res, dy, dpost, dres, None, "kernels"),
        "post_backward through torch.ops": lambda: torch.ops.mhc_lab.post_backward(x, y, post, res, g, "kernels"),
        "post kernel through its wrapper": lambda: mhc_post_fused(x, y, post, res, out=post_out),
        "post kernel called bare": lambda: post_kernel_compiled(x, y, post, res, post_out),
        "an empty custom op": lambda: torch.ops.mhc_lab_bench.nothing(x),
        "torch.empty": lambda: torch.empty((64, 64), device=x.device),
    }
    return {name: wall_ms(fn, steps) * 1e3 for name, fn in calls.items()}


def bench_host(tokens, C, *, steps=200, top=25, log=print) -> dict:
    """What the host costs per site: ours_chained's forward + backward at a small shape, where the GPU's work is
    a few microseconds per kernel, timed launched (wall clock per step) and as a CUDA graph (the GPU alone),
    with the kernels launched per step (profiler) and the Python functions that take the host's time
    (cProfile, own time, the ``top`` largest). Then lab 07's full-mode model (StreamLM, width 768, 4 blocks,
    16 x 256 tokens, bf16 lanes): one step's wall time against the GPU time of its kernels, for the plain
    residual, our kernels, and our kernels with recompute."""
    import cProfile
    import io
    import pstats

    from mhc_lab.course import training_lab

    def wall_ms(step, repeat):
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(repeat):
            step()
        torch.cuda.synchronize()
        return (time.perf_counter() - t) / repeat * 1e3

    impls, _, _ = _site_impls({"compile", "eager", "tilekernels"})
    (x, phi, bias, alpha), leaves, g = _site_operands(tokens, C)

    def site():
        return torch.autograd.grad(impls["ours_chained"](*leaves), leaves, g)

    out = {"site": {"tokens": tokens, "C": C, "wall_ms": wall_ms(site, steps)}}
    replay = _graph_replay(site)
    out["site"]["graph_ms"] = wall_ms(replay, steps)
    out["site"]["kernel_ms"], out["site"]["kernels_per_step"] = kernel_totals(kernel_times(site))
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        site()
    torch.cuda.synchronize()
    profiler.disable()
    stats = pstats.Stats(profiler)
    rows = sorted(((v[2] / steps * 1e6, v[1] / steps, f"{k[0].split('site-packages/')[-1]}:{k[1]}({k[2]})")
                   for k, v in stats.stats.items()), reverse=True)[:top]
    out["site"]["host_us_per_step_by_function"] = [{"us": round(us, 1), "calls": calls, "function": where}
                                                   for us, calls, where in rows]
    text = io.StringIO()
    for us, calls, where in rows:
        text.write(f"    {us:8.1f} us  {calls:6.1f} calls  {where}\n")
    log(f"  host: site {tokens}x{C} ours_chained: {out['site']['wall_ms']:.3f} ms launched, "
        f"{out['site']['graph_ms']:.3f} ms as a CUDA graph, {out['site']['kernels_per_step']:.0f} kernels "
        f"({out['site']['kernel_ms']:.3f} ms of kernel time); own host time per step by function:\n"
        + text.getvalue())
    out["ops_us"] = _op_host_costs(x, phi, bias, alpha, wall_ms, steps)
    for name, row in out["ops_us"].items():
        log(f"  host: {name:34s} {row:8.1f} us per call")
    width, depth, heads, seq, batch = 768, 4, 12, 256, 16
    tok = torch.randint(0, 256, (batch, seq + 1), device="cuda",
                        generator=torch.Generator(device="cuda").manual_seed(1))
    out["lab_model"] = {"width": width, "depth": depth, "heads": heads, "tokens": batch * seq}
    for name, kw in (("residual", {"connection": "residual"}), ("kernels", {"backend": "kernels"}),
                     ("kernels_recompute", {"backend": "kernels", "recompute_block": "auto"})):
        torch.manual_seed(0)
        model = training_lab.StreamLM(width=width, depth=depth, heads=heads, seq_len=seq, n=N,
                                      lane_dtype=torch.bfloat16, **kw).cuda()
        forward = training_lab.training_step(model, (tok[:, :-1], tok[:, 1:]))

        def step(model=model, forward=forward):
            model.zero_grad(set_to_none=False)
            forward().backward()

        row = {"wall_ms": wall_ms(step, 20)}
        row["kernel_ms"], row["kernels_per_step"] = kernel_totals(kernel_times(step))
        out["lab_model"][name] = row
        log(f"  host: lab 07's model, {name:18s} {row['wall_ms']:7.2f} ms per step, {row['kernel_ms']:6.2f} ms of "
            f"kernel time, {row['kernels_per_step']:.0f} kernels")
    return out


PARTS = ("site", "block", "sweep", "host", "block_kernels", "behind_gemms", "overlap", "block_zeroed",
         "profile_kernels")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mhc_lab.bench training", description=__doc__.splitlines()[0])
    parser.add_argument("--parts", default="site,block", help="comma-separated: site,block,sweep,host,"
                        "block_kernels (the plain and the chained block's kernels, side by side),behind_gemms "
                        "(the chained site's kernels alone and behind GEMMs, at --shapes),overlap (kernel 2, the "
                        "post + projection and a copy each beside a weight-gradient GEMM on a second stream, at "
                        "--shapes),block_zeroed (the plain block's CUDA graph on its random tensors and on zeros, "
                        "at --widths),profile_kernels "
                        "(kernel 2 and the post + projection once each between cudaProfilerStart and Stop, at "
                        "--shapes, for ncu --profile-from-start off; nothing recorded)")
    parser.add_argument("--shapes", default=",".join(f"{t}x{c}" for t, c in SHAPES), help="site shapes TOKENSxC")
    parser.add_argument("--widths", default=",".join(str(c) for c in BLOCK_WIDTHS), help="block widths C")
    parser.add_argument("--skip", default="", help="comma-separated baselines to skip: eager,compile,tilekernels")
    parser.add_argument("--name", default="training_h200", help="recording name (mhc_lab/recorded/NAME.json)")
    parser.add_argument("--out", "--out-dir", dest="out_dir", default=None, help="write the JSON here instead")
    parser.add_argument("--no-save", action="store_true", help="print only")
    parser.add_argument("--sweep", default="", help="JSON [tuning dicts] of the pre backward's kernel 2, timed "
                        "alone at each site shape (part 'sweep')")
    parser.add_argument("--sweep-coefficients", default="", help="JSON [tuning dicts] of the pre backward's "
                        "kernel 1 (part 'sweep')")
    parser.add_argument("--lane-tuning", default="", help="JSON {tuning} of the pre backward's kernel 2 for the "
                        "parts site, block and host (mhc_lab.ops.training.lane_tuning; recorded as lane_tuning)")
    parser.add_argument("--post-grad", choices=("on", "off"), default=None, help="on: linked and chained sites hand "
                        "the post's output gradient to the pre's backward, which adds H_res^T g; off: the post's "
                        "backward writes H_res^T g; default: mhc_lab.ops.training.post_gradient_to_pre_for (on at "
                        "n = 4 on CUDA); recorded as post_gradient_to_pre when given")
    parser.add_argument("--graph-rounds", type=int, default=1, help="part 'site': time the CUDA graphs again in "
                        "this many interleaved rounds (recorded as graph_rounds_ms, with the chained site's ratio "
                        "to TileKernels per round)")
    parser.add_argument("--coefficient-phases", default=None, choices=("fused", "split", "spread"),
                        help="the pre backward's kernel 1 for the parts site, block and host (mhc_lab.ops.training."
                        "coefficient_phases; recorded as coefficient_phases)")
    parser.add_argument("--post-project-tuning", default="", help="JSON {tuning} of the fused post + projection "
                        "on CUDA (gemm_wait) for the parts site, block, block_kernels, behind_gemms, host "
                        "and profile_kernels (mhc_lab.ops.training.post_project_tuning; recorded as "
                        "post_project_tuning)")
    parser.add_argument("--block-kernels-kinds", default="mhc_ours_chained", help="part 'block_kernels': the block "
                        "kinds (BLOCK_KINDS) each profiled beside the plain residual, comma-separated; copy_floor "
                        "shows its copies' time in the block")
    parser.add_argument("--uniform-branches", action="store_true", help="compile every CUDA kernel with its role "
                        "branches made warp-uniform (mhc_lab.kernels._target.uniform_warp_branches; recorded as "
                        "uniform_warp_branches); not for the sweep part")
    parser.add_argument("--weight-grads-beside", action="store_true", help="parts block and block_kernels: the "
                        "blocks' layers compute their weight gradients on a second stream (LinearWeightGradBeside), "
                        "beside what follows on the lanes' path, the plain residual's as well; recorded as "
                        "weight_grads_beside")
    parser.add_argument("--beside-carveout", type=int, default=0, help="with --weight-grads-beside: the SMs each "
                        "side-stream matmul leaves to the lanes' kernels (recorded as beside_carveout)")
    parser.add_argument("--blas", choices=("cublas", "cublaslt"), default=None, help="the library torch's matmuls "
                        "call (torch.backends.cuda.preferred_blas_library; recorded as blas): an SM carve-out reaches "
                        "cuBLASLt's matmuls, not cuBLAS's (part 'overlap', run CF)")
    parser.add_argument("--block-graphs", action="store_true", help="part 'block': time each step captured as a "
                        "CUDA graph (its replay: the GPU's time alone) instead of launched op by op")
    parser.add_argument("--block-rounds", type=int, default=1, help="part 'block': time the blocks again in this "
                        "many interleaved rounds (recorded as rounds_ms, with each kind's overhead over the plain "
                        "residual per round and its median, overhead_pct_rounds)")
    args = parser.parse_args(argv)
    for flag in ("graph_rounds", "block_rounds"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')}: expected an integer >= 1, got {getattr(args, flag)}")
    if args.beside_carveout and not args.weight_grads_beside:
        parser.error(f"--beside-carveout {args.beside_carveout}: expected with --weight-grads-beside, given without")
    if args.beside_carveout < 0:
        parser.error(f"--beside-carveout: expected a number of SMs >= 0, got {args.beside_carveout}")
    parts = {p for p in args.parts.split(",") if p}
    if parts - set(PARTS):
        parser.error(f"--parts: expected parts among {', '.join(PARTS)}, got {', '.join(sorted(parts - set(PARTS)))}")
    unknown = [k for k in args.block_kernels_kinds.split(",") if k not in BLOCK_KINDS or k == "residual"]
    if unknown:
        parser.error(f"--block-kernels-kinds: expected kinds among {', '.join(BLOCK_KINDS[1:])}, got "
                     f"{', '.join(unknown)}")
    import contextlib
    import json

    from mhc_lab.ops.training import (
        COEFFICIENT_PHASES,
        check_lane_tuning,
        check_post_project_tuning,
        coefficient_phases,
        lane_tuning,
        post_gradient_to_pre,
        post_project_tuning,
    )
    from mhc_lab.kernels._target import warp_uniform_branches

    tuning = check_lane_tuning(hashable_tuning(json.loads(args.lane_tuning)) if args.lane_tuning else {})
    project_tuning = check_post_project_tuning(json.loads(args.post_project_tuning) if args.post_project_tuning
                                               else {})
    if not torch.cuda.is_available():
        print("bench training needs a CUDA GPU; recorded H200 results: mhc_lab/recorded/training_h200.json")
        return 1
    if args.blas:
        torch.backends.cuda.preferred_blas_library(args.blas)
    skip = {s for s in args.skip.split(",") if s}
    bench, timer_name = _timer()
    t0 = time.time()
    results = {"timer": timer_name, "n": N, "dtype": "bfloat16", "sinkhorn_iterations": 20, "post_mult": 2.0,
               "copy_gbps": copy_bandwidth(bench), "site": [], "block": []}
    if tuning:
        results["lane_tuning"] = tuning
    post_grad = None if args.post_grad is None else args.post_grad == "on"
    if post_grad is not None:
        results["post_gradient_to_pre"] = post_grad
    phases = args.coefficient_phases or COEFFICIENT_PHASES
    if args.coefficient_phases:
        results["coefficient_phases"] = phases
    if project_tuning:
        results["post_project_tuning"] = project_tuning
    if args.uniform_branches:
        results["uniform_warp_branches"] = True
    if args.blas:
        results["blas"] = args.blas
    if args.weight_grads_beside:
        results["weight_grads_beside"] = True
        if args.beside_carveout:
            results["beside_carveout"] = args.beside_carveout
    print(f"copy {results['copy_gbps']:.0f} GB/s" + (f"; kernel 2 tuned {tuning}" if tuning else "")
          + ({True: "; the post's output gradient to the pre", False: "; the post's dx to the pre", None: ""}[
              post_grad])
          + (f"; kernel 1 {phases}" if args.coefficient_phases else "")
          + (f"; the post + projection tuned {project_tuning}" if project_tuning else "")
          + ("; role branches warp-uniform" if args.uniform_branches else "")
          + (f"; matmuls through {args.blas}" if args.blas else "")
          + ("; the layers' weight gradients on a second stream" if args.weight_grads_beside else ""))

    @contextlib.contextmanager
    def configured():  # the options that every part but the sweep runs under
        with lane_tuning(**tuning), post_gradient_to_pre(post_grad), coefficient_phases(phases), \
                post_project_tuning(**project_tuning), warp_uniform_branches(args.uniform_branches), \
                layers_weight_grads_beside(args.weight_grads_beside, args.beside_carveout):
            yield

    def save(final=False):
        if not args.no_save:
            return save_recording(args.name, {**results, "partial": not final}, directory=args.out_dir)

    if "site" in parts:
        for s in args.shapes.split(","):
            tokens, C = (int(v) for v in s.split("x"))
            with configured():
                r = bench_site(tokens, C, bench, skip=skip, graph_rounds=args.graph_rounds)
            if "ours" in r["times_ms"]:
                ms = r["times_ms"]["ours"]
                r["ours_gbps"] = r["bytes"]["ours"] / (ms * 1e-3) / 1e9
                r["least_bytes_pct_of_copy"] = 100 * r["bytes"]["least"] / (ms * 1e-3) / 1e9 / results["copy_gbps"]
            results["site"].append(r)
            save()
            torch.cuda.empty_cache()
    if "sweep" in parts:
        results["sweeps"] = []
        for s in args.shapes.split(","):
            tokens, C = (int(v) for v in s.split("x"))
            results["sweeps"].append(sweep_pre_backward(
                tokens, C, bench, json.loads(args.sweep or "[{}]"),
                coefficient_variants=json.loads(args.sweep_coefficients or "[]")))
            save()
    if "host" in parts:
        with configured():
            results["host"] = bench_host(256, 768)
        save()
    if "behind_gemms" in parts:
        results["behind_gemms"] = []
        for sh in args.shapes.split(","):
            tokens, C = (int(v) for v in sh.split("x"))
            with configured():
                results["behind_gemms"].append(bench_behind_gemms(tokens, C))
            save()
    if "overlap" in parts:
        results["overlap"] = []
        for sh in args.shapes.split(","):
            tokens, C = (int(v) for v in sh.split("x"))
            with configured():
                results["overlap"].append(bench_overlap(tokens, C, bench))
            save()
    if "block_zeroed" in parts:
        results["block_zeroed"] = []
        for w in args.widths.split(","):
            results["block_zeroed"].append(bench_block_zeroed(int(w), bench))
            save()
    if "profile_kernels" in parts:
        for sh in args.shapes.split(","):
            tokens, C = (int(v) for v in sh.split("x"))
            with configured():
                profile_hot_kernels(tokens, C)
    if "block_kernels" in parts:
        results["block_kernels"] = []
        for w in args.widths.split(","):
            for kind in args.block_kernels_kinds.split(","):
                with configured():
                    results["block_kernels"].append(bench_block_kernels(int(w), bench, kind=kind))
                save()
    if "block" in parts:
        for w in args.widths.split(","):
            with configured():
                results["block"].append(bench_block(int(w), bench, skip=skip, rounds=args.block_rounds,
                                                     graphs=args.block_graphs))
            save()
    results["wall_s"] = round(time.time() - t0, 1)
    path = save(final=True)
    if path:
        print(f"saved {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
