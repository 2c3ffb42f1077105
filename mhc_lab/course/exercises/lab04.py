"""Lab 04 exercises: predict, then measure. The learner predicts bytes per token, a memory-bound time, an
arithmetic intensity and a launch count; each check compares the prediction with the count (the bytes model,
or the operations the reference code really launches) and explains the difference."""

from __future__ import annotations

import math

import torch

from mhc_lab.measure import bytes_model, profiling
from mhc_lab.course.checks import Mistake, call, expect_number, register
from mhc_lab.reference import sinkhorn_deepseek_v4


def _close(a: float, b: float, rel: float = 1e-6) -> bool:
    return abs(a - b) <= rel * max(abs(b), 1e-300)


def _explain(got, usual: dict[str, float], where: str) -> str:
    """Name the usual mistake the prediction matches, if any, then say where the count comes from."""
    try:
        value = float(got)
    except (TypeError, ValueError):
        return where
    if math.isnan(value):
        return where
    for explanation, wrong in usual.items():
        if _close(value, wrong):
            return f"This looks like the usual mistake: {explanation} {where}"
    return where


def _rows_text(method: str, n: int) -> str:
    parts = [f"{r.operation}: reads {r.read}, writes {r.write}" for r in bytes_model.rows(method, n)]
    return "; ".join(parts)


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
    solution=bytes_model.hc_forward_elements,
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
        expected = bytes_model.hc_forward_elements(n, C)
        where = f"mHC Table 2 counts, per token: {_rows_text('hc', n)}."
        expect_number(got, expected, case=case, name="elements per token",
                      explain=_explain(got, _hc_usual(n, C), where))
        cases.append(case)
    return cases


# ---- 4.2 ------------------------------------------------------------------------------------------------


def _minimal_usual(n: int, C: int) -> dict[str, float]:
    k = n * n + n
    return {
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
    solution=bytes_model.minimal_site_forward_elements,
    mistakes=[
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
        expected = bytes_model.minimal_site_forward_elements(n, C)
        where = f"The count, per token: {_rows_text('mhc_minimal', n)}."
        expect_number(got, expected, case=case, name="elements per token",
                      explain=_explain(got, _minimal_usual(n, C), where))
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
    solution=bytes_model.memory_bound_seconds,
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
        expected = bytes_model.memory_bound_seconds(tokens, n, C, bw)
        where = (f"The count: {bytes_model.bytes_per_token('mhc', n, C):,} bytes per token "
                 f"({bytes_model.total('mhc', n).moved} elements), times {tokens} tokens, over {bw:g} GB/s.")
        expect_number(got, expected, case=case, name="seconds",
                      explain=_explain(got, _seconds_usual(tokens, n, C, bw), where))
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
    }


@register(
    "4.4", "arithmetic intensity of H_res x",
    hints=[
        "Each output channel of each new lane is a sum of n products: n^2 multiply-adds per channel, C channels.",
        "Bytes: read x (nC elements) and H_res (n^2), write the new lanes (nC).",
        "intensity = 2 n^2 C / (2 n C * stream_bytes + n^2 * coefficient_bytes)",
    ],
    solution=bytes_model.res_apply_intensity,
    mistakes=[
        Mistake(lambda n, C, s, c: n * n * C / (2 * n * C * s + n * n * c), "multiply-adds"),
        Mistake(lambda n, C, s, c: 2 * n * n * C / (n * C * s + n * n * c), "writing the result"),
        Mistake(lambda n, C, s, c: 2 * n * n * C / (2 * n * C * s), "reading H_res"),
    ],
)
def _check_intensity(answer):
    cases = []
    for n, C, s, c in [(4, 4096, 2, 4), (1, 7, 4, 4), (8, 33, 2, 4), (2, 1, 4, 4), (4, 2560, 4, 4)]:
        case = f"n={n}, C={C}, stream_bytes={s}, coefficient_bytes={c}"
        got = call(answer, n, C, s, c, case=case)
        expected = bytes_model.res_apply_intensity(n, C, s, c)
        where = (f"The count: {2 * n * n * C:,} FLOPs over {2 * n * C * s + n * n * c:,} bytes "
                 f"(read nC + n^2, write nC).")
        expect_number(got, expected, case=case, name="FLOP per byte",
                      explain=_explain(got, _intensity_usual(n, C, s, c), where))
        cases.append(case)
    return cases


# ---- 4.5 ------------------------------------------------------------------------------------------------


def _sinkhorn_usual(t: int) -> dict[str, float]:
    return {
        "you left out the input check: `torch.isnan(logits).any()` launches two kernels (isnan, any), and its "
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
    solution=profiling.sinkhorn_launches,
    mistakes=[
        Mistake(lambda t: 6 * t - 1, "input check"),
        Mistake(lambda t: 2 * t, "one kernel per normalisation"),
        Mistake(lambda t: 6 * (t - 1), "only the loop"),
    ],
)
def _check_sinkhorn_launches(answer):
    cases = []
    logits = torch.randn(3, 4, 4, generator=torch.Generator().manual_seed(0))
    for t in (20, 1, 2, 3, 7):
        case = f"t={t}"
        got = call(answer, t, case=case)
        trace = profiling.trace_ops(sinkhorn_deepseek_v4, logits, t)
        ops = ", ".join(f"{count} {name}" for name, count in trace.by_name().items())
        where = f"Measured (trace_ops on sinkhorn_deepseek_v4): {trace.launches} launches: {ops}."
        expect_number(got, trace.launches, case=case, name="launches",
                      explain=_explain(got, _sinkhorn_usual(t), where))
        cases.append(case)
    return cases


