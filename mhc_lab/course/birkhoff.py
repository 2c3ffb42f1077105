"""Lab 03's measuring tools: distance to the Birkhoff polytope, permutation decompositions, Sinkhorn's error
by iteration, and the composite gain of unconstrained (HC) versus Sinkhorn-projected (mHC) lane mixing.

The Birkhoff polytope (mHC, arXiv 2512.24880, Eq. 6) is the set of doubly stochastic n x n matrices:
H >= 0, H 1 = 1 (rows sum to 1), 1^T H = 1^T (columns sum to 1).
"""

from __future__ import annotations

import itertools

import torch

from mhc_lab.reference import composite_gain, sinkhorn
from mhc_lab.reference.validate import InputError, require_positive_int, require_tensor

GAP_NAMES = ("negative entry", "row sum", "column sum")


def _square(name: str, h) -> torch.Tensor:
    require_tensor(name, h)
    if h.dim() < 2 or h.shape[-1] != h.shape[-2]:
        raise InputError(f"{name}: expected square matrices [..., n, n], got shape {tuple(h.shape)}")
    return h


def doubly_stochastic_gaps(h: torch.Tensor) -> torch.Tensor:
    """How far each matrix of h [..., n, n] is from the Birkhoff polytope, as three numbers [..., 3]:

    [..., 0]  max(0, -min_ij H_ij)        how far the most negative entry is below zero
    [..., 1]  max_i |sum_j H_ij - 1|       the worst row sum       (H 1 = 1,     forward gain)
    [..., 2]  max_j |sum_i H_ij - 1|       the worst column sum    (1^T H = 1^T, backward gain)
    """
    h = _square("h", h)
    negative = (-h.amin(dim=(-2, -1))).clamp(min=0)
    rows = (h.sum(dim=-1) - 1).abs().amax(dim=-1)
    columns = (h.sum(dim=-2) - 1).abs().amax(dim=-1)
    return torch.stack([negative, rows, columns], dim=-1)


def is_doubly_stochastic(h: torch.Tensor, tol: float = 1e-6) -> torch.Tensor:
    """True for every matrix of h [..., n, n] whose three gaps are all at most ``tol``."""
    return doubly_stochastic_gaps(h).amax(dim=-1) <= tol


def permutation_matrices(n: int, dtype=torch.float64) -> torch.Tensor:
    """All n! permutation matrices [n!, n, n] (row i has its 1 in column perm[i]); n <= 7."""
    require_positive_int("n", n)
    if n > 7:
        raise InputError(f"n: expected n <= 7 (n! matrices are listed), got {n}")
    perms = torch.tensor(list(itertools.permutations(range(n))))
    return torch.nn.functional.one_hot(perms, n).to(dtype)


def random_doubly_stochastic(n: int, count: int, *, terms: int = 5, seed: int = 0) -> torch.Tensor:
    """count random points of the polytope [count, n, n]: convex combinations of ``terms`` random
    permutation matrices with Dirichlet(1) weights (float64, exact up to rounding)."""
    require_positive_int("n", n)
    require_positive_int("count", count)
    require_positive_int("terms", terms)
    g = torch.Generator().manual_seed(seed)
    eye = torch.eye(n, dtype=torch.float64)
    perms = torch.stack([torch.stack([eye[torch.randperm(n, generator=g)] for _ in range(terms)])
                         for _ in range(count)])  # [count, terms, n, n]
    weights = -torch.log(torch.rand(count, terms, generator=g, dtype=torch.float64))
    weights = weights / weights.sum(dim=-1, keepdim=True)
    return torch.einsum("ct,ctij->cij", weights, perms)


def birkhoff_von_neumann(h: torch.Tensor, tol: float = 1e-9) -> list[tuple[float, tuple[int, ...]]]:
    """Write one doubly stochastic matrix h [n, n] as sum_k w_k P_k (Birkhoff-von Neumann), greedily.

    Each step picks the permutation whose smallest entry in the remainder is largest, takes that entry as
    its weight and subtracts it; this stops when no permutation has an entry above ``tol``. Returns
    [(weight, perm), ...] with perm[i] the column of row i. For n <= 7 (all n! permutations are tried).
    """
    h = _square("h", h)
    if h.dim() != 2:
        raise InputError(f"h: expected one matrix [n, n], got shape {tuple(h.shape)}")
    n = h.shape[-1]
    perms = permutation_matrices(n, torch.float64)
    index = perms.argmax(dim=-1)  # [n!, n]: column of row i
    rows = torch.arange(n)
    remainder = h.detach().to(torch.float64).clone()
    terms = []
    for _ in range(n * n):  # at most (n - 1)^2 + 1 terms are ever needed
        bottleneck = remainder[rows, index].amin(dim=-1)  # [n!]
        best = int(bottleneck.argmax())
        weight = float(bottleneck[best])
        if weight <= tol:
            break
        terms.append((weight, tuple(int(j) for j in index[best])))
        remainder[rows, index[best]] -= weight
    return terms


