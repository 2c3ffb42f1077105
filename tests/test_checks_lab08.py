"""Lab 08's checks close the gaps a learner found: exercise 8.3 refuses the plain stack's verdict in place of the mHC
stack's own, and exercise 8.6 refuses a layer input returned in float32 for bfloat16 lanes; each names the mistake."""

import pytest
import torch

from mhc_lab.course import deepseek_v4
from mhc_lab.course.checks import CheckFailed, run_check
from mhc_lab.reference import mhc_coefficients, mhc_pre


def _host_ms(launched_ms, gpu_ms, plain_launched_ms, plain_gpu_ms, layers):
    return ((launched_ms - plain_launched_ms) - (gpu_ms - plain_gpu_ms)) / layers


def test_the_right_answer_passes():
    def right(launched_ms, gpu_ms, plain_launched_ms, plain_gpu_ms, layers):
        return (_host_ms(launched_ms, gpu_ms, plain_launched_ms, plain_gpu_ms, layers),
                launched_ms - gpu_ms > launched_ms / 2)

    assert run_check("8.3", right)


def test_the_plain_stacks_verdict_fails_naming_it():
    def plain_verdict(launched_ms, gpu_ms, plain_launched_ms, plain_gpu_ms, layers):
        host_ms = _host_ms(launched_ms, gpu_ms, plain_launched_ms, plain_gpu_ms, layers)
        return host_ms, plain_launched_ms - plain_gpu_ms > plain_launched_ms / 2

    with pytest.raises(CheckFailed, match="the plain stack's verdict returned") as failure:
        run_check("8.3", plain_verdict)
    assert "expected host_bound" in str(failure.value)


def test_a_verdict_that_ignores_both_steps_fails():
    def always_host_bound(launched_ms, gpu_ms, plain_launched_ms, plain_gpu_ms, layers):
        return _host_ms(launched_ms, gpu_ms, plain_launched_ms, plain_gpu_ms, layers), True

    with pytest.raises(CheckFailed, match="expected host_bound = False"):
        run_check("8.3", always_host_bound)


needs_transformers = pytest.mark.skipif(deepseek_v4.TRANSFORMERS is None, reason="transformers not installed")


def _right(fn, base, scale, x):
    pre, post, res = mhc_coefficients(x, fn, base, scale)
    return post, res.transpose(-1, -2), mhc_pre(x, pre)


@needs_transformers
def test_hyper_connection_answer_passes():
    assert run_check("8.6", _right)


@needs_transformers
@pytest.mark.parametrize("how", ["lanes cast first", "result cast after"])
def test_a_float32_layer_input_fails_naming_it(how):
    def float32(fn, base, scale, x):
        pre, post, res = mhc_coefficients(x, fn, base, scale)
        collapsed = mhc_pre(x.float(), pre) if how == "lanes cast first" else mhc_pre(x, pre).float()
        return post, res.transpose(-1, -2), collapsed

    with pytest.raises(CheckFailed, match="collapsed in float32") as failure:
        run_check("8.6", float32)
    assert "bfloat16" in str(failure.value)
