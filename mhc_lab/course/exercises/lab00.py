"""Lab 00 exercises: the vocabulary of measuring (bytes moved, GB/s, arithmetic intensity)."""

from __future__ import annotations

import torch

from mhc_lab.course.checks import Mistake, call, expect_number, register
from mhc_lab.measure import gigabytes_per_second
from mhc_lab.measure.roofline import copy_bytes as bytes_moved_by_copy, matmul_intensity


_COPY_CASES = [(1000, torch.float32), (4096 * 4, torch.bfloat16), (7, torch.float64), (123_457, torch.float16)]


def _size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


# Each usual mistake: what the check says, and the number it gives.
_COPY_MISTAKES = {
    "you counted only the read: a copy also writes every byte it reads.": lambda numel, dtype: numel * _size(dtype),
    "you assumed 4 bytes per element; look the size up for the dtype: torch.empty((), dtype=dtype).element_size().":
        lambda numel, dtype: 2 * numel * 4,
    "you counted elements, not bytes: multiply by the bytes of one element.": lambda numel, dtype: 2 * numel,
}


@register(
    "0.1", "bytes moved by a copy",
    hints=[
        "A copy reads every element once and writes every element once.",
        "torch.empty((), dtype=dtype).element_size() gives the bytes of one element.",
        "bytes = 2 * numel * element size.",
    ],
    library="mhc_lab.measure.roofline.copy_bytes",
    mistakes=[Mistake(fn, says) for says, fn in _COPY_MISTAKES.items()],
)
def _check_copy(answer):
    cases = []
    for numel, dtype in _COPY_CASES:
        case = f"numel={numel}, dtype={dtype}"
        got = call(answer, numel, dtype, case=case)
        expect_number(got, bytes_moved_by_copy(numel, dtype), case=case, name="bytes",
                      mistakes={says: fn(numel, dtype) for says, fn in _COPY_MISTAKES.items()})
        cases.append(case)
    return cases


_GBS_MISTAKES = {
    "you divided by 2**30 (GiB); the course uses GB = 1e9 bytes, as spec sheets do.":
        lambda nbytes, seconds: nbytes / seconds / 2**30,
    "your formula is upside down: bandwidth is bytes per second.": lambda nbytes, seconds: seconds / nbytes * 1e9,
    "you left out the 1e9: the answer is in GB/s, not bytes per second.": lambda nbytes, seconds: nbytes / seconds,
}


@register(
    "0.2", "GB/s from bytes and seconds",
    hints=["Bandwidth is bytes divided by seconds.", "The course uses GB = 1e9 bytes, as spec sheets do."],
    library="mhc_lab.measure.timing.gigabytes_per_second",
    mistakes=[Mistake(fn, says) for says, fn in _GBS_MISTAKES.items()],
)
def _check_gbs(answer):
    cases = []
    for nbytes, seconds in [(8e9, 2.0), (4096 * 4096 * 2 * 2, 3.1e-5), (1.0, 1e-9), (123456789, 0.25)]:
        case = f"nbytes={nbytes:g}, seconds={seconds:g}"
        got = call(answer, nbytes, seconds, case=case)
        expect_number(got, gigabytes_per_second(nbytes, seconds), case=case, name="GB/s",
                      mistakes={says: fn(nbytes, seconds) for says, fn in _GBS_MISTAKES.items()})
        cases.append(case)
    return cases


_INTENSITY_MISTAKES = {
    "you counted multiply-adds; each is 2 FLOPs (a multiply and an add).":
        lambda m, n, k, b: m * n * k / ((m * k + k * n + m * n) * b),
    "you left out writing the output C (m*n elements).": lambda m, n, k, b: 2 * m * n * k / ((m * k + k * n) * b),
    "you counted elements, not bytes: multiply the elements by bytes_per_element.":
        lambda m, n, k, b: 2 * m * n * k / (m * k + k * n + m * n),
    "your ratio is upside down: intensity is FLOPs per byte.":
        lambda m, n, k, b: (m * k + k * n + m * n) * b / (2 * m * n * k),
}


@register(
    "0.3", "arithmetic intensity of a matmul",
    hints=[
        "An [m, k] x [k, n] product does m*n*k multiply-adds, and one multiply-add is 2 FLOPs.",
        "At best it reads A and B once and writes C once: (m*k + k*n + m*n) elements.",
        "intensity = FLOPs / bytes.",
    ],
    library="mhc_lab.measure.roofline.matmul_intensity",
    mistakes=[Mistake(fn, says) for says, fn in _INTENSITY_MISTAKES.items()],
)
def _check_intensity(answer):
    cases = []
    for m, n, k, b in [(4096, 4096, 4096, 2), (16384, 24, 16384, 2), (1, 1, 1, 4), (333, 77, 1000, 4)]:
        case = f"m={m}, n={n}, k={k}, bytes_per_element={b}"
        got = call(answer, m, n, k, b, case=case)
        expect_number(got, matmul_intensity(m, n, k, b), case=case, name="FLOP per byte",
                      mistakes={says: fn(m, n, k, b) for says, fn in _INTENSITY_MISTAKES.items()})
        cases.append(case)
    return cases
