"""Lab 07 exercises: the backward of one mHC site, derived by hand. The post backward, one Sinkhorn
normalisation step backward, the whole Sinkhorn backward by recomputation, the RMS scale backward, and Eq. 20's
recompute memory.

Every tensor check runs in float64 on seeded random inputs and random upstream gradients (never all-ones), for
n = 1, 2, 4, 8 lanes and awkward widths, against mhc_lab.reference.backward (tested against autograd) or the
course library (mhc_lab.course.training_lab, mhc_lab.reference.recompute).
"""

from __future__ import annotations

import math

import torch

from mhc_lab.course.checks import CheckFailed, Mistake, assert_close, call, expect_number, randn, register
from mhc_lab.reference.recompute import recompute_memory
from mhc_lab.course.training_lab import norm_scale_backward, normalize_step_backward
from mhc_lab.reference import sinkhorn
from mhc_lab.reference.backward import post_backward, sinkhorn_backward


def _as_tuple(got, count: int, case: str, names: tuple[str, ...]):
    if not isinstance(got, (tuple, list)) or len(got) != count:
        raise CheckFailed(f"{case}: expected a tuple of {count} tensors ({', '.join(names)}), "
                          f"got {type(got).__name__}" + (f" of length {len(got)}" if isinstance(got, (tuple, list))
                                                          else ""))
    return got


# ---- 7.1 the post backward ------------------------------------------------------------------------------------

_POST_NAMES = ("dx", "dlayer_output", "dpost", "dres")
_POST_CASES = [((5,), 4, 33), ((1,), 1, 7), ((2, 3), 2, 1), ((7,), 8, 9), ((3,), 4, 64)]
_NO_TRANSPOSE = ("forgetting the transpose of H_res in dx. Lane j of x fed every output lane i with weight "
                 "H_res[i, j], so its gradient gathers from all of them: dx_j = sum_i H_res[i, j] g_i, that is "
                 "H_res^T g (you computed H_res g).")
_DRES_TRANSPOSED = ("dH_res transposed. dH_res[i, j] = <g_i, x_j>: the first index is the lane written (g_i), "
                    "the second the lane read (x_j).")
_DF_UNWEIGHTED = ("the lanes' gradients were summed without H_post: f reaches lane i with weight H_post[i], so "
                  "df = sum_i H_post[i] g_i.")
_DPOST_AXIS = ("summing over the wrong axis: dH_post[i] = <g_i, f> is a sum over the width C (one number per "
               "lane), not over the lanes.")


def _post_inputs(lead, n, C, seed):
    x = randn(*lead, n, C, seed=seed)
    f = randn(*lead, C, seed=seed + 1)
    post = 2 * torch.sigmoid(randn(*lead, n, seed=seed + 2))
    res = sinkhorn(randn(*lead, n, n, seed=seed + 3, scale=2.0))  # doubly stochastic, not symmetric
    g = randn(*lead, n, C, seed=seed + 4)
    return x, f, post, res, g


def _post_wrong(kind: str):
    def wrong(x, layer_output, post, res, grad_out):
        dx, df, dpost, dres = post_backward(x, layer_output, post, res, grad_out)
        g = grad_out
        if kind == "no_transpose":
            dx = torch.einsum("...ij,...jc->...ic", res, g)
        elif kind == "dres_transposed":
            dres = dres.transpose(-1, -2)
        elif kind == "df_unweighted":
            df = g.sum(dim=-2)
        elif kind == "dpost_axis":
            dpost = (g * layer_output.unsqueeze(-2)).sum(dim=-2)
        return dx, df, dpost, dres

    wrong.__name__ = f"post_backward_{kind}"
    return wrong


