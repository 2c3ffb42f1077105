"""The backward of one mHC site, derived by hand (arXiv 2512.24880 Eqs. 3, 7-9; DeepSeek-V4 convention).

Autograd could differentiate mhc_lab.reference directly; these functions write each gradient out so a
learner can read it, and so the fused kernels have a formula to match. They are tested against autograd of
the forward reference in float64. Every function takes the gradients of a step's outputs and returns the
gradients of its inputs; shapes as in mhc_lab.reference.mhc (x [..., n, C], H_res[i, j] mixes lane j into
lane i).

    post:  out_i = sum_j H_res[i, j] x_j + H_post[i] f
           dx_j = sum_i H_res[i, j] g_i,  df = sum_i H_post[i] g_i,
           dH_res[i, j] = <g_i, x_j>,  dH_post[i] = <g_i, f>               (<., .>: a sum over the width C)
    pre:   y = sum_j H_pre[j] x_j:  dx_j = H_pre[j] dy,  dH_pre[j] = <dy, x_j>
    Sinkhorn, a row step Q = P / (rowsum(P) + eps):  dP = (dQ - rowsum(dQ * Q)) / (rowsum(P) + eps)
           (columns alike); the softmax: dL = S * (dS - rowsum(dS * S)).
    norm:  r = (s / nC + eps)^(-1/2) with s = sum(x^2):  ds = -r^3 / (2 nC) dr,  dx += 2 ds x
           (computed on x / max|x| (_scaled_rms), so that no square or cube over- or underflows)
    projection: mix = x_flat phi^T:  dx_flat += dmix phi,  dphi = sum over tokens of dmix^T x_flat
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from mhc_lab.reference.mhc import mixes_width
from mhc_lab.reference.validate import InputError, coefficient_dtype, require_floating, require_lanes


class PostGradients(NamedTuple):
    x: torch.Tensor
    layer_output: torch.Tensor
    post: torch.Tensor
    res: torch.Tensor


class PreGradients(NamedTuple):
    x: torch.Tensor
    phi: torch.Tensor
    bias: torch.Tensor
    alpha: torch.Tensor


def _scaled_rms(flat: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(u, rho, scale) with flat = scale u and r = rsqrt(mean(flat^2) + eps) = rho / scale, over the last dim.

    scale is the row's largest |value| (at least sqrt(eps)), so u^2 <= 1 and (sqrt(eps) / scale)^2 <= 1 cannot
    overflow, and rho = rsqrt(mean(u^2) + eps / scale^2) is about 1 where r^3 x^2 would leave float32's range."""
    scale = flat.abs().amax(dim=-1, keepdim=True).clamp_min(max(math.sqrt(eps), torch.finfo(flat.dtype).tiny))
    u = flat / scale
    return u, torch.rsqrt(u.pow(2).mean(dim=-1, keepdim=True) + (math.sqrt(eps) / scale).pow(2)), scale


def post_backward(x, layer_output, post, res, grad_out) -> PostGradients:
    """Gradients of mhc_post's inputs given grad_out = dL/d(next lanes)."""
    require_lanes("x", x)
    if grad_out.shape != x.shape:
        raise InputError(f"grad_out: expected shape {tuple(x.shape)} (the lanes'), got {tuple(grad_out.shape)}")
    for name, value in (("layer_output", layer_output), ("post", post), ("res", res), ("grad_out", grad_out)):
        require_floating(name, value)
    cd = coefficient_dtype(x)
    x, f, g = x.to(cd), layer_output.to(cd), grad_out.to(cd)
    res, post = res.to(cd), post.to(cd)
    return PostGradients(
        x=torch.einsum("...ij,...ic->...jc", res, g),
        layer_output=torch.einsum("...i,...ic->...c", post, g),
        post=torch.einsum("...ic,...c->...i", g, f),
        res=torch.einsum("...ic,...jc->...ij", g, x),
    )


