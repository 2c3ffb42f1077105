"""Amax gain by depth: composite H_res of random or trained connections, averaged, and drawn on a log axis.

The math (amax_gain, composite_product, composite_gain) lives in mhc_lab.reference.metrics; this module
makes the inputs the labs measure (perturbed identities, the per-site H_res of a trained model) and the figure.

    layers = perturbed_identities(n=4, depth=64, scale=0.1)      # [64, samples, 4, 4]
    curve = gain_by_depth(layers)                                # Gain of [64] tensors, mean over samples
    gain_figure({"scale 0.1": curve}).show()
"""

from __future__ import annotations

from typing import Mapping

import torch

from mhc_lab.reference import amax_gain, composite_gain
from mhc_lab.reference.metrics import Gain
from mhc_lab.reference.validate import InputError, require_positive_int, require_tensor


def perturbed_identities(n: int, depth: int, scale: float, samples: int = 256, seed: int = 0,
                         dtype=torch.float64) -> torch.Tensor:
    """``depth`` layers of H_res = I + scale * G, G ~ N(0, 1) entrywise, ``samples`` independent stacks.

    Returns [depth, samples, n, n]. Stands in for HC's unconstrained H_res, which start at I (HC Eq. 14)
    and drift away from it in training.
    """
    require_positive_int("n", n)
    require_positive_int("depth", depth)
    require_positive_int("samples", samples)
    if not scale >= 0:
        raise InputError(f"scale: expected a number >= 0, got {scale!r}")
    g = torch.Generator().manual_seed(seed)
    noise = torch.randn(depth, samples, n, n, generator=g, dtype=torch.float64)
    return (torch.eye(n, dtype=torch.float64) + scale * noise).to(dtype)


def gain_by_depth(layers: torch.Tensor) -> Gain:
    """Amax gain of the composite of the first k layers, k = 1..L, averaged over every other dim.

    ``layers`` is [L, ..., n, n] in the order the layers are applied (e.g. [L, samples, n, n] or the
    per-token [L, B, T, n, n] of a trained model). The average over tokens is what mHC's Figs. 3 and 7 plot.
    """
    layers = require_tensor("layers", layers)
    if layers.dim() < 3:
        raise InputError(f"layers: expected [L, ..., n, n] with L >= 1, got shape {tuple(layers.shape)}")
    gain = composite_gain(layers.to(torch.float64))
    return Gain(gain.forward.flatten(1).mean(dim=1), gain.backward.flatten(1).mean(dim=1))


def single_gain(layers: torch.Tensor) -> Gain:
    """Amax gain of each layer on its own, averaged over every dim but the first: Gain of [L] tensors."""
    layers = require_tensor("layers", layers)
    if layers.dim() < 3:
        raise InputError(f"layers: expected [L, ..., n, n] with L >= 1, got shape {tuple(layers.shape)}")
    gain = amax_gain(layers.to(torch.float64))
    return Gain(gain.forward.flatten(1).mean(dim=1), gain.backward.flatten(1).mean(dim=1))


@torch.no_grad()
def site_matrices(model: torch.nn.Module, idx: torch.Tensor) -> torch.Tensor:
    """Every connection site's H_res for the tokens ``idx`` [B, T]: [sites, B, T, n, n] in float64.

    ``model`` is a mhc_lab.models.TinyLM with connection "hc" or "mhc" (its forward collects them).
    """
    was_training = model.training
    model.eval()
    matrices: list[torch.Tensor] = []
    model(idx, residual_matrices=matrices)
    model.train(was_training)
    if not matrices:
        raise InputError("model: expected a TinyLM with connection 'hc' or 'mhc'; it collected no H_res")
    return torch.stack(matrices).to(torch.float64)


def repeat_to_depth(layers: torch.Tensor, depth: int) -> torch.Tensor:
    """Cycle the L layers [L, ..., n, n] to ``depth`` layers: what a deeper stack of such layers would compose."""
    require_positive_int("depth", depth)
    layers = require_tensor("layers", layers)
    index = torch.arange(depth) % layers.shape[0]
    return layers[index]


def gain_figure(curves: Mapping[str, Gain | torch.Tensor], title: str = "Composite Amax gain by depth",
                backward: bool = False, height: int = 420):
    """Plotly figure: gain against depth (1..L) on a log y axis, one line per curve; the gain-1 line dotted.

    Each curve is a Gain (its forward gain is drawn, and its backward gain dashed when ``backward``) or a
    plain tensor [L].
    """
    import plotly.graph_objects as go

    fig = go.Figure()
    palette = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f"]
    longest = 1
    for k, (label, curve) in enumerate(curves.items()):
        color = palette[k % len(palette)]
        forward = curve.forward if isinstance(curve, Gain) else curve
        depth = list(range(1, len(forward) + 1))
        longest = max(longest, len(depth))
        fig.add_trace(go.Scatter(x=depth, y=forward.tolist(), mode="lines", name=label,
                                 line=dict(color=color)))
        if backward and isinstance(curve, Gain):
            fig.add_trace(go.Scatter(x=depth, y=curve.backward.tolist(), mode="lines",
                                     name=f"{label} (backward)", line=dict(color=color, dash="dash")))
    fig.add_trace(go.Scatter(x=[1, longest], y=[1, 1], mode="lines", name="gain 1 (identity)",
                             line=dict(color="black", dash="dot", width=1)))
    fig.update_xaxes(title="depth (layers composed)")
    fig.update_yaxes(type="log", title="Amax gain (max abs row sum" + (" / column sum)" if backward else ")"))
    fig.update_layout(title=title, height=height, legend=dict(font=dict(size=10)))
    return fig
