"""Hidden checks for lab 05 (used by `mhc-lab grade`, never shown in a lab): byte counts of one row, one
column and DeepSeek-V4-sized rows; bandwidth fractions above and far below the roof."""

from mhc_lab.bench.tilelang import fraction_of_copy_roof
from mhc_lab.course.checks import CheckFailed, call, expect_number
from mhc_lab.classroom.hidden_checks import hidden
from mhc_lab.kernels.rmsnorm import rmsnorm_bytes


@hidden("5.4", "one row, one column, 7168-wide rows")
def _rmsnorm_bytes(answer):
    cases = []
    for N, C in [(1, 1), (1, 4096), (16384, 1), (8192, 7168), (3, 1000)]:
        case = f"N={N}, C={C}"
        got = call(answer, N, C, case=case)
        if not isinstance(got, dict):
            raise CheckFailed(f"{case}: expected a dict with keys 'fused' and 'eager', got {type(got).__name__}")
        expected = rmsnorm_bytes(N, C)
        for key in ("fused", "eager"):
            expect_number(got.get(key), expected[key], case=case, name=f"{key} bytes", rel=1e-9)
        cases.append(case)
    return cases


@hidden("5.5", "faster than the roof, a thousand times slower, a tiny kernel")
def _fraction(answer):
    cases = []
    for nbytes, seconds, copy_gbs in [(4.2e9, 0.9e-3, 4273.0), (1e6, 1.0, 1.0), (64.0, 1e-9, 64.0)]:
        case = f"nbytes={nbytes:g}, seconds={seconds:g}, copy_gbs={copy_gbs:g}"
        got = call(answer, nbytes, seconds, copy_gbs, case=case)
        expect_number(got, fraction_of_copy_roof(nbytes, seconds, copy_gbs), case=case, name="fraction", rel=1e-9)
        cases.append(case)
    return cases
