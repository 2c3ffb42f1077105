"""Hidden checks for lab 02 (used by `mhc-lab grade`, never shown in a lab): one lane and sixteen, width one,
batch dimensions, per-token coefficients, layer indices past n, float64 initialisation."""

import torch

from mhc_lab.course.checks import CheckFailed, TanhLayer, randn
from mhc_lab.classroom.hidden_checks import hidden, same_as_reference
from mhc_lab.reference.hyper_connections import collapse_lanes, expand_lanes, hc_apply, hc_static_init
from mhc_lab.reference.metrics import amax_gain, composite_product


@hidden("2.1", "one lane and sixteen, width one, batch dimensions")
def _expand_shapes(answer):
    return [same_as_reference(answer, expand_lanes, randn(*shape, seed=51), n, case=f"h of shape {shape}, n={n}")
            for shape, n in [((3, 1), 4), ((2, 3, 5), 1), ((7,), 16)]]


@hidden("2.2", "one lane and sixteen, width one, batch dimensions")
def _collapse_shapes(answer):
    return [same_as_reference(answer, collapse_lanes, randn(*shape, seed=52), case=f"x of shape {shape}")
            for shape in [(3, 1, 5), (2, 3, 16, 1), (16, 7)]]


@hidden("2.3", "one lane, eight lanes, per-token coefficients")
def _apply_shapes(answer):
    cases = []
    for n, batch in [(1, (3,)), (8, (2,)), (4, (2, 3))]:
        x = randn(*batch, n, 5, seed=53)
        weight = randn(5, 5, seed=54, scale=0.4)
        layer = TanhLayer(weight.T, torch.zeros(weight.shape[1], dtype=torch.float64))  # tanh(v @ weight)
        alpha_m, alpha_r, beta = randn(n, seed=55), randn(n, n, seed=56), randn(n, seed=57)
        cases.append(same_as_reference(answer, hc_apply, x, layer, alpha_m, alpha_r, beta,
                                       case=f"n={n}, lanes of shape {tuple(x.shape)}"))
    x = randn(2, 3, 4, 5, seed=58)
    per_token = (randn(2, 3, 4, seed=59), randn(2, 3, 4, 4, seed=60), randn(2, 3, 4, seed=61))
    cases.append(same_as_reference(answer, hc_apply, x, torch.sin, *per_token, case="per-token coefficients"))
    return cases


@hidden("2.4", "one lane, layer indices past n, float64")
def _init_edges(answer):
    cases = []
    for n, index, dtype in [(1, 0, torch.float32), (4, 9, torch.float32), (8, 3, torch.float64)]:
        case = f"n={n}, layer_index={index}, dtype={dtype}"
        got = answer(n, index, dtype=dtype)
        expected = hc_static_init(n, index, dtype=dtype)
        if not isinstance(got, (tuple, list)) or len(got) != 3:
            raise CheckFailed(f"{case}: expected (alpha_m, alpha_r, beta), got {type(got).__name__}")
        for label, g, e in zip(("alpha_m", "alpha_r", "beta"), got, expected):
            if not isinstance(g, torch.Tensor) or g.dtype != e.dtype or g.shape != e.shape or not torch.equal(g, e):
                raise CheckFailed(f"{case}: {label} should be {e.tolist()} ({e.dtype}), got "
                                  f"{g.tolist() if isinstance(g, torch.Tensor) else g!r}")
        cases.append(case)
    return cases


@hidden("2.6", "one lane, negative entries, batch dimensions")
def _gain_shapes(answer):
    return [same_as_reference(answer, amax_gain, h, case=case) for h, case in [
        (randn(1, 1, seed=62), "a 1 x 1 matrix"),
        (-randn(4, 4, seed=63).abs(), "all entries negative"),
        (randn(2, 3, 8, 8, seed=64), "a [2, 3] batch of 8 x 8 matrices"),
    ]]


@hidden("2.7", "one layer, a stacked tensor, batch dimensions")
def _product_shapes(answer):
    layers = randn(5, 3, 3, seed=65, scale=0.6)
    return [
        same_as_reference(answer, composite_product, [layers[0]], case="a single layer"),
        same_as_reference(answer, composite_product, layers, case="a stacked tensor [5, 3, 3]"),
        same_as_reference(answer, composite_product, list(randn(4, 2, 2, 2, seed=66)), case="a batch of 2 x 2"),
    ]
