"""Differentiable mHC site ops (forward and backward) and the modules that train with them.

    y, post, res = mhc_pre(x, phi, bias, alpha)          # x: lanes [..., n, C]
    x_next = mhc_post(x, layer(y), post, res)

Backends:
  - "kernels": the fused TileLang kernels, forward and backward (mhc_lab.kernels). On CUDA: bf16 lanes,
    n = 1..8, n*C a multiple of 8. On the CPU the same kernels run through TileLang's C target, in float32
    (slow, for checking and learning).
  - "reference": mhc_lab.reference's math forward, and the hand-derived backward of mhc_lab.reference.backward
    (it recomputes the coefficients from the inputs).
  - "auto" (the default): "kernels" on CUDA where they apply, "reference" everywhere else.

Both backends are torch.library custom ops (``torch.ops.mhc_lab.*``) with their own backward ops, so
torch.compile traces a model around them without graph breaks, and selective activation checkpointing can
recompute exactly these ops (``MHCResidualStream(recompute_block=...)``).
"""

from __future__ import annotations

import contextlib
import functools
from typing import Optional, Sequence

import torch
from torch import nn

from mhc_lab.reference.backward import post_backward as reference_post_backward
from mhc_lab.reference.backward import pre_backward as reference_pre_backward
from mhc_lab.reference.hyper_connections import collapse_lanes, expand_lanes
from mhc_lab.reference.mhc import mhc_coefficients, mhc_identity_init, mixes_width
from mhc_lab.reference.mhc import mhc_post as reference_post
from mhc_lab.reference.mhc import mhc_pre as reference_pre
from mhc_lab.ops.forward import _DTYPE_NAMES, _describe
from mhc_lab.reference.validate import (
    InputError,
    coefficient_dtype,
    require_lanes,
    require_positive_int,
    require_tensor,
)

BACKENDS = ("auto", "reference", "kernels")
KERNEL_MAX_LANES = 8
# kernel 1 of the pre backward on CUDA (pre_backward_coefficients_program's phases): "spread" (a streaming
# dH_pre kernel, then each token's coefficient backward over a warp's threads) took 0.132 / 0.189 / 0.162 ms at
# C = 2560 / 4096 / 7168 on the H200, against 0.223 / 0.275 / 0.201 for "fused" and 0.204 / 0.260 / 0.221 for
# "split" (one thread per token) (2026-11-30, run AF, training_h200.json sweeps). "spread" needs n a power of
# two; other n run "fused".
COEFFICIENT_PHASES = "spread"
COEFFICIENT_PHASE_CHOICES = ("fused", "split", "spread")
# kernel 2 of the pre backward on CUDA: tunings of pre_backward_lanes_program that replace its defaults (none:
# the defaults), and "lane_splits", its grid's token splits instead of lane_splits_for's; lane_tuning(...) sets
# them for a block of code, so that a benchmark can time whole sites and blocks with a variant before it becomes
# the default
LANE_TUNING: dict = {}


# ----------------------------------------------------------------------------------------------------------
# input checks and dispatch


def kernels_apply(x: torch.Tensor) -> tuple[bool, str]:
    """Whether the fused kernels take these lanes, and if not, why not."""
    n, C = x.shape[-2], x.shape[-1]
    if n > KERNEL_MAX_LANES:
        return False, f"the kernels take n = 1..{KERNEL_MAX_LANES} lanes, got n = {n}"
    if x.device.type == "cuda":
        if x.dtype != torch.bfloat16:
            return False, f"the CUDA kernels take bfloat16 lanes, got {x.dtype}"
        if (n * C) % 8:
            return False, f"the CUDA kernels read 16-byte rows: n * C must be a multiple of 8, got {n} * {C}"
        return True, ""
    if x.device.type == "cpu":
        if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            return False, f"the C-target kernels take float32/bfloat16/float16 lanes, got {x.dtype}"
        return True, ""
    return False, f"the kernels run on CPU or CUDA tensors, got device {x.device}"


def resolve_backend(backend: str, x: torch.Tensor) -> str:
    """'auto' -> 'kernels' on CUDA where they apply, else 'reference'; 'kernels' is checked, not downgraded."""
    if backend not in BACKENDS:
        raise InputError(f"backend: expected one of {BACKENDS}, got {backend!r}")
    if backend == "reference":
        return backend
    ok, why = kernels_apply(x)
    if backend == "kernels":
        if not ok:
            raise InputError(f"backend 'kernels': {why} (x: {_describe(x)}); use backend='reference'")
        return backend
    return "kernels" if ok and x.device.type == "cuda" else "reference"


def _check_site(x, phi, bias, alpha, op: str) -> tuple[int, int]:
    n, C = require_lanes("x", x)
    m = mixes_width(n)
    for name, value, shape in (("phi", phi, (m, n * C)), ("bias", bias, (m,)), ("alpha", alpha, (3,))):
        require_tensor(name, value)
        if tuple(value.shape) != shape:
            raise InputError(f"{op}: {name}: expected shape {shape} for n = {n}, C = {C}, got {_describe(value)}")
        if value.device != x.device:
            raise InputError(f"{op}: {name}: expected device {x.device} (the lanes'), got {_describe(value)}")
        if not value.is_floating_point():
            raise InputError(f"{op}: {name}: expected a floating-point tensor, got {_describe(value)}")
    return n, C


# ----------------------------------------------------------------------------------------------------------
# the custom ops: forward and backward of pre and post, each with both backends


def _partial_reference(x: torch.Tensor, phi: torch.Tensor) -> torch.Tensor:
    """[1, T, n^2+2n+1]: the raw projections and sum of squares the backward starts from."""
    tokens, n, C = x.shape
    cd = coefficient_dtype(x)
    flat = x.reshape(tokens, n * C).to(cd)
    return torch.cat([flat @ phi.to(cd).t(), flat.pow(2).sum(-1, keepdim=True)], dim=-1).unsqueeze(0)


def _lane_splits(n: int, C: int, device: torch.device, add_dx: bool, post_grad: bool = False,
                 tiling: dict | None = None) -> int:
    """Token splits of the pre backward's lane kernel: its CTAs in waves that fill the GPU's SMs (with the
    lane_group, block_c, ctas_per_sm, block_tokens and consumer warpgroups of ``tiling``, default
    LANE_TUNING's)."""
    from mhc_lab.kernels.pre_backward import consumer_groups_asked, lane_splits_for

    tiling = LANE_TUNING if tiling is None else tiling
    if tiling.get("lane_splits"):  # given: taken as it is
        return tiling["lane_splits"]
    groups = consumer_groups_asked(tiling.get("consumer_groups"), tiling.get("threads", 128),
                                   tiling.get("overlap_dx"), tuple(tiling.get("leave_out", ())))
    return lane_splits_for(n, C, torch.cuda.get_device_properties(device).multi_processor_count, add_dx=add_dx,
                           post_grad=post_grad, lane_group=tiling.get("lane_group"), block_c=tiling.get("block_c"),
                           ctas_per_sm=tiling.get("ctas_per_sm", 1), block_tokens=tiling.get("block_tokens", 64),
                           consumer_groups=groups)


