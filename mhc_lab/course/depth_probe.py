"""Depth probes for lab 01: a stack of residual steps, its unrolled form, per-layer signal and gradient norms,
the scaled shortcut h(x) = λx, and the two-spirals task on which a plain and a residual stack are trained.

The equations are those of He et al., *Identity Mappings in Deep Residual Networks* (arXiv 1603.05027),
Eqs. 3-5 and Sec. 3.1, which the mHC paper (arXiv 2512.24880) restates as its Eqs. 1-2.
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple, Sequence

import torch
import torch.nn.functional as F

from mhc_lab.course.data import two_spirals
from mhc_lab.models import DeepStack
from mhc_lab.reference import residual_step
from mhc_lab.reference.validate import InputError, require_tensor

Layer = Callable[[torch.Tensor], torch.Tensor]


# ---- the math ------------------------------------------------------------------------------------------------


def residual_stack(x: torch.Tensor, layers: Sequence[Layer], shortcut_scale: float = 1.0) -> torch.Tensor:
    """Every state x_0 = x, x_1, ..., x_L of x_{i+1} = λ x_i + F_i(x_i), stacked into [L + 1, *x.shape].

    λ = 1 is the residual (ResNet-v2 Eq. 3, mHC Eq. 1); λ = 0 is a plain stack; other λ are the scaled
    shortcut h(x) = λx of ResNet-v2 Sec. 3.1.
    """
    require_tensor("x", x)
    states = [x]
    for layer in layers:
        h = states[-1]
        states.append(residual_step(h, layer) if shortcut_scale == 1.0 else shortcut_scale * h + layer(h))
    return torch.stack(states)


def unrolled_state(x_l: torch.Tensor, branch_outputs: torch.Tensor, shortcut_scale: float = 1.0) -> torch.Tensor:
    """x_L from x_l and the branch outputs F_i(x_i), i = l..L-1, given as [L - l, *x_l.shape].

    x_L = λ^(L-l) x_l + Σ_i λ^(L-1-i) F_i(x_i); at λ = 1 this is ResNet-v2 Eq. 4 (mHC Eq. 2):
    x_L = x_l + Σ_i F_i(x_i).
    """
    require_tensor("x_l", x_l)
    require_tensor("branch_outputs", branch_outputs)
    if branch_outputs.shape[1:] != x_l.shape:
        raise InputError(
            f"branch_outputs: expected shape [k, {', '.join(map(str, x_l.shape))}] (one F_i(x_i) per layer), "
            f"got {tuple(branch_outputs.shape)}"
        )
    k = branch_outputs.shape[0]
    # F_i(x_i) passes through the L-1-i shortcuts above layer i, so it is scaled by λ^(L-1-i).
    powers = torch.tensor([shortcut_scale ** (k - 1 - j) for j in range(k)], dtype=x_l.dtype, device=x_l.device)
    powers = powers.reshape(k, *([1] * x_l.dim()))
    return shortcut_scale**k * x_l + (powers * branch_outputs).sum(dim=0)


def residual_tanh_backward(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, grad_out: torch.Tensor
) -> torch.Tensor:
    """∂E/∂x for y = x + tanh(x Wᵀ + b), given ∂E/∂y: the identity's 1 plus the branch (ResNet-v2 Eq. 5).

    ∂E/∂x = ∂E/∂y + (∂E/∂y ⊙ (1 - tanh²(x Wᵀ + b))) W.
    """
    z = x @ weight.T + bias
    return grad_out + (grad_out * (1 - torch.tanh(z) ** 2)) @ weight


def shortcut_gain(scales: torch.Tensor) -> torch.Tensor:
    """Running products λ_1, λ_1 λ_2, ..., λ_1 ... λ_L: what the shortcuts alone do to a signal after k layers.

    The scalar version of the composite residual matrix Π H_res of Hyper-Connections (mHC Eq. 4).
    """
    require_tensor("scales", scales)
    if scales.dim() != 1 or scales.numel() == 0:
        raise InputError(f"scales: expected a non-empty 1-D tensor [L], got shape {tuple(scales.shape)}")
    return torch.cumprod(scales, dim=0)


# ---- models and measurements ----------------------------------------------------------------------------------


class ScaledShortcutStack(DeepStack):
    """A DeepStack whose shortcut is scaled: h <- λ h + tanh(W h + b). λ = 1: residual; λ = 0: plain."""

    def __init__(self, depth: int, width: int, shortcut_scale: float, inputs: int = 2, outputs: int = 2):
        super().__init__(depth, width, inputs=inputs, outputs=outputs, residual=True)
        self.shortcut_scale = float(shortcut_scale)

    def forward(self, x: torch.Tensor, keep: list | None = None) -> torch.Tensor:
        h = self.inp(x)
        for layer in self.layers:
            h = self.shortcut_scale * h + torch.tanh(layer(h))
            if keep is not None:
                h.retain_grad()
                keep.append(h)
        return self.out(h)


def seeded_stack(depth: int, width: int, shortcut_scale: float = 1.0, seed: int = 0) -> DeepStack:
    """A stack whose weights depend only on (depth, width, seed): equal seeds give equal weights for every λ.

    λ = 1 returns a residual DeepStack, λ = 0 a plain one, other λ a ScaledShortcutStack.
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if shortcut_scale == 1.0:
            return DeepStack(depth, width, residual=True)
        if shortcut_scale == 0.0:
            return DeepStack(depth, width, residual=False)
        return ScaledShortcutStack(depth, width, shortcut_scale)


