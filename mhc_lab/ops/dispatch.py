"""Which implementation runs an mHC site: the backends, their input checks, and the paths the kernels take.

Backends:
  - "kernels": the fused TileLang kernels, forward and backward (mhc_lab.kernels). On CUDA: bf16 lanes,
    n = 1..8, n*C a multiple of 8. On the CPU the same kernels run through TileLang's C target, in float32
    (slow, for checking and learning).
  - "reference": mhc_lab.reference's math forward, and the hand-derived backward of mhc_lab.reference.backward
    (it recomputes the coefficients from the inputs).
  - "auto" (the default): "kernels" on CUDA where they apply, on a GPU whose architecture they serve
    (kernel_paths), "reference" everywhere else.

Every choice here is a pure function of the lanes and the backend: nothing module-wide changes what runs.
"""

from __future__ import annotations

import functools
import warnings

import torch

from mhc_lab.kernels._target import memoize
from mhc_lab.ops.forward import _describe
from mhc_lab.reference.mhc import mixes_width
from mhc_lab.reference.validate import InputError, require_lanes, require_lanes_not_transposed, require_tensor

BACKENDS = ("auto", "reference", "kernels")
KERNEL_MAX_LANES = 8
# Column splits of the fused post + next projection on CUDA: the next pre's apply pass sums that many partials.
# One split beat two and four at 16384 x 4096 on the H200 (0.434 ms against 0.444 with two); the pre's own
# projection pass keeps its own count (pre_split.PROJECTION_SPLITS).
CHAIN_SPLITS = 1


def kernels_apply(x: torch.Tensor) -> tuple[bool, str]:
    """Whether the fused kernels take these lanes, and if not, why not. On CUDA that includes the GPU the lanes
    are on: every op of the site must have a program that builds for its architecture and fits its shared memory
    (kernel_paths); where one has not, the answer names the GPU and its compute capability."""
    why = _lanes_refusal(x)
    if why is None and x.device.type == "cuda":
        why = _gpu_refusal(x)
    return why is None, why or ""


def _lanes_refusal(x: torch.Tensor) -> str | None:
    """Why the kernels do not take lanes of this shape, dtype and device type (whatever the GPU), or None."""
    n, C = x.shape[-2], x.shape[-1]
    if n > KERNEL_MAX_LANES:
        return f"the kernels take n = 1..{KERNEL_MAX_LANES} lanes, got n = {n}"
    if x.device.type == "cuda":
        if x.dtype != torch.bfloat16:
            return f"the CUDA kernels take bfloat16 lanes, got {x.dtype}"
        if (n * C) % 8:
            return f"the CUDA kernels read 16-byte rows: n * C must be a multiple of 8, got {n} * {C}"
        return None
    if x.device.type == "cpu":
        if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            return f"the C-target kernels take float32/bfloat16/float16 lanes, got {x.dtype}"
        return None
    return f"the kernels run on CPU or CUDA tensors, got device {x.device}"


def _gpu_refusal(x: torch.Tensor) -> str | None:
    """Why the GPU that CUDA lanes x are on cannot run a site of their n in the kernels (naming the GPU and its
    compute capability), or None."""
    name, capability, shared = cuda_device_facts(x.device)
    refused = [path for path in kernel_paths(capability, x.shape[-2], shared_bytes=shared).values()
               if path.startswith("reference")]
    if not refused:
        from mhc_lab.ops.native import native_refusal

        return native_refusal() or None  # the site's CUDA ops are C++ (native.cpp), built on first use
    return f"{name} (compute capability {capability[0]}.{capability[1]}): {refused[0].split(': ', 1)[1]}"


_warned: set[str] = set()  # the reasons resolve_backend has warned of in this process


_RESOLVED: dict = {}  # (backend, device, dtype, n, C) -> the backend that runs: a site asks on every call