def sinkhorn_errors(logits: torch.Tensor, variant: str, max_iterations: int = 30) -> dict:
    """Worst row and column error of H_res = Sinkhorn(logits) over a batch, for 1..max_iterations
    iterations: {"iterations": [...], "row": [...], "column": [...]}."""
    require_positive_int("max_iterations", max_iterations)
    out = {"iterations": [], "row": [], "column": []}
    for t in range(1, max_iterations + 1):
        gaps = doubly_stochastic_gaps(sinkhorn(logits, variant=variant, iterations=t))
        out["iterations"].append(t)
        out["row"].append(gaps[..., 1].max().item())
        out["column"].append(gaps[..., 2].max().item())
    return out


def hc_and_mhc_matrices(n: int = 4, depth: int = 64, tokens: int = 256, *, hc_scale: float = 0.2,
                        logit_scale: float = 4.0, variant: str = "deepseek_v4", seed: int = 0):
    """One random draw Z [depth, tokens, n, n] (float64) used twice: HC's unconstrained H_res = I + hc_scale Z,
    and mHC's H_res = Sinkhorn(logit_scale Z). Returns (hc, mhc), each [depth, tokens, n, n]."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(depth, tokens, n, n, generator=g, dtype=torch.float64)
    hc = torch.eye(n, dtype=torch.float64) + hc_scale * z
    mhc = sinkhorn(logit_scale * z, variant=variant)
    return hc, mhc


def composite_gains(layers: torch.Tensor) -> dict:
    """Amax gains of the running products of layers [depth, tokens, n, n], per depth: the mean over tokens
    (as in the paper's Figs. 3 and 7) and the worst token. Lists of floats, depth 1..L."""
    gain = composite_gain(layers)
    return {
        "depth": list(range(1, layers.shape[0] + 1)),
        "forward": gain.forward.mean(dim=-1).tolist(),
        "backward": gain.backward.mean(dim=-1).tolist(),
        "forward_worst": gain.forward.amax(dim=-1).tolist(),
        "backward_worst": gain.backward.amax(dim=-1).tolist(),
    }


# ---- figures ----------------------------------------------------------------------------------------------


def matrix_heatmap(h: torch.Tensor, title: str = "", zmax: float | None = 1.0):
    """A heatmap of one n x n matrix with its entries written in the cells (row i = output lane i)."""
    import plotly.graph_objects as go

    values = h.detach().to(torch.float64).cpu()
    n = values.shape[-1]
    text = [[f"{v:.3f}" for v in row] for row in values.tolist()]
    fig = go.Figure(go.Heatmap(z=values.tolist(), x=[f"in {j}" for j in range(n)], y=[f"out {i}" for i in range(n)],
                               text=text, texttemplate="%{text}", colorscale="Blues", zmin=0, zmax=zmax))
    fig.update_yaxes(autorange="reversed")
    fig.update_layout(title=title, width=500, height=440, margin=dict(l=60, r=20, t=80, b=40))
    return fig


def sinkhorn_error_figure(curves: dict[str, dict], title: str = ""):
    """Row and column errors by iteration, one colour per variant (solid: rows, dashed: columns); log y."""
    import plotly.graph_objects as go

    colours = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd"]
    fig = go.Figure()
    floor = 1e-17  # an exact zero cannot be drawn on a log axis
    for k, (name, c) in enumerate(curves.items()):
        colour = colours[k % len(colours)]
        for side, dash in (("row", "solid"), ("column", "dash")):
            fig.add_scatter(x=c["iterations"], y=[max(v, floor) for v in c[side]], name=f"{name}: {side} error",
                            line=dict(color=colour, dash=dash))
    fig.update_yaxes(type="log", title="max |sum - 1| over the batch", exponentformat="power")
    fig.update_xaxes(title="Sinkhorn iterations t")
    fig.update_layout(title=title, height=430)
    return fig


def gain_figure(series: dict[str, dict], title: str = ""):
    """Composite Amax gain by depth, one colour per method (solid: forward, dashed: backward); log y."""
    import plotly.graph_objects as go

    colours = ["#d62728", "#1f77b4", "#2ca02c", "#ff7f0e"]
    fig = go.Figure()
    for k, (name, g) in enumerate(series.items()):
        colour = colours[k % len(colours)]
        fig.add_scatter(x=g["depth"], y=g["forward"], name=f"{name}: forward (rows)", line=dict(color=colour))
        fig.add_scatter(x=g["depth"], y=g["backward"], name=f"{name}: backward (columns)",
                        line=dict(color=colour, dash="dash"))
    fig.update_yaxes(type="log", title="composite Amax gain (mean over tokens)", exponentformat="power")
    fig.update_xaxes(title="depth (number of composed H_res)")
    fig.update_layout(title=title, height=430)
    return fig

