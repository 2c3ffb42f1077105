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
    projection: mix = x_flat phi^T:  dx_flat += dmix phi,  dphi = sum over tokens of dmix^T x_flat
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from mhc_lab.reference.mhc import mixes_width
from mhc_lab.reference.validate import InputError, coefficient_dtype, require_lanes


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


def post_backward(x, layer_output, post, res, grad_out) -> PostGradients:
    """Gradients of mhc_post's inputs given grad_out = dL/d(next lanes)."""
    require_lanes("x", x)
    if grad_out.shape != x.shape:
        raise InputError(f"grad_out: expected shape {tuple(x.shape)} (the lanes'), got {tuple(grad_out.shape)}")
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
    m, k = mixes_width(n), n * C
    cd = coefficient_dtype(x)
    lanes = x.to(cd)
    flat = lanes.reshape(*x.shape[:-2], k)
    phi, bias, alpha = phi.to(cd), bias.to(cd), alpha.to(cd)
    dy, dpost, dres = grad_layer_input.to(cd), grad_post.to(cd), grad_res.to(cd)
    s = flat.pow(2).sum(dim=-1, keepdim=True)
    r = torch.rsqrt(s / k + rms_eps)
    mix = flat @ phi.t()
    groups = (slice(0, n), slice(n, 2 * n), slice(2 * n, m))
    logits = [alpha[g] * r * mix[..., sl] + bias[sl] for g, sl in enumerate(groups)]
    # forward again: H_pre = sigmoid + eps, H_post = 2 sigmoid, H_res = Sinkhorn
    s_pre, s_post = torch.sigmoid(logits[0]), torch.sigmoid(logits[1])
    pre = s_pre + eps
    dpre = torch.einsum("...c,...jc->...j", dy, lanes)
    dlogit = torch.cat([
        dpre * s_pre * (1 - s_pre),
        dpost * 2 * s_post * (1 - s_post),
        sinkhorn_backward(logits[2].reshape(*logits[2].shape[:-1], n, n), dres, iterations, eps).flatten(-2),
    ], dim=-1)
    scale = torch.cat([alpha[g].expand(sl.stop - sl.start) for g, sl in enumerate(groups)])  # alpha per logit
    dmix = dlogit * scale * r
    per_group = torch.stack([(dlogit[..., sl] * mix[..., sl]).sum(-1) for sl in groups], dim=-1)  # [..., 3]
    dr = (per_group * alpha).sum(-1, keepdim=True)
    ds = dr * (-0.5) * r.pow(3) / k
    dflat = dmix @ phi + 2 * ds * flat
    dx = dflat.reshape(lanes.shape) + pre.unsqueeze(-1) * dy.unsqueeze(-2)
    return PreGradients(
        x=dx,
        phi=dmix.reshape(-1, m).t() @ flat.reshape(-1, k),
        bias=dlogit.reshape(-1, m).sum(0),
        alpha=(per_group * r).reshape(-1, 3).sum(0),
    )
