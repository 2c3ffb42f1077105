"""mHC: Manifold-Constrained Hyper-Connections (Xie et al., arXiv 2512.24880, Eqs. 3, 7-9).

One mHC site turns lanes x [..., n, C] into the next lanes:

    x_{l+1} = H_res x_l + H_post^T F(H_pre x_l)                                         (Eq. 3)

with coefficients made from the whole flattened stream (Eqs. 7-8):

    x'      = RMSNorm(vec(x))                                       [..., nC]
    mixes   = x' phi^T                                              [..., n^2 + 2n], order [pre, post, res]
    H_pre   = sigmoid(alpha_pre  * mixes_pre  + b_pre) (+ eps in DeepSeek-V4)           [..., n]
    H_post  = 2 sigmoid(alpha_post * mixes_post + b_post)                               [..., n]
    H_res   = Sinkhorn(alpha_res * mat(mixes_res) + b_res)                              [..., n, n]

Parameter layout is DeepSeek-V4's (so its trained weights would load): phi is [n^2 + 2n, nC] (rows are the
outputs, like an nn.Linear weight, RMSNorm weight already folded in), bias [n^2 + 2n], alpha [3].
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch
from torch import nn

from mhc_lab.reference.sinkhorn import SINKHORN_VARIANTS, sinkhorn
from mhc_lab.reference.validate import (
    InputError,
    checking_values,
    coefficient_dtype,
    require_finite,
    require_lanes,
    require_lanes_not_transposed,
    require_positive_int,
    require_shape,
    require_trailing,
    skipping_value_checks,
)


class MHCCoefficients(NamedTuple):
    pre: torch.Tensor  # [..., n]
    post: torch.Tensor  # [..., n]
    res: torch.Tensor  # [..., n, n]; new lane i = sum_j res[i, j] x_j


def mixes_width(n: int) -> int:
    """Number of projected coefficients per token: n (pre) + n (post) + n^2 (res)."""
    return n * n + 2 * n


def mhc_coefficients(
    x: torch.Tensor,
    phi: torch.Tensor,
    bias: torch.Tensor,
    alpha: torch.Tensor,
    *,
    variant: str = "deepseek_v4",
    iterations: int = 20,
    eps: float = 1e-6,
    rms_eps: float = 1e-6,
) -> MHCCoefficients:
    """H_pre, H_post, H_res for every token of x (Eqs. 7-9), in float32 (float64 for float64 input).

    NaN or inf in x, phi, bias or alpha is an InputError naming the input (one value read back to the host, for
    all of them; mhc_lab.ops runs this without it, see validate.skipping_value_checks)."""
    n, C = require_lanes("x", x)
    require_lanes_not_transposed("x", x, phi)
    k = mixes_width(n)
    require_shape("phi", phi, (k, n * C))
    require_shape("bias", bias, (k,))
    require_shape("alpha", alpha, (3,))
    if variant not in SINKHORN_VARIANTS:
        raise InputError(f"variant: expected one of {SINKHORN_VARIANTS}, got {variant!r}")
    if isinstance(rms_eps, bool) or not isinstance(rms_eps, (int, float)) or not rms_eps >= 0:
        raise InputError(f"rms_eps: expected a number >= 0, got {rms_eps!r}")
    cd = coefficient_dtype(x)
    flat = x.reshape(*x.shape[:-2], n * C).to(cd)
    # Eq. 7, RMSNorm: flat * rsqrt(mean(flat^2) + eps), the squares summed in float64 in one pass (vector_norm's
    # dtype): x^2 overflows float32 from |x| ~ 1.8e19, float64 only from ~1.3e154
    sum_sq = torch.linalg.vector_norm(flat, dim=-1, keepdim=True, dtype=torch.float64).square()
    flat = flat * torch.rsqrt(sum_sq / (n * C) + rms_eps).to(cd)
    mixes = flat @ phi.to(cd).t()
    alpha, bias = alpha.to(cd), bias.to(cd)
    pre_logits = alpha[0] * mixes[..., :n] + bias[:n]
    post_logits = alpha[1] * mixes[..., n : 2 * n] + bias[n : 2 * n]
    res_logits = alpha[2] * mixes[..., 2 * n :] + bias[2 * n :]
    if checking_values():
        _require_finite_logits((pre_logits, post_logits, res_logits), x=x, phi=phi, bias=bias, alpha=alpha)
    res_logits = res_logits.reshape(*res_logits.shape[:-1], n, n)
    pre = torch.sigmoid(pre_logits)  # Eq. 8
    if variant == "deepseek_v4":
        pre = pre + eps
    post = 2.0 * torch.sigmoid(post_logits)  # Eq. 8
    with skipping_value_checks():  # the logits are finite by now: sinkhorn need not read them back again
        res = sinkhorn(res_logits, variant=variant, iterations=iterations, eps=eps)  # Eq. 9
    return MHCCoefficients(pre, post, res)


def _require_finite_logits(logits, **inputs) -> None:
    """One value read back for all of mhc_coefficients' logits; where one is NaN or inf, the input to blame."""
    joined = torch.cat(logits, dim=-1)
    if not (joined - joined).any():  # x - x: 0 for finite x, NaN for NaN and +-inf
        return
    for name, value in inputs.items():
        require_finite(name, value)
    raise InputError(
        "mhc_coefficients: the logits alpha * (RMSNorm(x) phi^T) + bias overflowed to inf from finite x, phi, bias "
        f"and alpha (largest |phi| {inputs['phi'].abs().max().item():.3g}, |alpha| "
        f"{inputs['alpha'].abs().max().item():.3g}, |bias| {inputs['bias'].abs().max().item():.3g})"
    )