@register(
    "7.1", "the post backward",
    hints=[
        "out_i = sum_j H_res[i, j] x_j + H_post[i] f. Differentiate with respect to each input, with g_i = dL/dout_i "
        "[..., n, C]. Every product of a coefficient and a C-wide vector gives the coefficient a gradient that is a "
        "dot product over C, and the vector a gradient that is the coefficient times g.",
        "dx_j = sum_i H_res[i, j] g_i (H_res transposed); df = sum_i H_post[i] g_i; dH_post[i] = <g_i, f>; "
        "dH_res[i, j] = <g_i, x_j>, where <., .> sums over the width C. torch.einsum writes each in one line.",
        "dx = einsum('...ij,...ic->...jc', res, g); df = einsum('...i,...ic->...c', post, g); "
        "dpost = einsum('...ic,...c->...i', g, f); dres = einsum('...ic,...jc->...ij', g, x)",
    ],
    library="mhc_lab.reference.backward.post_backward",
    mistakes=[
        Mistake(_post_wrong("no_transpose"), "forgetting the transpose of H_res in dx"),
        Mistake(_post_wrong("dres_transposed"), "dH_res transposed"),
        Mistake(_post_wrong("df_unweighted"), "without H_post"),
        Mistake(_post_wrong("dpost_axis"), "summing over the wrong axis"),
    ],
)
def _check_post_backward(answer):
    cases = []
    for k, (lead, n, C) in enumerate(_POST_CASES):
        case = f"x of shape {(*lead, n, C)}"
        x, f, post, res, g = _post_inputs(lead, n, C, seed=7100 + 10 * k)
        got = _as_tuple(call(answer, x, f, post, res, g, case=case), 4, case, _POST_NAMES)
        want = post_backward(x, f, post, res, g)
        wrong = {kind: _post_wrong(kind)(x, f, post, res, g) for kind in
                 ("no_transpose", "dres_transposed", "df_unweighted", "dpost_axis")}
        mistakes = [
            {_NO_TRANSPOSE: wrong["no_transpose"][0]},
            {_DF_UNWEIGHTED: wrong["df_unweighted"][1]},
            {_DPOST_AXIS: wrong["dpost_axis"][2]},
            {_DRES_TRANSPOSED: wrong["dres_transposed"][3]},
        ]
        for index, name in enumerate(_POST_NAMES):
            assert_close(got[index], want[index], case=case, name=name, mistakes=mistakes[index])
        cases.append(case)
    return cases


# ---- 7.2 one normalisation step, backward ---------------------------------------------------------------------

# a large eps first: a dropped eps then fails where the difference shows, and is named
_STEP_CASES = [((5,), 4, -2, 0.25), ((5,), 4, -1, 1e-6), ((1,), 1, -1, 1e-6), ((3, 2), 2, -2, 1e-6),
               ((7,), 8, -1, 0.25), ((2,), 8, -2, 1e-6)]
_STEP_MISTAKES = {
    "p_not_q": "the sum was taken with P, the step's input. The correction term is sum(dQ * Q): Q after the "
               "step, the matrix the step produced.",
    "no_eps": "forgetting the eps: the step divides by (sum + eps), and so does its backward, twice (in Q and "
              "in the final division).",
    "wrong_axis": "summing over the wrong axis: a row step (dim = -1) shares one denominator per row, so its "
                  "correction sums along that row, the same dim the forward summed.",
    "no_correction": "dP = dQ / s treats the sum as a constant. Every entry of the row (or column) moves the "
                     "sum, so subtract sum(dQ * Q) along it before dividing by s.",
}


def _step_wrong(kind: str):
    def wrong(p, grad_q, dim, eps=1e-6):
        s = p.sum(dim=dim, keepdim=True) + (0.0 if kind == "no_eps" else eps)
        q = p / s
        other = -1 if dim in (-2, p.dim() - 2) else -2
        if kind == "p_not_q":
            return (grad_q - (grad_q * p).sum(dim=dim, keepdim=True)) / s
        if kind == "wrong_axis":
            return (grad_q - (grad_q * q).sum(dim=other, keepdim=True)) / s
        if kind == "no_correction":
            return grad_q / s
        return (grad_q - (grad_q * q).sum(dim=dim, keepdim=True)) / s

    wrong.__name__ = f"normalize_step_backward_{kind}"
    return wrong


