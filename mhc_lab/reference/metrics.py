"""Amax gain magnitude of residual mixing matrices (mHC, arXiv 2512.24880, Sec. 3.1 and Figs. 3, 7).

For a matrix H acting as x -> H x: the forward gain is the largest absolute row sum (worst-case amplification
of the signal), the backward gain the largest absolute column sum (worst-case amplification of the gradient).
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import torch

from mhc_lab.reference.validate import InputError, require_tensor


class Gain(NamedTuple):
    forward: torch.Tensor
    backward: torch.Tensor


def _as_square(name: str, h) -> torch.Tensor:
    require_tensor(name, h)
    if h.dim() < 2 or h.shape[-1] != h.shape[-2]:
        raise InputError(f"{name}: expected square matrices [..., n, n], got shape {tuple(h.shape)}")
    return h


def amax_gain(h: torch.Tensor) -> Gain:
    """(max_i sum_j |H_ij|, max_j sum_i |H_ij|) for every matrix in h [..., n, n]."""
    h = _as_square("h", h).abs()
    return Gain(h.sum(dim=-1).amax(dim=-1), h.sum(dim=-2).amax(dim=-1))


def composite_product(layers: Sequence[torch.Tensor] | torch.Tensor) -> torch.Tensor:
    """Running products P_k = H_k ... H_2 H_1 for k = 1..L (mHC Eq. 4); returns [L, ..., n, n].

    ``layers`` is a sequence (or a stacked tensor [L, ..., n, n]) in the order the layers are applied.
    """
    if isinstance(layers, torch.Tensor):
        layers = list(_as_square("layers", layers).unbind(0))
    if len(layers) == 0:
        raise InputError("layers: expected at least one matrix, got an empty sequence")
    products, running = [], None
    for k, h in enumerate(layers):
        h = _as_square(f"layers[{k}]", h)
        running = h if running is None else h @ running
        products.append(running)
    return torch.stack(products)


def composite_gain(layers: Sequence[torch.Tensor] | torch.Tensor) -> Gain:
    """Amax gains of every running product: entry k is the gain of the first k + 1 layers composed."""
    return amax_gain(composite_product(layers))
