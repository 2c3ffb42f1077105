"""Hidden checks for lab 01 (used by `mhc-lab grade`, never shown in a lab): one-element and batched states,
float32, an empty list of layers or branches, shortcut scales of 0 and below 0. Each calls the learner's
function the way the visible check does (the learner's signature may be narrower than the library's)."""

import torch

from mhc_lab.course.checks import TanhLayer, randn
from mhc_lab.course.depth_probe import residual_stack, residual_tanh_backward, shortcut_gain, unrolled_state
from mhc_lab.classroom.hidden_checks import hidden, same_as_reference
from mhc_lab.reference.residual import residual_step


def _tanh_layer(width: int, seed: int) -> TanhLayer:
    # A library class, not a closure: the grader sends it to the learner's kernel.
    weight = randn(width, width, seed=seed, scale=width**-0.5)
    return TanhLayer(weight, torch.zeros(width, dtype=torch.float64))


@hidden("1.1", "one element, batch dimensions, float32, a layer that outputs zeros")
def _step_shapes(answer):
    cases = []
    for shape, dtype in [((1,), torch.float64), ((2, 3, 5), torch.float64), ((4, 7), torch.float32)]:
        x = randn(*shape, seed=11, dtype=dtype)
        cases.append(same_as_reference(answer, residual_step, x, _tanh_layer(shape[-1], 12),
                                       case=f"x of shape {shape}, {dtype}"))
    x = randn(3, 4, seed=13)
    cases.append(same_as_reference(answer, residual_step, x, torch.zeros_like, case="a layer that outputs zeros"))
    return cases


@hidden("1.2", "no layers at all, one layer, float32")
def _stack_edges(answer):
    x = randn(2, 5, seed=21)
    layers = [_tanh_layer(5, 22 + i) for i in range(3)]
    return [
        same_as_reference(answer, residual_stack, x, [], case="an empty list of layers"),
        same_as_reference(answer, residual_stack, x, layers[:1], case="one layer"),
        same_as_reference(answer, residual_stack, x.float(), layers, case="float32, three layers"),
    ]


@hidden("1.3", "no branches, shortcut scales 0 and -1, batched states")
def _unrolled_edges(answer):
    x = randn(3, 4, seed=31)
    branches = randn(5, 3, 4, seed=32)
    return [
        same_as_reference(answer, unrolled_state, x, branches[:0], case="no branch outputs (l = L)"),
        same_as_reference(answer, unrolled_state, x, branches, 0.0, case="shortcut_scale = 0"),
        same_as_reference(answer, unrolled_state, x, branches, -1.0, case="shortcut_scale = -1"),
        same_as_reference(answer, unrolled_state, x[0], branches[:, 0], 1.0, case="a single state of width 4"),
    ]


@hidden("1.4", "batch of one, width one, zero upstream gradient")
def _tanh_backward_edges(answer):
    cases = []
    for batch, width in [(1, 1), (1, 6), (9, 3)]:
        x, w = randn(batch, width, seed=41), randn(width, width, seed=42)
        b, g = randn(width, seed=43), randn(batch, width, seed=44)
        cases.append(same_as_reference(answer, residual_tanh_backward, x, w, b, g,
                                       case=f"batch {batch}, width {width}"))
    x, w, b = randn(2, 3, seed=45), randn(3, 3, seed=46), randn(3, seed=47)
    cases.append(same_as_reference(answer, residual_tanh_backward, x, w, b, torch.zeros(2, 3, dtype=torch.float64),
                                   case="a zero upstream gradient"))
    return cases


@hidden("1.6", "one layer, a zero scale, negative scales, float32")
def _gain_edges(answer):
    cases = []
    for scales in [[0.9], [1.0, 0.0, 2.0], [-1.0, 0.5, -2.0, 1.5]]:
        cases.append(same_as_reference(answer, shortcut_gain, torch.tensor(scales, dtype=torch.float64),
                                       case=f"scales {scales}"))
    cases.append(same_as_reference(answer, shortcut_gain, torch.full((40,), 1.1), case="40 scales of 1.1, float32"))
    return cases