@register(
    "7.2", "one Sinkhorn normalisation step, backward",
    hints=[
        "Q = P / s with s = sum of P along dim (keepdim) + eps. An entry P_ab reaches every Q of its row (or "
        "column): directly through the numerator, and through s, which all of them share.",
        "dP = (dQ - sum(dQ * Q along dim)) / s. Compute s and Q from P first (recomputation: the forward is cheap); "
        "the sum in the correction uses Q, the step's output.",
        "s = p.sum(dim=dim, keepdim=True) + eps; q = p / s; return (grad_q - (grad_q * q).sum(dim=dim, "
        "keepdim=True)) / s",
    ],
    library="mhc_lab.course.training_lab.normalize_step_backward",
    mistakes=[
        Mistake(_step_wrong("p_not_q"), "Q after the step"),
        Mistake(_step_wrong("no_eps"), "forgetting the eps"),
        Mistake(_step_wrong("wrong_axis"), "summing over the wrong axis"),
        Mistake(_step_wrong("no_correction"), "treats the sum as a constant"),
    ],
)
def _check_step(answer):
    cases = []
    for k, (lead, n, dim, eps) in enumerate(_STEP_CASES):
        case = f"P of shape {(*lead, n, n)}, dim={dim}, eps={eps:g}"
        p = torch.exp(randn(*lead, n, n, seed=7200 + 10 * k))  # positive, like the matrices Sinkhorn normalises
        dq = randn(*lead, n, n, seed=7201 + 10 * k)
        got = call(answer, p.clone(), dq.clone(), dim, eps, case=case)
        mistakes = {text: _step_wrong(kind)(p, dq, dim, eps) for kind, text in _STEP_MISTAKES.items()}
        assert_close(got, normalize_step_backward(p, dq, dim, eps), case=case, name="dP", mistakes=mistakes)
        cases.append(case)
    return cases


# ---- 7.3 the Sinkhorn backward by recomputation ------------------------------------------------------------------

# (lead, n, iterations, eps); first a large eps and few rounds, where a dropped eps or a round too many or too
# few makes a difference that shows (20 rounds converge: one more changes little)
_SINKHORN_CASES = [((3,), 4, 4, 0.05), ((5,), 4, 20, 1e-6), ((1,), 1, 20, 1e-6), ((3,), 2, 20, 1e-6),
                   ((2, 2), 8, 20, 1e-6), ((7,), 4, 3, 1e-6), ((4,), 4, 1, 1e-6)]
_SINKHORN_MISTAKES = {
    "no_transpose": "the layer uses H_res = comb^T, so the gradient of comb is grad_res transposed; you walked "
                    "back from grad_res itself.",
    "no_softmax": "the softmax backward at the end is missing: comb starts as softmax(logits) + eps, so finish "
                  "with S * (d - rowsum(d * S)), S the softmax.",
    "final_q": "every step's backward used the final matrix. Each step needs its own Q (and s): recompute the "
               "forward and walk the steps back in reverse, each with the matrices of that step.",
    "extra_round": "one Sinkhorn round too many. `iterations` rounds are a column step, then iterations - 1 times a "
                   "row step and a column step (39 steps for 20 rounds): loop over [-2] + [-1, -2] * (iterations - 1).",
    "round_short": "one Sinkhorn round too few. `iterations` rounds are a column step, then iterations - 1 times a "
                   "row step and a column step (39 steps for 20 rounds): loop over [-2] + [-1, -2] * (iterations - 1).",
    "row_first": "the steps in the wrong order: the forward starts with a column step (dim -2), then alternates a "
                 "row and a column step, [-2] + [-1, -2] * (iterations - 1); starting with a row step computes "
                 "another matrix.",
    "no_eps": "forgetting the eps, in both places: comb = softmax(logits) + eps, and every step divides by "
              "(sum + eps). The recomputed forward must be the forward itself.",
    "no_eps_comb": "forgetting the eps of comb = softmax(logits) + eps: the recomputed forward must be the forward "
                   "itself (the eps has no gradient, but it changes every step's matrices).",
    "no_eps_steps": "forgetting the eps of the steps: each divides by (sum + eps), in the recomputed forward and in "
                    "each step's backward.",
}


