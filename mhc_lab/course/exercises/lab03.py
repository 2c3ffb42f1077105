"""Lab 03 exercises: the Birkhoff polytope, three Sinkhorn-Knopp variants, and mHC's coefficients and update
(mHC, arXiv 2512.24880, Eqs. 3, 6-9)."""

from __future__ import annotations

import inspect

import torch

from mhc_lab.course.birkhoff import doubly_stochastic_gaps, random_doubly_stochastic
from mhc_lab.course.checks import CheckFailed, Mistake, assert_close, call, randn, register
from mhc_lab.reference import (
    mhc_coefficients,
    mhc_post,
    sinkhorn,
    sinkhorn_deepseek_v4,
    sinkhorn_log_domain,
    sinkhorn_paper,
)
from mhc_lab.reference.mhc import mixes_width

LANES = (1, 2, 4, 8)


def _reference(fn, *args, dtype, **kwargs):
    """The reference answer computed in float64 and returned in the learner's dtype."""
    out = fn(*(a.double() if isinstance(a, torch.Tensor) else a for a in args), **kwargs)
    if isinstance(out, tuple):
        return type(out)(*(o.to(dtype) for o in out))
    return out.to(dtype)


def _as_tensor(got, case: str, name: str) -> torch.Tensor:
    if not isinstance(got, torch.Tensor):
        raise CheckFailed(f"{case}: expected {name} to be a torch.Tensor, got {type(got).__name__}")
    return got


# ---- 3.1 the three gaps -------------------------------------------------------------------------------------


def _gaps_rows_columns_swapped(h):
    g = doubly_stochastic_gaps(h)
    return g[..., [0, 2, 1]]


def _gaps_signed(h):
    negative = (-h.amin(dim=(-2, -1))).clamp(min=0)
    return torch.stack([negative, (h.sum(-1) - 1).amax(-1), (h.sum(-2) - 1).amax(-1)], dim=-1)


def _gaps_unclamped(h):
    g = doubly_stochastic_gaps(h).clone()
    g[..., 0] = -h.amin(dim=(-2, -1))
    return g


def _gap_inputs():
    """(description, matrices): points inside the polytope, near it, and just outside it in each way."""
    cases = []
    for n in LANES:
        cases.append((f"{n}x{n} doubly stochastic, batch 5", random_doubly_stochastic(n, 5, seed=n)))
    positive = randn(3, 4, 4, seed=31).abs() * 0.5
    cases.append(("3 positive 4x4 matrices, sums anywhere", positive))
    cases.append(("2 row-stochastic 3x3 (softmax over rows)", torch.softmax(randn(2, 3, 3, seed=32), dim=-1)))
    cases.append(("2 column-stochastic 5x5", torch.softmax(randn(2, 5, 5, seed=33), dim=-2)))
    # Rows and columns sum to 1 but entries go negative: I + a zero-sum perturbation.
    z = randn(4, 4, 4, seed=34)
    z = z - z.mean(-1, keepdim=True) - z.mean(-2, keepdim=True) + z.mean((-2, -1), keepdim=True)
    cases.append(("4 matrices I + Z with zero-sum Z (sums exact, entries negative)", torch.eye(4) + 0.6 * z))
    cases.append(("2x7 batch of 7x7 matrices from Sinkhorn, 3 iterations",
                  sinkhorn(randn(2, 7, 7, 7, seed=35, scale=2.0), variant="paper", iterations=3)))
    cases.append(("one 1x1 matrix [[0.5]] (no batch dims)", torch.tensor([[0.5]], dtype=torch.float64)))
    return cases


