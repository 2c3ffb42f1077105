"""Hyper-Connections (Zhu et al., arXiv 2409.19606): n lanes, static and dynamic coefficients.

Notation follows the HC paper; in mHC's notation (arXiv 2512.24880, Eq. 3) the same maps are
H_pre = A_m^T, H_post = B and H_res = A_r^T, and one layer is

    x_{l+1} = H_res x_l + H_post^T F(H_pre x_l).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn
import torch.nn.functional as F

from mhc_lab.reference.validate import (
    InputError,
    coefficient_dtype,
    require_lanes,
    require_positive_int,
    require_tensor,
    require_trailing,
)


def expand_lanes(h: torch.Tensor, n: int) -> torch.Tensor:
    """Copy a hidden state ``[..., C]`` into n identical lanes ``[..., n, C]`` (HC Algorithm 1, line 2)."""
    require_tensor("h", h)
    require_positive_int("n", n)
    if h.dim() < 1:
        raise InputError("h: expected a hidden state of shape [..., C], got a 0-dim tensor")
    return h.unsqueeze(-2).expand(*h.shape[:-1], n, h.shape[-1]).contiguous()


def collapse_lanes(x: torch.Tensor) -> torch.Tensor:
    """Sum the n lanes ``[..., n, C]`` back into one hidden state ``[..., C]`` (HC Algorithm 1, lines 11-13)."""
    require_lanes("x", x)
    return x.sum(dim=-2)


def hc_static_init(n: int, layer_index: int = 0, dtype=torch.float32):
    """HC initialisation (Eq. 14): B = 1, A_m = e_{k mod n}, A_r = I; at init HC equals a Pre-Norm residual.

    Returns (alpha_m [n], alpha_r [n, n], beta [n]).
    """
    require_positive_int("n", n)
    if not isinstance(layer_index, int) or layer_index < 0:
        raise InputError(f"layer_index: expected an int >= 0, got {layer_index!r}")
    alpha_m = torch.zeros(n, dtype=dtype)
    alpha_m[layer_index % n] = 1.0
    return alpha_m, torch.eye(n, dtype=dtype), torch.ones(n, dtype=dtype)


def hc_apply(
    x: torch.Tensor,
    layer: Callable[[torch.Tensor], torch.Tensor],
    alpha_m: torch.Tensor,
    alpha_r: torch.Tensor,
    beta: torch.Tensor,
) -> torch.Tensor:
    """One hyper-connected layer (HC Eqs. 2-5).

    x: lanes [..., n, C]; alpha_m: [n] or [..., n]; alpha_r: [n, n] or [..., n, n]; beta: [n] or [..., n].
        h_0     = sum_i alpha_m[i] x_i                 the layer's input (width connection)
        x'_j    = sum_i alpha_r[i, j] x_i              lanes remixed (width connection)
        out_j   = beta_j F(h_0) + x'_j                 layer output added to every lane (depth connection)
    """
    n, C = require_lanes("x", x)
    require_trailing("alpha_m", alpha_m, (n,))
    require_trailing("alpha_r", alpha_r, (n, n))
    require_trailing("beta", beta, (n,))
    h0 = torch.einsum("...i,...ic->...c", alpha_m.to(x.dtype), x)
    y = layer(h0)
    if not isinstance(y, torch.Tensor) or y.shape != h0.shape:
        got = tuple(y.shape) if isinstance(y, torch.Tensor) else type(y).__name__
        raise InputError(f"layer(h0): expected an output of shape {tuple(h0.shape)}, got {got}")
    remixed = torch.einsum("...ij,...ic->...jc", alpha_r.to(x.dtype), x)
    return beta.to(x.dtype).unsqueeze(-1) * y.unsqueeze(-2) + remixed


def hc_dynamic_coefficients(
    x: torch.Tensor,
    static: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    w_m: torch.Tensor,
    w_r: torch.Tensor,
    w_beta: torch.Tensor,
    s_alpha: torch.Tensor | float,
    s_beta: torch.Tensor | float,
    norm_eps: float = 1e-5,
):
    """Dynamic HC coefficients (HC Eqs. 10-13); each lane's own normalised row makes that lane's coefficients.

        x_bar  = norm(x)                                   LayerNorm over C, per lane        (Eq. 10)
        beta   = s_beta  * tanh(x_bar w_beta) + beta_0     [..., n]                          (Eq. 11)
        alpha_m= s_alpha * tanh(x_bar w_m)    + alpha_m0   [..., n]                          (Eq. 12)
        alpha_r= s_alpha * tanh(x_bar w_r)    + alpha_r0   [..., n, n], row i from lane i    (Eq. 13)

    Shapes: w_m [C], w_r [C, n], w_beta [C]. Returns (alpha_m, alpha_r, beta) in the coefficient dtype.
    """
    n, C = require_lanes("x", x)
    alpha_m0, alpha_r0, beta0 = static
    require_trailing("static alpha_m", alpha_m0, (n,))
    require_trailing("static alpha_r", alpha_r0, (n, n))
    require_trailing("static beta", beta0, (n,))
    require_trailing("w_m", w_m, (C,), leading=())
    require_trailing("w_r", w_r, (C, n), leading=())
    require_trailing("w_beta", w_beta, (C,), leading=())
    cd = coefficient_dtype(x)
    x_bar = F.layer_norm(x.to(cd), (C,), eps=norm_eps)
    beta = s_beta * torch.tanh(x_bar @ w_beta.to(cd)) + beta0.to(cd)
    alpha_m = s_alpha * torch.tanh(x_bar @ w_m.to(cd)) + alpha_m0.to(cd)
    alpha_r = s_alpha * torch.tanh(x_bar @ w_r.to(cd)) + alpha_r0.to(cd)
    return alpha_m, alpha_r, beta


class HyperConnection(nn.Module):
    """One HC site around a layer: static (SHC) or dynamic (DHC) coefficients, initialised by Eq. 14.

    The static parts are plain parameters; the dynamic parts start at zero with scales s_alpha = s_beta = 0.01
    (HC Algorithm 2), so a fresh HyperConnection computes exactly a Pre-Norm residual layer on lane k mod n.
    """

    def __init__(self, n: int, width: int, layer_index: int = 0, dynamic: bool = True):
        super().__init__()
        require_positive_int("n", n)
        require_positive_int("width", width)
        self.n, self.width, self.dynamic = n, width, dynamic
        alpha_m, alpha_r, beta = hc_static_init(n, layer_index)
        self.alpha_m = nn.Parameter(alpha_m)
        self.alpha_r = nn.Parameter(alpha_r)
        self.beta = nn.Parameter(beta)
        if dynamic:
            self.w_m = nn.Parameter(torch.zeros(width))
            self.w_r = nn.Parameter(torch.zeros(width, n))
            self.w_beta = nn.Parameter(torch.zeros(width))
            self.s_alpha = nn.Parameter(torch.tensor(0.01))
            self.s_beta = nn.Parameter(torch.tensor(0.01))

    def coefficients(self, x: torch.Tensor):
        """(alpha_m, alpha_r, beta) for this input; static ones broadcast over the batch dims."""
        require_lanes("x", x, n=self.n)
        if x.shape[-1] != self.width:
            raise InputError(f"x: expected lanes of width C = {self.width}, got shape {tuple(x.shape)}")
        static = (self.alpha_m, self.alpha_r, self.beta)
        if not self.dynamic:
            return static
        return hc_dynamic_coefficients(x, static, self.w_m, self.w_r, self.w_beta, self.s_alpha, self.s_beta)

    def residual_matrix(self, x: torch.Tensor) -> torch.Tensor:
        """H_res = A_r^T in mHC's notation: new lane i = sum_j H_res[i, j] x_j."""
        return self.coefficients(x)[1].transpose(-1, -2)

    def forward(self, x: torch.Tensor, layer: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        alpha_m, alpha_r, beta = self.coefficients(x)
        return hc_apply(x, layer, alpha_m, alpha_r, beta)
