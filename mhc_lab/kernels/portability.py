"""Which CUDA programs an mHC site's ops run on which GPU, and the shared memory each takes per block.

The tile programs are written once, and TileLang lowers them for the architecture at hand: a T.copy to TMA
from sm_90 on and to cp.async on sm_80, a T.gemm to the warpgroup MMA (wgmma) on Hopper and to mma.sync on the
others. Two ops have a program of their own for Hopper (TMA copies and stores written out, wgmma issued
asynchronously and waited for with T.wait_wgmma), which builds nowhere else:

- kernel 2 of the pre backward (pre_backward_lanes.py), which has a portable program beside it, of the same
  arithmetic and arguments;
- the post fused with the next site's projection (post_project.py): on other GPUs a stack of sites runs
  unchained, the post kernel and then the next pre's own projection pass.

A program that builds for a GPU still has to fit its shared memory: a block may use at most
shared_bytes_per_block(capability), 99 KB on most desktop and laptop GPUs, and a launch that asks for more
fails. site_shared_bytes says what each op's programs ask for (tests/test_portable.py checks these numbers
against the programs TileLang lowers).
"""

from __future__ import annotations

from mhc_lab.kernels._coefficients import spread_fits
from mhc_lab.kernels._target import SHARED_BYTES_PER_BLOCK, shared_bytes_per_block  # noqa: F401 (the table's home)

OPS = ("post forward", "pre forward", "post backward", "pre backward coefficients", "pre backward lanes",
       "chained sites")

# Programs whose shared memory stays below this on every n (the post kernels, the phi split, the apply pass,
# kernel 1's spread program): the least any GPU from sm_70 on gives a block.
SMALL_SHARED_BYTES = 48 * 1024


def hopper_architecture(capability: tuple[int, int]) -> bool:
    """Whether a GPU of this compute capability runs the Hopper programs: sm_90 (9.x), the one architecture with
    both TMA and wgmma; Blackwell (10.x, 12.x) has TMA but not wgmma."""
    return capability[0] == 9


def projection_shared_bytes(n: int, capability: tuple[int, int]) -> int:
    """Shared memory of the pre's projection pass (pre_split.project_program) on a GPU of this capability: the
    stages of its block_m x 64 tile of x and phi_tile_rows(n) x 64 tile of phi, bf16, or the
    phi_tile_rows(n) x block_m float32 accumulator tile that TileLang places over them, whichever is larger
    (pre_split.projection_tiles)."""
    from mhc_lab.kernels._target import device_target
    from mhc_lab.kernels.pre_split import phi_tile_rows, projection_tiles

    rows = phi_tile_rows(n)
    block_m, stages = projection_tiles(n, device_target(capability))
    return max(stages * (block_m + rows) * 64 * 2, rows * block_m * 4)


def coefficients_shared_bytes(n: int, capability: tuple[int, int]) -> int:
    """Shared memory of kernel 1 of the pre backward at most (any width) on a GPU of this capability: where n
    is not a power of two the fused program (pre_backward_coefficients.fused_coefficients_program), two stages
    of n lanes' and dy's 64 x BC bf16 tiles; else the spread programs, below SMALL_SHARED_BYTES."""
    if spread_fits(n):
        return SMALL_SHARED_BYTES
    columns = 1 << (max(32, min(128, 128 * 256 // (n * 64))).bit_length() - 1)
    while columns > 32 and 2 * (n + 1) * 64 * columns * 2 > shared_bytes_per_block(capability):
        columns //= 2
    return 2 * (n + 1) * 64 * columns * 2


def lanes_shared_bytes_for(n: int, hopper: bool) -> int | None:
    """Shared memory of kernel 2 of the pre backward at most, over the forms the ops run (a separate site, a
    linked site with the post's dx, and at n = 4 with the post's g: dispatch.post_gradient_to_pre_for); None
    where the portable program has no tiles for one of them."""
    from mhc_lab.kernels.pre_backward_lanes import (
        consumer_groups_for,
        lane_stages,
        lane_tiling,
        lanes_shared_bytes,
        portable_lane_tiling,
        portable_shared_bytes,
    )

    forms = [(False, False), (True, False)] + ([(False, True)] if consumer_groups_for(n) == 2 else [])
    most = 0
    for add_dx, post_grad in forms:
        if hopper:
            lanes, columns, _ = lane_tiling(n, add_dx, post_grad)
            stages = lane_stages(n, lanes, columns, add_dx, post_grad)
            need = lanes_shared_bytes(n, lanes, columns, stages, add_dx, post_grad)
        else:
            try:
                lanes, columns, stages = portable_lane_tiling(n, add_dx, post_grad)
            except ValueError:
                return None
            need = portable_shared_bytes(n, lanes, columns, stages, add_dx, post_grad)
        most = max(most, need)
    return most


def site_shared_bytes(n: int, hopper: bool, capability: tuple[int, int]) -> dict[str, int | None]:
    """The most shared memory per block each op's CUDA programs take at n lanes (any width), on Hopper or on the
    portable path (OPS order; None: no program for it). The chained sites' is the fused post + projection's on
    Hopper, else the post kernel's and the projection pass's."""
    from mhc_lab.kernels.post_project import cuda_tiles, shared_bytes

    projection = max(projection_shared_bytes(n, capability), SMALL_SHARED_BYTES)
    chained = shared_bytes(n, **{k: v for k, v in cuda_tiles(n).items() if k != "threads"}) if hopper else projection
    return {"post forward": SMALL_SHARED_BYTES, "pre forward": projection, "post backward": SMALL_SHARED_BYTES,
            "pre backward coefficients": coefficients_shared_bytes(n, capability),
            "pre backward lanes": lanes_shared_bytes_for(n, hopper), "chained sites": chained}