def sinkhorn_backward(logits: torch.Tensor, grad_res: torch.Tensor, iterations: int = 20, eps: float = 1e-6):
    """dL/dlogits of the DeepSeek-V4 Sinkhorn (H_res = comb^T), recomputing the forward and keeping only
    each step's reciprocal sums (as the fused kernel does on chip)."""
    softmax = torch.softmax(logits, dim=-1)
    comb = softmax + eps
    steps = []  # (axis, reciprocal): axis -2 normalises columns, -1 rows
    inv = 1.0 / (comb.sum(dim=-2, keepdim=True) + eps)
    comb = comb * inv
    steps.append((-2, inv))
    for _ in range(iterations - 1):
        for axis in (-1, -2):
            inv = 1.0 / (comb.sum(dim=axis, keepdim=True) + eps)
            comb = comb * inv
            steps.append((axis, inv))
    d = grad_res.transpose(-1, -2)
    for axis, inv in reversed(steps):
        d = (d - (d * comb).sum(dim=axis, keepdim=True)) * inv
        comb = comb / inv
    return softmax * (d - (d * softmax).sum(dim=-1, keepdim=True))


def pre_backward(x, phi, bias, alpha, grad_layer_input, grad_post, grad_res, *, iterations: int = 20,
                 eps: float = 1e-6, rms_eps: float = 1e-6) -> PreGradients:
    """Gradients of x, phi, bias and alpha through mhc_coefficients and mhc_pre (DeepSeek-V4 convention),
    given the gradients of the layer input H_pre x, of H_post and of H_res."""
    n, C = require_lanes("x", x)
    for name, value in (("phi", phi), ("bias", bias), ("alpha", alpha)):
        require_floating(name, value)
    m, k = mixes_width(n), n * C
    cd = coefficient_dtype(x)
    lanes = x.to(cd)
    phi, bias, alpha = phi.to(cd), bias.to(cd), alpha.to(cd)
    dy, dpost, dres = grad_layer_input.to(cd), grad_post.to(cd), grad_res.to(cd)
    # x_flat = scale u and r = rho / scale (_scaled_rms): every product below that would over- or underflow in
    # x_flat's units (r^3 x_flat^2 at |x| ~ 1e19 in float32) is formed in u's, and divided by scale at the end
    u, rho, scale = _scaled_rms(lanes.reshape(*x.shape[:-2], k), rms_eps)
    mix_u = u @ phi.t()  # mix / scale
    groups = (slice(0, n), slice(n, 2 * n), slice(2 * n, m))
    logits = [alpha[g] * rho * mix_u[..., sl] + bias[sl] for g, sl in enumerate(groups)]  # alpha r mix + bias
    # forward again: H_pre = sigmoid + eps, H_post = 2 sigmoid, H_res = Sinkhorn
    s_pre, s_post = torch.sigmoid(logits[0]), torch.sigmoid(logits[1])
    pre = s_pre + eps
    dpre = torch.einsum("...c,...jc->...j", dy, lanes)
    dlogit = torch.cat([
        dpre * s_pre * (1 - s_pre),
        dpost * 2 * s_post * (1 - s_post),
        sinkhorn_backward(logits[2].reshape(*logits[2].shape[:-1], n, n), dres, iterations, eps).flatten(-2),
    ], dim=-1)
    per_logit = torch.cat([alpha[g].expand(sl.stop - sl.start) for g, sl in enumerate(groups)])  # alpha per logit
    dmix_u = dlogit * per_logit * rho  # dmix * scale
    per_group_u = torch.stack([(dlogit[..., sl] * mix_u[..., sl]).sum(-1) for sl in groups], dim=-1)  # / scale
    dr_u = (per_group_u * alpha).sum(-1, keepdim=True)  # dr / scale
    # dmix phi + 2 ds x_flat, with ds = -r^3 dr / (2k): (dmix_u phi - dr_u rho^3 u / k) / scale
    dflat = (dmix_u @ phi - dr_u * rho.pow(3) * u / k) / scale
    dx = dflat.reshape(lanes.shape) + pre.unsqueeze(-1) * dy.unsqueeze(-2)
    return PreGradients(
        x=dx,
        phi=dmix_u.reshape(-1, m).t() @ u.reshape(-1, k),  # dmix^T x_flat
        bias=dlogit.reshape(-1, m).sum(0),
        alpha=(per_group_u * rho).reshape(-1, 3).sum(0),  # per_group * r
    )
