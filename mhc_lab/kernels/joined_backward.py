# joined backward: kernel 2 of one site's pre backward and the post backward of the site before it, in one pass.
#
# In a stack the backward meets, for every pair of consecutive sites p and i, kernel 2 of site i's pre backward
# (which writes dx_i, the gradient of the lanes between the two sites) and then the post backward of site p
# (which reads dx_i back as its upstream gradient g). Joined, dx_i stays on chip: for every token and column the
# program forms dx_i as kernel 2 does (pre_backward.lane_dx_c, plus the post gradient of site i's own lanes,
# dx_post) and takes the post backward of site p from it (post_backward.py's formulas with g = dx_i):
#     dx_prev[t, j, c] = sum_i H_res_p[t, i, j] dx_i[t, i, c]    (written: the dx_post of site p's kernel 2)
#     df_prev[t, c]    = sum_i H_post_p[t, i] dx_i[t, i, c]
#     dH_res_p[t, i, j], dH_post_p[t, i]: sums over the width, written as one partial sum per column block
#     (coef_partial [T, blocks, n^2 + n], dH_res then dH_post), summed afterwards in a fixed order;
# and dphi of site i as kernel 2 does. Bytes per token at n = 4 (bf16): reads x_i, dy_i, dx_post_i, x_p, f_p
# (14C), writes dx_prev, df_prev (5C), against 13C + 14C for the two kernels apart: 8C fewer, less the partial
# sums (n^2 + n floats per token and column block). docs/kernel-notes.md, section 7, has the arithmetic.
#
# The C target is this file's program; on CUDA the joined kernel is kernel 2's program with joined=True
# (pre_backward.pre_backward_lanes_program: the add_dx kernel with two consumer warpgroups of all four lanes and
# an epilogue after a named barrier), which takes kernel 1's CUDA outputs as kernel 2 does. On the H200 it gives
# the two kernels' results and is slower than they are together (kernel notes, version 34).
"""joined backward: kernel 2 of a site's pre backward with the previous site's post backward."""


import tilelang.language as T

from mhc_lab.kernels._coefficients import mixes_width
from mhc_lab.kernels._target import (
    canonical_target,
    ceil_div,
    check_lanes_and_width,
    check_target_dtype,
    compile_program,
)
from mhc_lab.kernels.pre_backward import EXTRA, lane_dx_c, lane_tiling, pre_backward_lanes_program

BLOCK_C = 8  # columns per program instance on the C target (the partial sums' blocks)


def coef_blocks(C: int, target: str = "c", block_c: int | None = None) -> int:
    """The column blocks of coef_partial's second axis: BLOCK_C columns each on the C target; on CUDA the joined
    kernel's block_c (default lane_tiling's with dx_post at n = 4)."""
    if canonical_target(target) == "c":
        return ceil_div(C, BLOCK_C)
    return ceil_div(C, block_c or lane_tiling(4, add_dx=True)[1])