@register(
    "3.1", "distance to the Birkhoff polytope",
    hints=[
        "Three numbers per matrix: how negative the smallest entry is, the worst row sum error, the worst "
        "column sum error. Reduce only over the last two dims; keep the batch dims.",
        "A row sum is sum over j of H[i, j]: h.sum(dim=-1). A column sum: h.sum(dim=-2). "
        "Take |sum - 1| and its max over the n sums.",
        "negative = (-h.amin(dim=(-2, -1))).clamp(min=0); stack the three with torch.stack(..., dim=-1).",
    ],
    library="mhc_lab.course.birkhoff.doubly_stochastic_gaps",
    mistakes=[
        Mistake(_gaps_rows_columns_swapped, "rows and columns swapped"),
        Mistake(_gaps_signed, "absolute value"),
        Mistake(_gaps_unclamped, "clamp"),
    ],
)
def _check_gaps(answer):
    cases = []
    for description, h in _gap_inputs():
        expected = doubly_stochastic_gaps(h)
        got = _as_tensor(call(answer, h.clone(), case=description), description, "the gaps")
        assert_close(got, expected, case=description, name="the gaps [..., 3]", mistakes={
            "rows and columns swapped: a row sum is sum_j H[i, j], i.e. h.sum(dim=-1); gap 1 is the rows, "
            "gap 2 the columns": _gaps_rows_columns_swapped(h),
            "a sum below 1 is as far off as one above it: take the absolute value |sum - 1| before the max":
                _gaps_signed(h),
            "a matrix with no negative entry has a negative-entry gap of 0, not -min: clamp at zero":
                _gaps_unclamped(h),
        })
        cases.append(description)
    return cases


# ---- 3.2 - 3.4 Sinkhorn variants ----------------------------------------------------------------------------


def _sinkhorn_inputs():
    """(description, logits, iterations): lanes 1, 2, 4, 8, odd batch shapes, one float32 case."""
    return [
        ("4x4 logits, 1 iteration", randn(4, 4, seed=41), 1),
        ("batch 3 of 2x2 logits, 3 iterations", randn(3, 2, 2, seed=42), 3),
        ("batch (2, 7) of 4x4 logits ~ N(0, 3^2), 20 iterations", randn(2, 7, 4, 4, seed=43, scale=3.0), 20),
        ("one 1x1 logit, 20 iterations", randn(1, 1, seed=44), 20),
        ("batch 5 of 8x8 logits, 20 iterations", randn(5, 8, 8, seed=45), 20),
        ("batch 33 of 4x4 logits in float32, 20 iterations", randn(33, 4, 4, seed=46, dtype=torch.float32), 20),
    ]


def _rows_first(logits, iterations=20):
    m = torch.exp(logits - logits.amax(dim=(-2, -1), keepdim=True))
    for _ in range(iterations):
        m = m / m.sum(dim=-1, keepdim=True)
        m = m / m.sum(dim=-2, keepdim=True)
    return m


def _rows_only(logits, iterations=20):
    return torch.softmax(logits, dim=-1)


def _check_sinkhorn(answer, reference, mistakes_for, extra=None):
    cases = []
    for description, logits, iterations in _sinkhorn_inputs():
        expected = _reference(reference, logits, iterations=iterations, dtype=logits.dtype)
        got = call(answer, logits.clone(), iterations=iterations, case=description)
        wrong = {k: f(logits.double(), iterations=iterations) for k, f in mistakes_for.items()}
        assert_close(got, expected, case=description, name="H_res", mistakes=wrong)
        cases.append(description)
    if extra is not None:
        cases += extra(answer)
    return cases


@register(
    "3.2", "Sinkhorn-Knopp, the paper's Eq. 9",
    hints=[
        "Start from M = exp(logits), then repeat `iterations` times: divide every column by its sum (T_c), "
        "then every row by its sum (T_r). Rows are normalised last.",
        "Column sums: m.sum(dim=-2, keepdim=True); row sums: m.sum(dim=-1, keepdim=True). keepdim makes the "
        "division broadcast over the right axis.",
        "Subtract logits.amax(dim=(-2, -1), keepdim=True) before exp: it cancels in the normalisation and "
        "keeps exp from overflowing.",
    ],
    library="mhc_lab.reference.sinkhorn.sinkhorn_paper",
    mistakes=[Mistake(_rows_first, "normalising rows first"), Mistake(_rows_only, "only the rows")],
)
def _check_sinkhorn_paper(answer):
    return _check_sinkhorn(answer, sinkhorn_paper, {
        "normalising rows first: Eq. 9 is M_t = T_r(T_c(M_{t-1})), the column step comes first and the "
        "row step last, so the rows end exact": _rows_first,
        "normalising only the rows (a softmax) makes a row-stochastic matrix; the columns need their own "
        "normalisation, alternated with the rows": _rows_only,
    })


