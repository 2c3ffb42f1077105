"""Lab 04 exercises: predict, then measure. The learner predicts bytes per token, a memory-bound time, an
arithmetic intensity and a launch count; each check compares the prediction with the count (the bytes model,
or the operations the reference code really launches) and says what is wrong with it: too high or too low, by
what ratio, which part (the lanes' or the coefficients', the first iteration's or each further one's), and the
usual mistake it matches. It never prints the count's breakdown, which is the answer."""

from __future__ import annotations

import math
from typing import Callable

import torch

from mhc_lab.measure import bytes_model, profiling
from mhc_lab.course.checks import CheckFailed, Mistake, call, is_close, recognise, register
from mhc_lab.reference import sinkhorn_deepseek_v4



def _number(got, case: str, name: str) -> float:
    try:
        value = float(got)
    except (TypeError, ValueError):
        raise CheckFailed(f"{case}: expected {name} to be a number, got {type(got).__name__}") from None
    if math.isnan(value) or math.isinf(value):
        raise CheckFailed(f"{case}: your prediction is {value}; expected a finite number")
    return value


def _ratio(got: float, expected: float) -> str:
    """got / expected with as many digits as it takes not to read as 1 (1.0003x, not 1x)."""
    r = got / expected
    for digits in range(3, 10):
        text = f"{r:.{digits}g}"
        if float(text) != 1.0:
            return f"{text}x"
    return f"{r:.10g}x"


def _show(value: float) -> str:
    return f"{value:,.0f}" if value == int(value) and abs(value) < 1e15 else f"{value:,.6g}"


def _part(label: str, got: float, expected: float, scale: float) -> str:
    """How one part of the prediction compares with the same part of the count, without giving the count;
    ``scale``: the size of the whole, below a billionth of which a part counts as zero (rounding)."""
    zero = 1e-9 * scale
    if abs(got - expected) <= max(1e-6 * abs(expected), zero):
        return f"{label} is right"
    if abs(expected) <= zero:
        return f"{label} should not be there"
    if abs(got) <= zero:
        return f"{label} is missing"
    return f"{label} is too {'high' if got > expected else 'low'} ({_ratio(got, expected)} the count's)"


def _affine(f: Callable[[int], float], at: int) -> tuple[float, float] | None:
    """(slope, value at ``at``) of f, when f is affine around ``at`` (f(at), f(at + 1), f(at + 2) on a line)."""
    a, b, c = (float(f(at + k)) for k in range(3))
    if any(math.isnan(v) or math.isinf(v) for v in (a, b, c)):
        return None
    if abs(c - 2 * b + a) > 1e-9 * max(abs(a), abs(b), abs(c), 1e-300):
        return None
    return b - a, a


def _parts_text(mine, right, at: int, split: Callable[[float, float, int], tuple[float, float]],
                labels: tuple[str, str], variable: str = "C") -> str:
    """Compare the prediction's two parts with the count's: ``mine`` and ``right`` are functions of one integer
    ``variable`` (C, or the iterations t), affine in it; ``split(slope, value, at)`` turns a slope and a value
    into the two parts named by ``labels``."""
    try:
        got = _affine(mine, at)
    except (CheckFailed, ArithmeticError, TypeError, ValueError):
        return ""
    if got is None:
        return f" Your prediction does not grow in a straight line with {variable}; the count does."
    count = _affine(right, at)
    scale = max(abs(got[1]), abs(count[1]))
    first, second = (_part(label, g, e, scale)
                     for label, g, e in zip(labels, split(*got, at), split(*count, at)))
    return f" Of your prediction, {first}; {second}."


def _wrong(value: float, expected: float, *, case: str, name: str, parts: str = "", usual: str = "",
           advice: str = "") -> None:
    """Raise CheckFailed: what the prediction is, too high or too low by what ratio (close, if it is), which
    part, which mistake."""
    if expected == 0:
        how = "should be 0"
    else:
        close = "close, but " if not usual and is_close(abs(value - expected), abs(expected)) else ""
        how = f"is {close}too {'high' if value > expected else 'low'}: {_ratio(value, expected)} the count"
    message = f"{case}: your prediction, {_show(value)} {name}, {how}.{parts}{usual}"
    raise CheckFailed(f"{message} {advice}".rstrip())


def _expect(got, expected: float, *, case: str, name: str, rel: float = 1e-6,
            parts: Callable[[], str] | None = None, usual: dict[str, float] | None = None, advice: str = ""):
    value = _number(got, case, name)
    if abs(value - expected) <= rel * max(abs(expected), 1e-12):
        return
    _wrong(value, expected, case=case, name=name, parts=parts() if parts else "",
           usual=recognise(value, expected, usual).lstrip("."), advice=advice)


