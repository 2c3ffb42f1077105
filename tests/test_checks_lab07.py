"""Lab 07's checks name the usual mistakes of the backward: a Sinkhorn round too many or too few, a dropped eps
(in each place it can be dropped, with a difference the message's digits show), and the RMS r taken for its
inverse; an answer that is nearly right is not told it made one of them."""

import re

import pytest
import torch

from mhc_lab.course.checks import CheckFailed, run_check
from mhc_lab.course.exercises import lab07
from mhc_lab.course.training_lab import norm_scale_backward, normalize_step_backward


def _message(id, answer) -> str:
    with pytest.raises(CheckFailed) as failure:
        run_check(id, answer)
    return str(failure.value)


def _digits_differ(message: str) -> bool:
    """The message's 'expected A, got B' shows two different numbers."""
    found = re.search(r"expected (\S+), got (\S+?)[.,]?(?:\s|$)", message)
    return bool(found) and found.group(1) != found.group(2)


@pytest.mark.parametrize("kind, says", [("extra_round", "one Sinkhorn round too many"),
                                        ("round_short", "one Sinkhorn round too few"),
                                        ("row_first", "starts with a column step")])
def test_a_sinkhorn_round_too_many_or_too_few_is_named(kind, says):
    message = _message("7.3", lab07._sinkhorn_wrong(kind))
    assert says in message and "forgetting the eps" not in message, message


def test_a_learner_loop_with_one_round_more_is_named():
    """Written as a learner writes it: the loop runs `iterations` times a row and a column step after the first."""
    def one_more(logits, grad_res, iterations=20, eps=1e-6):
        softmax = torch.softmax(logits, dim=-1)
        comb, steps = softmax + eps, []
        for dim in [-2] + [-1, -2] * iterations:
            steps.append((dim, comb))
            comb = comb / (comb.sum(dim=dim, keepdim=True) + eps)
        d = grad_res.transpose(-1, -2)
        for dim, p in reversed(steps):
            d = normalize_step_backward(p, d, dim, eps)
        return softmax * (d - (d * softmax).sum(dim=-1, keepdim=True))

    assert "one Sinkhorn round too many" in _message("7.3", one_more)


@pytest.mark.parametrize("id, answer, says", [
    ("7.2", lab07._step_wrong("no_eps"), "forgetting the eps"),
    ("7.3", lab07._sinkhorn_wrong("no_eps"), "forgetting the eps, in both places"),
    ("7.3", lab07._sinkhorn_wrong("no_eps_comb"), "forgetting the eps of comb"),
    ("7.3", lab07._sinkhorn_wrong("no_eps_steps"), "forgetting the eps of the steps"),
    ("7.4", lab07._norm_wrong("no_eps"), "forgetting the eps"),
])
def test_a_dropped_eps_is_named_where_its_difference_shows(id, answer, says):
    message = _message(id, answer)
    assert says in message, message
    assert _digits_differ(message), f"the expected and the given value print alike: {message}"


# each exercise's answer written out (the wrong-answer builders with no mistake): the checks refuse the library's own
RIGHT = {"7.2": lab07._step_wrong("none"), "7.3": lab07._sinkhorn_wrong("none"), "7.4": lab07._norm_wrong("none")}


@pytest.mark.parametrize("id", RIGHT)
def test_the_answer_written_out_passes(id):
    assert run_check(id, RIGHT[id])


@pytest.mark.parametrize("id", RIGHT)
def test_a_nearly_right_answer_is_not_told_it_dropped_the_eps(id):
    def nearly(*args):
        return RIGHT[id](*args) * (1 + 3e-7)

    message = _message(id, nearly)
    assert "is close, but not within the tolerance" in message and "usual mistake" not in message, message


def test_the_rms_taken_for_its_inverse_is_named():
    """r is the RMS; the scale the norm applies is 1/r. The formula of the inverse RMS, r^3 on top, is named."""
    message = _message("7.4", lab07._norm_wrong("r3_on_top"))
    assert "r^3 multiplies where it should divide" in message and "r is the RMS" in message


def test_norm_scale_backward_is_the_gradient_through_one_over_the_rms():
    """Against autograd in float64: x -> 1/r = 1 / sqrt(mean(x^2) + eps) over each token's n * C values."""
    g = torch.Generator().manual_seed(0)
    for shape, eps in (((3, 4, 5), 1e-6), ((2, 1, 1), 0.5), ((1, 8, 33), 1e-6)):
        x = torch.randn(*shape, dtype=torch.float64, generator=g).requires_grad_(True)
        upstream = torch.randn(shape[0], 1, dtype=torch.float64, generator=g)
        inv_r = 1 / torch.sqrt(x.pow(2).mean(dim=(-2, -1)) + eps)
        (want,) = torch.autograd.grad(inv_r, x, upstream.squeeze(-1))
        torch.testing.assert_close(norm_scale_backward(x.detach(), upstream, eps), want, rtol=1e-12, atol=1e-14)