def _sinkhorn_wrong(kind: str):
    def wrong(logits, grad_res, iterations=20, eps=1e-6):
        if kind == "no_transpose":
            return sinkhorn_backward(logits, grad_res.transpose(-1, -2), iterations, eps)
        comb_eps = 0.0 if kind in ("no_eps", "no_eps_comb") else eps
        step_eps = 0.0 if kind in ("no_eps", "no_eps_steps") else eps
        rounds = iterations + {"extra_round": 1, "round_short": -1}.get(kind, 0)
        order = [-1, -2] * iterations if kind == "row_first" else [-2] + [-1, -2] * (rounds - 1)
        softmax = torch.softmax(logits, dim=-1)
        comb, history = softmax + comb_eps, []
        for dim in order:
            history.append((dim, comb))
            comb = comb / (comb.sum(dim=dim, keepdim=True) + step_eps)
        d = grad_res.transpose(-1, -2)
        for dim, p in reversed(history):
            if kind == "final_q":
                s = comb.sum(dim=dim, keepdim=True) + eps
                d = (d - (d * comb).sum(dim=dim, keepdim=True)) / s
            else:
                d = normalize_step_backward(p, d, dim, step_eps)
        if kind == "no_softmax":
            return d
        return softmax * (d - (d * softmax).sum(dim=-1, keepdim=True))

    wrong.__name__ = f"sinkhorn_backward_{kind}"
    return wrong


@register(
    "7.3", "the Sinkhorn backward by recomputation",
    hints=[
        "Run the forward again from the logits (softmax + eps, one column step, then iterations - 1 times a row "
        "step and a column step), remembering each step's input matrix and dim. Then start from d = grad_res "
        "transposed (H_res = comb^T) and walk the steps back in reverse order.",
        "Each step back is your 7.2 (or the library's normalize_step_backward(p, d, dim, eps)) with that step's "
        "input p. At the end, comb = softmax + eps: the eps has no gradient, the softmax's backward is "
        "S * (d - rowsum(d * S)).",
        "softmax = torch.softmax(logits, -1); comb = softmax + eps; steps = []; for dim in [-2] + [-1, -2] * "
        "(iterations - 1): steps.append((dim, comb)); comb = comb / (comb.sum(dim, keepdim=True) + eps). Then "
        "d = grad_res.transpose(-1, -2); for dim, p in reversed(steps): d = normalize_step_backward(p, d, dim, eps); "
        "return softmax * (d - (d * softmax).sum(-1, keepdim=True))",
    ],
    library="mhc_lab.reference.backward.sinkhorn_backward",
    mistakes=[
        Mistake(_sinkhorn_wrong("no_transpose"), "grad_res transposed"),
        Mistake(_sinkhorn_wrong("no_softmax"), "softmax backward"),
        Mistake(_sinkhorn_wrong("final_q"), "its own Q"),
        Mistake(_sinkhorn_wrong("extra_round"), "one Sinkhorn round too many"),
        Mistake(_sinkhorn_wrong("round_short"), "one Sinkhorn round too few"),
        Mistake(_sinkhorn_wrong("row_first"), "starts with a column step"),
        Mistake(_sinkhorn_wrong("no_eps"), "forgetting the eps, in both places"),
        Mistake(_sinkhorn_wrong("no_eps_comb"), "forgetting the eps of comb"),
        Mistake(_sinkhorn_wrong("no_eps_steps"), "forgetting the eps of the steps"),
    ],
)
def _check_sinkhorn_backward(answer):
    cases = []
    for k, (lead, n, iterations, eps) in enumerate(_SINKHORN_CASES):
        case = f"logits of shape {(*lead, n, n)}, iterations={iterations}, eps={eps:g}"
        logits = randn(*lead, n, n, seed=7300 + 10 * k, scale=2.0)
        grad = randn(*lead, n, n, seed=7301 + 10 * k)
        got = call(answer, logits.clone(), grad.clone(), iterations, eps, case=case)
        mistakes = {text: _sinkhorn_wrong(kind)(logits, grad, iterations, eps)
                    for kind, text in _SINKHORN_MISTAKES.items()}
        assert_close(got, sinkhorn_backward(logits, grad, iterations, eps), case=case, name="dlogits",
                     mistakes=mistakes)
        cases.append(case)
    return cases


