"""The ResNet residual: x_{l+1} = x_l + F(x_l) (He et al., arXiv 1603.05027, Eq. 3; mHC Eq. 1)."""

from __future__ import annotations

from typing import Callable

import torch

from mhc_lab.reference.validate import InputError, require_tensor


def residual_step(x: torch.Tensor, layer: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """One residual layer: the identity path plus the layer's output (Eq. 1)."""
    require_tensor("x", x)
    y = layer(x)
    if not isinstance(y, torch.Tensor) or y.shape != x.shape:
        got = tuple(y.shape) if isinstance(y, torch.Tensor) else type(y).__name__
        raise InputError(f"layer(x): expected an output of the input's shape {tuple(x.shape)}, got {got}")
    return x + y
