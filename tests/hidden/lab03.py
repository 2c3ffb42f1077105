"""Hidden checks for lab 03 (used by `mhc-lab grade`, never shown in a lab): n = 1 and 16, batch dimensions,
float32, a single iteration, exactly doubly stochastic input."""

import torch

from mhc_lab.course.birkhoff import doubly_stochastic_gaps
from mhc_lab.course.checks import randn
from mhc_lab.classroom.hidden_checks import hidden, same_as_reference
from mhc_lab.reference import mhc_post, sinkhorn_deepseek_v4, sinkhorn_log_domain, sinkhorn_paper


@hidden("3.1", "one lane, a permutation matrix, batch dimensions")
def _gaps_edges(answer):
    return [same_as_reference(answer, doubly_stochastic_gaps, h, case=case) for h, case in [
        (randn(1, 1, seed=71), "a 1 x 1 matrix"),
        (torch.eye(5, dtype=torch.float64)[[2, 0, 4, 1, 3]], "a permutation matrix (gaps all zero)"),
        (randn(2, 3, 6, 6, seed=72), "a [2, 3] batch of 6 x 6 matrices"),
    ]]


def _sinkhorn_cases(answer, reference):
    cases = []
    for shape, iterations, dtype in [((1, 1), 20, torch.float64), ((16, 16), 20, torch.float64),
                                     ((3, 5, 4, 4), 20, torch.float64), ((4, 4), 1, torch.float64),
                                     ((2, 8, 8), 20, torch.float32)]:
        logits = randn(*shape, seed=73, dtype=dtype)
        cases.append(same_as_reference(answer, reference, logits, iterations=iterations,
                                       case=f"logits of shape {shape}, {iterations} iterations, {dtype}"))
    return cases


@hidden("3.2", "n = 1 and 16, batch dimensions, one iteration, float32")
def _paper_shapes(answer):
    return _sinkhorn_cases(answer, sinkhorn_paper)


@hidden("3.3", "n = 1 and 16, batch dimensions, one iteration, float32")
def _v4_shapes(answer):
    return _sinkhorn_cases(answer, sinkhorn_deepseek_v4)


@hidden("3.4", "n = 1 and 16, batch dimensions, one iteration, float32")
def _log_shapes(answer):
    return _sinkhorn_cases(answer, sinkhorn_log_domain)


@hidden("3.6", "one lane, width one, batch dimensions")
def _post_shapes(answer):
    cases = []
    for batch, n, width in [((2,), 1, 5), ((3,), 4, 1), ((2, 3), 8, 6)]:
        x, out = randn(*batch, n, width, seed=74), randn(*batch, width, seed=75)
        post, res = randn(*batch, n, seed=76), randn(*batch, n, n, seed=77)
        cases.append(same_as_reference(answer, mhc_post, x, out, post, res,
                                       case=f"lanes of shape {tuple(x.shape)}"))
    return cases