@torch.compiler.assume_constant_result
def resolve_backend(backend: str, x: torch.Tensor) -> str:
    """'auto' -> 'kernels' on CUDA where they apply (the GPU's architecture included), else 'reference', with a
    warning, once per process and reason, where the lanes suit the kernels but their GPU cannot run them;
    'kernels' is checked, not downgraded (an InputError that names the GPU where it is the GPU). Decided once
    per backend, device, dtype, n and C (the checks cost a site tens of microseconds of host time). A
    torch.compile trace takes the answer as a constant: traced, the first call's lookup would fill the cache,
    and its guard on the key's absence would compile the graph a second time."""
    if backend not in BACKENDS:
        raise InputError(f"backend: expected one of {BACKENDS}, got {backend!r}")
    key = (backend, x.device, x.dtype, x.shape[-2], x.shape[-1])
    chosen = _RESOLVED.get(key)
    if chosen is None:
        chosen = _RESOLVED[key] = _resolve_backend(backend, x)
    return chosen


def _resolve_backend(backend: str, x: torch.Tensor) -> str:
    if backend == "reference":
        return backend
    ok, why = kernels_apply(x)
    if backend == "kernels":
        if not ok:
            raise InputError(f"backend 'kernels': {why} (x: {_describe(x)}); use backend='reference'")
        return backend
    if ok:
        return "kernels" if x.device.type == "cuda" else "reference"
    if x.device.type == "cuda" and _lanes_refusal(x) is None and why not in _warned:
        _warned.add(why)
        warnings.warn(f"backend 'auto' runs the reference (PyTorch) for these lanes, not the fused kernels: {why}. "
                      f"Each op's path on a GPU: mhc_lab.ops.dispatch.kernel_paths (said once per process)",
                      stacklevel=2)
    return "reference"


def check_site(x, phi, bias, alpha, op: str) -> tuple[int, int]:
    """(n, C) of the lanes x [..., n, C], after checking that phi, bias and alpha fit them."""
    n, C = require_lanes("x", x)
    require_lanes_not_transposed("x", x, phi, op)
    m = mixes_width(n)
    for name, value, shape in (("phi", phi, (m, n * C)), ("bias", bias, (m,)), ("alpha", alpha, (3,))):
        require_tensor(name, value)
        if tuple(value.shape) != shape:
            raise InputError(f"{op}: {name}: expected shape {shape} for n = {n}, C = {C}, got {_describe(value)}")
        if value.device != x.device:
            raise InputError(f"{op}: {name}: expected device {x.device} (the lanes'), got {_describe(value)}")
        if not value.is_floating_point():
            raise InputError(f"{op}: {name}: expected a floating-point tensor, got {value.dtype} "
                             f"({_describe(value)})")
    return n, C


def check_layer_output(x, layer_output, op: str) -> None:
    """The layer's output fits the lanes x [..., n, C]: shape [..., C], the same dtype and device."""
    shape = tuple(x.shape[:-2]) + (x.shape[-1],)
    require_tensor("layer_output", layer_output)
    if tuple(layer_output.shape) != shape or layer_output.device != x.device:
        raise InputError(f"{op}: layer_output: expected shape {shape} on {x.device}, got {_describe(layer_output)}")
    if layer_output.dtype != x.dtype:
        raise InputError(f"{op}: layer_output: expected dtype {x.dtype} (the lanes'), got {_describe(layer_output)}")


def partial_splits(backend: str, x: torch.Tensor, *, chained: bool = False) -> int:
    """The first axis of the partial sums a backend's pre projects into, or (chained) that a post projects
    into for the next pre (post_forward_linked's partial_next, pre_forward's partial_in)."""
    if backend == "kernels" and x.device.type == "cuda":
        from mhc_lab.kernels.pre_split import PROJECTION_SPLITS

        return CHAIN_SPLITS if chained else PROJECTION_SPLITS
    return 1


