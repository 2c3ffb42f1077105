"""Launch the CUDA pre plans on torch tensors (scratch buffers included): what mhc_lab.ops calls.

Plans (see pre.py): 'split' (phi split + projection pass + apply pass; n = 1..8), 'lookback' (phi split +
one pass over x whose second read hits L2; n = 1..8) and 'cluster' (one pass, n = 4, C small enough for the
phi slice to stay in shared memory). 'auto' takes the plan measured fastest on the H200
(docs/kernel-notes.md) among those that fit.
"""

import torch

from mhc_lab.kernels._coefficients import mixes_width
from mhc_lab.kernels.pre_split import phi_rows, split_kernels

# Tuning of each plan; the benchmark overrides these to compare variants. The split plan's apply pass runs as
# two kernels (per-token coefficients, then the lane mix): site forward 0.442 / 0.675 / 0.596 ms against
# 0.458 / 0.689 / 0.597 as one kernel at 16384 x 2560 / 16384 x 4096 / 8192 x 7168 (H200, 2026-11-30).
SPLIT_DEFAULTS = {"block_m": 256, "block_k": 64, "splits": 4, "stages": 3, "block_tokens": 16, "block_c": 256,
                  "apply_stages": 2, "project_ws": True, "apply_phases": "split", "spread_coefficients": True}
CLUSTER_DEFAULTS = {"cluster": 16, "block_tokens": 16, "stages": 2, "iters": 16, "threads": 256}
LOOKBACK_DEFAULTS = {"block_tokens": 64, "block_k": 128, "stages": 3, "apply_c": 64, "apply_stages": 2}
AUTO_PLAN = "split"  # what 'auto' picks: fastest on the H200 at all three issue shapes (forward_h200.json)
PLANS = ("auto", "split", "lookback", "cluster")


def lookback_splits(C: int) -> int:
    """Column splits of a token tile in the lookback plan: ~256 columns per CTA, at most 16 CTAs."""
    return max(1, min(16, round(C / 256)))


def choose_plan(n: int, C: int, plan: str = "auto") -> str:
    from mhc_lab.kernels.pre_cluster import cluster_config
    from mhc_lab.kernels.pre_lookback import lookback_config

    if plan not in PLANS:
        raise ValueError(f"plan: expected one of {PLANS}, got {plan!r}")
    fits = cluster_config(n, C, **CLUSTER_DEFAULTS)["fits"]
    if plan == "cluster" and not fits:
        raise ValueError(f"plan 'cluster' needs n = 4 and a phi slice that fits in shared memory; got n = {n}, C = {C}")
    lookback_fits = lookback_config(n, C)["fits"]
    if plan == "lookback" and not lookback_fits:
        raise ValueError(f"plan 'lookback' needs 2 <= n <= 8 and n * C a multiple of 8; got n = {n}, C = {C}")
    if plan == "auto":
        if (AUTO_PLAN == "cluster" and not fits) or (AUTO_PLAN == "lookback" and not lookback_fits):
            return "split"
        return AUTO_PLAN
    return plan


def run_pre_cuda(x, phi, bias, alpha, y, pre, post, res, *, plan: str = "auto", partial=None, projected=False,
                 **overrides) -> str:
    """Fill y, pre, post, res for lanes x [T, n, C] (bf16, contiguous, on the current CUDA device).

    partial: optional [splits, T, n^2+2n+1] float32 buffer (split plan only) that keeps the projection
    pass's output for a backward; splits = SPLIT_DEFAULTS['splits'] unless overridden. projected=True: partial
    already holds the projection of x with this phi (the previous site's post made it:
    kernels/post_project.py), so only the apply pass runs."""
    tokens, n, C = x.shape
    if (n * C) % 8 != 0:
        raise ValueError(f"CUDA pre kernels read 16-byte rows: n * C must be a multiple of 8, got n = {n}, C = {C}")
    chosen = choose_plan(n, C, plan)
    if projected and partial is None:
        raise ValueError("projected=True: expected the partial sums of x's projection in partial, got None")
    if partial is not None and chosen != "split":
        raise ValueError(f"partial: only the split plan keeps the projection's partial sums, got plan {chosen!r}")
    if chosen == "cluster":
        from mhc_lab.kernels.pre_cluster import cluster_kernel

        cfg = {**CLUSTER_DEFAULTS, **overrides}
        kernel = cluster_kernel(n, C, "bfloat16", "cuda", **cfg)
        kernel(x, phi, bias, alpha, y, pre, post, res)
        return chosen
    if chosen == "lookback":
        from mhc_lab.kernels.pre_lookback import lookback_kernel
        from mhc_lab.kernels.pre_split import phi_split_kernel

        cfg = {"splits": lookback_splits(C), **LOOKBACK_DEFAULTS, **overrides}
        kernel = lookback_kernel(n, C, "bfloat16", "cuda", **cfg)
        phi_hl = torch.empty((phi_rows(n), n * C), dtype=torch.bfloat16, device=x.device)
        mixes = torch.zeros((tokens, mixes_width(n) + 1), dtype=torch.float32, device=x.device)
        sync = torch.zeros((2, -(-tokens // cfg["block_tokens"])), dtype=torch.int32, device=x.device)
        phi_split_kernel(n, C, "cuda")(phi, phi_hl)
        kernel(x, phi_hl, bias, alpha, mixes, sync, y, pre, post, res)
        return chosen
    cfg = {**SPLIT_DEFAULTS, **overrides}
    phi_split, project, apply = split_kernels(n, C, "bfloat16", "cuda", **cfg)
    phi_hl = torch.empty((phi_rows(n), n * C), dtype=torch.bfloat16, device=x.device)
    shape = (cfg["splits"], tokens, mixes_width(n) + 1)
    if partial is None:
        partial = torch.empty(shape, dtype=torch.float32, device=x.device)
    elif tuple(partial.shape) != shape or partial.dtype != torch.float32:
        raise ValueError(f"partial: expected shape {shape} float32, got {tuple(partial.shape)} {partial.dtype}")
    if not projected:
        phi_split(phi, phi_hl)
        project(x.view(tokens, n * C), phi_hl, partial)
    apply(x, partial, bias, alpha, y, pre, post, res)
    return chosen