# ---- 7.4 the RMS scale backward ------------------------------------------------------------------------------------

# r = sqrt(s / (n C) + eps) is the RMS of the token's flattened lanes, s = sum(x^2); the norm multiplies by 1/r, and
# grad_inv_r is dL/d(1/r). A large eps first: a dropped eps then fails where the difference shows, and is named.
_NORM_CASES = [((3,), 2, 7, 0.5), ((5,), 8, 33, 1e-6), ((1,), 1, 1, 1e-6), ((2, 3), 4, 5, 1e-6), ((4,), 4, 16, 0.5)]
_NORM_MISTAKES = {
    "sign": "the sign of ds: 1/r = (s / nC + eps)^(-1/2) falls as s grows, so ds = -d(1/r) / (2 nC r^3) is "
            "negative where d(1/r) is positive.",
    "no_two": "the factor 2 is missing: s = sum(x^2), so ds/dx = 2 x and dx = 2 ds x.",
    "lane_width": "the mean was taken over C, one lane. The norm is over the whole flattened row of n * C values: "
                  "divide s by n * C.",
    "r_not_r3": "d/ds (s / nC + eps)^(-1/2) = -(1/2) (s / nC + eps)^(-3/2) / (nC) = -1 / (2 nC r^3): the power of "
                "r is 3.",
    "r3_on_top": "r^3 multiplies where it should divide. r is the RMS, sqrt(s / nC + eps), and the norm's scale is "
                 "its inverse 1/r = (s / nC + eps)^(-1/2), whose derivative is -1 / (2 nC r^3): "
                 "ds = -d(1/r) / (2 nC r^3).",
    "no_eps": "forgetting the eps: r = sqrt(s / nC + eps), and r^3 carries the same eps.",
    "no_k": "the 1 / (n C) of the inner derivative is missing: 1/r is a function of s / (n C), so the chain rule "
            "brings d(s / nC)/ds = 1 / (n C) as well: ds = -d(1/r) / (2 nC r^3).",
    "no_half": "dx is twice too large: the 1/2 of the power rule is missing. d/du u^(-1/2) = -(1/2) u^(-3/2), so "
               "ds = -d(1/r) / (2 nC r^3) (and then dx = 2 ds x: the 2 and the 1/2 cancel only together).",
    "per_lane": "each lane was normalised on its own (s summed over C only, one r per lane). The norm has one r per "
                "token: s sums x^2 over all n * C values of the token, sum(dim=(-2, -1), keepdim=True).",
}
_NORM_NO_UNSQUEEZE = ("grad_inv_r was used as it comes, [..., 1]: against r [..., 1, 1] it broadcasts along the "
                      "wrong dims. Give it the lanes' two trailing dims first: grad_inv_r.unsqueeze(-1), [..., 1, 1], "
                      "so it broadcasts over [n, C].")
