"""Lab 01 exercises: the residual step, the stack and its unrolled form, the backward's "1", gradient norms by
depth, and the composite gain of a scaled shortcut (ResNet-v2, arXiv 1603.05027, Eqs. 3-5 and Sec. 3.1)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mhc_lab.course.checks import CheckFailed, Mistake, TanhLayer, assert_close, call, randn, register
from mhc_lab.course.depth_probe import (
    gradient_norms,
    residual_stack,
    seeded_stack,
    shortcut_gain,
    unrolled_state,
)
from mhc_lab.reference import residual_step


def _tanh_layer(width: int, seed: int, dtype=torch.float64):
    """F(h) = tanh(h Wᵀ + b) with seeded weights, the layer every check uses."""
    weight = randn(width, width, seed=seed, dtype=dtype, scale=1.5 / width**0.5)
    bias = randn(width, seed=seed + 1, dtype=dtype, scale=0.3)
    return TanhLayer(weight, bias)


# ---- 1.1 ----------------------------------------------------------------------------------------------------------


def _plain_step(x, layer):
    return layer(x)


def _inplace_step(x, layer):
    return x.add_(layer(x))


@register(
    "1.1", "a residual step",
    hints=[
        "A residual step is the input plus the layer's output: the identity path carries x past the layer.",
        "Return x + layer(x) (ResNet-v2 Eq. 3). Do not add in place: the caller still needs x.",
    ],
    library="mhc_lab.reference.residual.residual_step",
    mistakes=[Mistake(_plain_step, "identity path"), Mistake(_inplace_step, "in place")],
)
def _check_step(answer):
    cases = []
    for k, (shape, dtype) in enumerate(
        [((1,), torch.float64), ((7,), torch.float64), ((5, 33), torch.float32), ((2, 3, 8), torch.float64)]
    ):
        case = f"x of shape {shape}, {dtype}"
        layer64 = _tanh_layer(shape[-1], seed=10 + k)
        x64 = randn(*shape, seed=20 + k)
        x = x64.to(dtype)
        layer = _tanh_layer(shape[-1], seed=10 + k, dtype=dtype)
        got = call(answer, x, layer, case=case)
        expected = residual_step(x64, layer64).to(dtype)
        assert_close(got, expected, case=case, mistakes={
            "you returned F(x) alone, which is a plain layer; the identity path adds x back: x + F(x).":
                layer64(x64).to(dtype),
        })
        cases.append(case)
    return cases


# ---- 1.2 ----------------------------------------------------------------------------------------------------------


def _plain_stack(x, layers):
    states = [x]
    for layer in layers:
        states.append(layer(states[-1]))
    return torch.stack(states)


def _stack_without_input(x, layers):
    states, h = [], x
    for layer in layers:
        h = h + layer(h)
        states.append(h)
    return torch.stack(states)


def _stack_fed_the_input(x, layers):
    return torch.stack([x] + [x + layer(x) for layer in layers])


def _stack_in_place(x, layers):
    h, states = x, [x]
    for layer in layers:
        h += layer(h)
        states.append(h)
    return torch.stack(states)


@register(
    "1.2", "a residual stack, state by state",
    hints=[
        "Start from a list holding x itself (that is x_0), and append one new state per layer.",
        "Each new state is the previous state plus the layer applied to the previous state: h = h + layer(h).",
        "torch.stack(states) turns the list of L + 1 tensors into one tensor [L + 1, *x.shape].",
    ],
    library="mhc_lab.course.depth_probe.residual_stack",
    mistakes=[
        Mistake(_plain_stack, "identity path"),
        Mistake(_stack_without_input, "x_0 itself"),
        Mistake(_stack_fed_the_input, "instead of the previous state"),
        Mistake(_stack_in_place, "in place"),
    ],
)
def _check_stack(answer):
    cases = []
    for k, (depth, shape) in enumerate([(1, (4,)), (2, (3, 7)), (7, (5, 33)), (4, (1, 1))]):
        case = f"{depth} layer{'s' if depth > 1 else ''}, x of shape {shape}"
        layers = [_tanh_layer(shape[-1], seed=100 + 10 * k + i) for i in range(depth)]
        x = randn(*shape, seed=200 + k)
        got = call(answer, x, layers, case=case)
        assert_close(got, residual_stack(x, layers), case=case, name="the stack of states", mistakes={
            "x_{i+1} = F_i(x_i) is a plain stack; the identity path keeps the previous state: x_i + F_i(x_i).":
                _plain_stack(x, layers),
            "the first entry must be x_0 itself, the input, followed by the L states the layers produce.":
                _stack_without_input(x, layers),
            "every layer was applied to the input x instead of the previous state; update h = h + layer(h) as you go.":
                _stack_fed_the_input(x, layers),
        })
        cases.append(case)
    return cases


# ---- 1.3 ----------------------------------------------------------------------------------------------------------


def _unscaled_branches(x_l, branch_outputs, shortcut_scale=1.0):
    return shortcut_scale ** branch_outputs.shape[0] * x_l + branch_outputs.sum(dim=0)


def _one_power_too_many(x_l, branch_outputs, shortcut_scale=1.0):
    k = branch_outputs.shape[0]
    total = shortcut_scale**k * x_l
    for j in range(k):
        total = total + shortcut_scale ** (k - j) * branch_outputs[j]
    return total


def _without_x_l(x_l, branch_outputs, shortcut_scale=1.0):
    k = branch_outputs.shape[0]
    return sum(shortcut_scale ** (k - 1 - j) * branch_outputs[j] for j in range(k))


@register(
    "1.3", "the unrolled stack",
    hints=[
        "With λ = 1: x_L = x_l + (sum of the branch outputs). Start there, then put λ back.",
        "Follow one term upwards. x_l passes through all k = L - l shortcuts, so it arrives as λ^k x_l.",
        "F_i(x_i) is added after layer i, so it passes through the shortcuts of layers i+1..L-1 only: "
        "branch_outputs[j] is multiplied by λ^(k-1-j). The last one is not scaled at all.",
    ],
    library="mhc_lab.course.depth_probe.unrolled_state",
    mistakes=[
        Mistake(_unscaled_branches, "scaled too"),
        Mistake(_one_power_too_many, "one power of λ too many"),
        Mistake(_without_x_l, "x_l"),
    ],
)
def _check_unrolled(answer):
    cases = []
    for k, (steps, scale, shape, dtype) in enumerate([
        (1, 1.0, (3,), torch.float64),
        (4, 0.9, (2, 7), torch.float64),
        (7, 1.1, (33,), torch.float64),
        (3, 0.5, (1, 5), torch.float32),
        (5, 1.0, (4, 4), torch.float64),
    ]):
        case = f"{steps} branch output{'s' if steps > 1 else ''}, λ = {scale}, x_l of shape {shape}, {dtype}"
        x64 = randn(*shape, seed=300 + k)
        branch64 = randn(steps, *shape, seed=400 + k, scale=0.5)
        got = call(answer, x64.to(dtype), branch64.to(dtype), scale, case=case)
        expected = unrolled_state(x64, branch64, scale).to(dtype)
        assert_close(got, expected, case=case, name="x_L", mistakes={
            "the branch outputs are scaled too: F_i(x_i) then passes through the shortcuts above it, "
            "so it arrives multiplied by λ^(L-1-i).": _unscaled_branches(x64, branch64, scale).to(dtype),
            "one power of λ too many on the branch outputs: the last branch output, F_{L-1}(x_{L-1}), "
            "is added after the last shortcut and is not scaled.": _one_power_too_many(x64, branch64, scale).to(dtype),
            "the term λ^(L-l) x_l is missing: x_l itself reaches x_L through the shortcuts.":
                _without_x_l(x64, branch64, scale).to(dtype),
        })
        cases.append(case)
    return cases


# ---- 1.4 ----------------------------------------------------------------------------------------------------------


def _branch_only_backward(x, weight, bias, grad_out):
    return (grad_out * (1 - torch.tanh(x @ weight.T + bias) ** 2)) @ weight


def _no_tanh_derivative_backward(x, weight, bias, grad_out):
    return grad_out + grad_out @ weight


def _transposed_backward(x, weight, bias, grad_out):
    return grad_out + (grad_out * (1 - torch.tanh(x @ weight.T + bias) ** 2)) @ weight.T


def _autograd_backward(x, weight, bias, grad_out):
    """The independent reference: let autograd differentiate y = x + tanh(x Wᵀ + b)."""
    x = x.detach().clone().requires_grad_(True)
    y = x + torch.tanh(x @ weight.T + bias)
    (grad,) = torch.autograd.grad(y, x, grad_out)
    return grad


@register(
    "1.4", "the backward of a residual step, by hand",
    hints=[
        "y = x + F(x), so ∂E/∂x = ∂E/∂y · (1 + ∂F/∂x): the first term is ∂E/∂y unchanged "
        "(ResNet-v2 Eq. 5).",
        "For F(x) = tanh(z), z = x Wᵀ + b: first multiply ∂E/∂y elementwise by tanh'(z) = 1 - tanh(z)², "
        "then carry it back through the linear map.",
        "x has shape [B, C] and z = x Wᵀ + b, so ∂E/∂x through the linear map is (∂E/∂z) @ W, not @ Wᵀ.",
    ],
    library="mhc_lab.course.depth_probe.residual_tanh_backward",
    mistakes=[
        Mistake(_branch_only_backward, "identity"),
        Mistake(_no_tanh_derivative_backward, "tanh"),
        Mistake(_transposed_backward, "transpose"),
    ],
)
def _check_backward(answer):
    cases = []
    for k, (batch, width) in enumerate([(1, 1), (5, 7), (3, 33), (8, 4)]):
        case = f"x of shape ({batch}, {width})"
        x = randn(batch, width, seed=500 + k)
        weight = randn(width, width, seed=510 + k, scale=1.5 / width**0.5)
        bias = randn(width, seed=520 + k, scale=0.5)
        grad_out = randn(batch, width, seed=530 + k)
        expected = _autograd_backward(x, weight, bias, grad_out)  # before the learner's function runs
        got = call(answer, x, weight, bias, grad_out, case=case)
        assert_close(got, expected, case=case, name="∂E/∂x", mistakes={
            "the identity's 1 is missing: y = x + F(x) passes ∂E/∂y straight back to x, on top of the branch.":
                _branch_only_backward(x, weight, bias, grad_out),
            "the tanh derivative 1 - tanh(z)² is missing; the gradient passes through tanh on its way back.":
                _no_tanh_derivative_backward(x, weight, bias, grad_out),
            "you multiplied by Wᵀ; going back through z = x Wᵀ + b multiplies by W (check the transpose).":
                _transposed_backward(x, weight, bias, grad_out),
        })
        cases.append(case)
    return cases


# ---- 1.5 ----------------------------------------------------------------------------------------------------------


def _weight_gradient_norms(model, x, y):
    loss = F.cross_entropy(model(x), y)
    grads = torch.autograd.grad(loss, [layer.weight for layer in model.layers])
    return torch.stack([g.norm() for g in grads])


def _forward_norms(model, x, y):
    keep = []
    model(x, keep=keep)
    return torch.stack([h.detach().norm() for h in keep])


@register(
    "1.5", "gradient norms by depth",
    hints=[
        "model(x, keep=keep) appends every layer output h_1..h_L to the list keep (and asks autograd to keep "
        "their gradients).",
        "loss = F.cross_entropy(model(x, keep=keep), y); then either loss.backward() and read h.grad, or "
        "torch.autograd.grad(loss, keep).",
        "Return torch.stack([g.norm() for g in the gradients]): one number per layer, layer 1 first.",
    ],
    library="mhc_lab.course.depth_probe.gradient_norms",
    mistakes=[Mistake(_weight_gradient_norms, "weight"), Mistake(_forward_norms, "forward")],
)
def _check_gradient_norms(answer):
    cases = []
    for k, (depth, width, batch, residual) in enumerate(
        [(1, 8, 16, True), (2, 8, 1, False), (7, 33, 16, True), (7, 33, 16, False)]
    ):
        kind = "residual" if residual else "plain"
        case = f"{kind} stack of depth {depth}, width {width}, batch {batch}"
        model = seeded_stack(depth, width, 1.0 if residual else 0.0, seed=600 + k).double()
        x = randn(batch, 2, seed=610 + k)
        y = torch.randint(0, 2, (batch,), generator=torch.Generator().manual_seed(620 + k))
        expected = gradient_norms(model, x, y).detach()
        wrong = {
            "these are the norms of the weight gradients ∂loss/∂W_l; the exercise asks for ∂loss/∂h_l, the "
            "gradient with respect to each layer's output (the tensors in keep).":
                _weight_gradient_norms(model, x, y).detach(),
            "these are the forward norms ||h_l|| of the activations; take the norm of their gradients instead.":
                _forward_norms(model, x, y),
        }
        got = call(answer, model, x, y, case=case)
        if isinstance(got, torch.Tensor):
            got = got.detach()
        assert_close(got, expected, case=case, name="the tensor of gradient norms", check_dtype=False, mistakes=wrong)
        cases.append(case)
    return cases


# ---- 1.6 ----------------------------------------------------------------------------------------------------------


def _added_gain(scales):
    return torch.cumsum(scales, dim=0)


def _shifted_gain(scales):
    return torch.cumprod(torch.cat([torch.ones_like(scales[:1]), scales[:-1]]), dim=0)


def _last_gain_only(scales):
    return torch.prod(scales)


@register(
    "1.6", "the composite gain of a scaled shortcut",
    hints=[
        "After one layer the shortcut has multiplied the signal by λ_1; after two by λ_2 λ_1; and so on.",
        "Return all L running products, the first being λ_1 itself: torch.cumprod does exactly this.",
    ],
    library="mhc_lab.course.depth_probe.shortcut_gain",
    mistakes=[
        Mistake(_added_gain, "multiply"),
        Mistake(_shifted_gain, "shifted"),
        Mistake(_last_gain_only, "every depth"),
    ],
)
def _check_shortcut_gain(answer):
    cases = []
    for k, (name, scales) in enumerate([
        ("L = 1, λ = 0.5", torch.tensor([0.5], dtype=torch.float64)),
        ("L = 7, λ_i random near 1", 1 + 0.1 * randn(7, seed=700)),
        ("L = 33, λ = 1.1", torch.full((33,), 1.1, dtype=torch.float64)),
        ("L = 2, λ = (2, 0.5)", torch.tensor([2.0, 0.5], dtype=torch.float64)),
        ("L = 12, λ_i random near 0.9", 0.9 + 0.05 * randn(12, seed=701)),
    ]):
        got = call(answer, scales.clone(), case=name)
        assert_close(got, shortcut_gain(scales), case=name, name="the tensor of running gains", mistakes={
            "you added the λ's; each shortcut multiplies the signal, so the gains multiply.": _added_gain(scales),
            "the products are shifted by one layer: entry k is λ_1 ... λ_k, so the first entry is λ_1, not 1.":
                _shifted_gain(scales),
            "only the last product is returned; the exercise asks for the gain at every depth (a tensor [L]).":
                _last_gain_only(scales),
        })
        cases.append(name)
    return cases
