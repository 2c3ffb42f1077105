"""The mHC site as torch.library custom ops (``torch.ops.mhc_lab.*``): forward and backward of pre and post,
each with both backends (mhc_lab.ops.dispatch), and their autograd.

    pre_forward(x, phi, bias, alpha, backend[, partial_in])  -> y, post, res, pre, partial, link
    post_forward(x, f, post, res, backend)                   -> the next lanes
    post_forward_linked(x, link, f, post, res, backend[, phi_next]) -> the next lanes, partial_next
    pre_backward(...), post_backward(...)                    -> the gradients (each an op of its own)

Custom ops with their own backward ops let torch.compile trace a model around them without graph breaks, and
let selective activation checkpointing recompute exactly these ops (``MHCResidualStream(recompute_block=...)``).
Each op's implementation is ``<op>_impl`` (the CPU's C target and the reference backend). On CUDA the ops' kernels
are mhc_lab.ops.native's C++ (native.cpp registers them when it is loaded): the op itself, which allocates and
launches the kernels, and its autograd key, which goes on without Python where no gradient is needed (every call
from a compiled graph) and otherwise hands the call to the autograd built from the formulas below. Called eagerly
(run_pre_forward, run_post_forward, run_post_forward_linked; as_ops says which path runs), a CUDA site is
native.cpp's C++ autograd Functions, and the CPU's C target and the reference run their implementations through
autograd.Functions with the same setup_context and backward formulas: the custom ops' Python dispatch would cost
the host more than a small model's site costs the GPU (the end of this file).

A linked site (pre_forward's link handed to post_forward_linked) sums the lanes' two gradients inside the
pre's backward: the post's backward either writes H_res^T g for kernel 2 to add, or (post_gradient_to_pre_for)
hands g itself back and kernel 2 forms H_res^T g in the pass that writes dx.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch

from mhc_lab.ops import native
from mhc_lab.ops.dispatch import cuda_programs, lane_splits, partial_splits, post_gradient_to_pre_for
from mhc_lab.ops.forward import _describe
from mhc_lab.reference.backward import post_backward as reference_post_backward
from mhc_lab.reference.backward import pre_backward as reference_pre_backward
from mhc_lab.reference.mhc import mhc_coefficients, mixes_width
from mhc_lab.reference.mhc import mhc_post as reference_post
from mhc_lab.reference.mhc import mhc_pre as reference_pre
from mhc_lab.reference.validate import InputError, coefficient_dtype, skipping_value_checks


def no_autocast(fn):
    """Run an op's implementation with autocast off: the coefficients stay float32 inside torch.autocast.
    The two contexts are entered only where autocast is on: they cost about 5 us per op on a desktop CPU
    against 0.3 us for the check, and an op runs on the host's critical path. (Defined in this module:
    torch.library resolves an op's string annotations in the wrapper's globals.)"""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if not (torch.is_autocast_enabled("cpu") or torch.is_autocast_enabled("cuda")):
            return fn(*args, **kwargs)
        with torch.autocast("cpu", enabled=False), torch.autocast("cuda", enabled=False):
            return fn(*args, **kwargs)

    return wrapper


_PLANS: dict = {}  # (op, n, C, GPU index, flags) -> the op's native plan(s): chosen once per configuration


def _plan(x: torch.Tensor, op: str, *flags):
    """The native.cpp plan(s) of one op on CUDA lanes x (bf16, [..., n, C]): chosen by the GPU x is on, n, C and
    the flags the first time, then read from a dict (an eager site asks on every call).

        "pre_forward", projected                -> the pre's forward plan
        "pre_backward", splits, add_dx, post_grad -> the pre's backward plan (splits: the forward partial's)
        "pre", projected, linked, post_grad     -> (forward, backward) plans of an eager pre
        "post_forward", project_next            -> the post's forward plan
        "post_backward", lanes_grad             -> the post's backward plan
        "post", linked, project_next, post_grad -> (forward, backward) plans of an eager post"""
    key = (op, x.shape[-2], x.shape[-1], x.device.index, *flags)
    plan = _PLANS.get(key)
    if plan is None:
        plan = _PLANS[key] = _choose_plan(x, op, *flags)
    return plan


def kernel2_inputs(linked: bool, post_grad: bool) -> tuple[bool, bool]:
    """(add_dx, post_grad) of the pre backward's kernel 2, from what the op is given: for a pre linked to its post
    it adds the post's lanes gradient as it is (add_dx), or with post_grad forms H_res^T g from the post's output
    gradient g itself; an unlinked pre's kernel 2 adds neither. The one place this rule is written."""
    return linked and not post_grad, linked and post_grad