def gradient_norms(model: DeepStack, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """||∂loss/∂h_l|| (Frobenius norm over the whole batch) for every layer output h_1..h_L.

    The loss is the mean cross-entropy of model(x) against y.
    """
    keep: list[torch.Tensor] = []
    loss = F.cross_entropy(model(x, keep=keep), y)
    grads = torch.autograd.grad(loss, keep)
    return torch.stack([g.norm() for g in grads])


class DepthProfile(NamedTuple):
    signal: torch.Tensor  # [L]: RMS of the entries of h_l, the typical size of one hidden value
    input_share: torch.Tensor  # [L]: RMS over features of h_l's spread across the batch, divided by signal
    gradient: torch.Tensor  # [L]: ||∂loss/∂h_l||, as in gradient_norms


def _rms(t: torch.Tensor) -> torch.Tensor:
    return t.pow(2).mean().sqrt()


def depth_profile(model: DeepStack, x: torch.Tensor, y: torch.Tensor) -> DepthProfile:
    """Forward signal, how much of it still depends on the input, and the gradient norm after every layer,
    from one forward and one backward pass over the batch (x, y)."""
    keep: list[torch.Tensor] = []
    loss = F.cross_entropy(model(x, keep=keep), y)
    grads = torch.autograd.grad(loss, keep)
    hidden = [h.detach() for h in keep]
    signal = torch.stack([_rms(h) for h in hidden])
    # The part of h_l that changes from one input to the next; near 0, the layer has forgotten its input.
    spread = torch.stack([_rms(h.std(dim=0, correction=0)) for h in hidden])
    return DepthProfile(signal, spread / signal, torch.stack([g.norm() for g in grads]))


# ---- the two-spirals task ---------------------------------------------------------------------------------------


class SpiralTask:
    """Two interleaved spirals: a fixed train set and a fixed validation set, and random training batches."""

    def __init__(self, train_points: int = 2000, val_points: int = 1000, batch_size: int = 128, seed: int = 0):
        self.x_train, self.y_train = two_spirals(train_points, seed=seed)
        self.x_val, self.y_val = two_spirals(val_points, seed=seed + 1)
        self.batch_size = batch_size

    def batch(self, generator: torch.Generator, split: str = "train"):
        """(inputs [B, 2], labels [B]); the signature training.train expects."""
        x, y = (self.x_train, self.y_train) if split == "train" else (self.x_val, self.y_val)
        index = torch.randint(0, len(x), (self.batch_size,), generator=generator)
        return x[index], y[index]


@torch.no_grad()
def accuracy(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    device = next(model.parameters()).device
    return (model(x.to(device)).argmax(dim=-1).cpu() == y).double().mean().item()


# ---- figures ----------------------------------------------------------------------------------------------------


def _positive(values: torch.Tensor) -> list:
    """Values for a log axis, to 4 digits: zeros (an underflowed gradient) become gaps instead of breaking the axis."""
    return [float(f"{v:.4g}") if v > 0 and math.isfinite(v) else None for v in values.double().tolist()]


def profile_figure(profiles: dict, title: str = "Signal and gradient by depth", guides: dict | None = None):
    """Three panels, log y, one line per named DepthProfile: the RMS signal, the share of it that depends on the
    input, and the gradient norm, after each layer.

    ``guides`` maps a name to a [L] tensor drawn dashed on the gradient panel (a prediction to compare with).
    """
    from plotly.subplots import make_subplots

    panels = ("forward: RMS of h_l", "forward: input-dependent share of h_l", "backward: ||dloss/dh_l||")
    fig = make_subplots(rows=1, cols=3, subplot_titles=panels, horizontal_spacing=0.07)
    colors = ["#d62728", "#1f77b4", "#2ca02c", "#9467bd", "#ff7f0e"]
    for k, (name, profile) in enumerate(profiles.items()):
        color = colors[k % len(colors)]
        layers = list(range(1, len(profile.signal) + 1))
        for col, values in enumerate((profile.signal, profile.input_share, profile.gradient), start=1):
            fig.add_scatter(x=layers, y=_positive(values), name=name, legendgroup=name, showlegend=col == 1,
                            line_color=color, row=1, col=col)
    for name, guide in (guides or {}).items():
        layers = list(range(1, len(guide) + 1))
        fig.add_scatter(x=layers, y=_positive(guide), name=name, line=dict(dash="dash", color="gray"),
                        row=1, col=3)
    fig.update_yaxes(type="log", exponentformat="power")
    fig.update_xaxes(title_text="layer l")
    fig.update_layout(title=title, height=400, margin=dict(t=80, b=90), legend=dict(orientation="h", y=-0.25))
    return fig


def loss_figure(histories: dict, title: str = "Training loss"):
    """Training loss (thin) and validation loss (markers) of each named run, side by side on one axis."""
    import plotly.graph_objects as go

    fig = go.Figure()
    colors = ["#d62728", "#1f77b4", "#2ca02c", "#9467bd"]
    for k, (name, history) in enumerate(histories.items()):
        color = colors[k % len(colors)]
        fig.add_scatter(x=history["step"], y=[round(v, 4) for v in history["loss"]], name=f"{name}: train",
                        line=dict(color=color, width=1), opacity=0.5)
        fig.add_scatter(x=history["eval_step"], y=[round(v, 4) for v in history["eval_loss"]],
                        name=f"{name}: validation", mode="lines+markers", line=dict(color=color, width=3))
    fig.add_hline(y=math.log(2), line_dash="dot", annotation_text="ln 2: guessing", line_color="gray")
    fig.update_layout(title=title, xaxis_title="step", yaxis_title="cross-entropy", height=380)
    return fig


def _rounded(values: torch.Tensor, decimals: int = 3) -> list:
    return torch.round(values.double(), decimals=decimals).tolist()


@torch.no_grad()
def decision_figure(models: dict, task: SpiralTask, resolution: int = 64):
    """What each named model predicts over the plane, with the validation points on top."""
    from plotly.subplots import make_subplots

    names = list(models)
    fig = make_subplots(rows=1, cols=len(names), subplot_titles=names, shared_yaxes=True)
    extent = float(task.x_val.abs().max()) * 1.05
    grid = torch.linspace(-extent, extent, resolution)
    gx, gy = torch.meshgrid(grid, grid, indexing="xy")
    points = torch.stack([gx.flatten(), gy.flatten()], dim=1)
    for k, name in enumerate(names):
        model = models[name]
        device = next(model.parameters()).device
        p = torch.softmax(model(points.to(device)), dim=-1)[:, 1].cpu().reshape(resolution, resolution)
        # Rounded: two decimals are plenty for a colour, and keep the stored notebook small.
        fig.add_heatmap(x=_rounded(grid), y=_rounded(grid), z=_rounded(p, 2), zmin=0, zmax=1, colorscale="RdBu",
                        showscale=k == len(names) - 1, row=1, col=k + 1)
        for label, color in ((0, "#08306b"), (1, "#67000d")):
            mask = task.y_val == label
            fig.add_scatter(x=_rounded(task.x_val[mask, 0]), y=_rounded(task.x_val[mask, 1]), mode="markers",
                            marker=dict(size=3, color=color), showlegend=False, row=1, col=k + 1)
    fig.update_layout(title="P(class 1) over the plane, validation points on top", height=420)
    return fig
