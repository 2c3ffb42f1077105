"""Hidden checks for lab 07 (used by `mhc-lab grade`, never shown in a lab): the post backward for n = 3 and 16
and one channel; a normalisation step on rectangular matrices and a large eps; the Sinkhorn backward for n = 3,
few rounds and large logits; the RMS scale backward for n = 16, one channel, float32 and no eps; Eq. 20 for
deep stacks, one-layer and whole-stack blocks."""

import torch

from mhc_lab.course.checks import call, expect_number, randn
from mhc_lab.classroom.hidden_checks import hidden, same_as_reference
from mhc_lab.reference.recompute import recompute_memory
from mhc_lab.course.training_lab import norm_scale_backward, normalize_step_backward
from mhc_lab.reference import sinkhorn
from mhc_lab.reference.backward import post_backward, sinkhorn_backward


@hidden("7.1", "n = 3 and 16, one channel, batch dimensions")
def _post_backward(answer):
    cases = []
    for k, (lead, n, C) in enumerate([((2, 2), 3, 5), ((3,), 16, 2), ((4,), 2, 1), ((1, 1), 5, 13)]):
        x, f, g = randn(*lead, n, C, seed=170 + k), randn(*lead, C, seed=180 + k), randn(*lead, n, C, seed=190 + k)
        post = 2 * torch.sigmoid(randn(*lead, n, seed=200 + k))
        res = sinkhorn(randn(*lead, n, n, seed=210 + k, scale=3.0))
        cases.append(same_as_reference(answer, post_backward, x, f, post, res, g,
                                       case=f"x of shape {tuple(x.shape)}", name="gradients"))
    return cases


@hidden("7.2", "rectangular matrices, batch dimensions, a large eps")
def _step(answer):
    cases = []
    for k, (shape, dim, eps) in enumerate([((2, 3, 5), -1, 1e-6), ((2, 3, 5), -2, 1e-6), ((4, 7, 2), -1, 1.0),
                                           ((1, 2, 3, 3), -2, 0.5)]):
        p = torch.exp(randn(*shape, seed=220 + k, scale=2.0))
        dq = randn(*shape, seed=230 + k)
        cases.append(same_as_reference(answer, normalize_step_backward, p, dq, dim, eps,
                                       case=f"P of shape {shape}, dim={dim}, eps={eps:g}", name="dP"))
    return cases


@hidden("7.3", "n = 3, few rounds, large logits")
def _sinkhorn(answer):
    cases = []
    for k, (lead, n, iterations, scale) in enumerate([((4,), 3, 20, 1.0), ((2,), 3, 2, 1.0), ((3,), 4, 20, 4.0),
                                                      ((2, 2), 5, 7, 2.0)]):
        logits = randn(*lead, n, n, seed=240 + k, scale=scale)
        grad = randn(*lead, n, n, seed=250 + k)
        cases.append(same_as_reference(answer, sinkhorn_backward, logits, grad, iterations, 1e-6,
                                       case=f"logits of shape {tuple(logits.shape)}, iterations={iterations}",
                                       name="dlogits"))
    return cases


@hidden("7.4", "n = 16, one channel, float32, no eps")
def _norm(answer):
    cases = []
    for k, (lead, n, C, eps, dtype) in enumerate([((3,), 16, 1, 1e-6, torch.float64), ((2,), 3, 2, 0.0, torch.float64),
                                                  ((5,), 4, 32, 1e-6, torch.float32), ((1, 2), 1, 9, 0.1,
                                                                                       torch.float64)]):
        x = randn(*lead, n, C, seed=260 + k, dtype=dtype)
        grad_r = randn(*lead, 1, seed=270 + k, dtype=dtype)
        cases.append(same_as_reference(answer, norm_scale_backward, x, grad_r, eps,
                                       case=f"x of shape {tuple(x.shape)}, {dtype}, rms_eps={eps:g}", name="dx"))
    return cases


@hidden("7.5", "deep stacks, one-layer blocks, one block of the whole stack, n = 16")
def _eq20(answer):
    cases = []
    for n, layers, block in [(4, 1000, 1), (4, 1000, 1000), (16, 97, 10), (1, 1, 1), (4, 61, 8)]:
        case = f"n={n}, L={layers}, L_r={block}"
        got = call(answer, n, layers, block, case=case)
        expect_number(got, recompute_memory(n, layers, block), case=case, name="memory per token", rel=1e-12)
        cases.append(case)
    return cases