def _no_autocast(fn):
    """Run an op's implementation with autocast off: the coefficients stay float32 inside torch.autocast.
    The two contexts are entered only where autocast is on: they cost about 5 us per op on a desktop CPU
    against 0.3 us for the check (2026-11-30), and an op runs on the host's critical path."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if not (torch.is_autocast_enabled("cpu") or torch.is_autocast_enabled("cuda")):
            return fn(*args, **kwargs)
        with torch.autocast("cpu", enabled=False), torch.autocast("cuda", enabled=False):
            return fn(*args, **kwargs)

    return wrapper


@torch.library.custom_op("mhc_lab::pre_forward", mutates_args=())
@_no_autocast
def pre_forward(x: torch.Tensor, phi: torch.Tensor, bias: torch.Tensor, alpha: torch.Tensor, backend: str,
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
    link = _link(x)
    projected = partial_in is not None
    if projected:
        _check_partial(partial_in, x, backend, "pre_forward")
    if backend == "reference":
        co = mhc_coefficients(x, phi, bias, alpha)
        y = reference_pre(x, co.pre)
        partial = _no_partial(x) if projected else _partial_reference(x, phi)
        outputs = (y, co.post, co.res, co.pre, partial)
        return (*(t.contiguous() for t in outputs), link)  # the custom op promises contiguous outputs
    m = mixes_width(n)
    y = torch.empty((tokens, C), dtype=x.dtype, device=x.device)
    post = torch.empty((tokens, n), dtype=torch.float32, device=x.device)
    res = torch.empty((tokens, n, n), dtype=torch.float32, device=x.device)
    pre = torch.empty((tokens, n), dtype=torch.float32, device=x.device)
    phi32, bias32, alpha32 = phi.float().contiguous(), bias.float().contiguous(), alpha.float().contiguous()
    if x.device.type == "cuda":
        from mhc_lab.kernels.pre_cuda import run_pre_cuda

        partial = partial_in.contiguous() if projected else torch.empty(
            (partial_splits(backend, x), tokens, m + 1), dtype=torch.float32, device=x.device)
        if tokens:
            with torch.cuda.device(x.device):
                run_pre_cuda(x.contiguous(), phi32, bias32, alpha32, y, pre, post, res, plan="split",
                             partial=partial, projected=projected, splits=partial.shape[0])
        return y, post, res, pre, _no_partial(x) if projected else partial, link
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
    return y, post, res, pre, partial, link


def _link(x: torch.Tensor) -> torch.Tensor:
    # a [T, n, C] view of one element whose value nothing reads (only link's gradient matters): empty, not
    # zeros, so that a site's forward launches no fill kernel for it
    return x.new_empty(1).expand(x.shape)


def _no_partial(x: torch.Tensor) -> torch.Tensor:
    return torch.empty((0,), dtype=coefficient_dtype(x), device=x.device)


# Column splits of the fused post + next projection on CUDA: the next pre's apply pass sums that many partials.
# One split: 0.434 ms at 16384 x 4096 on the H200 against 0.444 with 2 and 0.464 with 4 (2026-11-30,
# kernel_variants_h200.json); the pre's own projection pass keeps its 4 (SPLIT_DEFAULTS).
CHAIN_SPLITS = 1


def partial_splits(backend: str, x: torch.Tensor, *, chained: bool = False) -> int:
    """The first axis of the partial sums a backend's pre projects into, or (chained) that a post projects
    into for the next pre (post_forward_linked's partial_next, pre_forward's partial_in)."""
    if backend == "kernels" and x.device.type == "cuda":
        from mhc_lab.kernels.pre_cuda import SPLIT_DEFAULTS

        return CHAIN_SPLITS if chained else SPLIT_DEFAULTS["splits"]
    return 1


def _check_partial(partial: torch.Tensor, x: torch.Tensor, backend: str, op: str) -> None:
    tokens, n, _ = x.shape
    shape = (partial_splits(backend, x, chained=True), tokens, mixes_width(n) + 1)
    if tuple(partial.shape) != shape or partial.dtype != coefficient_dtype(x) or partial.device != x.device:
        raise InputError(f"{op}: partial_in: expected shape {shape}, dtype {coefficient_dtype(x)} on {x.device} "
                         f"(backend {backend!r}), got {_describe(partial)}")


@pre_forward.register_fake
def _(x, phi, bias, alpha, backend, partial_in=None):
    tokens, n, C = x.shape
    m = mixes_width(n)
    cd = dict(dtype=coefficient_dtype(x), device=x.device)
    splits = partial_splits(backend, x)
    partial = _no_partial(x) if partial_in is not None else x.new_empty((splits, tokens, m + 1), **cd)
    return (x.new_empty((tokens, C)), x.new_empty((tokens, n), **cd), x.new_empty((tokens, n, n), **cd),
            x.new_empty((tokens, n), **cd), partial, _link(x))


def _coefficients_and_lanes(x, phi, bias, alpha, pre, partial, dy, dpost, dres, *, add_dx: bool, post_grad: bool,
                            joined: bool = False):
    """Kernel 1 of the pre backward run on x's device (kernels backend), and the lanes kernel built for what
    follows it (kernel 2, or with ``joined`` the joined kernel): (lanes, its leading operands, dlogit, extra,
    dphi_partial). The leading operands are x and dy, kernel 1's outputs as the lanes kernel takes them
    (CUDA: dsplit and coef; C target: H_pre, dmix and extra, in float32) and phi; dphi_partial is the lanes
    kernel's dphi output in its layout (zeros when there are no tokens; _parameter_grads sums it)."""
    from mhc_lab.kernels.pre_backward import gemm_depth, pre_backward_kernels

    tokens, n, C = x.shape
    m = mixes_width(n)
    f32 = dict(dtype=torch.float32, device=x.device)
    dpre, dlogit, dmix, extra = (torch.empty((tokens, k), **f32) for k in (n, m, m, 4))
    phi32, bias32, alpha32 = phi.float().contiguous(), bias.float().contiguous(), alpha.float().contiguous()
    dpost, dres = dpost.float().contiguous(), dres.float().contiguous()
    alloc = torch.empty if tokens else torch.zeros
    if x.device.type == "cuda":
        from mhc_lab.kernels.pre_backward import coef_width, dphi_partial_shape

        splits = _lane_splits(n, C, x.device, add_dx or joined, post_grad)
        coefficients, lanes = pre_backward_kernels(n, C, "bfloat16", "cuda", splits=partial.shape[0],
                                                   lane_splits=splits, add_dx=add_dx or joined, post_grad=post_grad,
                                                   joined=joined, phases=_coefficient_phases_for(n),
                                                   **lane_program_tuning())
        dsplit = torch.empty((tokens, 3, 2 * gemm_depth(n)), dtype=torch.bfloat16, device=x.device)
        coef = torch.empty((tokens, coef_width(n)), **f32)
        xc, dyc = x.contiguous(), dy.contiguous()
        if tokens:
            with torch.cuda.device(x.device):
                coefficients(xc, dyc, partial, bias32, alpha32, dpost, dres, pre.contiguous(), dpre, dlogit, dmix,
                             extra, dsplit, coef)
        dphi_partial = alloc(dphi_partial_shape(splits, n, C), **f32)
        return lanes, (xc, dyc, dsplit, coef, phi32), dlogit, extra, dphi_partial
    coefficients, lanes = pre_backward_kernels(n, C, "float32", "c", splits=partial.shape[0], add_dx=add_dx,
                                               post_grad=post_grad, joined=joined)
    x32, dy32 = x.float().contiguous(), dy.float().contiguous()
    if tokens:
        coefficients(x32, dy32, partial, bias32, alpha32, dpost, dres, dpre, dlogit, dmix, extra)
    return lanes, (x32, dy32, pre.contiguous(), dmix, extra, phi32), dlogit, extra, alloc((1, m, n * C), **f32)


