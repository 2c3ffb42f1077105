"""Run the CUDA pre (pre_split.py) on torch tensors, scratch buffers included: what mhc_lab.ops calls."""

import torch

from mhc_lab.kernels._coefficients import mixes_width
from mhc_lab.kernels._target import tensor_target
from mhc_lab.kernels.pre_split import PROJECTION_SPLITS, apply_kernel, phi_rows, phi_split_kernel, project_kernel


def run_pre_cuda(x, phi, bias, alpha, y, pre, post, res, *, splits: int = PROJECTION_SPLITS, partial=None,
                 projected: bool = False) -> None:
    """Fill y, pre, post, res for lanes x [T, n, C] (bf16, contiguous, on the current CUDA device).

    Reads x, phi [n^2+2n, nC], bias [n^2+2n] and alpha [3] (float32); writes y [T, C] (bf16) and pre, post [T, n],
    res [T, n, n] (float32). splits: the projection's column splits, the first axis of partial.
    partial: optional [splits, T, n^2+2n+1] float32 buffer that keeps the projection's partial sums for a
    backward. projected=True: partial already holds the projection of x with this phi (the previous site's post
    made it: post_project.py), so only the apply pass runs."""
    tokens, n, C = x.shape
    if (n * C) % 8 != 0:
        raise ValueError(f"CUDA pre kernels read 16-byte rows: n * C must be a multiple of 8, got n = {n}, C = {C}")
    if projected and partial is None:
        raise ValueError("projected=True: expected the partial sums of x's projection in partial, got None")
    shape = (splits, tokens, mixes_width(n) + 1)
    if partial is None:
        partial = torch.empty(shape, dtype=torch.float32, device=x.device)
    elif tuple(partial.shape) != shape or partial.dtype != torch.float32:
        raise ValueError(f"partial: expected shape {shape} float32, got {tuple(partial.shape)} {partial.dtype}")
    target = tensor_target(x)  # built for the GPU x is on
    if not projected:
        phi_hl = torch.empty((phi_rows(n), n * C), dtype=torch.bfloat16, device=x.device)
        phi_split_kernel(n, C, target)(phi, phi_hl)
        project_kernel(n, C, "bfloat16", target, splits=splits)(x.view(tokens, n * C), phi_hl, partial)
    apply_kernel(n, C, "bfloat16", target, splits=splits)(x, partial, bias, alpha, y, pre, post, res)
