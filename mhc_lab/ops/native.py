"""The site's CUDA ops in C++ (native.cpp): what the kernels backend runs on a GPU, eagerly and inside the custom ops.

In Python, the site's forward and backward cost the host about 0.8 ms per site (allocations, launches through
TileLang's Python, the autograd.Functions), several times what a small model's site takes on the GPU. In C++ the
same ops, and their autograd, cost the host their allocations and launches. Python decides once per
configuration which compiled kernels run (a plan: their TVM FFI entry functions and buffer sizes); native.cpp
allocates, launches on torch's current stream, and differentiates.

    extension()              the compiled module (built on first use, cached on disk); loading it registers
                             the CUDA and AutogradCUDA kernels of torch.ops.mhc_lab.* (site_ops' ops)
    when_loaded(connect)     connect(module) once it is loaded (site_ops hands those kernels its plans this way)
    pre_forward_plan(...), pre_backward_plan(...), post_forward_plan(...), post_backward_plan(...)
                             each op's plan for a CUDA target (mhc_lab.ops.site_ops chooses them per lanes)

The build needs a C++ compiler and ninja (as TileLang's CUDA builds need nvcc and a host compiler); it takes
about a minute once, then loads from torch's extension cache (TORCH_EXTENSIONS_DIR).
"""

from __future__ import annotations

import functools
import os
import threading

import torch

from mhc_lab.kernels._target import memoize

SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "native.cpp")
_build_lock = threading.Lock()


class NativeBuildError(RuntimeError):
    """The C++ ops could not be built here (no compiler, no ninja, or the build failed)."""


@functools.lru_cache(maxsize=None)
def extension():
    """The compiled C++ module (torch.utils.cpp_extension.load: rebuilt when native.cpp changes); NativeBuildError
    naming what failed where it cannot be built."""
    import tvm_ffi.libinfo
    from torch.utils import cpp_extension

    library = tvm_ffi.libinfo.find_libtvm_ffi()
    folder = os.path.dirname(library)
    includes = list(dict.fromkeys(tvm_ffi.libinfo.include_paths() + [tvm_ffi.libinfo.find_dlpack_include_path()]))
    with _build_lock:
        try:
            module = cpp_extension.load(
                name="mhc_lab_native", sources=[SOURCE], extra_include_paths=includes,
                extra_cflags=["-O2"], extra_ldflags=[f"-L{folder}", "-ltvm_ffi", f"-Wl,-rpath,{folder}"],
                verbose=False)
        except Exception as error:  # compiler or ninja missing, or a failed build: say which
            raise NativeBuildError(f"building mhc_lab's C++ site ops ({SOURCE}) failed: {error}") from error
    for connect in _on_load:
        connect(module)
    return module


_on_load: list = []  # what is called with the module once it is loaded (when_loaded)


def when_loaded(connect) -> None:
    """Call connect(module) with the C++ module now if it is loaded, else as soon as extension() loads it. Loading
    it registers CUDA kernels for the ops of mhc_lab.ops.site_ops, which connects them to its plans this way."""
    _on_load.append(connect)
    if extension.cache_info().currsize:
        connect(extension())


@memoize
def native_refusal() -> str:
    """Why the CUDA kernels cannot run here for want of the C++ ops (their build failed), or "" where they are
    built; tried once per process (a dict torch.compile reads through: dispatch asks on every site call)."""
    return _build_refusal()


@torch.compiler.disable
def _build_refusal() -> str:
    try:
        extension()
    except NativeBuildError as error:
        return str(error)
    return ""


def _entry(kernel) -> tuple[int, object]:
    """(handle, keep-alive) of a compiled kernel's TVM FFI entry function."""
    function = getattr(kernel, "kernel", kernel).torch_function  # CheckedKernel wraps the JIT kernel
    return function.__chandle__(), function


def _plan(keep: list, **fields):
    plan = extension().Plan()
    for name, value in fields.items():
        if hasattr(value, "torch_function") or hasattr(value, "kernel"):
            value, ref = _entry(value)
            keep.append(ref)
        setattr(plan, name, value)
    plan.keep = keep  # the entry functions stay alive as long as the plan (plans live for the process)
    return plan