def _v4_without_transpose(logits, iterations=20, eps=1e-6):
    return sinkhorn_deepseek_v4(logits, iterations, eps).transpose(-1, -2)


def _v4_without_eps(logits, iterations=20, eps=1e-6):
    return sinkhorn_deepseek_v4(logits, iterations, 0.0)


def _v4_one_pass_too_many(logits, iterations=20, eps=1e-6):
    comb = torch.softmax(logits, dim=-1) + eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(iterations):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return comb.transpose(-1, -2)


@register(
    "3.3", "Sinkhorn-Knopp, DeepSeek-V4's convention",
    hints=[
        "comb = softmax(logits, dim=-1) + eps; divide by (column sums + eps) once; then iterations - 1 times: "
        "rows (+ eps), then columns (+ eps). Return comb transposed.",
        "The softmax over rows already is T_r(exp(logits)), so the first pass only needs the column step: "
        "in total that is `iterations` row steps and `iterations` column steps.",
        "comb ends on a column step, so its columns are exact; mHC applies comb^T (the new lane i is "
        "sum_j comb[j, i] x_j), whose rows are then the exact ones. Return comb.transpose(-1, -2).",
    ],
    library="mhc_lab.reference.sinkhorn.sinkhorn_deepseek_v4",
    mistakes=[
        Mistake(_v4_without_transpose, "forgetting the transpose"),
        Mistake(_v4_without_eps, "eps"),
        Mistake(_v4_one_pass_too_many, "one (row, column) pass too many"),
    ],
)
def _check_sinkhorn_v4(answer):
    return _check_sinkhorn(answer, sinkhorn_deepseek_v4, {
        "forgetting the transpose: DeepSeek-V4 applies comb^T, so return comb.transpose(-1, -2)":
            _v4_without_transpose,
        "leaving out eps: DeepSeek-V4 adds eps after the softmax and to every denominator": _v4_without_eps,
        "one (row, column) pass too many: after the first column step there are iterations - 1 more "
        "passes, because the softmax was already the first row step": _v4_one_pass_too_many,
    })


def _log_rows_first(logits, iterations=20):
    f = torch.zeros_like(logits[..., :, :1])
    g = torch.zeros_like(logits[..., :1, :])
    for _ in range(iterations):
        f = -torch.logsumexp(logits + g, dim=-1, keepdim=True)
        g = -torch.logsumexp(logits + f, dim=-2, keepdim=True)
    return torch.exp(logits + f + g)


def _log_without_exp(logits, iterations=20):
    return torch.log(sinkhorn_log_domain(logits, iterations))


def _check_extreme(answer):
    description = "batch 4 of 4x4 logits ~ N(0, 1000^2) (exp underflows even in float64)"
    logits = randn(4, 4, 4, seed=47, scale=1000.0)
    try:
        got = answer(logits.clone(), iterations=20)
    except NotImplementedError:
        raise
    except Exception as error:
        raise CheckFailed(
            f"{description}: your function raised {type(error).__name__}: {str(error).rstrip('.')}. This looks "
            "like the usual "
            "mistake: exponentiating the logits before normalising (the paper's form); in the log domain only "
            "logsumexp and the final exp(logits + f + g) touch exp."
        ) from error
    got = _as_tensor(got, description, "H_res")
    if not torch.isfinite(got).all():
        raise CheckFailed(
            f"{description}: H_res has non-finite entries. This looks like the usual mistake: exponentiating "
            "the logits before normalising; keep the potentials f, g in log space with torch.logsumexp."
        )
    assert_close(got, sinkhorn_log_domain(logits, 20), case=description, name="H_res")
    return [description]


