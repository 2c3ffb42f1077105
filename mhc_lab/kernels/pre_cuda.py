"""Launch the CUDA pre plans on torch tensors (scratch buffers included): what mhc_lab.ops calls.

Plans (see pre.py): 'split' (phi split + projection pass + apply pass; n = 1..8) and 'cluster' (one pass,
n = 4, C small enough for the phi slice to stay in shared memory). 'auto' takes 'cluster' where it fits and
was measured faster on the H200 (docs/kernel-notes.md), else 'split'.
"""

import torch

from mhc_lab.kernels._coefficients import mixes_width
from mhc_lab.kernels.pre_split import phi_rows, split_kernels

# Tuning of each plan; the benchmark overrides these to compare variants.
SPLIT_DEFAULTS = {"block_m": 256, "block_k": 64, "splits": 4, "stages": 3, "block_tokens": 16}
CLUSTER_DEFAULTS = {"cluster": 16, "block_tokens": 16, "stages": 2, "iters": 16, "threads": 256}
AUTO_USES_CLUSTER = False  # switched on only once the cluster plan is measured correct and faster


def choose_plan(n: int, C: int, plan: str = "auto") -> str:
    from mhc_lab.kernels.pre_cluster import cluster_config

    if plan not in ("auto", "split", "cluster"):
        raise ValueError(f"plan: expected 'auto', 'split' or 'cluster', got {plan!r}")
    fits = cluster_config(n, C, **CLUSTER_DEFAULTS)["fits"]
    if plan == "cluster" and not fits:
        raise ValueError(f"plan 'cluster' needs n = 4 and a phi slice that fits in shared memory; got n = {n}, C = {C}")
    if plan == "auto":
        return "cluster" if (fits and AUTO_USES_CLUSTER) else "split"
    return plan


def run_pre_cuda(x, phi, bias, alpha, y, pre, post, res, *, plan: str = "auto", **overrides) -> str:
    """Fill y, pre, post, res for lanes x [T, n, C] (bf16, contiguous, on the current CUDA device)."""
    tokens, n, C = x.shape
    if (n * C) % 8 != 0:
        raise ValueError(f"CUDA pre kernels read 16-byte rows: n * C must be a multiple of 8, got n = {n}, C = {C}")
    chosen = choose_plan(n, C, plan)
    if chosen == "cluster":
        from mhc_lab.kernels.pre_cluster import cluster_kernel

        cfg = {**CLUSTER_DEFAULTS, **overrides}
        kernel = cluster_kernel(n, C, "bfloat16", "cuda", **cfg)
        kernel(x, phi, bias, alpha, y, pre, post, res)
        return chosen
    cfg = {**SPLIT_DEFAULTS, **overrides}
    phi_split, project, apply = split_kernels(n, C, "bfloat16", "cuda", **cfg)
    phi_hl = torch.empty((phi_rows(n), n * C), dtype=torch.bfloat16, device=x.device)
    partial = torch.empty((cfg["splits"], tokens, mixes_width(n) + 1), dtype=torch.float32, device=x.device)
    phi_split(phi, phi_hl)
    project(x.view(tokens, n * C), phi_hl, partial)
    apply(x, partial, bias, alpha, y, pre, post, res)
    return chosen