def joined_backward_program(n: int, C: int, dtype: str = "float32", target: str = "c", **cuda_tuning):
    """Arguments at run time (T dynamic; float32): site i's x [T, n, C], dy [T, C], pre [T, n], dmix [T, n^2+2n],
    extra [T, 4] and phi [n^2+2n, nC] (kernel 1's outputs, as kernel 2 takes them on the C target), dx_post
    [T, n, C] (site i's own post gradient of its lanes); site p's x_prev [T, n, C], f_prev [T, C], post_prev
    [T, n], res_prev [T, n, n]; then the outputs dx_prev [T, n, C], df_prev [T, C], dphi_partial [1, n^2+2n,
    nC] (site i's dphi) and coef_partial [T, coef_blocks(C), n^2 + n] (site p's dH_res, then dH_post, per
    column block). On CUDA: pre_backward_lanes_program(n, C, dtype, target, add_dx=True, joined=True,
    **cuda_tuning), whose arguments are kernel 2's (kernel 1's CUDA outputs dsplit and coef in place of pre, dmix
    and extra)."""
    check_lanes_and_width("joined backward", n, C, max_lanes=8)
    if canonical_target(target) != "c":
        return pre_backward_lanes_program(n, C, dtype, target, add_dx=True, joined=True, **cuda_tuning)
    if cuda_tuning:
        raise ValueError(f"joined backward: the C target takes no tuning, got {sorted(cuda_tuning)}")
    check_target_dtype("joined backward", dtype, target, ())
    M, K, NQ, NB = mixes_width(n), n * C, n * n + n, coef_blocks(C)
    NT = T.dynamic("T")
    lanes = list(range(n))

    @T.prim_func
    def joined_backward_c(
        x: T.Tensor((NT, n, C), dtype), dy: T.Tensor((NT, C), dtype), pre: T.Tensor((NT, n), "float32"),
        dmix: T.Tensor((NT, M), "float32"), extra: T.Tensor((NT, EXTRA), "float32"),
        phi: T.Tensor((M, K), "float32"), dx_post: T.Tensor((NT, n, C), dtype),
        x_prev: T.Tensor((NT, n, C), dtype), f_prev: T.Tensor((NT, C), dtype),
        post_prev: T.Tensor((NT, n), "float32"), res_prev: T.Tensor((NT, n, n), "float32"),
        dx_prev: T.Tensor((NT, n, C), dtype), df_prev: T.Tensor((NT, C), dtype),
        dphi_partial: T.Tensor((1, M, K), "float32"), coef_partial: T.Tensor((NT, NB, NQ), "float32"),
    ):
        with T.Kernel(NB) as bc:
            g = T.alloc_local((n,), "float32")  # dx_i of one token and column: never leaves the program
            part = T.alloc_local((NQ,), "float32")
            acc = T.alloc_local((1,), "float32")
            for tok in T.serial(NT):
                for q in T.serial(NQ):
                    part[q] = T.float32(0)
                for cc in T.serial(BLOCK_C):
                    col = bc * BLOCK_C + cc
                    if col < C:
                        for j in lanes:
                            g[j] = (lane_dx_c(x, dy, pre, dmix, extra, phi, tok, j, col, M, C)
                                    + T.cast(dx_post[tok, j, col], "float32"))
                        for j in lanes:
                            dx_prev[tok, j, col] = T.cast(sum([res_prev[tok, i, j] * g[i] for i in lanes]), dtype)
                            for i in lanes:
                                part[i * n + j] += g[i] * T.cast(x_prev[tok, j, col], "float32")
                        df_prev[tok, col] = T.cast(sum([post_prev[tok, i] * g[i] for i in lanes]), dtype)
                        for i in lanes:
                            part[n * n + i] += g[i] * T.cast(f_prev[tok, col], "float32")
                for q in T.serial(NQ):
                    coef_partial[tok, bc, q] = part[q]
            for cc in T.serial(BLOCK_C):
                col = bc * BLOCK_C + cc
                if col < C:
                    for j in T.serial(n):
                        for q in T.serial(M):
                            acc[0] = T.float32(0)
                            for tok in T.serial(NT):
                                acc[0] += dmix[tok, q] * T.cast(x[tok, j, col], "float32")
                            dphi_partial[0, q, j * C + col] = acc[0]

    return joined_backward_c


def joined_backward_kernel(n: int, C: int, dtype: str = "float32", target: str = "c"):
    """The compiled joined backward (cached per process)."""
    return compile_program(joined_backward_program(n, C, dtype, target), target)


def coefficients_from_partial(coef_partial, n: int):
    """(dH_res [T, n, n], dH_post [T, n]) of the previous site's post from coef_partial: its column blocks
    summed, then split into two tensors of their own."""
    summed = coef_partial.sum(1)  # one pass over the contiguous partials
    return summed[:, : n * n].unflatten(1, (n, n)), summed[:, n * n :].clone()  # no two results alias (custom ops)
