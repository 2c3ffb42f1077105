"""Lab 02 exercises: Hyper-Connections (lanes, one HC layer, its initialisation, dynamic coefficients, gains)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mhc_lab.course.checks import CheckFailed, Mistake, TanhLayer, assert_close, call, randn, register
from mhc_lab.reference import (
    amax_gain,
    collapse_lanes,
    composite_product,
    expand_lanes,
    hc_apply,
    hc_dynamic_coefficients,
    hc_static_init,
)

LANES = (1, 2, 4, 8)


def _layer(C: int, seed: int):
    """A fixed nonlinear layer F: [..., C] -> [..., C] in float64 (tanh of a random affine map)."""
    w = randn(C, C, seed=seed, scale=C**-0.5)
    b = randn(C, seed=seed + 1, scale=0.1)
    return TanhLayer(w, b)


def _tuple_of(got, count: int, case: str, names: str):
    if not isinstance(got, (tuple, list)) or len(got) != count:
        kind = type(got).__name__
        size = f" of length {len(got)}" if isinstance(got, (tuple, list)) else ""
        raise CheckFailed(f"{case}: expected a tuple of {count} tensors ({names}), got a {kind}{size}")
    return tuple(got)


# ---- 2.1 expand ------------------------------------------------------------------------------------------


def _expand_in_c(h, n):
    return h.repeat(*([1] * (h.dim() - 1)), n)


def _expand_lanes_first(h, n):
    return h.unsqueeze(0).expand(n, *h.shape).contiguous()


def _expand_divided(h, n):
    return h.unsqueeze(-2).expand(*h.shape[:-1], n, h.shape[-1]) / n


_EXPAND_MISTAKES = {
    "you repeated h along C, which makes one wide vector [..., n*C]; the lanes are a new dim -2, [..., n, C]":
        _expand_in_c,
    "you put the lanes first ([n, ..., C]); the layout is [..., n, C], lanes in dim -2 next to C":
        _expand_lanes_first,
    "you divided the copies by n; HC copies h unchanged into every lane (the sum at the end is n*h, and the "
    "final norm removes the factor)": _expand_divided,
}


@register(
    "2.1", "expand a hidden state into n lanes",
    hints=[
        "Every lane is a copy of h: lane i of the result is h itself.",
        "Add a lane dim just before C with h.unsqueeze(-2), then repeat it n times along that dim.",
        "h.unsqueeze(-2).expand(*h.shape[:-1], n, h.shape[-1]) (add .contiguous() for a real copy).",
    ],
    library="mhc_lab.reference.hyper_connections.expand_lanes",
    mistakes=[
        Mistake(_expand_in_c, "[..., n*C]"),
        Mistake(_expand_lanes_first, "lanes first"),
        Mistake(_expand_divided, "divided the copies by n"),
    ],
)
def _check_expand(answer):
    cases = []
    shapes = [(7,), (3, 33), (2, 5, 1), (2, 3, 64)]
    for k, (shape, n) in enumerate([(s, n) for s in shapes for n in LANES]):
        case = f"h of shape {shape}, n={n}"
        h = randn(*shape, seed=100 + k)
        got = call(answer, h.clone(), n, case=case)
        wrong = {text: fn(h, n) for text, fn in _EXPAND_MISTAKES.items()}
        assert_close(got, expand_lanes(h, n), case=case, name="the lane tensor", mistakes=wrong)
        cases.append(case)
    return cases


# ---- 2.2 collapse ----------------------------------------------------------------------------------------


_COLLAPSE_MISTAKES = {
    "you averaged the lanes; HC sums them (Algorithm 1), and the final norm takes care of the scale":
        lambda x: x.mean(dim=-2),
    "you summed over C (dim -1); the lanes are dim -2": lambda x: x.sum(dim=-1),
    "you kept only lane 0; the output is the sum of all n lanes": lambda x: x[..., 0, :],
}


@register(
    "2.2", "collapse the lanes",
    hints=[
        "The n lanes sit in dim -2 of [..., n, C]; the result has shape [..., C].",
        "HC sums the lanes (it does not average them).",
        "x.sum(dim=-2).",
    ],
    library="mhc_lab.reference.hyper_connections.collapse_lanes",
    mistakes=[
        Mistake(lambda x: x.mean(dim=-2), "averaged"),
        Mistake(lambda x: x.sum(dim=-1), "summed over C"),
        Mistake(lambda x: x[..., 0, :], "only lane 0"),
    ],
)
def _check_collapse(answer):
    cases = []
    shapes = [(7,), (3, 33), (2, 5, 1), (2, 3, 64)]
    for k, (shape, n) in enumerate([(s, n) for s in shapes for n in LANES]):
        *lead, C = shape
        case = f"x of shape {(*lead, n, C)}"
        x = randn(*lead, n, C, seed=200 + k)
        got = call(answer, x.clone(), case=case)
        wrong = {text: fn(x) for text, fn in _COLLAPSE_MISTAKES.items()}
        assert_close(got, collapse_lanes(x), case=case, name="the collapsed state", mistakes=wrong)
        cases.append(case)
    return cases


# ---- 2.3 one static HC layer -----------------------------------------------------------------------------


def _hc_no_transpose(x, layer, alpha_m, alpha_r, beta):
    h0 = torch.einsum("...i,...ic->...c", alpha_m, x)
    return beta.unsqueeze(-1) * layer(h0).unsqueeze(-2) + torch.einsum("...ij,...jc->...ic", alpha_r, x)


def _hc_no_beta(x, layer, alpha_m, alpha_r, beta):
    h0 = torch.einsum("...i,...ic->...c", alpha_m, x)
    return layer(h0).unsqueeze(-2) + torch.einsum("...ij,...ic->...jc", alpha_r, x)


def _hc_no_remix(x, layer, alpha_m, alpha_r, beta):
    h0 = torch.einsum("...i,...ic->...c", alpha_m, x)
    return beta.unsqueeze(-1) * layer(h0).unsqueeze(-2) + x


def _hc_mean_input(x, layer, alpha_m, alpha_r, beta):
    h0 = x.mean(dim=-2)
    return beta.unsqueeze(-1) * layer(h0).unsqueeze(-2) + torch.einsum("...ij,...ic->...jc", alpha_r, x)


_HC_MISTAKES = {
    "you mixed the lanes with A_r instead of its transpose: new lane j is sum_i alpha_r[i, j] x_i "
    "(H_res = A_r^T)": _hc_no_transpose,
    "you added F(h0) to every lane without the weights beta (Eq. 5: beta_j F(h0))": _hc_no_beta,
    "you added F(h0) to the unmixed lanes; the lanes are first remixed by A_r^T (Eq. 4)": _hc_no_remix,
    "you fed the layer the mean of the lanes; its input is the alpha_m-weighted sum (Eq. 2)": _hc_mean_input,
}


@register(
    "2.3", "one static HC layer",
    hints=[
        "Three steps: the layer's input h0 = sum_i alpha_m[i] x_i (shape [..., C]); y = layer(h0); "
        "the remixed lanes x'_j = sum_i alpha_r[i, j] x_i; then out_j = beta_j y + x'_j.",
        "torch.einsum keeps the indices honest: '...i,...ic->...c' for h0 and '...ij,...ic->...jc' for the remix.",
        "Broadcast beta over C with beta.unsqueeze(-1), and y over the lanes with y.unsqueeze(-2).",
    ],
    library="mhc_lab.reference.hyper_connections.hc_apply",
    mistakes=[
        Mistake(_hc_no_transpose, "instead of its transpose"),
        Mistake(_hc_no_beta, "without the weights beta"),
        Mistake(_hc_no_remix, "unmixed lanes"),
        Mistake(_hc_mean_input, "mean of the lanes"),
    ],
)
def _check_hc_apply(answer):
    cases = []
    grid = [((), 7), ((3,), 33), ((2, 5), 1), ((2, 3), 16)]
    for k, ((lead, C), n) in enumerate([(g, n) for g in grid for n in LANES]):
        case = f"x of shape {(*lead, n, C)}"
        x = randn(*lead, n, C, seed=300 + k)
        alpha_m = randn(n, seed=310 + k)
        alpha_r = torch.eye(n, dtype=torch.float64) + randn(n, n, seed=320 + k, scale=0.5)
        beta = 1 + randn(n, seed=330 + k, scale=0.5)
        layer = _layer(C, seed=340 + k)
        args = (x, layer, alpha_m, alpha_r, beta)
        got = call(answer, x.clone(), layer, alpha_m.clone(), alpha_r.clone(), beta.clone(), case=case)
        wrong = {text: fn(*args) for text, fn in _HC_MISTAKES.items()}
        assert_close(got, hc_apply(*args), case=case, name="the output", mistakes=wrong)
        cases.append(case)
    return cases


# ---- 2.4 the initialisation of Eq. 14 --------------------------------------------------------------------


def _init_all_lanes(n, layer_index=0, dtype=torch.float32):
    return torch.ones(n, dtype=dtype), torch.eye(n, dtype=dtype), torch.ones(n, dtype=dtype)


def _init_uniform(n, layer_index=0, dtype=torch.float32):
    return torch.full((n,), 1.0 / n, dtype=dtype), torch.eye(n, dtype=dtype), torch.ones(n, dtype=dtype)


def _init_no_rotation(n, layer_index=0, dtype=torch.float32):
    return hc_static_init(n, 0, dtype)


def _init_zero_remix(n, layer_index=0, dtype=torch.float32):
    alpha_m, _, beta = hc_static_init(n, layer_index, dtype)
    return alpha_m, torch.zeros(n, n, dtype=dtype), beta


@register(
    "2.4", "the initialisation of Eq. 14",
    hints=[
        "Eq. 14: B = 1 (a row of ones), A_m = e_{k mod n} (layer k reads exactly one lane), A_r = I_n.",
        "alpha_m is zeros except a 1 at index layer_index % n; alpha_r is torch.eye(n); beta is torch.ones(n).",
        "Create all three with dtype=dtype and return them as a tuple (alpha_m, alpha_r, beta).",
    ],
    library="mhc_lab.reference.hyper_connections.hc_static_init",
    mistakes=[
        Mistake(_init_all_lanes, "reads every lane"),
        Mistake(_init_uniform, "average of the lanes"),
        Mistake(_init_no_rotation, "layer_index % n"),
        Mistake(_init_zero_remix, "identity"),
    ],
)
def _check_init(answer):
    wrong_fns = {
        "your layer reads every lane (alpha_m = 1); at init layer k reads one lane, e_{k mod n}, so that HC "
        "equals a Pre-Norm residual": _init_all_lanes,
        "your alpha_m takes the average of the lanes (1/n each); Eq. 14 reads one lane, e_{k mod n}": _init_uniform,
        "every layer reads lane 0; the lane read rotates with the layer: index layer_index % n": _init_no_rotation,
        "your alpha_r is zero, which drops the lanes; it starts as the identity, so every lane carries its "
        "state on (the residual's identity path)": _init_zero_remix,
    }
    cases = []
    grid = [(1, 0), (1, 3), (2, 0), (2, 1), (2, 5), (4, 0), (4, 1), (4, 6), (8, 3), (8, 13)]
    for n, k in grid:
        for dtype in (torch.float32, torch.float64) if n in (2, 8) else (torch.float32,):
            case = f"n={n}, layer_index={k}, dtype={dtype}"
            got = _tuple_of(call(answer, n, k, dtype=dtype, case=case), 3, case, "alpha_m, alpha_r, beta")
            expected = hc_static_init(n, k, dtype)
            wrong = [fn(n, k, dtype) for fn in wrong_fns.values()]
            for index, name in enumerate(("alpha_m", "alpha_r", "beta")):
                mistakes = {text: w[index] for text, w in zip(wrong_fns, wrong)}
                assert_close(got[index], expected[index], case=case, name=name, mistakes=mistakes)
            cases.append(case)
    return cases


# ---- 2.5 dynamic coefficients ----------------------------------------------------------------------------


def _dyn(x, static, w_m, w_r, w_beta, s_alpha, s_beta, norm=None, act=torch.tanh, transpose=False):
    alpha_m0, alpha_r0, beta0 = static
    C = x.shape[-1]
    x_bar = norm(x) if norm is not None else F.layer_norm(x, (C,), eps=1e-5)
    beta = s_beta * act(x_bar @ w_beta) + beta0
    alpha_m = s_alpha * act(x_bar @ w_m) + alpha_m0
    mix = act(x_bar @ w_r)
    alpha_r = s_alpha * (mix.transpose(-1, -2) if transpose else mix) + alpha_r0
    return alpha_m, alpha_r, beta


def _dyn_no_tanh(*args):
    return _dyn(*args, act=lambda t: t)


def _dyn_no_norm(*args):
    return _dyn(*args, norm=lambda x: x)


def _dyn_rms(*args):
    return _dyn(*args, norm=lambda x: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5))


def _dyn_swapped_scales(x, static, w_m, w_r, w_beta, s_alpha, s_beta):
    return _dyn(x, static, w_m, w_r, w_beta, s_beta, s_alpha)


def _dyn_transposed(*args):
    return _dyn(*args, transpose=True)


_DYN_MISTAKES = {
    "you left out the tanh (Eqs. 11-13: s * tanh(x_bar W) + static)": _dyn_no_tanh,
    "you did not normalise the lanes first; x_bar = LayerNorm(x) over C, per lane (Eq. 10)": _dyn_no_norm,
    "you normalised with RMSNorm; HC's Algorithm 2 uses a LayerNorm (subtract the mean, divide by the std, "
    "no affine weights): F.layer_norm(x, (C,))": _dyn_rms,
    "you swapped the scales: s_alpha goes with alpha_m and alpha_r, s_beta with beta": _dyn_swapped_scales,
    "your alpha_r is transposed: row i of alpha_r comes from lane i (x_bar @ w_r is already [..., n, n] "
    "with that orientation)": _dyn_transposed,
}


@register(
    "2.5", "dynamic HC coefficients",
    hints=[
        "Normalise every lane over C first: x_bar = F.layer_norm(x, (C,), eps=1e-5), shape [..., n, C].",
        "x_bar @ w_m and x_bar @ w_beta give one number per lane ([..., n]); x_bar @ w_r gives [..., n, n], "
        "row i from lane i.",
        "Each coefficient is scale * tanh(projection) + its static part: s_alpha for alpha_m and alpha_r, "
        "s_beta for beta.",
    ],
    library="mhc_lab.reference.hyper_connections.hc_dynamic_coefficients",
    mistakes=[
        Mistake(_dyn_no_tanh, "tanh"),
        Mistake(_dyn_no_norm, "did not normalise"),
        Mistake(_dyn_rms, "RMSNorm"),
        Mistake(_dyn_swapped_scales, "swapped the scales"),
        Mistake(_dyn_transposed, "transposed"),
    ],
)
def _check_dynamic(answer):
    cases = []
    grid = [((2, 3), 7), ((5,), 33), ((2, 2), 64), ((3,), 1)]
    for k, ((lead, C), n) in enumerate([(g, n) for g in grid for n in LANES]):
        dtype = torch.float32 if k == 5 else torch.float64
        case = f"x of shape {(*lead, n, C)}, dtype {dtype}"
        x = randn(*lead, n, C, seed=500 + k, scale=2.0) + randn(*lead, n, 1, seed=501 + k)
        alpha_m0, alpha_r0, beta0 = (t.double() for t in hc_static_init(n, k))
        static = (alpha_m0 + randn(n, seed=502 + k, scale=0.1), alpha_r0 + randn(n, n, seed=503 + k, scale=0.1),
                  beta0 + randn(n, seed=504 + k, scale=0.1))
        w_m, w_r, w_beta = randn(C, seed=505 + k), randn(C, n, seed=506 + k), randn(C, seed=507 + k)
        w_m, w_r, w_beta = (w * C**-0.5 for w in (w_m, w_r, w_beta))
        s_alpha, s_beta = 0.3, 0.7
        args = (x, static, w_m, w_r, w_beta, s_alpha, s_beta)
        expected = [t.to(dtype) for t in hc_dynamic_coefficients(*args)]
        wrong = {text: fn(*args) for text, fn in _DYN_MISTAKES.items()}
        given = [t.to(dtype) for t in (x, *static, w_m, w_r, w_beta)]
        got = call(answer, given[0], tuple(given[1:4]), *given[4:], s_alpha, s_beta, case=case)
        got = _tuple_of(got, 3, case, "alpha_m, alpha_r, beta")
        for index, name in enumerate(("alpha_m", "alpha_r", "beta")):
            mistakes = {text: w[index] for text, w in wrong.items()}
            assert_close(got[index], expected[index], case=case, name=name, mistakes=mistakes)
        cases.append(case)
    return cases


# ---- 2.6 Amax gain ---------------------------------------------------------------------------------------


def _gain_swapped(h):
    g = amax_gain(h)
    return g.backward, g.forward


def _gain_signed(h):
    return h.sum(dim=-1).amax(dim=-1), h.sum(dim=-2).amax(dim=-1)


def _gain_entry(h):
    m = h.abs().amax(dim=(-1, -2))
    return m, m


def _gain_whole_batch(h):
    a = h.abs()
    return a.sum(dim=-1).amax(), a.sum(dim=-2).amax()


_GAIN_MISTAKES = {
    "you swapped the two: forward = largest absolute ROW sum (x -> H x sums along a row), backward = largest "
    "absolute COLUMN sum": _gain_swapped,
    "you summed signed entries; the gain uses absolute values, |H_ij|, so that cancelling entries still count":
        _gain_signed,
    "you took the largest single entry; the gain is the largest row (or column) SUM of absolute values":
        _gain_entry,
    "you took one maximum over the whole batch; return one gain for every matrix in [..., n, n]":
        _gain_whole_batch,
}


@register(
    "2.6", "Amax gain of H_res",
    hints=[
        "Take absolute values first: a = h.abs().",
        "A row sum is a.sum(dim=-1), a column sum a.sum(dim=-2); each has shape [..., n].",
        "forward = a.sum(dim=-1).amax(dim=-1), backward = a.sum(dim=-2).amax(dim=-1); return them as a tuple.",
    ],
    library="mhc_lab.reference.metrics.amax_gain",
    mistakes=[
        Mistake(_gain_swapped, "swapped"),
        Mistake(_gain_signed, "signed"),
        Mistake(_gain_entry, "largest single entry"),
        Mistake(_gain_whole_batch, "whole batch"),
    ],
)
def _check_gain(answer):
    cases = []
    leads = [(), (3,), (2, 5)]
    for k, (lead, n) in enumerate([(lead, n) for lead in leads for n in LANES]):
        case = f"H of shape {(*lead, n, n)}"
        h = torch.eye(n, dtype=torch.float64) + randn(*lead, n, n, seed=600 + k, scale=0.7)
        got = _tuple_of(call(answer, h.clone(), case=case), 2, case, "forward, backward")
        expected = amax_gain(h)
        wrong = [fn(h) for fn in _GAIN_MISTAKES.values()]
        for index, name in enumerate(("the forward gain", "the backward gain")):
            mistakes = {text: w[index] for text, w in zip(_GAIN_MISTAKES, wrong)}
            assert_close(got[index], expected[index], case=case, name=name, mistakes=mistakes)
        cases.append(case)
    return cases


# ---- 2.7 composite product -------------------------------------------------------------------------------


def _product_wrong_order(layers):
    out, running = [], None
    for h in layers:
        running = h if running is None else running @ h
        out.append(running)
    return torch.stack(out)


def _product_last_only(layers):
    return composite_product(layers)[-1]


def _product_with_identity(layers):
    eye = torch.eye(layers[0].shape[-1], dtype=layers[0].dtype).expand_as(layers[0])
    return torch.cat([eye.unsqueeze(0), composite_product(layers)])


_PRODUCT_MISTAKES = {
    "you multiplied in the wrong order: the newest layer acts last, so P_k = H_k @ P_(k-1) (mHC Eq. 4: "
    "H_(L-1) ... H_(l+1) H_l)": _product_wrong_order,
    "you returned only the final product; return every running product P_1..P_L, stacked": _product_last_only,
    "you included the empty product I at the front; P_1 is H_1 itself": _product_with_identity,
}


@register(
    "2.7", "composite product of H_res",
    hints=[
        "Keep a running product: P_1 = H_1, then P_k = H_k @ P_(k-1).",
        "The newest layer multiplies from the LEFT: x after k layers is H_k ... H_2 H_1 x.",
        "Collect every P_k in a list and return torch.stack(list): shape [L, ..., n, n].",
    ],
    library="mhc_lab.reference.metrics.composite_product",
    mistakes=[
        Mistake(_product_wrong_order, "wrong order"),
        Mistake(_product_last_only, "only the final product"),
        Mistake(_product_with_identity, "empty product"),
    ],
)
def _check_product(answer):
    cases = []
    grid = [(1, ()), (3, ()), (10, (2,)), (6, (3, 2))]
    for k, ((L, lead), n) in enumerate([(g, n) for g in grid for n in LANES]):
        case = f"{L} layers of shape {(*lead, n, n)}"
        layers = [torch.eye(n, dtype=torch.float64) + randn(*lead, n, n, seed=700 + 16 * k + i, scale=0.4)
                  for i in range(L)]
        got = call(answer, [h.clone() for h in layers], case=case)
        wrong = {text: fn(layers) for text, fn in _PRODUCT_MISTAKES.items()}
        assert_close(got, composite_product(layers), case=case, name="the stack of products", mistakes=wrong)
        cases.append(case)
    return cases