_NORM_BROADCAST = ("The shapes did not broadcast: s, r and grad_inv_r are one number per token and must line up with "
                   "x [..., n, C] as [..., 1, 1]: sum with keepdim=True over dims (-2, -1), and "
                   "grad_inv_r.unsqueeze(-1).")


def _norm_wrong(kind: str):
    def wrong(x, grad_inv_r, rms_eps=1e-6):
        n, C = x.shape[-2:]
        k = C if kind in ("lane_width", "per_lane") else n * C
        dims = -1 if kind == "per_lane" else (-2, -1)
        s = x.pow(2).sum(dim=dims, keepdim=True)
        r = torch.sqrt(s / k + (0.0 if kind == "no_eps" else rms_eps))
        g = grad_inv_r if kind == "no_unsqueeze" else grad_inv_r.unsqueeze(-1)
        half = {"sign": 0.5, "no_half": -1.0}.get(kind, -0.5)
        if kind == "r3_on_top":
            ds = half * r.pow(3) / k * g
        else:
            ds = half * g / ((1 if kind == "no_k" else k) * r.pow(1 if kind == "r_not_r3" else 3))
        if kind == "no_x":
            return 2 * ds
        return (1 if kind == "no_two" else 2) * ds * x

    wrong.__name__ = f"norm_scale_backward_{kind}"
    return wrong


def _call_norm(answer, x, grad_inv_r, eps, want, case):
    """The learner's dx; a shape error of the usual kind (grad_inv_r not unsqueezed) is named."""
    try:
        return call(answer, x.clone(), grad_inv_r.clone(), eps, case=case)
    except CheckFailed as failure:
        error = failure.__cause__
        if not isinstance(error, RuntimeError) or not any(
                words in str(error) for words in ("must match the size", "broadcast", "expanded size")):
            raise
        try:  # would their function be right with grad_inv_r already [..., 1, 1]?
            probe = answer(x.clone(), grad_inv_r.unsqueeze(-1), eps)
            fixed = (isinstance(probe, torch.Tensor) and probe.shape == want.shape
                     and torch.allclose(probe.to(want.dtype), want, rtol=1e-6, atol=1e-9))
        except Exception:
            fixed = False
        explain = (f"This looks like the usual mistake: {_NORM_NO_UNSQUEEZE}" if fixed else _NORM_BROADCAST)
        raise CheckFailed(f"{str(failure).rstrip('.')}. {explain}") from error