def _lanes_and_coefficients(slope: float, value: float, C: int) -> tuple[float, float]:
    """An affine count in C split into its part proportional to C (the lanes) and its part without C."""
    return slope * C, value - slope * C


_IN_C = ("the part proportional to C (the lanes' traffic)",
         "the part that does not grow with C (the coefficients H_pre, H_post, H_res)")


# ---- 4.1 ------------------------------------------------------------------------------------------------


def _hc_usual(n: int, C: int) -> dict[str, float]:
    k = n * n + 2 * n
    return {
        "you counted only the reads; every operation also writes its result.": (5 * n + 1) * C + k,
        "you left out the coefficients: the first kernel writes n^2 + 2n of them per token (H_pre, H_post, "
        "H_res) and the apply kernels read them back.": (8 * n + 2) * C,
        "you scaled the residual's 3C by n, as if n lanes cost n times one; HC runs five operations, each a "
        "pass over the lanes.": 3 * n * C,
        "you left out the residual merge (reads 2nC, writes nC): unfused, the H_post and H_res results are "
        "added by one more pass.": (5 * n + 2) * C + 2 * k,
    }


@register(
    "4.1", "predict the HC forward traffic",
    hints=[
        "Go through the five operations one by one: what does each read, what does it write, per token?",
        "The lanes x are nC elements; F's input and output are C; H_pre and H_post are n numbers, H_res n^2.",
        "Reads: nC + (nC + n) + (C + n) + (nC + n^2) + 2nC. Writes: (n^2 + 2n) + C + nC + nC + nC. Add both.",
    ],
    library="mhc_lab.measure.bytes_model.hc_forward_elements",
    mistakes=[
        Mistake(lambda n, C: (5 * n + 1) * C + n * n + 2 * n, "only the reads"),
        Mistake(lambda n, C: (8 * n + 2) * C, "left out the coefficients"),
        Mistake(lambda n, C: 3 * n * C, "n times one"),
        Mistake(lambda n, C: (5 * n + 2) * C + 2 * (n * n + 2 * n), "residual merge"),
    ],
)
def _check_hc_elements(answer):
    cases = []
    for n, C in [(4, 2560), (1, 7), (2, 33), (8, 1), (4, 4096), (3, 100)]:
        case = f"n={n}, C={C}"
        got = call(answer, n, C, case=case)
        _expect(got, bytes_model.hc_forward_elements(n, C), case=case, name="elements per token",
                usual=_hc_usual(n, C), parts=lambda: _parts_text(
                    lambda c: call(answer, n, c, case=case), lambda c: bytes_model.hc_forward_elements(n, c), C,
                    _lanes_and_coefficients, _IN_C),
                advice="Count each of the five operations' reads and writes again (hint('4.1') walks through "
                       "them).")
        cases.append(case)
    return cases


# ---- 4.2 ------------------------------------------------------------------------------------------------


def _minimal_usual(n: int, C: int) -> dict[str, float]:
    k = n * n + n
    return {
        "you counted only the reads; each kernel also writes its results (F's input and the coefficients, then "
        "the new lanes).": (2 * n + 1) * C + k,
        "you read x once; F runs between the two kernels, and the lanes cannot wait on chip meanwhile, so the "
        "post kernel reads x again.": (2 * n + 2) * C + 2 * k,
        "that is the paper's five-kernel plan; the fewest-bytes plan does everything before F in one pass "
        "over x.": bytes_model.elements_per_token("mhc_fused", n, C),
        "that is the unfused count of Table 2; fused, each kernel reads x once.":
            bytes_model.hc_forward_elements(n, C),
        "you left out the coefficients: the pre kernel writes H_post and H_res (n + n^2 per token) and the post "
        "kernel reads them.": (3 * n + 2) * C,
    }


@register(
    "4.2", "predict the fewest-bytes fused site",
    hints=[
        "Two kernels: one before F (reads x, writes F's input and the coefficients the second kernel needs), "
        "one after F (reads x, F's output and those coefficients, writes the new lanes).",
        "The pre kernel reads nC and writes C + n + n^2; the post kernel reads nC + C + n + n^2 and writes nC.",
    ],
    library="mhc_lab.measure.bytes_model.minimal_site_forward_elements",
    mistakes=[
        Mistake(lambda n, C: (2 * n + 1) * C + n * n + n, "only the reads"),
        Mistake(lambda n, C: (2 * n + 2) * C + 2 * (n * n + n), "x again"),
        Mistake(lambda n, C: bytes_model.elements_per_token("mhc_fused", n, C), "five-kernel plan"),
        Mistake(lambda n, C: bytes_model.hc_forward_elements(n, C), "unfused count"),
        Mistake(lambda n, C: (3 * n + 2) * C, "left out the coefficients"),
    ],
)
def _check_minimal_elements(answer):
    cases = []
    for n, C in [(4, 4096), (1, 7), (2, 33), (8, 1), (4, 2560)]:
        case = f"n={n}, C={C}"
        got = call(answer, n, C, case=case)
        _expect(got, bytes_model.minimal_site_forward_elements(n, C), case=case, name="elements per token",
                usual=_minimal_usual(n, C), parts=lambda: _parts_text(
                    lambda c: call(answer, n, c, case=case),
                    lambda c: bytes_model.minimal_site_forward_elements(n, c), C, _lanes_and_coefficients, _IN_C),
                advice="Count what each of the two kernels reads and writes (hint('4.2') says more).")
        cases.append(case)
    return cases


