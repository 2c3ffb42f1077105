"""The copy floor: what a transformer block with mHC would cost if every mHC kernel streamed its bytes at the
copy's pace and the small kernels took no time. The plain residual block, plus device-to-device copies of the
bytes our chained sites move beyond it, in the passes where they move them (76C per token for a block's two
sites at n = 4)."""

from __future__ import annotations

import torch

from mhc_lab.bench.common import N
from mhc_lab.measure import bytes_model


def residual_elements() -> dict[str, tuple[int, int]]:
    """The plain residual h + F(h), (read, written) lane-wide elements per token in units of C: the add forward,
    and in backward the gradient copied past F and added."""
    return {"forward add (h, f -> h + f)": (2, 1), "backward add (g, dh from F -> dh)": (2, 1)}


def copy_floor_plan(n: int = N, sites: int = 2) -> list[dict]:
    """Per site of a chained block, the lane-wide elements per token (units of C, read + written) that its mHC
    kernels move beyond the plain residual's, as bytes_model counts our chained kernels: at the pre (forward:
    the first site's projection, the pre apply; backward: kernel 1's dpre_reduce and kernel 2) and at the post
    (forward: post + next projection, backward: the post backward with the post's gradient handed to the pre),
    the residual's add (forward) and gradient add (backward) taken off the post's. At n = 4: 76C for two sites."""
    forward = [r.moved.per_C for r in bytes_model.rows("ours_chained", n, "forward")]  # pre apply, post + proj
    post_bwd, dpre, lanes = (r.moved.per_C for r in bytes_model.rows("ours_chained", n, "backward"))
    post_bwd -= bytes_model.post_gradient_saving(n)
    projection = bytes_model.rows("ours", n, "forward")[0].moved.per_C
    add_fwd, add_bwd = (r + w for r, w in residual_elements().values())
    return [{"pre": {"forward": ([projection] if i == 0 else []) + [forward[0]], "backward": [dpre, lanes]},
             "post": {"forward": [forward[1] - add_fwd], "backward": [post_bwd - add_bwd]}} for i in range(sites)]


def copy_floor_counts(plan: list[dict]) -> list[int]:
    """Every count of a copy_floor_plan (units of C per token), site by site, place by place, forward then
    backward."""
    return [k for site in plan for place in site.values() for ks in place.values() for k in ks]


class _MovesBytes(torch.autograd.Function):
    """h unchanged, forward and backward; each pass runs its device-to-device copies (dst.copy_(src) pairs)."""

    @staticmethod
    def forward(ctx, h, forward_copies, backward_copies):
        for dst, src in forward_copies:
            dst.copy_(src)
        ctx.backward_copies = backward_copies
        return h.view_as(h)

    @staticmethod
    def backward(ctx, grad):
        for dst, src in ctx.backward_copies:
            dst.copy_(src)
        return grad, None, None


class CopyFloor:
    """The copies that move copy_floor_plan's elements for a plain h of some tokens and width C: a copy of k C / 2
    elements per token moves k C (read + written). One source and one destination buffer, as large as the
    largest copy, made for the first h and again when h's size or device changes."""

    def __init__(self, plan: list[dict]):
        self.plan, self.buffers = plan, None
        self.largest = max(copy_floor_counts(plan))

    def copies(self, h: torch.Tensor, counts: list[int]) -> list:
        per_k = h.numel()  # tokens x C
        if per_k % 2:
            raise ValueError(f"copy floor: tokens x C must be even to halve into read + written, got {per_k}")
        if self.buffers is None or self.buffers[0].numel() != self.largest * per_k // 2 \
                or self.buffers[0].device != h.device:
            self.buffers = tuple(torch.empty(self.largest * per_k // 2, dtype=h.dtype, device=h.device)
                                 for _ in range(2))
        src, dst = self.buffers
        return [(dst[: k * per_k // 2], src[: k * per_k // 2]) for k in counts]

    def __call__(self, h: torch.Tensor, site: int, place: str) -> torch.Tensor:
        moves = self.plan[site][place]
        return _MovesBytes.apply(h, self.copies(h, moves["forward"]), self.copies(h, moves["backward"]))