@register(
    "3.4", "Sinkhorn-Knopp in the log domain",
    hints=[
        "Keep H = exp(logits + f_i + g_j) implicit: f [..., n, 1] are row potentials, g [..., 1, n] column "
        "potentials, both starting at 0.",
        "The column step sets g so every column of exp(logits + f + g) sums to 1: "
        "g = -logsumexp(logits + f, dim=-2, keepdim=True). The row step then sets f the same way over dim=-1.",
        "Repeat (g then f) `iterations` times and return torch.exp(logits + f + g).",
    ],
    library="mhc_lab.reference.sinkhorn.sinkhorn_log_domain",
    mistakes=[
        Mistake(_log_rows_first, "normalising rows first"),
        Mistake(_log_without_exp, "log H"),
        Mistake(sinkhorn_paper, "exponentiating the logits"),
        Mistake(_rows_only, "only the rows"),
    ],
)
def _check_sinkhorn_log(answer):
    return _check_sinkhorn(answer, sinkhorn_log_domain, {
        "normalising rows first: update the column potential g first and the row potential f last, as Eq. 9 "
        "does (T_c, then T_r)": _log_rows_first,
        "returning log H: finish with torch.exp(logits + f + g)": _log_without_exp,
        "normalising only the rows (one logsumexp over dim=-1, a softmax) makes a row-stochastic matrix; the "
        "column potential g needs its own step, alternated with the row potential f": _rows_only,
    }, extra=_check_extreme)


# ---- 3.5 coefficients (Eqs. 7-8) ----------------------------------------------------------------------------


# The RMSNorm's eps of the reference (mhc_coefficients' rms_eps, 1e-6), and as the lab writes it ("1e-6").
RMS_EPS = inspect.signature(mhc_coefficients).parameters["rms_eps"].default
_RMS_EPS_TEXT = f"{RMS_EPS:.0e}".replace("e-0", "e-")


def _coefficients(x, phi, bias, alpha, iterations=20, eps=1e-6, *, per_lane_norm=False, post_scale=2.0,
                  pre_eps=True, order="pre,post,res", res_transposed=False, rms_eps=RMS_EPS):
    """mHC coefficients with one knob per usual mistake (the defaults give the right answer). ``rms_eps=None``
    normalises with F.rms_norm's default eps, as a learner who leaves it out does."""
    n, C = x.shape[-2], x.shape[-1]
    if per_lane_norm:
        x = x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + rms_eps)
        flat = x.reshape(*x.shape[:-2], n * C)
    elif rms_eps is None:
        flat = torch.nn.functional.rms_norm(x.reshape(*x.shape[:-2], n * C), (n * C,))
    else:
        flat = x.reshape(*x.shape[:-2], n * C)
        flat = flat * torch.rsqrt(flat.pow(2).mean(dim=-1, keepdim=True) + rms_eps)
    mixes = flat @ phi.t()
    parts = dict(zip(order.split(","), mixes.split([n, n, n * n] if order == "pre,post,res" else [n, n * n, n], -1)))
    bias_parts = dict(zip(order.split(","), bias.split([n, n, n * n] if order == "pre,post,res" else [n, n * n, n])))
    pre = torch.sigmoid(alpha[0] * parts["pre"] + bias_parts["pre"]) + (eps if pre_eps else 0.0)
    post = post_scale * torch.sigmoid(alpha[1] * parts["post"] + bias_parts["post"])
    res_logits = (alpha[2] * parts["res"] + bias_parts["res"]).reshape(*mixes.shape[:-1], n, n)
    if res_transposed:
        res_logits = res_logits.transpose(-1, -2)
    res = sinkhorn_deepseek_v4(res_logits, iterations, eps)
    return pre, post, res


def _coefficient_inputs():
    """(description, x, phi, bias, alpha, iterations) with lanes of very different sizes, so that a norm over
    C instead of nC shows."""
    cases = []
    # n = 4 comes first: for n <= 2 some mistakes barely show (a 2x2 doubly stochastic matrix is symmetric).
    shapes = [((2, 3), 4, 8, 20), ((), 1, 7, 20), ((3,), 2, 5, 20), ((5,), 8, 3, 3), ((1,), 4, 33, 20)]
    for k, (batch, n, C, iterations) in enumerate(shapes):
        lane_scale = torch.logspace(-1, 1, n, dtype=torch.float64).unsqueeze(-1)  # lanes of RMS 0.1 .. 10
        x = randn(*batch, n, C, seed=50 + k) * lane_scale
        width = mixes_width(n)
        phi = randn(width, n * C, seed=60 + k, scale=1.0 / (n * C) ** 0.5)
        bias = randn(width, seed=70 + k, scale=0.5)
        alpha = torch.tensor([0.8, 1.1, 1.3], dtype=torch.float64)
        cases.append((f"x {tuple(x.shape)} (n={n}, C={C}), {iterations} iterations", x, phi, bias, alpha,
                      iterations))
    x, phi, bias, alpha, iterations = (t.float() if isinstance(t, torch.Tensor) else t for t in cases[0][1:])
    cases.append(("x (2, 3, 4, 8) in float32", x, phi, bias, alpha, iterations))
    return cases


