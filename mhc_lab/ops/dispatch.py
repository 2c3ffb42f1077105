"""Which implementation runs an mHC site: the backends, their input checks, and the paths the kernels take.

Backends:
  - "kernels": the fused TileLang kernels, forward and backward (mhc_lab.kernels). On CUDA: bf16 lanes,
    n = 1..8, n*C a multiple of 8. On the CPU the same kernels run through TileLang's C target, in float32
    (slow, for checking and learning).
  - "reference": mhc_lab.reference's math forward, and the hand-derived backward of mhc_lab.reference.backward
    (it recomputes the coefficients from the inputs).
  - "auto" (the default): "kernels" on CUDA where they apply, "reference" everywhere else.

Every choice here is a pure function of the lanes and the backend: nothing module-wide changes what runs.
"""

from __future__ import annotations

import torch

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
            raise InputError(f"{op}: {name}: expected a floating-point tensor, got {_describe(value)}")
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


def fused_projection_applies(backend: str, x: torch.Tensor) -> bool:
    """Whether a post can project its lanes for the next site (post_forward_linked's phi_next): always for the
    reference and the C target; on CUDA where the fused kernel's 16-byte row copies fit (C a multiple of 8)."""
    if backend == "reference" or x.device.type != "cuda":
        return True
    return x.shape[-1] % 8 == 0


def post_gradient_to_pre_for(x: torch.Tensor, backend: str) -> bool:
    """Whether a linked site on lanes like x hands the post's output gradient g to the pre's backward, whose
    kernel 2 adds H_res^T g in the pass that writes dx (True: the post's backward writes no dx, 42C per chained
    site at n = 4), or the post's backward writes H_res^T g for kernel 2 to read back (False: 46C). True on CUDA
    where kernel 2 splits the n lanes between two consumer warpgroups (n = 4): with one warpgroup of all n lanes
    kernel 2 lost more than the post's backward saved. Decided at the forward, for both ops of a site."""
    from mhc_lab.kernels.pre_backward_lanes import consumer_groups_for

    return backend == "kernels" and x.device.type == "cuda" and consumer_groups_for(x.shape[1]) == 2


def lane_splits(n: int, C: int, device: torch.device, add_dx: bool, post_grad: bool) -> int:
    """Token splits of the pre backward's kernel 2 on CUDA: its CTAs in waves that fill the GPU's SMs."""
    from mhc_lab.kernels.pre_backward_lanes import lane_splits_for

    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return lane_splits_for(n, C, sms, add_dx=add_dx, post_grad=post_grad)