def mhc_pre(x: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """The layer input H_pre x: a weighted sum of the lanes, [..., n, C] -> [..., C] (Eq. 3)."""
    n, C = require_lanes("x", x)
    require_trailing("pre", pre, (n,), leading=tuple(x.shape[:-2]))
    cd = coefficient_dtype(x)
    return torch.einsum("...j,...jc->...c", pre.to(cd), x.to(cd)).to(x.dtype)


def mhc_post(x: torch.Tensor, layer_out: torch.Tensor, post: torch.Tensor, res: torch.Tensor) -> torch.Tensor:
    """The next lanes H_res x + H_post^T F: lane i = sum_j res[i, j] x_j + post_i * layer_out (Eq. 3)."""
    n, C = require_lanes("x", x)
    batch = tuple(x.shape[:-2])
    require_trailing("layer_out", layer_out, (C,), leading=batch)
    require_trailing("post", post, (n,), leading=batch)
    require_trailing("res", res, (n, n), leading=batch)
    cd = coefficient_dtype(x)
    mixed = torch.einsum("...ij,...jc->...ic", res.to(cd), x.to(cd))
    return (mixed + post.to(cd).unsqueeze(-1) * layer_out.to(cd).unsqueeze(-2)).to(x.dtype)


def mhc_identity_init(n: int, width: int, off_diagonal: float = -8.0, alpha: float = 0.01):
    """A near-identity start, our choice where the paper is silent (it only fixes alpha = 0.01).

    phi = 0 (coefficients start token-independent, as HC's Eq. 14), b_pre = 0 (H_pre = 1/2 on every lane),
    b_post = 0 (H_post = 1, as HC's B = 1), b_res = 0 on the diagonal and -8 off it, so H_res is within
    about 1e-3 of the identity. Returns (phi, bias, alpha).
    """
    require_positive_int("n", n)
    require_positive_int("width", width)
    phi = torch.zeros(mixes_width(n), n * width)
    res_bias = torch.full((n, n), float(off_diagonal))
    res_bias.fill_diagonal_(0.0)
    bias = torch.cat([torch.zeros(2 * n), res_bias.flatten()])
    return phi, bias, torch.full((3,), float(alpha))


class ManifoldHyperConnection(nn.Module):
    """One mHC site around a layer, with learnable phi, bias, alpha (DeepSeek-V4 layout)."""

    def __init__(self, n: int, width: int, variant: str = "deepseek_v4", iterations: int = 20):
        super().__init__()
        if variant not in SINKHORN_VARIANTS:
            raise InputError(f"variant: expected one of {SINKHORN_VARIANTS}, got {variant!r}")
        self.n, self.width, self.variant = n, width, variant
        self.iterations = require_positive_int("iterations", iterations)
        phi, bias, alpha = mhc_identity_init(n, width)
        self.phi, self.bias, self.alpha = nn.Parameter(phi), nn.Parameter(bias), nn.Parameter(alpha)

    def coefficients(self, x: torch.Tensor) -> MHCCoefficients:
        require_lanes("x", x, n=self.n)
        return mhc_coefficients(
            x, self.phi, self.bias, self.alpha, variant=self.variant, iterations=self.iterations
        )

    def forward(self, x: torch.Tensor, layer: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        coeffs = self.coefficients(x)
        y = layer(mhc_pre(x, coeffs.pre))
        return mhc_post(x, y, coeffs.post, coeffs.res)