def _rms_eps_mistakes(dtype: torch.dtype) -> dict[str, float]:
    """The RMSNorm eps values a learner may use instead of 1e-6, each with the message that names it."""
    default, e = torch.finfo(dtype).eps, _RMS_EPS_TEXT
    return {
        f"your RMSNorm eps is {default:.3g} (F.rms_norm's and nn.RMSNorm's default when eps is not given: "
        f"torch.finfo({dtype}).eps), expected {e}: rsqrt(mean(flat^2) + {e}), or "
        f"F.rms_norm(flat, (n * C,), eps={e})": default,
        f"your RMSNorm eps is 1e-5 (the usual LayerNorm default), expected {e}: rsqrt(mean(flat^2) + {e})": 1e-5,
        f"your RMSNorm eps is 1e-8, expected {e}: rsqrt(mean(flat^2) + {e})": 1e-8,
    }


@register(
    "3.5", "mHC coefficients (Eqs. 7-8, DeepSeek-V4 layout)",
    hints=[
        "Flatten the lanes: flat = x.reshape(*x.shape[:-2], n * C); RMSNorm it over all nC numbers "
        "(rsqrt of the mean square + 1e-6; with F.rms_norm pass eps=1e-6, its default differs); "
        "mixes = flat @ phi.T has n^2 + 2n entries in the order [pre, post, res].",
        "pre = sigmoid(alpha[0] * mixes_pre + bias_pre) + eps; post = 2 * sigmoid(alpha[1] * mixes_post + "
        "bias_post); res logits = alpha[2] * mixes_res + bias_res, reshaped to [..., n, n] row by row.",
        "H_res = sinkhorn(res_logits, variant='deepseek_v4', iterations=iterations, eps=eps) from "
        "mhc_lab.reference (it returns comb^T already). Return (pre, post, res).",
    ],
    library="mhc_lab.reference.mhc.mhc_coefficients",
    mistakes=[
        Mistake(lambda x, p, b, a, iterations=20, eps=1e-6: _coefficients(x, p, b, a, iterations, eps,
                                                                            per_lane_norm=True), "norm over C"),
        Mistake(lambda x, p, b, a, iterations=20, eps=1e-6: _coefficients(x, p, b, a, iterations, eps,
                                                                            post_scale=1.0), "factor 2"),
        Mistake(lambda x, p, b, a, iterations=20, eps=1e-6: _coefficients(x, p, b, a, iterations, eps,
                                                                            pre_eps=False), "+ eps"),
        Mistake(lambda x, p, b, a, iterations=20, eps=1e-6: _coefficients(x, p, b, a, iterations, eps,
                                                                            order="pre,res,post"), "order"),
        Mistake(lambda x, p, b, a, iterations=20, eps=1e-6: _coefficients(x, p, b, a, iterations, eps,
                                                                            res_transposed=True), "row by row"),
        Mistake(lambda x, p, b, a, iterations=20, eps=1e-6: _coefficients(x, p, b, a, iterations, eps,
                                                                            rms_eps=None),
                "your RMSNorm eps is 2.22e-16 (F.rms_norm's"),
        Mistake(lambda x, p, b, a, iterations=20, eps=1e-6: _coefficients(x, p, b, a, iterations, eps,
                                                                            rms_eps=1e-5),
                "your RMSNorm eps is 1e-5"),
    ],
)
def _check_coefficients(answer):
    cases = []
    for description, x, phi, bias, alpha, iterations in _coefficient_inputs():
        expected = _reference(mhc_coefficients, x, phi, bias, alpha, iterations=iterations, dtype=x.dtype)
        got = call(answer, x.clone(), phi, bias, alpha, iterations=iterations, case=description)
        if not isinstance(got, (tuple, list)) or len(got) != 3:
            raise CheckFailed(f"{description}: expected a tuple (pre, post, res), got {type(got).__name__}"
                              + (f" of length {len(got)}" if isinstance(got, (tuple, list)) else ""))

        def wrong(**knobs):
            return _coefficients(*(t.double() for t in (x, phi, bias, alpha)), iterations, **knobs)

        named = {
            "a norm over C (each lane alone) instead of over all nC numbers of the flattened stream":
                wrong(per_lane_norm=True),
            "a split in the wrong order: DeepSeek-V4's mixes are [pre, post, res], n + n + n^2":
                wrong(order="pre,res,post"),
        }
        # the eps mistakes differ from the right answer by little: the check names the nearest one
        named.update({why: wrong(rms_eps=value) for why, value in _rms_eps_mistakes(x.dtype).items()})
        named["H_pre without its + eps (DeepSeek-V4 adds eps = 1e-6 after the sigmoid)"] = wrong(pre_eps=False)
        named["H_post without the factor 2: Eq. 8 is H_post = 2 sigmoid(...), range (0, 2)"] = wrong(post_scale=1.0)
        named["res logits reshaped column by column: mat() fills H_res row by row (reshape(..., n, n), no "
              "transpose)"] = wrong(res_transposed=True)
        for k, name in enumerate(("pre", "post", "res")):
            assert_close(got[k], expected[k], case=description, name=f"H_{name}",
                         mistakes={why: w[k] for why, w in named.items()})
        cases.append(description)
    return cases


