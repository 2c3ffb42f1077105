"""Sinkhorn-Knopp: logits [..., n, n] to a (nearly) doubly stochastic H_res (mHC, arXiv 2512.24880, Eq. 9).

Every variant returns H_res in the paper's meaning: the new lane i is sum_j H_res[i, j] x_j.
Which sums are exact depends on which normalisation runs last; all three variants here end so that
the rows of H_res (the forward gain) are exact and the columns carry the remaining error.

- ``paper``       Eq. 9: M = exp(logits), then t times (column normalise, row normalise). No eps.
- ``deepseek_v4`` DeepSeek-V4's convention: row softmax + eps, one column normalisation, then t - 1 times
                  (row, column) with + eps in every denominator; the result is applied transposed.
- ``log_domain``  the paper's iteration on log-potentials (logsumexp), finite for any finite logits.

Logits must be finite: NaN, +inf and -inf are refused (an InputError naming "logits"). -inf is not taken as a
zero weight: a row of -inf has no softmax, a column of -inf no normalisation, and both would give NaN; a weight
meant to be zero is a large negative logit (e.g. -1e4: exp(-1e4) is 0 in float32 and float64).
"""

from __future__ import annotations

import math

import torch

from mhc_lab.reference.validate import (
    InputError,
    checking_values,
    require_finite,
    require_positive_int,
    require_tensor,
)

SINKHORN_VARIANTS = ("deepseek_v4", "paper", "log_domain")


def _check_logits(logits) -> torch.Tensor:
    require_tensor("logits", logits)
    if logits.dim() < 2 or logits.shape[-1] != logits.shape[-2]:
        raise InputError(
            f"logits: expected square matrices of shape [..., n, n], got shape {tuple(logits.shape)}"
        )
    if not logits.is_floating_point():
        raise InputError(f"logits: expected a floating-point tensor, got dtype {logits.dtype}")
    # x - x is 0 for every finite x and NaN for NaN, +inf and -inf: two launches and one value read back (a sync),
    # which mhc_lab.ops skips (skipping_value_checks)
    if checking_values() and (logits - logits).any():
        require_finite("logits", logits)
    return logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits


def sinkhorn_paper(logits: torch.Tensor, iterations: int = 20) -> torch.Tensor:
    """Eq. 9: M0 = exp(logits); M_t = T_r(T_c(M_{t-1})). Row sums exact; may give NaN for extreme logits."""
    logits = _check_logits(logits)
    require_positive_int("iterations", iterations)
    # Subtracting a per-matrix constant changes nothing after normalisation, and keeps exp from overflowing.
    m = torch.exp(logits - logits.amax(dim=(-2, -1), keepdim=True))
    for _ in range(iterations):
        m = m / m.sum(dim=-2, keepdim=True)  # T_c: every column sums to 1
        m = m / m.sum(dim=-1, keepdim=True)  # T_r: every row sums to 1
    # (non-finite logits get here only inside skipping_value_checks: their NaN propagates)
    if not torch.isfinite(m).all() and torch.isfinite(logits).all():
        spread = (logits.amax(dim=(-2, -1)) - logits.amin(dim=(-2, -1))).max().item()
        raise InputError(
            "sinkhorn_paper: exp(logits) underflowed to an all-zero column (largest logit spread in one matrix: "
            f"{spread:.3g}; exp in {logits.dtype} underflows to 0 below about "
            f"{math.log(torch.finfo(logits.dtype).tiny):.0f}). Use variant='log_domain' or 'deepseek_v4'."
        )
    return m


def sinkhorn_deepseek_v4(logits: torch.Tensor, iterations: int = 20, eps: float = 1e-6) -> torch.Tensor:
    """DeepSeek-V4: comb = (T_c T_r)^t (softmax(logits) + eps) with + eps in denominators; H_res = comb^T."""
    logits = _check_logits(logits)
    require_positive_int("iterations", iterations)
    comb = torch.softmax(logits, dim=-1) + eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iterations - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return comb.transpose(-1, -2)


def sinkhorn_log_domain(logits: torch.Tensor, iterations: int = 20) -> torch.Tensor:
    """Eq. 9 on log-potentials: H = exp(logits + f_i + g_j); column step updates g, row step updates f."""
    logits = _check_logits(logits)
    require_positive_int("iterations", iterations)
    f = torch.zeros_like(logits[..., :, :1])  # row potentials [..., n, 1]
    g = torch.zeros_like(logits[..., :1, :])  # column potentials [..., 1, n]
    for _ in range(iterations):
        g = -torch.logsumexp(logits + f, dim=-2, keepdim=True)
        f = -torch.logsumexp(logits + g, dim=-1, keepdim=True)
    h = torch.exp(logits + f + g)
    # The last step made the rows sum to 1 in exact arithmetic; for huge logits the sum logits + f + g cancels
    # digits, so restore the row sums explicitly (a no-op up to rounding otherwise).
    return h / h.sum(dim=-1, keepdim=True)


def sinkhorn(logits: torch.Tensor, variant: str = "deepseek_v4", iterations: int = 20, eps: float = 1e-6):
    """H_res from logits by the named variant (see the module docstring)."""
    if variant == "deepseek_v4":
        return sinkhorn_deepseek_v4(logits, iterations, eps)
    if variant == "paper":
        return sinkhorn_paper(logits, iterations)
    if variant == "log_domain":
        return sinkhorn_log_domain(logits, iterations)
    raise InputError(f"variant: expected one of {SINKHORN_VARIANTS}, got {variant!r}")
