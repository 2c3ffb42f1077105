"""Hidden checks for lab 06 (used by `mhc-lab grade`, never shown in a lab): the norm-after logits for n = 3
and 16 and batch dimensions; byte counts for one lane, one channel and 8-byte elements."""

from mhc_lab.course.checks import call, expect_number, randn
from mhc_lab.course.forward_lab import PLANS, logits_norm_first, phi_bytes_per_token, site_lane_bytes
from mhc_lab.classroom.hidden_checks import hidden, same_as_reference


@hidden("6.3", "n = 3 and 16, batch dimensions, one channel")
def _logits(answer):
    cases = []
    for k, (lead, n, C) in enumerate([((2, 3), 3, 5), ((1,), 16, 2), ((4,), 2, 1)]):
        width = n * n + 2 * n
        x = randn(*lead, n, C, seed=90 + k)
        phi, bias, alpha = randn(width, n * C, seed=95 + k), randn(width, seed=99 + k), randn(3, seed=103 + k)
        cases.append(same_as_reference(answer, logits_norm_first, x, phi, bias, alpha,
                                       case=f"lanes of shape {tuple(x.shape)}", name="logits"))
    return cases


@hidden("6.4", "one lane, one channel, 8-byte elements, n = 16")
def _site_bytes(answer):
    cases = []
    for n, C, itemsize in [(1, 1, 2), (16, 4096, 2), (4, 7168, 8), (3, 5, 1)]:
        for plan in PLANS:
            case = f"n={n}, C={C}, plan={plan!r}, itemsize={itemsize}"
            got = call(answer, n, C, plan, itemsize, case=case)
            expect_number(got, site_lane_bytes(n, C, plan, itemsize), case=case, name="bytes per token", rel=1e-9)
            cases.append(case)
    return cases


@hidden("6.5", "one-token tiles, n = 16, a tile larger than a wave")
def _phi_bytes(answer):
    cases = []
    for n, C, tile in [(16, 128, 1), (4, 2560, 1024), (1, 1, 1), (8, 7168, 3)]:
        case = f"n={n}, C={C}, tile_tokens={tile}"
        got = call(answer, n, C, tile, case=case)
        expect_number(got, phi_bytes_per_token(n, C, tile), case=case, name="bytes per token", rel=1e-9)
        cases.append(case)
    return cases