def _choose_plan(x, op: str, *flags):
    n, C = x.shape[-2], x.shape[-1]
    target, hopper = cuda_programs(x)  # the programs of the GPU x is on (Hopper or portable)
    if op == "pre_forward":
        (projected,) = flags
        return native.pre_forward_plan(n, C, target, partial_splits("kernels", x, chained=projected), projected)
    if op == "pre_backward":
        splits, add_dx, post_grad = flags
        return native.pre_backward_plan(n, C, target, hopper, splits, lane_splits(n, C, x.device, add_dx, post_grad),
                                        add_dx, post_grad)
    if op == "pre":
        projected, linked, post_grad = flags
        forward = _plan(x, "pre_forward", projected)
        return forward, _plan(x, "pre_backward", forward.splits, *kernel2_inputs(linked, post_grad))
    if op == "post_forward":
        (project_next,) = flags
        return native.post_forward_plan(n, C, target, hopper,
                                        partial_splits("kernels", x, chained=True) if project_next else 0)
    if op == "post_backward":
        (lanes_grad,) = flags
        return native.post_backward_plan(n, C, target, lanes_grad)
    linked, project_next, post_grad = flags
    return _plan(x, "post_forward", project_next), _plan(x, "post_backward", not (linked and post_grad))


# ------------------------------------------------------------------------ the ops' CUDA kernels (native.cpp)
#
# native.cpp registers its own CUDA and AutogradCUDA kernels for the ops below when it is loaded: a call on CUDA
# lanes then goes from torch's dispatcher to the C++ op without Python (torch.library's Python autograd and
# wrappers, and the implementation itself, took most of each op's host time in a compiled graph). The C++ kernels
# ask plan_for_native for a configuration's plan the first time they see it, hand a backend other than "kernels"
# to IMPLEMENTATIONS and a call that needs autograd to _autograd_for_native (both defined at the end of this
# module). Only a process's first CUDA call of the kernels backend, made before native.cpp was loaded, reaches an
# implementation below: _first_native_call loads it and calls the op again.

# The flags native.cpp passes for each op (ints): those of its plan (_plan), except the pre backward's, which are
# what the op was given, (the forward partial's splits, linked: dx_post given, post_grad).
_NATIVE_FLAGS = {"pre_forward": (bool,), "pre_backward": (int, bool, bool), "post_forward": (bool,),
                 "post_backward": (bool,)}


def plan_for_native(op: str, x: torch.Tensor, *flags: int):
    """The plan native.cpp's registered CUDA kernel of ``op`` runs on lanes x with these flags (ints from C++)."""
    flags = tuple(kind(flag) for kind, flag in zip(_NATIVE_FLAGS[op], flags))
    if op == "pre_backward":
        splits, linked, post_grad = flags
        flags = (splits, *kernel2_inputs(linked, post_grad))
    return _plan(x, op, *flags)


def _first_native_call(op, *args):
    native.extension()  # loading native.cpp registers its CUDA kernels for the ops
    if not torch._C._dispatch_has_kernel_for_dispatch_key(op._qualname, "CUDA"):
        raise RuntimeError(f"{op._qualname}: mhc_lab.ops.native loaded without registering its CUDA kernel")
    return op(*args)


def _partial_reference(x: torch.Tensor, phi: torch.Tensor) -> torch.Tensor:
    """[1, T, n^2+2n+1]: the raw projections and sum of squares the backward starts from."""
    tokens, n, C = x.shape
    cd = coefficient_dtype(x)
    flat = x.reshape(tokens, n * C).to(cd)
    return torch.cat([flat @ phi.to(cd).t(), flat.pow(2).sum(-1, keepdim=True)], dim=-1).unsqueeze(0)


