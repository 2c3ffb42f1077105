"""Lab 00 exercises: the vocabulary of measuring (bytes moved, GB/s, arithmetic intensity)."""

from __future__ import annotations

import torch

from mhc_lab.course.checks import Mistake, call, expect_number, register


from mhc_lab.measure import gigabytes_per_second
from mhc_lab.measure.roofline import copy_bytes as bytes_moved_by_copy, matmul_intensity


_COPY_CASES = [(1000, torch.float32), (4096 * 4, torch.bfloat16), (7, torch.float64), (123_457, torch.float16)]


@register(
    "0.1", "bytes moved by a copy",
    hints=[
        "A copy reads every element once and writes every element once.",
        "torch.empty((), dtype=dtype).element_size() gives the bytes of one element.",
        "bytes = 2 * numel * element size.",
    ],
    library="mhc_lab.measure.roofline.copy_bytes",
    mistakes=[
        Mistake(lambda numel, dtype: numel * torch.empty((), dtype=dtype).element_size(), "only the read"),
        Mistake(lambda numel, dtype: 2 * numel * 4, "4 bytes per element"),
    ],
)
def _check_copy(answer):
    cases = []
    for numel, dtype in _COPY_CASES:
        case = f"numel={numel}, dtype={dtype}"
        got = call(answer, numel, dtype, case=case)
        expected = bytes_moved_by_copy(numel, dtype)
        size = torch.empty((), dtype=dtype).element_size()
        explain = ""
        if got == numel * size:
            explain = "You counted only the read: a copy also writes every byte it reads."
        elif got == 2 * numel * 4 and size != 4:
            explain = f"You assumed 4 bytes per element; {dtype} has {size}."
        expect_number(got, expected, case=case, name="bytes", explain=explain)
        cases.append(case)
    return cases


@register(
    "0.2", "GB/s from bytes and seconds",
    hints=["Bandwidth is bytes divided by seconds.", "The course uses GB = 1e9 bytes, as spec sheets do."],
    library="mhc_lab.measure.timing.gigabytes_per_second",
    mistakes=[
        Mistake(lambda nbytes, seconds: nbytes / seconds / 2**30, "2**30"),
        Mistake(lambda nbytes, seconds: seconds / nbytes * 1e9, "upside down"),
    ],
)
def _check_gbs(answer):
    cases = []
    for nbytes, seconds in [(8e9, 2.0), (4096 * 4096 * 2 * 2, 3.1e-5), (1.0, 1e-9), (123456789, 0.25)]:
        case = f"nbytes={nbytes:g}, seconds={seconds:g}"
        got = call(answer, nbytes, seconds, case=case)
        expected = gigabytes_per_second(nbytes, seconds)
        explain = ""
        try:
            if abs(float(got) - nbytes / seconds / 2**30) < 1e-9 * expected:
                explain = "You divided by 2**30 (GiB); the course uses GB = 1e9 bytes, as spec sheets do."
            elif abs(float(got) - seconds / nbytes * 1e9) < 1e-12 * max(1.0, seconds / nbytes * 1e9):
                explain = "Your formula is upside down: bandwidth is bytes per second."
        except (TypeError, ValueError):
            pass
        expect_number(got, expected, case=case, name="GB/s", explain=explain)
        cases.append(case)
    return cases


@register(
    "0.3", "arithmetic intensity of a matmul",
    hints=[
        "An [m, k] x [k, n] product does m*n*k multiply-adds, and one multiply-add is 2 FLOPs.",
        "At best it reads A and B once and writes C once: (m*k + k*n + m*n) elements.",
        "intensity = FLOPs / bytes.",
    ],
    library="mhc_lab.measure.roofline.matmul_intensity",
    mistakes=[
        Mistake(lambda m, n, k, b: m * n * k / ((m * k + k * n + m * n) * b), "multiply-add"),
        Mistake(lambda m, n, k, b: 2 * m * n * k / ((m * k + k * n) * b), "output"),
    ],
)
def _check_intensity(answer):
    cases = []
    for m, n, k, b in [(4096, 4096, 4096, 2), (16384, 24, 16384, 2), (1, 1, 1, 4), (333, 77, 1000, 4)]:
        case = f"m={m}, n={n}, k={k}, bytes_per_element={b}"
        got = call(answer, m, n, k, b, case=case)
        expected = matmul_intensity(m, n, k, b)
        explain = ""
        try:
            if abs(float(got) * 2 - expected) < 1e-9 * expected:
                explain = "You counted multiply-adds; each is 2 FLOPs (a multiply and an add)."
            elif abs(float(got) - 2 * m * n * k / ((m * k + k * n) * b)) < 1e-9 * expected:
                explain = "You left out writing the output C (m*n elements)."
        except (TypeError, ValueError):
            pass
        expect_number(got, expected, case=case, name="FLOP per byte", explain=explain)
        cases.append(case)
    return cases