@memoize
def pre_forward_plan(n: int, C: int, target: str, splits: int, projected: bool):
    """The pre's forward for a CUDA target: phi split and projection pass into `splits` partial sums (neither
    where the previous post projected: projected), then coefficients and lane mix."""
    from mhc_lab.kernels.pre_split import apply_kernel, phi_rows, phi_split_kernel, project_kernel

    apply = apply_kernel(n, C, "bfloat16", target, splits=splits)
    kernels = {} if projected else dict(phi_split=phi_split_kernel(n, C, target),
                                        project=project_kernel(n, C, "bfloat16", target, splits=splits))
    return _plan([], n=n, C=C, splits=splits, phi_rows=phi_rows(n), coefficients=apply.coefficients, mix=apply.mix,
                 **kernels)


@memoize
def pre_backward_plan(n: int, C: int, target: str, hopper: bool, splits: int, lane_splits: int, add_dx: bool,
                      post_grad: bool):
    """The pre's backward for a CUDA target, for forward partial sums of `splits` splits: kernel 1 (one program,
    or the reduction and the per-token program), kernel 2 (its Hopper or portable program, in `lane_splits`
    token splits; add_dx / post_grad: for a pre linked to its post, pre_backward.pre_backward_kernels), then the
    parameters' sums over the tokens (pre_backward_sums)."""
    from mhc_lab.kernels.pre_backward import pre_backward_kernels
    from mhc_lab.kernels.pre_backward_operands import EXTRA, coef_width, gemm_depth
    from mhc_lab.kernels.pre_backward_sums import pre_backward_sums_kernel

    coefficients, lanes = pre_backward_kernels(n, C, "bfloat16", target, splits=splits, lane_splits=lane_splits,
                                               add_dx=add_dx, post_grad=post_grad, hopper=hopper)
    kernel1 = (dict(k1_reduce=coefficients.reduce, k1_tokens=coefficients.tokens) if hasattr(coefficients, "tokens")
               else dict(k1_fused=coefficients))
    return _plan([], n=n, C=C, splits=splits, gemm_depth=gemm_depth(n), coef_width=coef_width(n), extra=EXTRA,
                 lane_splits=lane_splits, add_dx=add_dx, post_grad=post_grad, k2=lanes,
                 sums=pre_backward_sums_kernel(n, C, lane_splits, target), **kernel1)


@memoize
def post_forward_plan(n: int, C: int, target: str, hopper: bool, project_splits: int):
    """The post's forward for a CUDA target; project_splits > 0: the next lanes also projected with the next
    site's phi into that many partial sums, inside the post on Hopper (post + projection), else by the
    projection pass after the post."""
    from mhc_lab.kernels.post import post_kernel
    from mhc_lab.kernels.post_project import post_project_kernel
    from mhc_lab.kernels.pre_split import phi_rows, phi_split_kernel, project_kernel

    if not project_splits:
        return _plan([], n=n, C=C, post=post_kernel(n, C, "bfloat16", target))
    fused = dict(post_project=post_project_kernel(n, C, "bfloat16", target, splits=project_splits)) if hopper else \
        dict(post=post_kernel(n, C, "bfloat16", target),
             project=project_kernel(n, C, "bfloat16", target, splits=project_splits))
    return _plan([], n=n, C=C, splits=project_splits, phi_rows=phi_rows(n), phi_split=phi_split_kernel(n, C, target),
                 **fused)


@memoize
def post_backward_plan(n: int, C: int, target: str, lanes_grad: bool):
    """The post's backward for a CUDA target; without lanes_grad it writes no dx (a linked pre forms H_res^T g)."""
    from mhc_lab.kernels.post_backward import post_backward_kernel

    return _plan([], n=n, C=C, lanes_grad=lanes_grad,
                 post_backward=post_backward_kernel(n, C, "bfloat16", target, lanes_grad=lanes_grad))