@torch.compiler.assume_constant_result  # as resolve_backend: read from caches that a first trace would fill
def fused_projection_applies(backend: str, x: torch.Tensor) -> bool:
    """Whether a post can project its lanes for the next site (post_forward_linked's phi_next): always for the
    reference and the C target; on CUDA where the fused kernel runs, a Hopper program (cuda_programs), and its
    16-byte row copies fit (C a multiple of 8). Elsewhere the sites run unchained: the post kernel, then the next
    pre's own projection pass."""
    if backend == "reference" or x.device.type != "cuda":
        return True
    return x.shape[-1] % 8 == 0 and cuda_programs(x)[1]


def post_gradient_to_pre_for(x: torch.Tensor, backend: str) -> bool:
    """Whether a linked site on lanes like x hands the post's output gradient g to the pre's backward, whose
    kernel 2 adds H_res^T g in the pass that writes dx (True: the post's backward writes no dx, 42C per chained
    site at n = 4), or the post's backward writes H_res^T g for kernel 2 to read back (False: 46C). True on CUDA
    where kernel 2 splits the n lanes between two consumer warpgroups (n = 4): with one warpgroup of all n lanes
    kernel 2 lost more than the post's backward saved. Decided at the forward, for both ops of a site."""
    return backend == "kernels" and x.device.type == "cuda" and _two_consumer_groups(x.shape[-2])


@functools.lru_cache(maxsize=None)
def _two_consumer_groups(n: int) -> bool:
    from mhc_lab.kernels.pre_backward_lanes import consumer_groups_for

    return consumer_groups_for(n) == 2


@functools.lru_cache(maxsize=None)
def lane_splits(n: int, C: int, device: torch.device, add_dx: bool, post_grad: bool) -> int:
    """Token splits of the pre backward's kernel 2 on CUDA: its CTAs in waves that fill the GPU's SMs (read once
    per process and arguments: asking the GPU's SM count took 13 us of host time per call)."""
    from mhc_lab.kernels.pre_backward_lanes import lane_splits_for

    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return lane_splits_for(n, C, sms, add_dx=add_dx, post_grad=post_grad)


# ------------------------------------------------------------------------------------ the GPU's architecture


def cuda_device_facts(device: torch.device) -> tuple[str, tuple[int, int], int]:
    """(name, compute capability, shared memory a block may use) of a CUDA device, read once per process. Where
    torch sees no CUDA GPU (lanes that only stand for CUDA tensors, to plan without one), those of the default
    build, sm_90, as canonical_target('cuda') takes it."""
    index = torch.device(device).index
    if index is None and torch.cuda.is_available():
        index = torch.cuda.current_device()
    return _device_facts(index)


@memoize
def _device_facts(index: int | None) -> tuple[str, tuple[int, int], int]:
    # cached: the ops ask on every call, and torch.cuda.is_available() alone took 10 us of host time
    from mhc_lab.kernels.portability import shared_bytes_per_block

    if not torch.cuda.is_available():
        return "no CUDA GPU seen (the default build, sm_90)", (9, 0), shared_bytes_per_block((9, 0))
    props = torch.cuda.get_device_properties(index)
    capability = (props.major, props.minor)
    shared = getattr(props, "shared_memory_per_block_optin", 0) or shared_bytes_per_block(capability)
    return props.name, capability, int(shared)


def hopper_programs(capability: tuple[int, int]) -> bool:
    """Whether a GPU of this compute capability runs the Hopper programs (sm_90; portability.hopper_architecture)
    rather than the portable ones."""
    from mhc_lab.kernels.portability import hopper_architecture

    return hopper_architecture(capability)


def cuda_programs(x: torch.Tensor) -> tuple[str, bool]:
    """(target, hopper) of the CUDA programs for lanes x: the build for the architecture of the GPU x is on
    ('sm_86', 'sm_90a', ...), whatever the current device, and whether its ops take the Hopper programs."""
    from mhc_lab.kernels._target import device_target

    _, capability, _ = cuda_device_facts(x.device)
    return device_target(capability), hopper_programs(capability)


_DESCRIBED = {"pre forward": "the pre's projection pass", "pre backward coefficients": "kernel 1 of the pre backward",
              "pre backward lanes": "kernel 2 of the pre backward", "chained sites": "the fused post + projection",
              "post forward": "the post kernel", "post backward": "the post's backward kernel"}


