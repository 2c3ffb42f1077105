"""Hidden checks for lab 00 (used by `mhc-lab grade`, never shown in a lab): more dtypes, empty and huge counts,
integer inputs (a `//` where `/` belongs), vector-shaped matmuls, one-byte elements."""

import torch

from mhc_lab.course.checks import CheckFailed, call, expect_number
from mhc_lab.classroom.hidden_checks import hidden
from mhc_lab.measure import gigabytes_per_second
from mhc_lab.measure.roofline import copy_bytes, matmul_intensity


def _whole(got, case: str) -> None:
    try:
        whole = float(got).is_integer()
    except (TypeError, ValueError, OverflowError):
        whole = False
    if not whole:
        raise CheckFailed(f"{case}: a number of bytes is a whole number, got {got!r}")


@hidden("0.1", "every dtype, not only the floating ones")
def _copy_dtypes(answer):
    dtypes = [torch.int8, torch.uint8, torch.bool, torch.int16, torch.int32, torch.int64, torch.complex64,
              torch.complex128, torch.float8_e4m3fn]
    cases = []
    for dtype in dtypes:
        case = f"numel=3, dtype={dtype}"
        got = call(answer, 3, dtype, case=case)
        expect_number(got, copy_bytes(3, dtype), case=case, name="bytes",
                      explain=f"{dtype} has {torch.empty((), dtype=dtype).element_size()} bytes per element.")
        cases.append(case)
    return cases


@hidden("0.1", "zero, one and more than 2**32 elements")
def _copy_counts(answer):
    cases = []
    for numel, dtype in [(0, torch.float32), (1, torch.float64), (2**40 + 3, torch.bfloat16)]:
        case = f"numel={numel}, dtype={dtype}"
        got = call(answer, numel, dtype, case=case)
        _whole(got, case)
        expect_number(got, copy_bytes(numel, dtype), case=case, name="bytes", rel=0.0)
        cases.append(case)
    return cases


@hidden("0.2", "zero bytes, integer inputs, extreme magnitudes")
def _bandwidth_edges(answer):
    cases = []
    for nbytes, seconds in [(0, 1.0), (3, 2), (10**15, 1000.0), (64, 1e-12), (7, 3)]:
        case = f"nbytes={nbytes!r}, seconds={seconds!r}"
        got = call(answer, nbytes, seconds, case=case)
        explain = "Integer inputs: use true division `/`, not `//`." if isinstance(nbytes, int) else ""
        expect_number(got, gigabytes_per_second(nbytes, seconds), case=case, name="GB/s", rel=1e-9,
                      explain=explain)
        cases.append(case)
    return cases


@hidden("0.3", "matrix-vector shapes, small integer sizes, one-byte elements")
def _intensity_edges(answer):
    cases = []
    for m, n, k, b in [(1, 4096, 4096, 2), (4096, 1, 4096, 2), (3, 3, 3, 4), (8192, 8192, 8192, 1),
                       (2**20, 2**20, 2**20, 2)]:
        case = f"m={m}, n={n}, k={k}, bytes_per_element={b}"
        got = call(answer, m, n, k, b, case=case)
        expect_number(got, matmul_intensity(m, n, k, b), case=case, name="FLOP per byte", rel=1e-9,
                      explain="Integer sizes: use true division `/`, not `//`.")
        cases.append(case)
    return cases