# ---- 4.3 ------------------------------------------------------------------------------------------------


def _seconds_usual(tokens: int, n: int, C: int, bw: float) -> dict[str, float]:
    moved = bytes_model.total("mhc", n).moved
    elements = moved.at(C)
    right = bytes_model.bytes_per_token("mhc", n, C)
    return {
        "you divided elements, not bytes, by the bandwidth: a bf16 element is 2 bytes, a float32 one 4.":
            tokens * elements / (bw * 1e9),
        "you took 4 bytes for every element; the lanes are bf16 (2 bytes), only the coefficients float32.":
            tokens * elements * 4 / (bw * 1e9),
        "you took 2 bytes for every element; the coefficients are float32 (4 bytes).":
            tokens * elements * 2 / (bw * 1e9),
        "you divided by 2**30: the course's GB is 1e9 bytes, as spec sheets count.": tokens * right / (bw * 2**30),
        "you computed the time of one token; multiply by the number of tokens.": right / (bw * 1e9),
    }


@register(
    "4.3", "predict the memory-bound time",
    hints=[
        "Time at best = bytes moved / bandwidth. Bytes moved = tokens x bytes per token.",
        "Per token the unfused site moves (8n + 2)C lane elements (bf16, 2 bytes) and 2n^2 + 4n coefficients "
        "(float32, 4 bytes).",
        "seconds = tokens * (2 * (8n + 2) * C + 4 * (2n^2 + 4n)) / (bandwidth_gbs * 1e9)",
    ],
    library="mhc_lab.measure.bytes_model.memory_bound_seconds",
    mistakes=[
        Mistake(lambda t, n, C, bw: t * bytes_model.hc_forward_elements(n, C) / (bw * 1e9), "elements, not bytes"),
        Mistake(lambda t, n, C, bw: t * 4 * bytes_model.hc_forward_elements(n, C) / (bw * 1e9), "4 bytes"),
        Mistake(lambda t, n, C, bw: t * 2 * bytes_model.hc_forward_elements(n, C) / (bw * 1e9), "2 bytes"),
        Mistake(lambda t, n, C, bw: t * bytes_model.bytes_per_token("mhc", n, C) / (bw * 2**30), "2**30"),
        Mistake(lambda t, n, C, bw: bytes_model.bytes_per_token("mhc", n, C) / (bw * 1e9), "one token"),
    ],
)
def _check_seconds(answer):
    cases = []
    for tokens, n, C, bw in [(16384, 4, 4096, 4800.0), (16384, 4, 2560, 4274.0), (1, 1, 7, 1.0),
                             (1000, 8, 33, 20.5), (2048, 2, 256, 15.0)]:
        case = f"tokens={tokens}, n={n}, C={C}, bandwidth_gbs={bw:g}"
        got = call(answer, tokens, n, C, bw, case=case)
        _expect(got, bytes_model.memory_bound_seconds(tokens, n, C, bw), case=case, name="seconds",
                usual=_seconds_usual(tokens, n, C, bw), parts=lambda: _parts_text(
                    lambda c: call(answer, tokens, n, c, bw, case=case),
                    lambda c: bytes_model.memory_bound_seconds(tokens, n, c, bw), C, _lanes_and_coefficients,
                    ("the time of the part proportional to C (the lanes, bf16)",
                     "the time of the part that does not grow with C (the coefficients, float32)")),
                advice="Seconds = tokens x bytes per token / (GB/s x 1e9); hint('4.3') says more.")
        cases.append(case)
    return cases


# ---- 4.4 ------------------------------------------------------------------------------------------------


def _intensity_usual(n: int, C: int, s: int, c: int) -> dict[str, float]:
    flops = 2 * n * n * C
    return {
        "you counted multiply-adds; each is 2 FLOPs (a multiply and an add).":
            flops / 2 / (2 * n * C * s + n * n * c),
        "you left out writing the result: the new lanes are nC elements.": flops / (n * C * s + n * n * c),
        "you left out reading H_res itself: n^2 coefficients per token.": flops / (2 * n * C * s),
        "you counted elements, not bytes: a lane element is stream_bytes, a coefficient coefficient_bytes.":
            flops / (2 * n * C + n * n),
        "your ratio is upside down: intensity is FLOPs per byte.": (2 * n * C * s + n * n * c) / flops,
    }