def kernel_paths(capability: tuple[int, int] | None, n: int = 4, *,
                 shared_bytes: int | None = None) -> dict[str, str]:
    """For each op of an mHC site (portability.OPS) on a GPU of this compute capability (None: no CUDA GPU),
    the path backend 'auto' takes: "hopper" (sm_90: the programs built for Hopper, among them the Hopper
    programs of the pre backward's kernel 2 and of the chained sites' fused post + projection), "portable"
    (sm_80 and later: kernel 2's portable program, and "portable: unchained, ..." for the chained sites), or
    "reference: <why>" where an op of the site has no program that builds there or fits the GPU's shared memory
    (a site runs one backend, so then every op takes the reference). shared_bytes: the shared memory a block
    may use on that GPU (default: portability.shared_bytes_per_block). Pure, for doctor and the labs to print."""
    capability = None if capability is None else tuple(capability)
    hopper = capability is not None and hopper_programs(capability)
    return dict(_kernel_paths(capability, n, shared_bytes, hopper))


@memoize
def _kernel_paths(capability, n: int, shared_bytes, hopper: bool) -> dict[str, str]:
    from mhc_lab.kernels.portability import OPS, shared_bytes_per_block, site_shared_bytes

    def everywhere(why: str) -> dict[str, str]:
        return {op: f"reference: {why}" for op in OPS}

    if capability is None:
        return everywhere("no CUDA GPU (on the CPU backend 'kernels' runs the C-target kernels, for checking)")
    major, minor = capability
    arch = f"sm_{major}{minor}"
    if not 1 <= n <= KERNEL_MAX_LANES:
        return everywhere(f"the kernels take n = 1..{KERNEL_MAX_LANES} lanes, got n = {n}")
    limit = shared_bytes or shared_bytes_per_block(capability)
    why = None
    for op, need in site_shared_bytes(n, hopper, capability).items():
        if need is None:
            why = f"{_DESCRIBED[op]} has no portable tiles for n = {n} within {limit // 1024} KB of shared memory"
        elif need > limit:
            why = (f"{_DESCRIBED[op]} needs {need // 1024} KB of shared memory per block at n = {n}, {arch} gives "
                   f"{limit // 1024} KB")
        if why:
            break
    if (major, minor) < (8, 0):  # the programs build for sm_75, but their bf16 products run on CUDA cores there
        return everywhere(f"the kernels are made for sm_80 and later, where bf16 tensor-core products start; this "
                          f"GPU is {arch}" + (f"; and {why}" if why else ""))
    if why:
        return everywhere(why)
    if hopper:
        return {op: "hopper" for op in OPS}
    paths = {op: "portable" for op in OPS}
    paths["chained sites"] = ("portable: unchained, the post kernel and then the next pre's own projection pass "
                              "(the fused post + projection is a Hopper program)")
    return paths


def kernel_paths_line(device, n: int = 4) -> str:
    """One line for a learner: which programs the fused kernels run for n lanes on this device."""
    device = torch.device(device)
    if device.type != "cuda":
        return ("fused kernels on the CPU: TileLang's C target (plain loops on one core, for checking); backend "
                "'auto' runs the reference (PyTorch) here")
    name, capability, shared = cuda_device_facts(device)
    paths = kernel_paths(capability, n, shared_bytes=shared)
    where = f"fused kernels on {name} (compute capability {capability[0]}.{capability[1]}), n = {n}: "
    if all(path == "hopper" for path in paths.values()):
        return where + "the Hopper programs (TMA copies, wgmma products, the chained sites' fused post + projection)"
    if all(path.startswith("portable") for path in paths.values()):
        return where + ("the portable programs (cp.async copies, mma.sync products); chained sites run unchained, "
                        "the post kernel and then the next pre's projection pass")
    return where + "none: backend 'auto' runs the reference here, since " + next(
        path.split(": ", 1)[1] for path in paths.values() if path.startswith("reference"))