@register(
    "7.4", "the RMS scale backward",
    hints=[
        "Forward: s = sum of x^2 over the token's n * C values, r = sqrt(s / (n C) + eps) its RMS, and the norm "
        "multiplies by 1/r = (s / (n C) + eps)^(-1/2), one number per token. Chain rule in two steps: "
        "d(1/r) -> ds -> dx.",
        "The derivative of (s / (n C) + eps)^(-1/2) by s is -1 / (2 n C r^3), so ds = -d(1/r) / (2 n C r^3); the "
        "derivative of s by x is 2 x, so dx = 2 ds x. Keep grad_inv_r's last dim of 1 and add one more "
        "(unsqueeze(-1)) so that it broadcasts over [n, C].",
        "k = n * C; s = x.pow(2).sum(dim=(-2, -1), keepdim=True); r = torch.sqrt(s / k + rms_eps); "
        "ds = -grad_inv_r.unsqueeze(-1) / (2 * k * r.pow(3)); return 2 * ds * x",
    ],
    library="mhc_lab.course.training_lab.norm_scale_backward",
    mistakes=[
        Mistake(_norm_wrong("sign"), "the sign of ds"),
        Mistake(_norm_wrong("no_two"), "the factor 2"),
        Mistake(_norm_wrong("lane_width"), "n * C values"),
        Mistake(_norm_wrong("r_not_r3"), "the power of r is 3"),
        Mistake(_norm_wrong("r3_on_top"), "r^3 multiplies where it should divide"),
        Mistake(_norm_wrong("no_eps"), "forgetting the eps"),
        Mistake(_norm_wrong("no_k"), "the 1 / (n C) of the inner derivative"),
        Mistake(_norm_wrong("no_half"), "the 1/2 of the power rule"),
        Mistake(_norm_wrong("per_lane"), "each lane was normalised on its own"),
        Mistake(_norm_wrong("no_unsqueeze"), "grad_inv_r.unsqueeze(-1), [..., 1, 1]"),
        Mistake(_norm_wrong("no_x"), "dx = 2 ds x: multiply by x"),
    ],
)
def _check_norm_backward(answer):
    cases = []
    for k, (lead, n, C, eps) in enumerate(_NORM_CASES):
        case = f"x of shape {(*lead, n, C)}, rms_eps={eps:g}"
        # tokens of very different sizes, so that r matters
        x = randn(*lead, n, C, seed=7400 + 10 * k) * torch.exp(randn(*lead, 1, 1, seed=7401 + 10 * k))
        grad_inv_r = randn(*lead, 1, seed=7402 + 10 * k)
        want = norm_scale_backward(x, grad_inv_r, eps)
        got = _call_norm(answer, x, grad_inv_r, eps, want, case)
        if isinstance(got, torch.Tensor) and tuple(got.shape) == (*lead, 1, 1) and (n, C) != (1, 1):
            raise CheckFailed(f"{case}: expected dx of shape {tuple(want.shape)}, got {tuple(got.shape)}: one number "
                              "per token, ds (or 2 ds), not a gradient for each of x's values. This looks like the "
                              "usual mistake: the last step of the chain is missing, dx = 2 ds x: multiply by x.")
        mistakes = {text: _norm_wrong(kind)(x, grad_inv_r, eps) for kind, text in _NORM_MISTAKES.items()}
        assert_close(got, want, case=case, name="dx", mistakes=mistakes)
        cases.append(case)
    return cases


# ---- 7.5 Eq. 20, the recompute memory ---------------------------------------------------------------------------