@register(
    "4.4", "arithmetic intensity of H_res x",
    hints=[
        "Each output channel of each new lane is a sum of n products: n^2 multiply-adds per channel, C channels.",
        "Bytes: read x (nC elements) and H_res (n^2), write the new lanes (nC).",
        "intensity = 2 n^2 C / (2 n C * stream_bytes + n^2 * coefficient_bytes)",
    ],
    library="mhc_lab.measure.bytes_model.res_apply_intensity",
    mistakes=[
        Mistake(lambda n, C, s, c: n * n * C / (2 * n * C * s + n * n * c), "multiply-adds"),
        Mistake(lambda n, C, s, c: 2 * n * n * C / (n * C * s + n * n * c), "writing the result"),
        Mistake(lambda n, C, s, c: 2 * n * n * C / (2 * n * C * s), "reading H_res"),
        Mistake(lambda n, C, s, c: 2 * n * n * C / (2 * n * C + n * n), "elements, not bytes"),
        Mistake(lambda n, C, s, c: (2 * n * C * s + n * n * c) / (2 * n * n * C), "upside down"),
    ],
)
def _check_intensity(answer):
    cases = []
    for n, C, s, c in [(4, 4096, 2, 4), (1, 7, 4, 4), (8, 33, 2, 4), (2, 1, 4, 4), (4, 2560, 4, 4)]:
        case = f"n={n}, C={C}, stream_bytes={s}, coefficient_bytes={c}"
        got = call(answer, n, C, s, c, case=case)
        expected = bytes_model.res_apply_intensity(n, C, s, c)
        value = _number(got, case, "FLOP per byte")
        _expect(got, expected, case=case, name="FLOP per byte", usual=_intensity_usual(n, C, s, c),
                advice=("Too high: too many FLOPs counted, or too few bytes." if value > expected else
                        "Too low: too few FLOPs counted, or too many bytes.")
                + " Check both: the multiply-adds, and every tensor read or written (hint('4.4')).")
        cases.append(case)
    return cases


# ---- 4.5 ------------------------------------------------------------------------------------------------


def _sinkhorn_usual(t: int) -> dict[str, float]:
    return {
        "you left out the input check: `(logits - logits).any()` launches two kernels (a subtraction, any), and its "
        "`if` then waits for the answer.": 6 * t - 1,
        "one kernel per normalisation: each normalisation is three (a sum, + eps, a division).": 2 * t,
        "you counted only the loop: before it come the check (2), softmax, + eps and one column normalisation "
        "(3).": 6 * (t - 1),
    }


@register(
    "4.5", "predict the Sinkhorn launches",
    hints=[
        "Read sinkhorn_deepseek_v4 and _check_logits line by line: every tensor operation that computes is one "
        "launch; a transpose or a reshape is a view and launches nothing.",
        "comb.sum(...) is one launch, + eps another, the division a third.",
        "2 (input check) + 1 (softmax) + 1 (+ eps) + 3 (first column normalisation) + 6 (t - 1).",
    ],
    library="mhc_lab.measure.profiling.sinkhorn_launches",
    mistakes=[
        Mistake(lambda t: 6 * t - 1, "input check"),
        Mistake(lambda t: 2 * t, "one kernel per normalisation"),
        Mistake(lambda t: 6 * (t - 1), "only the loop"),
    ],
)
def _check_sinkhorn_launches(answer):
    cases = []
    logits = torch.randn(3, 4, 4, generator=torch.Generator().manual_seed(0))
    measured = {}

    def launches(t: int) -> int:
        if t not in measured:
            measured[t] = profiling.trace_ops(sinkhorn_deepseek_v4, logits, t).launches
        return measured[t]

    def first_and_each_further(slope: float, value: float, t: int) -> tuple[float, float]:
        return value - slope * (t - 1), slope  # the launches of t = 1, and what each further iteration adds

    for t in (20, 1, 2, 3, 7):
        case = f"t={t}"
        got = call(answer, t, case=case)
        _expect(got, launches(t), case=case, name="launches", usual=_sinkhorn_usual(t),
                parts=lambda: _parts_text(lambda k: call(answer, k, case=case), launches, t, first_and_each_further,
                                          ("the count for t = 1 (the check, the start and the first pass)",
                                           "what each further iteration adds"), "t"),
                advice="The check counts them with profiling.trace_ops(sinkhorn_deepseek_v4, logits, t); "
                       "predict first, then run it yourself.")
        cases.append(case)
    return cases