@no_autocast
def pre_forward_impl(x: torch.Tensor, phi: torch.Tensor, bias: torch.Tensor, alpha: torch.Tensor, backend: str,
                partial_in: Optional[torch.Tensor] = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [T, n, C] -> (y [T, C], post [T, n], res [T, n, n], pre [T, n], partial [S, T, n^2+2n+1], link).

    partial_in: the projection of x with this phi, made by the previous site's post (post_forward_linked with
    phi_next): the kernels then skip their own projection pass, and the partial output is empty ([0]), since
    the backward takes partial_in.

    Coefficients and partial are float32 (float64 for float64 lanes, reference backend only). link stands for
    the mixed lanes H_res x without holding them (a [T, n, C] view of one element, never read):
    post_forward_linked adds H_res x itself, and hands back as link's gradient the lanes' gradient of its own
    backward, H_res^T g, which this op's backward adds to its dx in the same pass (autograd would add the two dx
    in another)."""
    tokens, n, C = x.shape
    projected = partial_in is not None
    if projected:
        _check_partial(partial_in, x, backend, "pre_forward")
    if backend == "reference":
        with skipping_value_checks():  # no value read back to the host: NaN and inf propagate, as in the kernels
            co = mhc_coefficients(x, phi, bias, alpha)
        y = reference_pre(x, co.pre)
        partial = _no_partial(x) if projected else _partial_reference(x, phi)
        outputs = (y, co.post, co.res, co.pre, partial)
        return (*(t.contiguous() for t in outputs), _link(x))  # the custom op promises contiguous outputs
    if x.device.type == "cuda":
        return _first_native_call(pre_forward, x, phi, bias, alpha, backend, partial_in)
    m = mixes_width(n)
    y = torch.empty((tokens, C), dtype=x.dtype, device=x.device)
    post = torch.empty((tokens, n), dtype=torch.float32, device=x.device)
    res = torch.empty((tokens, n, n), dtype=torch.float32, device=x.device)
    pre = torch.empty((tokens, n), dtype=torch.float32, device=x.device)
    phi32, bias32, alpha32 = phi.float().contiguous(), bias.float().contiguous(), alpha.float().contiguous()
    from mhc_lab.kernels.pre import pre_kernel_c, projection_kernel_c

    partial = _no_partial(x) if projected else torch.empty((1, tokens, m + 1), dtype=torch.float32)
    if tokens:
        x32 = x.float().contiguous()
        y32 = y if x.dtype == torch.float32 else torch.empty((tokens, C), dtype=torch.float32)
        pre_kernel_c(n, C)(x32, phi32, bias32, alpha32, y32, pre, post, res)  # (the C program projects anyway)
        if not projected:
            projection_kernel_c(n, C)(x32, phi32, partial)
        if y32 is not y:
            y.copy_(y32)
    return y, post, res, pre, partial, _link(x)


def _link(x: torch.Tensor) -> torch.Tensor:
    # a [T, n, C] view of one element whose value nothing reads (only link's gradient matters): empty, not
    # zeros, so that a site's forward launches no fill kernel for it
    return x.new_empty(1).expand(x.shape)


def _no_partial(x: torch.Tensor) -> torch.Tensor:
    return torch.empty((0,), dtype=coefficient_dtype(x), device=x.device)


def _check_partial(partial: torch.Tensor, x: torch.Tensor, backend: str, op: str) -> None:
    tokens, n, _ = x.shape
    shape = (partial_splits(backend, x, chained=True), tokens, mixes_width(n) + 1)
    if tuple(partial.shape) != shape or partial.dtype != coefficient_dtype(x) or partial.device != x.device:
        raise InputError(f"{op}: partial_in: expected shape {shape}, dtype {coefficient_dtype(x)} on {x.device} "
                         f"(backend {backend!r}), got {_describe(partial)}")


pre_forward = torch.library.custom_op("mhc_lab::pre_forward", pre_forward_impl, mutates_args=())


@pre_forward.register_fake
def _(x, phi, bias, alpha, backend, partial_in=None):
    tokens, n, C = x.shape
    m = mixes_width(n)
    cd = dict(dtype=coefficient_dtype(x), device=x.device)
    splits = partial_splits(backend, x)
    partial = _no_partial(x) if partial_in is not None else x.new_empty((splits, tokens, m + 1), **cd)
    return (x.new_empty((tokens, C)), x.new_empty((tokens, n), **cd), x.new_empty((tokens, n, n), **cd),
            x.new_empty((tokens, n), **cd), partial, _link(x))


def _coefficients_and_lanes(x, phi, bias, alpha, pre, partial, dy, dpost, dres, *, add_dx: bool, post_grad: bool):
    """Kernel 1 of the pre backward run on the CPU (C target), and kernel 2 built for what follows it: (lanes, its
    leading operands, dtok, dphi_partial). The leading operands are x and dy, kernel 1's outputs as kernel 2
    takes them (H_pre, dmix and dtok, in float32) and phi; dtok is kernel 1's per-token [dlogit, alpha's three
    gradients, ds]; dphi_partial is kernel 2's dphi output (zeros when there are no tokens). (On CUDA:
    native.cpp's pre_backward.)"""
    from mhc_lab.kernels.pre_backward import pre_backward_kernels
    from mhc_lab.kernels.pre_backward_operands import EXTRA

    tokens, n, C = x.shape
    m = mixes_width(n)
    f32 = dict(dtype=torch.float32, device=x.device)
    dpre, dtok, dmix = (torch.empty((tokens, k), **f32) for k in (n, m + EXTRA, m))
    phi32, bias32, alpha32 = phi.float().contiguous(), bias.float().contiguous(), alpha.float().contiguous()
    dpost, dres = dpost.float().contiguous(), dres.float().contiguous()
    alloc = torch.empty if tokens else torch.zeros
    coefficients, lanes = pre_backward_kernels(n, C, "float32", "c", splits=partial.shape[0], add_dx=add_dx,
                                               post_grad=post_grad)
    x32, dy32 = x.float().contiguous(), dy.float().contiguous()
    if tokens:
        coefficients(x32, dy32, partial, bias32, alpha32, dpost, dres, dpre, dtok, dmix)
    return lanes, (x32, dy32, pre.contiguous(), dmix, dtok, phi32), dtok, alloc((1, m, n * C), **f32)