# Eq. 20 as the usual mistakes write it: (formula, what the check says). Named only when the answer equals the
# formula on every case, so that two mistakes that agree on one case (a swap and a floor at L = 30, L_r = 7) are
# told apart.
_RECOMPUTE_MISTAKES = {
    "floor": (lambda n, L, b: n * (L // b) + (n + 2) * b,
              "floor instead of ceil (L // L_r, int(L / L_r) and math.floor all round down). The last block may be "
              "shorter and still keeps its input: ceil(L / L_r) blocks, math.ceil(layers / block)."),
    "no_ceil": (lambda n, L, b: n * L / b + (n + 2) * b,
                "the ceil is missing: L / L_r is not a whole number of blocks (30 / 7 = 4.29 blocks), and every "
                "block, the last and shorter one too, keeps one whole input: n * math.ceil(layers / block)."),
    "round": (lambda n, L, b: n * round(L / b) + (n + 2) * b,
              "round() rounds to the nearest whole number; a count of blocks rounds up, since the last, shorter "
              "block still keeps its input: math.ceil(layers / block)."),
    "ceil_outside": (lambda n, L, b: math.ceil(n * L / b) + (n + 2) * b,
                     "the ceil is in the wrong place: round the number of blocks up, then multiply by the n C each "
                     "block keeps: n * ceil(L / L_r), not ceil(n L / L_r)."),
    "no_n": (lambda n, L, b: math.ceil(L / b) + (n + 2) * b,
             "a block input x_{l0} is the whole stream, n lanes of C: it counts n per block, n * ceil(L / L_r), "
             "not 1."),
    "n_plus_one": (lambda n, L, b: n * math.ceil(L / b) + (n + 1) * b,
                   "the transients are (n + 2) C per layer (Table 3): x_l (n C), H_pre x_l (C) and its RMSNorm (C)."),
    "every_layer": (lambda n, L, b: n * L + (n + 2) * b,
                    "the block input x_{l0} is kept once per block, not for every layer: n ceil(L / L_r)."),
    "all_transients": (lambda n, L, b: n * math.ceil(L / b) + (n + 2) * L,
                       "the transients are alive for one block at a time, the block being recomputed: "
                       "(n + 2) L_r, not (n + 2) L for every layer."),
    "swapped": (lambda n, L, b: n * b + (n + 2) * math.ceil(L / b),
                "the two terms are swapped: the kept block inputs, n C each, are one per block, n ceil(L / L_r); "
                "the transients, (n + 2) C per layer, are those of the L_r layers of one block, (n + 2) L_r."),
}
_RECOMPUTE_CASES = [(4, 30, 7), (4, 30, 5), (4, 60, 6), (4, 12, 3), (1, 7, 2), (8, 61, 7), (2, 1, 1), (4, 13, 13)]


def _same(value, expected) -> bool:
    return abs(value - expected) <= 1e-9 * max(1.0, abs(expected))


def _recompute_mistake(values: list) -> str:
    """The usual mistake the answers match on every case ("" if none does)."""
    for formula, explanation in _RECOMPUTE_MISTAKES.values():
        if all(v is not None and _same(v, formula(*c)) for v, c in zip(values, _RECOMPUTE_CASES)):
            return f"This looks like the usual mistake: {explanation}"
    return ""


@register(
    "7.5", "Eq. 20, memory with recompute blocks",
    hints=[
        "Two terms, per token, in units of C. The block inputs x_{l0} (n C each) stay in memory for the whole "
        "backward: one per block, and the last block may be shorter. While one block is recomputed, its (n + 2) C "
        "transients per layer are alive: x_l, H_pre x_l and its norm (Table 3).",
        "n * (number of blocks) + (n + 2) * L_r, with number of blocks = ceil(L / L_r): a whole number, rounded "
        "up (30 layers in blocks of 7 are 5 blocks, not 30 / 7 = 4.29 and not 30 // 7 = 4).",
        "return n * math.ceil(layers / block) + (n + 2) * block",
    ],
    library="mhc_lab.reference.recompute.recompute_memory",
    mistakes=[
        Mistake(_RECOMPUTE_MISTAKES["floor"][0], "floor instead of ceil"),
        Mistake(_RECOMPUTE_MISTAKES["no_ceil"][0], "the ceil is missing"),
        Mistake(_RECOMPUTE_MISTAKES["round"][0], "round() rounds to the nearest"),
        Mistake(_RECOMPUTE_MISTAKES["ceil_outside"][0], "the ceil is in the wrong place"),
        Mistake(_RECOMPUTE_MISTAKES["no_n"][0], "it counts n per block"),
        Mistake(_RECOMPUTE_MISTAKES["n_plus_one"][0], "(n + 2) C"),
        Mistake(_RECOMPUTE_MISTAKES["every_layer"][0], "once per block"),
        Mistake(_RECOMPUTE_MISTAKES["all_transients"][0], "for one block at a time"),
        Mistake(_RECOMPUTE_MISTAKES["swapped"][0], "the two terms are swapped"),
    ],
)
def _check_recompute_memory(answer):
    answers, values = [], []
    for n, layers, block in _RECOMPUTE_CASES:
        got = call(answer, n, layers, block, case=f"n={n}, L={layers}, L_r={block}")
        answers.append(got)
        try:
            values.append(float(got))
        except (TypeError, ValueError):
            values.append(None)
    explain = _recompute_mistake(values)
    cases = []
    for (n, layers, block), got in zip(_RECOMPUTE_CASES, answers):
        case = f"n={n}, L={layers}, L_r={block}"
        expect_number(got, recompute_memory(n, layers, block), case=case, name="memory per token (units of C)",
                      explain=explain)
        cases.append(case)
    return cases
