"""The naive layers lab 04 measures: a plain residual merge, one HC site and one mHC site (the reference
PyTorch code, layer function F = identity), ready to time, trace and profile, with their counted traffic.

"Site" means one connection around a layer: everything before F (coefficients, H_pre x) and after it
(H_res x + H_post^T F), with F itself left out, as in mHC's Table 2.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from mhc_lab.measure import bytes_model
from mhc_lab.reference import HyperConnection, ManifoldHyperConnection

LAYERS = ("residual", "hc", "mhc")


def _identity(h: torch.Tensor) -> torch.Tensor:
    return h


@dataclass
class NaiveLayer:
    """A layer to measure: ``forward()`` runs it once (no autograd), ``forward_backward()`` runs it and its
    backward with a fixed upstream gradient. ``method`` names its row set in :mod:`bytes_model`."""

    name: str
    method: str
    n: int
    C: int
    tokens: int
    stream_dtype: torch.dtype
    forward: Callable[[], torch.Tensor]
    forward_backward: Callable[[], None]

    def counted_bytes(self, direction: str = "forward") -> int:
        """Bytes the bytes model counts for all tokens (lanes in the stream dtype, coefficients in float32)."""
        per_token = bytes_model.bytes_per_token(self.method, self.n, self.C, direction,
                                                stream_dtype=self.stream_dtype)
        return self.tokens * per_token

    def counted_flops(self, direction: str = "forward") -> int:
        return self.tokens * bytes_model.flops_per_token(self.method, self.n, self.C, direction)


def make_layer(name: str, tokens: int, n: int, C: int, device: torch.device | str = "cpu",
               dtype: torch.dtype = torch.float32, seed: int = 0) -> NaiveLayer:
    """One naive layer on random inputs: 'residual' (x + F(x) on [tokens, C], F's output given), 'hc' (a
    dynamic HyperConnection site) or 'mhc' (a ManifoldHyperConnection site) on lanes [tokens, n, C]."""
    if name not in LAYERS:
        raise ValueError(f"name: expected one of {LAYERS}, got {name!r}")
    device = torch.device(device)
    g = torch.Generator(device=device).manual_seed(seed)  # drawn where they are used: GPU-sized inputs are big

    def random(*shape):
        return torch.randn(*shape, generator=g, device=device, dtype=torch.float32).to(dtype)

    if name == "residual":
        x, f = random(tokens, C), random(tokens, C)
        x_grad = x.clone().requires_grad_(True)
        f_grad = f.clone().requires_grad_(True)
        upstream = random(tokens, C)

        def forward():
            with torch.no_grad():
                return x + f

        def forward_backward():
            x_grad.grad = f_grad.grad = None  # a fresh gradient each call, not an accumulation
            (x_grad + f_grad).backward(upstream)

        return NaiveLayer("residual merge", "residual", 1, C, tokens, dtype, forward, forward_backward)
    weights = torch.Generator().manual_seed(seed + 1)  # the site's own weights, without touching the global RNG
    if name == "hc":
        site = HyperConnection(n, C, dynamic=True)
        with torch.no_grad():  # small random dynamic weights, so the coefficients depend on the tokens
            for w in (site.w_m, site.w_r, site.w_beta):
                w.normal_(0.0, 0.02, generator=weights)
        label, method = "HC site", "hc"
    else:
        site = ManifoldHyperConnection(n, C)
        with torch.no_grad():
            site.phi.normal_(0.0, 0.02, generator=weights)
        label, method = "mHC site", "mhc"
    site = site.to(device)
    x = random(tokens, n, C)
    x_grad = x.clone().requires_grad_(True)
    upstream = random(tokens, n, C)

    def forward():
        with torch.no_grad():
            return site(x, _identity)

    def forward_backward():
        x_grad.grad = None
        site.zero_grad(set_to_none=True)
        site(x_grad, _identity).backward(upstream)

    return NaiveLayer(label, method, n, C, tokens, dtype, forward, forward_backward)


def make_layers(tokens: int, n: int, C: int, device: torch.device | str = "cpu",
                dtype: torch.dtype = torch.float32, seed: int = 0) -> dict[str, NaiveLayer]:
    """The three naive layers at one shape: {'residual', 'hc', 'mhc'}."""
    return {name: make_layer(name, tokens, n, C, device, dtype, seed) for name in LAYERS}