# ---- 3.6 the update (Eq. 3) ---------------------------------------------------------------------------------


def _post_transposed(x, layer_out, post, res):
    return mhc_post(x, layer_out, post, res.transpose(-1, -2))


def _post_without_post(x, layer_out, post, res):
    return mhc_post(x, layer_out, torch.ones_like(post), res)


def _post_without_mixing(x, layer_out, post, res):
    eye = torch.eye(x.shape[-2], dtype=res.dtype).expand_as(res)
    return mhc_post(x, layer_out, post, eye)


@register(
    "3.6", "the mHC update (Eq. 3)",
    hints=[
        "New lane i = sum_j res[i, j] x_j + post_i * layer_out. Shapes: x [..., n, C], layer_out [..., C], "
        "post [..., n], res [..., n, n].",
        "torch.einsum('...ij,...jc->...ic', res, x) mixes the lanes; post.unsqueeze(-1) * "
        "layer_out.unsqueeze(-2) is H_post^T F, an [..., n, C] outer product.",
    ],
    library="mhc_lab.reference.mhc.mhc_post",
    mistakes=[
        Mistake(_post_transposed, "transpose"),
        Mistake(_post_without_post, "H_post"),
        Mistake(_post_without_mixing, "H_res x"),
    ],
)
def _check_post(answer):
    cases = []
    shapes = [((), 1, 5), ((3,), 2, 7), ((2, 5), 4, 33), ((4,), 8, 1), ((1, 1), 4, 16)]
    for k, (batch, n, C) in enumerate(shapes):
        description = f"x {(*batch, n, C)}, n={n}"
        x = randn(*batch, n, C, seed=80 + k)
        layer_out = randn(*batch, C, seed=90 + k)
        post = 2 * torch.sigmoid(randn(*batch, n, seed=100 + k))
        res = random_doubly_stochastic(n, max(1, x[..., 0, 0].numel()), seed=110 + k).reshape(*batch, n, n)
        expected = mhc_post(x, layer_out, post, res)
        got = call(answer, x.clone(), layer_out, post, res, case=description)
        assert_close(got, expected, case=description, name="the next lanes", mistakes={
            "using H_res transposed: new lane i is sum_j res[i, j] x_j (einsum '...ij,...jc->...ic')":
                _post_transposed(x, layer_out, post, res),
            "adding F to every lane unweighted: each lane i gets post_i * F (H_post^T F)":
                _post_without_post(x, layer_out, post, res),
            "keeping x as it is: the lanes are first mixed by H_res x": _post_without_mixing(x, layer_out, post, res),
        })
        cases.append(description)
    return cases