def _parameter_grads(dphi_partial, dlogit, extra, n: int, phi, bias, alpha) -> tuple:
    """(dphi, dbias, dalpha) from the lanes kernel's dphi partial sums (CUDA's split layout, or the C target's
    one row of them) and kernel 1's per-token dlogit and extra, summed over the tokens."""
    from mhc_lab.kernels.pre_backward import dphi_from_partial

    dphi = dphi_from_partial(dphi_partial, n) if dphi_partial.device.type == "cuda" else dphi_partial.sum(0)
    # extra's four columns summed whole, then cut: its three-column slice is strided, and torch summed it in two
    # thread blocks (11 us at 16384 tokens on the H200, Nsight Compute of the site, run AV)
    return dphi.to(phi.dtype), dlogit.sum(0).to(bias.dtype), extra.sum(0)[:3].to(alpha.dtype)


@torch.library.custom_op("mhc_lab::pre_backward", mutates_args=())
@_no_autocast
def pre_backward(x: torch.Tensor, phi: torch.Tensor, bias: torch.Tensor, alpha: torch.Tensor, pre: torch.Tensor,
                 partial: torch.Tensor, res: torch.Tensor, dy: torch.Tensor, dpost: torch.Tensor, dres: torch.Tensor,
                 dx_post: Optional[torch.Tensor], backend: str, post_grad: bool = False
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dx, dphi, dbias, dalpha) of pre_forward, given the gradients of y, post and res, and dx_post, the
    gradient of link when a post_forward_linked used it (the post's gradient of the lanes), added to dx. With
    post_grad, dx_post is instead the linked post's output gradient g, and H_res^T g is added (computed here,
    in the pass that writes dx, so that the post's backward need not write it)."""
    tokens, n, C = x.shape
    linked = dx_post is not None
    post_grad = post_grad and linked
    add_dx = linked and not post_grad  # the kernel adds dx_post as it is
    if backend == "reference":
        cd = res.dtype
        grads = reference_pre_backward(x, phi, bias, alpha, dy, dpost, dres)
        if post_grad:
            dx_post = torch.einsum("tij,tic->tjc", res.to(cd), dx_post.to(cd))
        dx = grads.x + dx_post.to(cd) if linked else grads.x
        return tuple(t.to(leaf.dtype).contiguous() for t, leaf in zip((dx, *grads[1:]), (x, phi, bias, alpha)))
    dx = torch.empty_like(x)
    lanes, lead, dlogit, extra, dphi_partial = _coefficients_and_lanes(x, phi, bias, alpha, pre, partial, dy, dpost,
                                                                       dres, add_dx=add_dx, post_grad=post_grad)
    if tokens:
        cuda = x.device.type == "cuda"
        work = x.dtype if cuda else torch.float32  # the C target computes in float32
        more = [dx_post.to(work).contiguous()] if linked else []
        if post_grad:
            more.append(res.float().contiguous())
        out = dx if dx.dtype == work else torch.empty(x.shape, dtype=work, device=x.device)
        with torch.cuda.device(x.device) if cuda else contextlib.nullcontext():
            lanes(*lead, *more, out, dphi_partial)
        if out is not dx:
            dx.copy_(out)
    return (dx, *_parameter_grads(dphi_partial, dlogit, extra, n, phi, bias, alpha))


@pre_backward.register_fake
def _(x, phi, bias, alpha, pre, partial, res, dy, dpost, dres, dx_post, backend, post_grad=False):
    return torch.empty_like(x), torch.empty_like(phi), torch.empty_like(bias), torch.empty_like(alpha)


def _pre_setup_context(ctx, inputs, output):
    x, phi, bias, alpha, backend, partial_in = inputs
    _, _, res, pre, partial, _ = output
    ctx.backend = backend
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
    dx, dphi, dbias, dalpha = pre_backward(x, phi, bias, alpha, pre, partial, res,
                                           *_pre_output_grads(x, pre, dy, dpost, dres), dx_post, ctx.backend,
                                           ctx.post_grad)
    return dx, dphi, dbias, dalpha, None, None


pre_forward.register_autograd(_pre_backward, setup_context=_pre_setup_context)


@torch.library.custom_op("mhc_lab::post_forward", mutates_args=())
@_no_autocast
def post_forward(x: torch.Tensor, f: torch.Tensor, post: torch.Tensor, res: torch.Tensor, backend: str
                 ) -> torch.Tensor:
    """x [T, n, C], f [T, C], post [T, n], res [T, n, n] -> the next lanes [T, n, C]."""
    if backend == "reference":
        return reference_post(x, f, post, res).contiguous()
    from mhc_lab.ops.forward import mhc_post_fused

    return mhc_post_fused(x.contiguous(), f.contiguous(), post.float().contiguous(), res.float().contiguous())


@post_forward.register_fake
def _(x, f, post, res, backend):
    return torch.empty_like(x)


@torch.library.custom_op("mhc_lab::post_backward", mutates_args=())
@_no_autocast
def post_backward(x: torch.Tensor, f: torch.Tensor, post: torch.Tensor, res: torch.Tensor, g: torch.Tensor,
                  backend: str, lanes_grad: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                                                  torch.Tensor]:
    """(dx, df, dpost, dres) of post_forward, given the gradient g of the next lanes; without lanes_grad dx is
    not computed (an empty tensor in its place): a linked pre's backward adds H_res^T g itself."""
    tokens, n, C = x.shape
    if backend == "reference":
        grads = reference_post_backward(x, f, post, res, g)
        out = [gr.to(leaf.dtype).contiguous() for gr, leaf in zip(grads, (x, f, post, res))]
        return (out[0] if lanes_grad else _no_lanes_grad(x), *out[1:])
    from mhc_lab.kernels.post_backward import post_backward_kernel

    f32 = dict(dtype=torch.float32, device=x.device)
    dpost, dres = torch.empty((tokens, n), **f32), torch.empty((tokens, n, n), **f32)
    dx, df = torch.empty_like(x) if lanes_grad else _no_lanes_grad(x), torch.empty_like(f)
    post32, res32 = post.float().contiguous(), res.float().contiguous()
    if tokens == 0:
        return dx, df, dpost.to(post.dtype), dres.to(res.dtype)
    if x.device.type == "cuda":
        dtype = _DTYPE_NAMES[x.dtype]
        with torch.cuda.device(x.device):
            post_backward_kernel(n, C, dtype, "cuda", lanes_grad=lanes_grad)(
                x.contiguous(), f.contiguous(), g.contiguous(), post32, res32, *([dx] if lanes_grad else []), df,
                dpost, dres)
    else:
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


@post_backward.register_fake
def _(x, f, post, res, g, backend, lanes_grad=True):
    return (torch.empty_like(x) if lanes_grad else _no_lanes_grad(x)), torch.empty_like(f), torch.empty_like(post), \
        torch.empty_like(res)


def _post_setup_context(ctx, inputs, output):
    x, f, post, res, backend = inputs
    ctx.backend = backend
    ctx.save_for_backward(x, f, post, res)


def _post_backward(ctx, g):
    x, f, post, res = ctx.saved_tensors
    dx, df, dpost, dres = post_backward(x, f, post, res, g.contiguous(), ctx.backend)
    return dx, df, dpost, dres, None


post_forward.register_autograd(_post_backward, setup_context=_post_setup_context)


@torch.library.custom_op("mhc_lab::post_forward_linked", mutates_args=())
@_no_autocast
def post_forward_linked(x: torch.Tensor, link: torch.Tensor, f: torch.Tensor, post: torch.Tensor,
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
        return post_forward(x, f, post, res, backend), _no_partial(x)
    tokens, n, C = x.shape
    if backend == "reference":
        out = reference_post(x, f, post, res).contiguous()
        return out, _partial_reference(out, phi_next).contiguous()
    m = mixes_width(n)
    post32, res32, phi32 = post.float().contiguous(), res.float().contiguous(), phi_next.float().contiguous()
    from mhc_lab.kernels.post_project import post_project_kernel

    if x.device.type == "cuda":
        from mhc_lab.kernels.pre_split import phi_rows, phi_split_kernel

        splits = partial_splits(backend, x, chained=True)
        out = torch.empty_like(x)
        partial = torch.empty((splits, tokens, m + 1), dtype=torch.float32, device=x.device)
        if tokens:
            with torch.cuda.device(x.device):
                phi_hl = torch.empty((phi_rows(n), n * C), dtype=torch.bfloat16, device=x.device)
                phi_split_kernel(n, C, "cuda")(phi32, phi_hl)
                post_project_kernel(n, C, "bfloat16", "cuda", splits=splits, **POST_PROJECT_TUNING)(
                    x.contiguous(), f.contiguous(), post32, res32, phi_hl, out, partial)
        return out, partial
    partial = torch.empty((1, tokens, m + 1), dtype=torch.float32)
    if x.dtype != torch.float32:
        # the C target computes in float32: the next pre must get the projection of the lanes as stored in the
        # stream's dtype, so round them first and project them in a pass of their own
        from mhc_lab.kernels.pre import projection_kernel_c

        out = post_forward(x, f, post, res, backend)
        if tokens:
            projection_kernel_c(n, C)(out.float().contiguous(), phi32, partial)
        return out, partial
    out = torch.empty(x.shape, dtype=torch.float32)
    if tokens:
        post_project_kernel(n, C, "float32", "c")(x.contiguous(), f.float().contiguous(), post32, res32, phi32, out,
                                                  partial)
    return out, partial


@post_forward_linked.register_fake
def _(x, link, f, post, res, backend, phi_next=None):
    if phi_next is None:
        return torch.empty_like(x), _no_partial(x)
    tokens, n, _ = x.shape
    splits = partial_splits(backend, x, chained=True)
    return torch.empty_like(x), x.new_empty((splits, tokens, mixes_width(n) + 1), dtype=coefficient_dtype(x))


# Chained sites on CUDA: each post projects its lanes for the next pre while they are on chip (the fused post +
# projection), so the next pre reads them once. Timed as CUDA graphs on the H200 (2026-11-30), a chained site's
# forward + backward took 1.42 / 2.06 / 1.80 ms against 1.46 / 2.11 / 1.84 for the linked site (16384 x 2560,
# 16384 x 4096, 8192 x 7168; two more runs timed without graphs agree at the two wider shapes). In the
# transformer block the two are level: three runs at C = 4096 gave +9.1 / +9.7 / +11.7% chained against
# +9.9 / +10.5 / +9.8% linked, within the block's run-to-run spread. So they are on; chaining_on_cuda(False)
# turns them off for a block of code (the benchmarks time both designs). On the CPU sites always chain.
CHAIN_ON_CUDA = True

# A linked site's backward, two ways. False: the post's backward writes H_res^T g (the lanes' gradient through
# the post) and the pre's backward reads it back and adds it to its dx (46C per chained site at n = 4). True:
# the post's backward hands g itself back through link and writes no dx; the pre's kernel 2, which holds all
# n lanes per CTA for it, adds H_res^T g in the pass that writes dx (42C per chained site). Decided at the
# forward, for both ops of a site at once. None (the default): True on CUDA where kernel 2 splits the n lanes
# between two consumer warpgroups (n = 4, kernels.pre_backward.consumer_groups_for), False elsewhere. On the
# H200 (2026-11-30) it was slower with one warpgroup: chained sites 1.465 / 2.129 / 1.869 ms as CUDA graphs
# against 1.402 / 1.997 / 1.787 at 16384 x 2560, 16384 x 4096, 8192 x 7168 in the same run (kernel notes,
# version 25). With two (version 33) it is faster: 1.071 / 1.602 / 1.463 against 1.076 / 1.655 / 1.507 (run
# BA; run AZ 1.625 / 1.462 against 1.659 / 1.507 at the two wider shapes). post_gradient_to_pre(True / False)
# sets it for a block of code.
POST_GRADIENT_TO_PRE: Optional[bool] = None


def post_gradient_to_pre_for(x: torch.Tensor, backend: str) -> bool:
    """Whether a linked site on lanes like x hands the post's output gradient to the pre's backward
    (POST_GRADIENT_TO_PRE, or its default where that is None)."""
    if POST_GRADIENT_TO_PRE is not None:
        return POST_GRADIENT_TO_PRE
    from mhc_lab.kernels.pre_backward import consumer_groups_for

    return backend == "kernels" and x.device.type == "cuda" and consumer_groups_for(x.shape[1]) == 2


@contextlib.contextmanager
def _module_setting(name: str, value):
    """Within this block, this module's setting ``name`` (a global the ops read when they run) is ``value``;
    the earlier value comes back after it, also after an exception."""
    saved = globals()[name]
    globals()[name] = value
    try:
        yield
    finally:
        globals()[name] = saved


def post_gradient_to_pre(enabled: Optional[bool]):
    """Within this block, linked sites hand the post's output gradient to the pre's backward (True), which
    adds H_res^T g to its dx, or the post's backward writes H_res^T g for the pre to read back (False); None:
    the default (post_gradient_to_pre_for)."""
    return _module_setting("POST_GRADIENT_TO_PRE", None if enabled is None else bool(enabled))


def coefficient_phases(phases: str):
    """Within this block, kernel 1 of the pre backward on CUDA runs as ``phases`` ("fused", "split" or
    "spread"; pre_backward_coefficients_program) instead of COEFFICIENT_PHASES."""
    if phases not in COEFFICIENT_PHASE_CHOICES:
        raise ValueError(f"coefficient_phases: expected one of {COEFFICIENT_PHASE_CHOICES}, got {phases!r}")
    return _module_setting("COEFFICIENT_PHASES", phases)


def _coefficient_phases_for(n: int) -> str:
    """COEFFICIENT_PHASES for n lanes: "spread" needs n a power of two, and runs as "fused" otherwise."""
    from mhc_lab.kernels._coefficients import spread_fits

    if COEFFICIENT_PHASES == "spread" and not spread_fits(n):
        return "fused"
    return COEFFICIENT_PHASES


def chaining_on_cuda(enabled: bool):
    """Within this block, chained sites on CUDA chain (enabled) or not, whatever CHAIN_ON_CUDA says: the
    benchmarks time both designs in one run."""
    return _module_setting("CHAIN_ON_CUDA", bool(enabled))


# run_sites with the backward joined across sites: each post and the next site's pre are one op
# (boundary_forward), whose backward runs kernel 2 of the pre with the post's backward in one kernel
# (kernels/joined_backward.py), so the lanes' gradient between the two sites never goes through memory (38C per
# chained site at n = 4 against 46C). Off: on the H200 its CUDA kernel takes longer than the two kernels it joins
# (1.33 against 0.90 ms at 16384 x 4096, run BC), bound by its epilogue's instructions (kernel notes, section 7).
JOIN_SITES_BACKWARD = False


def join_sites_backward(enabled: bool):
    """Within this block, run_sites joins each post with the next site's pre (boundary_forward; enabled)."""
    return _module_setting("JOIN_SITES_BACKWARD", bool(enabled))


# the fused post + projection's CUDA tunings (keywords of kernels/post_project.py's program; empty: its defaults:
# gemm_wait "once", faster under the GPU's power cap, where that kernel's time follows the SM clock: 0.419 against
# 0.438 ms behind GEMMs at 16384 x 4096, run BO)
POST_PROJECT_TUNABLE = ("gemm_wait",)
POST_PROJECT_TUNING: dict = {}


def check_post_project_tuning(tuning: dict) -> dict:
    """The tuning itself, if its keys are among POST_PROJECT_TUNABLE and each value one the kernel takes (gemm_wait:
    kernels.post_project.GEMM_WAITS); else a clear error."""
    from mhc_lab.kernels.post_project import GEMM_WAITS

    unknown = sorted(set(tuning) - set(POST_PROJECT_TUNABLE))
    if unknown:
        raise InputError(f"post_project_tuning: expected keys among {', '.join(POST_PROJECT_TUNABLE)}, got "
                         f"{', '.join(unknown)}")
    if "gemm_wait" in tuning and tuning["gemm_wait"] not in GEMM_WAITS:
        raise InputError(f"post_project_tuning: gemm_wait expected one of {', '.join(GEMM_WAITS)}, got "
                         f"{tuning['gemm_wait']!r}")
    return tuning


def post_project_tuning(**tuning):
    """Within this block, the fused post + projection on CUDA takes these tunings (check_post_project_tuning)
    instead of its defaults."""
    return _module_setting("POST_PROJECT_TUNING", dict(check_post_project_tuning(tuning)))


LANE_TUNABLE = ("block_tokens", "block_c", "lane_group", "stages", "dx_products", "threads", "trim_lo", "overlap_dx",
                "ctas_per_sm", "swizzle_epilogue", "stage_dx", "dy_once", "consumer_groups", "g_once", "held_terms",
                "lane_splits")


def check_lane_tuning(tuning: dict) -> dict:
    """The tuning itself, if its keys are among LANE_TUNABLE (lane_splits a positive integer); else a clear
    error."""
    unknown = sorted(set(tuning) - set(LANE_TUNABLE))
    if unknown:
        raise InputError(f"lane_tuning: expected keys among {', '.join(LANE_TUNABLE)}, got {', '.join(unknown)}")
    splits = tuning.get("lane_splits", 1)
    if isinstance(splits, bool) or not isinstance(splits, int) or splits < 1:
        raise InputError(f"lane_tuning: lane_splits expected a positive integer (kernel 2's token splits), got "
                         f"{splits!r}")
    return tuning


def lane_program_tuning() -> dict:
    """LANE_TUNING's keywords of pre_backward_lanes_program (all but lane_splits, which sets the grid)."""
    return {k: v for k, v in LANE_TUNING.items() if k != "lane_splits"}


def lane_tuning(**tuning):
    """Within this block, kernel 2 of the pre backward on CUDA takes these tunings (keys of LANE_TUNABLE, values
    as pre_backward_lanes_program takes them, and lane_splits, its grid's token splits) instead of its defaults."""
    return _module_setting("LANE_TUNING", dict(check_lane_tuning(tuning)))


def fused_projection_applies(backend: str, x: torch.Tensor) -> bool:
    """Whether a post can project its lanes for the next site (post_forward_linked's phi_next): always for the
    reference and the C target; on CUDA when CHAIN_ON_CUDA and the fused kernel's 16-byte row copies fit
    (C a multiple of 8)."""
    if backend == "reference" or x.device.type != "cuda":
        return True
    return CHAIN_ON_CUDA and x.shape[-1] % 8 == 0


def _post_linked_setup_context(ctx, inputs, output):
    x, _, f, post, res, backend, _ = inputs
    ctx.backend = backend
    ctx.post_grad = post_gradient_to_pre_for(x, backend)  # as the linked pre_forward decided it, in the same forward
    ctx.save_for_backward(x, f, post, res)
    ctx.mark_non_differentiable(output[1])


def _post_linked_backward(ctx, g, _dpartial):
    x, f, post, res = ctx.saved_tensors
    g = g.contiguous()
    dx, df, dpost, dres = post_backward(x, f, post, res, g, ctx.backend, not ctx.post_grad)
    # the lanes' gradient goes back through link: H_res^T g, or g itself for the pre's backward to finish
    return None, g if ctx.post_grad else dx, df, dpost, dres, None, None


post_forward_linked.register_autograd(_post_linked_backward, setup_context=_post_linked_setup_context)


def joined_kernel_applies(backend: str, x: torch.Tensor) -> bool:
    """Whether joined_backward runs the joined kernel for lanes like x: the kernels backend on the CPU (its C
    target), or on CUDA with bf16 lanes at n = 4 and C a multiple of 8 (two consumer warpgroups of all four
    lanes, tiles stored by TMA); elsewhere it runs the two kernels apart."""
    if backend != "kernels":
        return False
    if x.device.type != "cuda":
        return True
    return x.dtype == torch.bfloat16 and x.shape[1] == 4 and x.shape[2] % 8 == 0


@torch.library.custom_op("mhc_lab::joined_backward", mutates_args=())
@_no_autocast
def joined_backward(x: torch.Tensor, phi: torch.Tensor, bias: torch.Tensor, alpha: torch.Tensor, pre: torch.Tensor,
                    partial: torch.Tensor, res: torch.Tensor, dy: torch.Tensor, dpost: torch.Tensor,
                    dres: torch.Tensor, dx_post: torch.Tensor, x_prev: torch.Tensor, f_prev: torch.Tensor,
                    post_prev: torch.Tensor, res_prev: torch.Tensor, backend: str
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                               torch.Tensor]:
    """The backward of a site's pre (x, phi, bias, alpha; pre_backward with dx_post, the lanes' gradient of
    its own post) joined with the backward of the post before it (x_prev, f_prev, post_prev, res_prev;
    post_backward with g = this pre's dx): (the previous post's lanes gradient H_res_p^T g, df_prev,
    dpost_prev, dres_prev, dphi, dbias, dalpha). One kernel where joined_kernel_applies, else the two ops."""
    if not joined_kernel_applies(backend, x):
        dx, dphi, dbias, dalpha = pre_backward(x, phi, bias, alpha, pre, partial, res, dy, dpost, dres, dx_post,
                                               backend)
        dx_prev, df_prev, dpost_prev, dres_prev = post_backward(x_prev, f_prev, post_prev, res_prev, dx, backend)
        return dx_prev, df_prev, dpost_prev, dres_prev, dphi, dbias, dalpha
    from mhc_lab.kernels.joined_backward import coef_blocks, coefficients_from_partial

    tokens, n, C = x.shape
    lanes, lead, dlogit, extra, dphi_partial = _coefficients_and_lanes(x, phi, bias, alpha, pre, partial, dy, dpost,
                                                                       dres, add_dx=True, post_grad=False,
                                                                       joined=True)
    cuda = x.device.type == "cuda"
    work = x.dtype if cuda else torch.float32  # the C target computes in float32
    dx_prev = torch.empty(x_prev.shape, dtype=work, device=x.device)
    df_prev = torch.empty(f_prev.shape, dtype=work, device=x.device)
    blocks = coef_blocks(C, "cuda" if cuda else "c", LANE_TUNING.get("block_c"))
    alloc = torch.empty if tokens else torch.zeros
    coef_partial = alloc((tokens, blocks, n * n + n), dtype=torch.float32, device=x.device)
    previous = [t.to(work).contiguous() for t in (dx_post, x_prev, f_prev)]
    previous += [post_prev.float().contiguous(), res_prev.float().contiguous()]
    if tokens:
        with torch.cuda.device(x.device) if cuda else contextlib.nullcontext():
            lanes(*lead, *previous, dx_prev, df_prev, dphi_partial, coef_partial)
    dres_prev, dpost_prev = coefficients_from_partial(coef_partial, n)
    return (dx_prev.to(x_prev.dtype), df_prev.to(f_prev.dtype), dpost_prev.to(post_prev.dtype),
            dres_prev.to(res_prev.dtype), *_parameter_grads(dphi_partial, dlogit, extra, n, phi, bias, alpha))


@joined_backward.register_fake
def _(x, phi, bias, alpha, pre, partial, res, dy, dpost, dres, dx_post, x_prev, f_prev, post_prev, res_prev, backend):
    return (torch.empty_like(x_prev), torch.empty_like(f_prev), torch.empty_like(post_prev), torch.empty_like(res_prev),
            torch.empty_like(phi), torch.empty_like(bias), torch.empty_like(alpha))


@torch.library.custom_op("mhc_lab::boundary_forward", mutates_args=())
@_no_autocast
def boundary_forward(x_prev: torch.Tensor, link_prev: torch.Tensor, f_prev: torch.Tensor, post_prev: torch.Tensor,
                     res_prev: torch.Tensor, phi: torch.Tensor, bias: torch.Tensor, alpha: torch.Tensor, backend: str
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                                torch.Tensor]:
    """A post (post_forward_linked on x_prev, link_prev, f_prev, post_prev, res_prev) and the next site's pre
    (pre_forward with phi, bias, alpha on the lanes it makes) as one op: (x, y, post, res, pre, partial, link),
    the post's lanes and the pre's outputs. Its backward is joined_backward: the lanes' gradient between the two
    never goes through memory. The post's lanes gradient goes back through link_prev (as post_forward_linked's
    does, in the form that writes H_res^T g), x_prev's as None."""
    return _boundary(x_prev, link_prev, f_prev, post_prev, res_prev, phi, bias, alpha, backend)


def _boundary(x_prev, link_prev, f_prev, post_prev, res_prev, phi, bias, alpha, backend):
    x, partial = post_forward_linked(x_prev, link_prev, f_prev, post_prev, res_prev, backend, phi)
    y, post, res, pre, _, link = pre_forward(x, phi, bias, alpha, backend, partial)
    return x, y, post, res, pre, partial, link


boundary_forward.register_fake(_boundary)  # under fake tensors the two ops it calls run their own fakes


def _boundary_setup_context(ctx, inputs, output):
    x_prev, _, f_prev, post_prev, res_prev, phi, bias, alpha, backend = inputs
    x, _, _, res, pre, partial, _ = output
    ctx.backend = backend
    ctx.save_for_backward(x_prev, f_prev, post_prev, res_prev, x, phi, bias, alpha, pre, partial, res)
    ctx.mark_non_differentiable(pre, partial)
    ctx.set_materialize_grads(False)


def _boundary_backward(ctx, dx, dy, dpost, dres, _dpre, _dpartial, dlink):
    x_prev, f_prev, post_prev, res_prev, x, phi, bias, alpha, pre, partial, res = ctx.saved_tensors
    # the lanes' gradient besides this pre's own: its post's (through link) and any other use of x, summed
    dx_post = dlink if dx is None else dx if dlink is None else dlink + dx
    dx_post = torch.zeros_like(x) if dx_post is None else dx_post.contiguous()
    grads = joined_backward(x, phi, bias, alpha, pre, partial, res, *_pre_output_grads(x, pre, dy, dpost, dres),
                            dx_post, x_prev, f_prev, post_prev, res_prev, ctx.backend)
    dx_prev, df_prev, dpost_prev, dres_prev, dphi, dbias, dalpha = grads
    return None, dx_prev, df_prev, dpost_prev, dres_prev, dphi, dbias, dalpha, None


boundary_forward.register_autograd(_boundary_backward, setup_context=_boundary_setup_context)


# ----------------------------------------------------------------------------------------------------------
# the public functions


def mhc_pre(x, phi, bias, alpha, *, backend: str = "auto"):
    """(layer input H_pre x [..., C], H_post [..., n] f32, H_res [..., n, n] f32), differentiable in x, phi,
    bias and alpha. DeepSeek-V4 convention, 20 Sinkhorn rounds (mhc_lab.reference.mhc_coefficients)."""
    n, C = _check_site(x, phi, bias, alpha, "mhc_pre")
    chosen = resolve_backend(backend, x)
    batch = tuple(x.shape[:-2])
    y, post, res, _, _, _ = pre_forward(x.reshape(-1, n, C), phi, bias, alpha, chosen)
    return y.view(*batch, C), post.view(*batch, n), res.view(*batch, n, n)


def _check_layer_output(x, layer_output, op: str) -> None:
    shape = tuple(x.shape[:-2]) + (x.shape[-1],)
    require_tensor("layer_output", layer_output)
    if tuple(layer_output.shape) != shape or layer_output.device != x.device:
        raise InputError(f"{op}: layer_output: expected shape {shape} on {x.device}, got {_describe(layer_output)}")
    if layer_output.dtype != x.dtype:
        raise InputError(f"{op}: layer_output: expected dtype {x.dtype} (the lanes'), got {_describe(layer_output)}")


def mhc_post(x, layer_output, post, res, *, backend: str = "auto"):
    """The next lanes sum_j H_res[i, j] x_j + H_post[i] layer_output, differentiable in every input."""
    n, C = require_lanes("x", x)
    batch = tuple(x.shape[:-2])
    _check_layer_output(x, layer_output, "mhc_post")
    for name, value, shape in (("post", post, batch + (n,)), ("res", res, batch + (n, n))):
        require_tensor(name, value)
        if tuple(value.shape) != shape or value.device != x.device:
            raise InputError(f"mhc_post: {name}: expected shape {shape} on {x.device}, got {_describe(value)}")
    chosen = resolve_backend(backend, x)
    out = post_forward(x.reshape(-1, n, C), layer_output.reshape(-1, C), post.reshape(-1, n),
                       res.reshape(-1, n, n), chosen)
    return out.view(*batch, n, C)


def mhc_site(x, phi, bias, alpha, layer, *, backend: str = "auto"):
    """One whole site, x_next = H_res x + H_post^T layer(H_pre x), the same values as mhc_post(x, layer(y), ...)
    after mhc_pre, but the lanes' two gradients (the post's H_res^T g and the pre's) are summed inside the pre's
    backward pass instead of by autograd in a pass of their own: 50C per token at n = 4 instead of 58C.
    layer: a function of [..., C] -> [..., C]."""
    return mhc_site_chained(x, phi, bias, alpha, layer, backend=backend)[0]


def mhc_site_chained(x, phi, bias, alpha, layer, *, partial=None, next_phi=None, backend: str = "auto"):
    """mhc_site inside a chain of sites: (x_next, partial_next).

    partial: the projection of x with this site's phi, made by the previous site (or None: this site's pre
    projects x itself). next_phi: the next site's phi (or None): this site's post then projects x_next with it
    while x_next is on chip, so the next pre reads the lanes once instead of twice (4C fewer per token at
    n = 4 in the forward). partial_next is None when next_phi is None or the fused projection does not apply
    (fused_projection_applies)."""
    n, C = _check_site(x, phi, bias, alpha, "mhc_site")
    chosen = resolve_backend(backend, x)
    batch = tuple(x.shape[:-2])
    lanes = x.reshape(-1, n, C)
    y, post, res, _, _, link = pre_forward(lanes, phi, bias, alpha, chosen, partial)
    f = layer(y.view(*batch, C))
    _check_layer_output(x, f, "mhc_site")
    if next_phi is not None:
        require_tensor("next_phi", next_phi)
        if tuple(next_phi.shape) != tuple(phi.shape) or next_phi.device != x.device:
            raise InputError(f"mhc_site: next_phi: expected shape {tuple(phi.shape)} on {x.device} (the next site "
                             f"of the same n and C), got {_describe(next_phi)}")
        if not fused_projection_applies(chosen, x):
            next_phi = None
    out, partial_next = post_forward_linked(lanes, link, f.reshape(-1, C), post, res, chosen, next_phi)
    return out.view(*batch, n, C), (partial_next if next_phi is not None else None)


def run_sites(x, connections, layers):
    """x through a chain of MHCConnections, each around its layer; every post projects its lanes for the next
    site's pre (mhc_site_chained), so inside the chain the lanes are read once per site, not twice. Under
    join_sites_backward(True), with one backend, n and width throughout, each post and the next pre are one op
    (boundary_forward) whose backward is joined."""
    connections, layers = list(connections), list(layers)
    if len(connections) != len(layers):
        raise InputError(f"run_sites: expected one connection per layer, got {len(connections)} connections and "
                         f"{len(layers)} layers")
    if JOIN_SITES_BACKWARD and connections and len({(c.backend, c.n, c.width) for c in connections}) == 1:
        return _run_sites_joined(x, connections, layers)
    partial = None
    for i, (connection, layer) in enumerate(zip(connections, layers)):
        following = connections[i + 1] if i + 1 < len(connections) else None
        chain = following is not None and (following.backend, following.n, following.width) == (
            connection.backend, connection.n, connection.width)
        x, partial = connection.chained(x, layer, partial, following.phi if chain else None)
    return x


def _run_sites_joined(x, connections, layers):
    """run_sites with each post and the next pre as one op (boundary_forward): the first site's pre and the
    last site's post stand alone. Every post writes H_res^T g for its pre (post_gradient_to_pre(False)): the
    joined kernel adds it as kernel 2 with dx_post does."""
    first = connections[0]
    require_lanes("x", x, n=first.n)
    n, C = _check_site(x, first.phi, first.bias, first.alpha, "run_sites")
    backend = resolve_backend(first.backend, x)
    batch = tuple(x.shape[:-2])
    lanes = x.reshape(-1, n, C)
    with post_gradient_to_pre(False):
        y, post, res, _, _, link = pre_forward(lanes, first.phi, first.bias, first.alpha, backend)
        for i, layer in enumerate(layers):
            f = layer(y.view(*batch, C))
            _check_layer_output(x, f, "run_sites")
            f = f.reshape(-1, C)
            if i + 1 < len(layers):
                nxt = connections[i + 1]
                lanes, y, post, res, _, _, link = boundary_forward(lanes, link, f, post, res, nxt.phi, nxt.bias,
                                                                   nxt.alpha, backend)
            else:
                lanes, _ = post_forward_linked(lanes, link, f, post, res, backend)
    return lanes.view(*batch, n, C)


# ----------------------------------------------------------------------------------------------------------
# modules


class MHCConnection(nn.Module):
    """One mHC site around a layer function: x_next = H_res x + H_post^T layer(H_pre x).

    Parameters in DeepSeek-V4's layout (phi [n^2+2n, nC], bias [n^2+2n], alpha [3], float32), initialised
    near the identity (mhc_lab.reference.mhc_identity_init)."""

    def __init__(self, n: int, width: int, *, backend: str = "auto"):
        super().__init__()
        if backend not in BACKENDS:
            raise InputError(f"backend: expected one of {BACKENDS}, got {backend!r}")
        self.n, self.width, self.backend = require_positive_int("n", n), require_positive_int("width", width), backend
        phi, bias, alpha = mhc_identity_init(n, width)
        self.phi, self.bias, self.alpha = nn.Parameter(phi), nn.Parameter(bias), nn.Parameter(alpha)

    def forward(self, x: torch.Tensor, layer) -> torch.Tensor:
        require_lanes("x", x, n=self.n)
        return mhc_site(x, self.phi, self.bias, self.alpha, layer, backend=self.backend)

    def chained(self, x: torch.Tensor, layer, partial=None, next_phi=None):
        """(x_next, partial_next) of mhc_site_chained: how run_sites links consecutive connections."""
        require_lanes("x", x, n=self.n)
        return mhc_site_chained(x, self.phi, self.bias, self.alpha, layer, partial=partial, next_phi=next_phi,
                                backend=self.backend)


def recompute_policy(ctx, op, *args, **kwargs):
    """Selective checkpointing: recompute the mHC ops (torch.ops.mhc_lab.*) and views in backward, keep the
    rest. Views must be recomputed too: a kept view keeps its base alive, and the ops' outputs are viewed on
    their way out, so keeping views would keep every lane. Layers inside a recompute block must not modify
    their intermediate results in place (a kept tensor must not change before the backward): that is refused
    here, with the op named."""
    from torch.utils.checkpoint import CheckpointPolicy

    if getattr(op, "namespace", None) == "mhc_lab" or getattr(op, "is_view", False):
        return CheckpointPolicy.PREFER_RECOMPUTE
    if not ctx.is_recompute and op._schema.is_mutable:
        raise InputError(
            f"recompute_block: a layer modifies a tensor in place ({op}), which blocks that keep the layers' "
            "results cannot allow; use layers without in-place operations (on the CPU torch.nn.RMSNorm adds "
            "its eps in place; mhc_lab.course.training_lab.RMSNorm does not) or recompute_block=None"
        )
    return CheckpointPolicy.MUST_SAVE


class MHCResidualStream(nn.Module):
    """Layers joined by mHC: the hidden state is copied into n lanes, every layer is wrapped by its own
    MHCConnection, and the lanes are summed back into one hidden state at the end.

    recompute_block: None keeps every activation; k > 0 checkpoints blocks of k layers in which only the mHC
    ops are recomputed in backward (the layers' own activations are kept), so the lanes of a block's inner
    layers are not stored (arXiv 2512.24880 Sec. 4.3.2); "auto" takes the integer optimum of Eq. 20
    (mhc_lab.reference.recompute)."""

    def __init__(self, layers: Sequence[nn.Module], n: int, width: int, *, backend: str = "auto",
                 recompute_block: int | str | None = None):
        super().__init__()
        self.layers = nn.ModuleList(layers)
        if not len(self.layers):
            raise InputError("layers: expected at least one layer, got none")
        self.n = require_positive_int("n", n)
        self.connections = nn.ModuleList(MHCConnection(n, width, backend=backend) for _ in self.layers)
        if recompute_block == "auto":
            from mhc_lab.reference.recompute import optimal_block

            recompute_block, _ = optimal_block(n, len(self.layers))
        if recompute_block is not None and (not isinstance(recompute_block, int) or recompute_block < 1):
            raise InputError(f"recompute_block: expected None, 'auto' or a positive int, got {recompute_block!r}")
        self.recompute_block = recompute_block

    def _run(self, x: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        return run_sites(x, self.connections[start:stop], self.layers[start:stop])

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        x = expand_lanes(h, self.n)
        block = self.recompute_block
        if block is None or not torch.is_grad_enabled():
            x = self._run(x, 0, len(self.layers))
        else:
            from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

            context = functools.partial(create_selective_checkpoint_contexts, recompute_policy)
            for start in range(0, len(self.layers), block):
                x = checkpoint(self._run, x, start, min(start + block, len(self.layers)), use_reentrant=False,
                               context_fn=context)
        return collapse_lanes(x)