def _parameter_grads(dphi_partial, dtok, phi) -> tuple:
    """(dphi, dbias_alpha) from the C target's kernel 2 dphi output and kernel 1's per-token dtok, summed over the
    tokens in one reduction (its columns: bias's gradient, alpha's, then ds)."""
    return dphi_partial.sum(0).to(phi.dtype), dtok.sum(0)


@no_autocast
def pre_backward_impl(x: torch.Tensor, phi: torch.Tensor, bias: torch.Tensor, alpha: torch.Tensor, pre: torch.Tensor,
                 partial: torch.Tensor, res: torch.Tensor, dy: torch.Tensor, dpost: torch.Tensor, dres: torch.Tensor,
                 dx_post: Optional[torch.Tensor], backend: str, post_grad: bool = False
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx, dphi, dbias_alpha) of pre_forward, given the gradients of y, post and res, and dx_post, the
    gradient of link when a post_forward_linked used it (the post's gradient of the lanes), added to dx. With
    post_grad, dx_post is instead the linked post's output gradient g, and H_res^T g is added (computed here,
    in the pass that writes dx, so that the post's backward need not write it).

    dbias_alpha [n^2+2n+4], in the coefficients' dtype: bias's gradient, alpha's, then one entry no parameter
    takes (the tokens' summed ds): the kernels sum them over the tokens in one reduction, and an op's outputs
    may not share memory, so the pre's autograd formula (_pre_backward) cuts it."""
    tokens, n, C = x.shape
    linked = dx_post is not None
    add_dx, post_grad = kernel2_inputs(linked, post_grad)
    if backend == "reference":
        cd = res.dtype
        grads = reference_pre_backward(x, phi, bias, alpha, dy, dpost, dres)
        if post_grad:
            dx_post = torch.einsum("tij,tic->tjc", res.to(cd), dx_post.to(cd))
        dx = grads.x + dx_post.to(cd) if linked else grads.x
        dbias_alpha = torch.cat([grads.bias.to(cd), grads.alpha.to(cd), grads.alpha.new_zeros(1, dtype=cd)])
        return dx.to(x.dtype).contiguous(), grads.phi.to(phi.dtype).contiguous(), dbias_alpha
    if x.device.type == "cuda":
        return _first_native_call(pre_backward, x, phi, bias, alpha, pre, partial, res, dy, dpost, dres, dx_post,
                                  backend, post_grad)
    dx = torch.empty_like(x)
    lanes, lead, dtok, dphi_partial = _coefficients_and_lanes(x, phi, bias, alpha, pre, partial, dy, dpost, dres,
                                                              add_dx=add_dx, post_grad=post_grad)
    if tokens:
        more = [dx_post.float().contiguous()] if linked else []  # the C target computes in float32
        if post_grad:
            more.append(res.float().contiguous())
        out = dx if dx.dtype == torch.float32 else torch.empty(x.shape, dtype=torch.float32)
        lanes(*lead, *more, out, dphi_partial)
        if out is not dx:
            dx.copy_(out)
    return (dx, *_parameter_grads(dphi_partial, dtok, phi))


pre_backward = torch.library.custom_op("mhc_lab::pre_backward", pre_backward_impl, mutates_args=())


@pre_backward.register_fake
def _(x, phi, bias, alpha, pre, partial, res, dy, dpost, dres, dx_post, backend, post_grad=False):
    from mhc_lab.kernels.pre_backward_operands import EXTRA  # bias's and alpha's gradients, then the tokens' ds

    m = mixes_width(x.shape[1])
    return torch.empty_like(x), torch.empty_like(phi), x.new_empty((m + EXTRA,), dtype=coefficient_dtype(x))


def _pre_setup_context(ctx, inputs, output):
    x, phi, bias, alpha, backend, partial_in = inputs
    _, _, res, pre, partial, _ = output
    ctx.as_ops, ctx.backend = True, backend
    ctx.post_grad = post_gradient_to_pre_for(x, backend)  # what a linked post's backward hands back (decided now)
    ctx.save_for_backward(x, phi, bias, alpha, pre, partial if partial_in is None else partial_in, res)
    ctx.mark_non_differentiable(pre, partial)
    # an unused output's gradient must arrive as None: materialised, the unused link would hand the backward a
    # zero [T, n, C] gradient to add and turn a separate site's pre backward into the linked one (more bytes)
    ctx.set_materialize_grads(False)


def _pre_output_grads(x, pre, dy, dpost, dres) -> tuple:
    """The gradients of a pre's outputs y, post and res as its backward takes them: contiguous, zeros where
    autograd gave None (an output nothing used)."""
    tokens, n, C = x.shape
    dy = torch.zeros((tokens, C), dtype=x.dtype, device=x.device) if dy is None else dy
    dpost = torch.zeros_like(pre) if dpost is None else dpost
    dres = torch.zeros((tokens, n, n), dtype=pre.dtype, device=x.device) if dres is None else dres
    return dy.contiguous(), dpost.contiguous(), dres.contiguous()


def _pre_backward(ctx, dy, dpost, dres, _dpre, _dpartial, dlink):
    x, phi, bias, alpha, pre, partial, res = ctx.saved_tensors
    dx_post = None if dlink is None else dlink.contiguous()
    backward = pre_backward if ctx.as_ops else pre_backward_impl
    dx, dphi, dbias_alpha = backward(x, phi, bias, alpha, pre, partial, res,
                                     *_pre_output_grads(x, pre, dy, dpost, dres), dx_post, ctx.backend,
                                     ctx.post_grad)
    m = bias.shape[0]
    return dx, dphi, dbias_alpha[:m].to(bias.dtype), dbias_alpha[m:m + 3].to(alpha.dtype), None, None


pre_forward.register_autograd(_pre_backward, setup_context=_pre_setup_context)


@no_autocast
def post_forward_impl(x: torch.Tensor, f: torch.Tensor, post: torch.Tensor, res: torch.Tensor, backend: str
                 ) -> torch.Tensor:
    """x [T, n, C], f [T, C], post [T, n], res [T, n, n] -> the next lanes [T, n, C]."""
    if backend == "reference":
        return reference_post(x, f, post, res).contiguous()
    if x.device.type == "cuda":
        return _first_native_call(post_forward, x, f, post, res, backend)
    from mhc_lab.ops.forward import mhc_post_fused

    return mhc_post_fused(x.contiguous(), f.contiguous(), post.float().contiguous(), res.float().contiguous())


post_forward = torch.library.custom_op("mhc_lab::post_forward", post_forward_impl, mutates_args=())


@post_forward.register_fake
def _(x, f, post, res, backend):
    return torch.empty_like(x)


@no_autocast
def post_backward_impl(x: torch.Tensor, f: torch.Tensor, post: torch.Tensor, res: torch.Tensor, g: torch.Tensor,
                  backend: str, lanes_grad: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                                  torch.Tensor]:
    """(dx, df, dpost, dres) of post_forward, given the gradient g of the next lanes; without lanes_grad dx is
    not computed (an empty tensor in its place): a linked pre's backward adds H_res^T g itself."""
    tokens, n, C = x.shape
    if backend == "reference":
        grads = reference_post_backward(x, f, post, res, g)
        out = [gr.to(leaf.dtype).contiguous() for gr, leaf in zip(grads, (x, f, post, res))]
        return (out[0] if lanes_grad else _no_lanes_grad(x), *out[1:])
    if x.device.type == "cuda":
        return _first_native_call(post_backward, x, f, post, res, g, backend, lanes_grad)
    from mhc_lab.kernels.post_backward import post_backward_kernel

    f32 = dict(dtype=torch.float32, device=x.device)
    dpost, dres = torch.empty((tokens, n), **f32), torch.empty((tokens, n, n), **f32)
    dx, df = torch.empty_like(x) if lanes_grad else _no_lanes_grad(x), torch.empty_like(f)
    post32, res32 = post.float().contiguous(), res.float().contiguous()
    if tokens == 0:
        return dx, df, dpost.to(post.dtype), dres.to(res.dtype)
    args = [t.float().contiguous() for t in (x, f, g)]
    dx32 = dx if x.dtype == torch.float32 or not lanes_grad else torch.empty(x.shape, **f32)
    df32 = df if x.dtype == torch.float32 else torch.empty(f.shape, **f32)
    post_backward_kernel(n, C, "float32", "c", lanes_grad=lanes_grad)(
        args[0], args[1], args[2], post32, res32, *([dx32] if lanes_grad else []), df32, dpost, dres)
    if dx32 is not dx:
        dx.copy_(dx32)
    if df32 is not df:
        df.copy_(df32)
    return dx, df, dpost.to(post.dtype), dres.to(res.dtype)


def _no_lanes_grad(x: torch.Tensor) -> torch.Tensor:
    return x.new_empty((0,))


post_backward = torch.library.custom_op("mhc_lab::post_backward", post_backward_impl, mutates_args=())


@post_backward.register_fake
def _(x, f, post, res, g, backend, lanes_grad=True):
    return (torch.empty_like(x) if lanes_grad else _no_lanes_grad(x)), torch.empty_like(f), torch.empty_like(post), \
        torch.empty_like(res)


def _post_setup_context(ctx, inputs, output):
    x, f, post, res, backend = inputs
    ctx.as_ops, ctx.backend = True, backend
    ctx.save_for_backward(x, f, post, res)


def _post_backward(ctx, g):
    x, f, post, res = ctx.saved_tensors
    backward = post_backward if ctx.as_ops else post_backward_impl
    dx, df, dpost, dres = backward(x, f, post, res, g.contiguous(), ctx.backend)
    return dx, df, dpost, dres, None


post_forward.register_autograd(_post_backward, setup_context=_post_setup_context)


@no_autocast
def post_forward_linked_impl(x: torch.Tensor, link: torch.Tensor, f: torch.Tensor, post: torch.Tensor,
                        res: torch.Tensor, backend: str, phi_next: Optional[torch.Tensor] = None
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """(the next lanes link + H_post f, partial_next), where link (from pre_forward on the same x) stands for
    H_res x, which is computed here from x and res. Its backward is post_forward's, except that the lanes'
    gradient H_res^T g goes back as link's gradient (to pre_forward's backward, which adds it to its own dx),
    not as x's.

    phi_next: the next site's phi. The next lanes are then also projected with it while they are on chip
    (kernels/post_project.py), and partial_next [S, T, n^2+2n+1] is what the next pre_forward takes as
    partial_in; without phi_next partial_next is empty ([0]). partial_next carries no gradient: the next
    pre's backward differentiates its projection itself."""
    if phi_next is None:
        return post_forward_impl(x, f, post, res, backend), _no_partial(x)
    tokens, n, C = x.shape
    if backend == "reference":
        out = reference_post(x, f, post, res).contiguous()
        return out, _partial_reference(out, phi_next).contiguous()
    if x.device.type == "cuda":  # on Hopper the post and the projection in one kernel (post_project.py)
        return _first_native_call(post_forward_linked, x, link, f, post, res, backend, phi_next)
    m = mixes_width(n)
    post32, res32, phi32 = post.float().contiguous(), res.float().contiguous(), phi_next.float().contiguous()
    from mhc_lab.kernels.post_project import post_project_kernel

    partial = torch.empty((1, tokens, m + 1), dtype=torch.float32)
    if x.dtype != torch.float32:
        # the C target computes in float32: the next pre must get the projection of the lanes as stored in the
        # stream's dtype, so round them first and project them in a pass of their own
        from mhc_lab.kernels.pre import projection_kernel_c

        out = post_forward_impl(x, f, post, res, backend)
        if tokens:
            projection_kernel_c(n, C)(out.float().contiguous(), phi32, partial)
        return out, partial
    out = torch.empty(x.shape, dtype=torch.float32)
    if tokens:
        post_project_kernel(n, C, "float32", "c")(x.contiguous(), f.float().contiguous(), post32, res32, phi32, out,
                                                  partial)
    return out, partial


post_forward_linked = torch.library.custom_op("mhc_lab::post_forward_linked", post_forward_linked_impl,
                                              mutates_args=())


@post_forward_linked.register_fake
def _(x, link, f, post, res, backend, phi_next=None):
    if phi_next is None:
        return torch.empty_like(x), _no_partial(x)
    tokens, n, _ = x.shape
    splits = partial_splits(backend, x, chained=True)
    return torch.empty_like(x), x.new_empty((splits, tokens, mixes_width(n) + 1), dtype=coefficient_dtype(x))


def _post_linked_setup_context(ctx, inputs, output):
    x, _, f, post, res, backend, _ = inputs
    ctx.as_ops, ctx.backend = True, backend
    ctx.post_grad = post_gradient_to_pre_for(x, backend)  # as the linked pre_forward decided it, in the same forward
    ctx.save_for_backward(x, f, post, res)
    ctx.mark_non_differentiable(output[1])
    # partial_next's gradient (never used) arrives as None: materialised, it would cost a fill kernel per site
    ctx.set_materialize_grads(False)


def _post_linked_backward(ctx, g, _dpartial):
    if g is None:  # the next lanes unused
        return None, None, None, None, None, None, None
    x, f, post, res = ctx.saved_tensors
    g = g.contiguous()
    backward = post_backward if ctx.as_ops else post_backward_impl
    dx, df, dpost, dres = backward(x, f, post, res, g, ctx.backend, not ctx.post_grad)
    # the lanes' gradient goes back through link: H_res^T g, or g itself for the pre's backward to finish
    return None, g if ctx.post_grad else dx, df, dpost, dres, None, None


post_forward_linked.register_autograd(_post_linked_backward, setup_context=_post_linked_setup_context)


_OPS = {"pre_forward": (pre_forward, pre_forward_impl), "pre_backward": (pre_backward, pre_backward_impl),
        "post_forward": (post_forward, post_forward_impl),
        "post_forward_linked": (post_forward_linked, post_forward_linked_impl),
        "post_backward": (post_backward, post_backward_impl)}  # name -> (the custom op, its implementation)
IMPLEMENTATIONS = {name: impl for name, (_, impl) in _OPS.items()}
_AUTOGRAD = {}  # op name -> its autograd as torch.library runs it (made from register_autograd's formulas)


def _autograd_for_native(op: str, keys: int, *args):
    """A CUDA call that needs autograd, handed over by native.cpp's AutogradCUDA kernel of ``op`` with the
    dispatch key set it was called with (``keys``, raw): torch.library's own autograd kernel of the op (the one
    native.cpp's takes the place of on CUDA)."""
    if op not in _AUTOGRAD:
        from torch._library.autograd import make_autograd_impl

        definition = _OPS[op][0]
        _AUTOGRAD[op] = make_autograd_impl(definition._opoverload, definition)
    return _AUTOGRAD[op](torch._C.DispatchKeySet.from_raw_repr(keys), *args)


native.when_loaded(lambda module: module.connect(plan_for_native, IMPLEMENTATIONS, _autograd_for_native))


# ------------------------------------------------------------------------------------------ the eager path
#
# Called eagerly, a custom op costs about 60 us of host time more than an autograd.Function that runs the same
# implementation (torch.library's dispatch and autograd glue, in Python), and its backward about as much again:
# on a small model's training step that is more than the site's kernels take on the GPU. So eager calls run
# native.cpp's C++ autograd Functions on CUDA, and elsewhere the implementations through autograd.Functions (the
# same setup_context and backward formulas, calling the backward's implementation directly); only a trace sees
# the custom ops: torch.compile, torch.export, and any dispatch mode (selective activation checkpointing's,
# FakeTensorMode), which must see one op per site op.


def _eager(name: str, impl, setup_context, backward):
    # forward takes ctx and calls setup_context itself: an autograd.Function with a setup_context of its own
    # binds every call's arguments to forward's signature through inspect (about 50 us of host time per call)
    def forward(ctx, *inputs):
        output = impl(*inputs)
        setup_context(ctx, inputs, output)
        ctx.as_ops = False  # the backward calls the implementations, not the ops
        return output

    return type(name, (torch.autograd.Function,), {
        "__doc__": f"The eager path of torch.ops.mhc_lab.{impl.__name__.removesuffix('_impl')}.",
        "forward": staticmethod(forward),
        "backward": staticmethod(torch.autograd.function.once_differentiable(backward))})


_EagerPre = _eager("_EagerPre", pre_forward_impl, _pre_setup_context, _pre_backward)
_EagerPost = _eager("_EagerPost", post_forward_impl, _post_setup_context, _post_backward)
_EagerPostLinked = _eager("_EagerPostLinked", post_forward_linked_impl, _post_linked_setup_context,
                          _post_linked_backward)


def as_ops() -> bool:
    """Whether the site's ops run as torch.ops.mhc_lab.* custom ops (under torch.compile or torch.export, or a
    dispatch mode) rather than eagerly. Short-circuits under torch.compile, whose tracer must not see the
    dispatch stack's query."""
    return torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack() > 0


def traces_reference(backend: str) -> bool:
    """Whether torch.compile is tracing the reference backend: the site is then the reference math itself, in
    PyTorch ops that Dynamo traces and Inductor fuses (and autograd differentiates), not an opaque op that runs
    the same thousands of small kernels as eager does. Inside a recompute block those ops are kept, not
    recomputed (recompute_policy recomputes the mhc_lab ops, which the kernels backend runs)."""
    return backend == "reference" and torch.compiler.is_compiling()


@no_autocast
def _traced_reference_pre(x, phi, bias, alpha):
    co = mhc_coefficients(x, phi, bias, alpha)  # no value checks while compiling (validate.checking_values)
    return reference_pre(x, co.pre), co.post, co.res, co.pre, _no_partial(x), _link(x)


_traced_reference_post = no_autocast(reference_post)


def _native(x, backend: str) -> bool:
    """Whether an eager call runs native.cpp's ops and autograd: the kernels backend on CUDA."""
    return x.is_cuda and backend == "kernels"


def _flat(t: torch.Tensor, *tail: int) -> torch.Tensor:
    return t.reshape(-1, *tail)


def _flat_post_args(x, f, post, res) -> tuple:
    """A post's lanes [..., n, C], layer output, post and res flattened to the ops' [T, ...]."""
    *_, n, C = x.shape
    return _flat(x, n, C), _flat(f, C), _flat(post, n), _flat(res, n, n)


def run_pre_forward(x, phi, bias, alpha, backend: str, partial_in=None, *, linked: bool = False):
    """pre_forward on lanes x [..., n, C], eagerly or as the op (as_ops); traced where torch.compile traces the
    reference. y, post, res and link keep x's leading dims (native.cpp's ops take them so; elsewhere the lanes
    are flattened for the op and its outputs viewed back). linked: its link goes to the site's post
    (run_post_forward_linked), which decides the backward's kernel 2 on CUDA."""
    if _native(x, backend) and not as_ops():
        plans = _plan(x, "pre", partial_in is not None, linked, linked and post_gradient_to_pre_for(x, backend))
        return native.extension().pre(*plans, x, phi, bias, alpha, partial_in)
    *batch, n, C = x.shape
    lanes = _flat(x, n, C)
    if traces_reference(backend):
        out = _traced_reference_pre(lanes, phi, bias, alpha)
    elif as_ops():
        out = pre_forward(lanes, phi, bias, alpha, backend, partial_in)
    else:
        out = _EagerPre.apply(lanes, phi, bias, alpha, backend, partial_in)
    y, post, res, pre, partial, link = out
    return y.view(*batch, C), post.view(*batch, n), res.view(*batch, n, n), pre, partial, link.view(x.shape)


def run_post_forward(x, f, post, res, backend: str):
    """post_forward on lanes x [..., n, C] and the layer's output f [..., C], eagerly or as the op (as_ops);
    traced where torch.compile traces the reference. The next lanes have x's shape."""
    if _native(x, backend) and not as_ops():
        plans = _plan(x, "post", False, False, False)
        return native.extension().post(*plans, False, x, None, f, post, res, None)[0]
    args = _flat_post_args(x, f, post, res)
    if traces_reference(backend):
        out = _traced_reference_post(*args)
    elif as_ops():
        out = post_forward(*args, backend)
    else:
        out = _EagerPost.apply(*args, backend)
    return out.view(x.shape)


def run_post_forward_linked(x, link, f, post, res, backend: str, phi_next=None):
    """post_forward_linked on lanes x [..., n, C] (link from the site's pre, f [..., C]), eagerly or as the op
    (as_ops): (the next lanes, x's shape; partial_next). Where torch.compile traces the reference, the next lanes
    from x itself (autograd sums the lanes' two gradients) and no partial: the traced pre computes its
    coefficients from the lanes."""
    if _native(x, backend) and not as_ops():
        plans = _plan(x, "post", True, phi_next is not None, post_gradient_to_pre_for(x, backend))
        return tuple(native.extension().post(*plans, True, x, link, f, post, res, phi_next))
    args = _flat_post_args(x, f, post, res)
    if traces_reference(backend):
        return _traced_reference_post(*args).view(x.shape), _no_partial(x)
    lanes, link = args[0], link.reshape(args[0].shape)
    if as_ops():
        out, partial = post_forward_linked(lanes, link, *args[1:], backend, phi_next)
    else:
        out, partial = _EagerPostLinked.apply(lanes, link, *args[1:], backend, phi_next)
    return out.view(x.shape), partial


def post_then_pre(x, backend: str, next_backend: str, project: bool):
    """A chain's step from one site to the next on lanes like x [..., n, C], chosen once per chain:
    step(x, link, f, post, res, phi, bias, alpha) runs the linked post (backend), then the next site's linked pre
    (phi, bias, alpha; next_backend) on the lanes it makes, and returns those lanes and the pre's y, post, res and
    link. project: the post projects its lanes with phi for the pre (same backend, fused_projection_applies).
    Eagerly on CUDA with the kernels backend, the step is one call into native.cpp and one autograd node (its
    Joint), its plans looked up here; elsewhere run_post_forward_linked, then run_pre_forward."""
    if backend == next_backend and _native(x, backend) and not as_ops():
        post_grad = post_gradient_to_pre_for(x, backend)
        plans = (*_plan(x, "post", True, project, post_grad), *_plan(x, "pre", project, True, post_grad), project)
        joint = native.extension().joint

        def native_step(x, link, f, post, res, phi, bias, alpha):
            lanes, y, post, res, _, link = joint(*plans, x, link, f, post, res, phi, bias, alpha)
            return lanes, y, post, res, link

        return native_step

    def step(x, link, f, post, res, phi, bias, alpha):
        lanes, partial = run_post_forward_linked(x, link, f, post, res, backend, phi if project else None)
        y, post, res, _, _, link = run_pre_forward(lanes, phi, bias, alpha, next_backend,
                                                   partial if project else None, linked=True)
        return lanes, y, post, res, link

    return step
