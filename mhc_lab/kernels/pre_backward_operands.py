"""What kernel 1 of the pre backward hands kernel 2 on CUDA: the per-token operands and their layout.

Kernel 2 multiplies dmix [T, n^2 + 2n] with phi on tensor cores in bf16, and keeps about 16 bits of each by
splitting both into bf16 hi + lo (three products: hi.hi + hi.lo + lo.hi). Kernel 1 writes dmix already split,
in the three row layouts those products take, so that kernel 2's token loop only copies its operands (a loop
fed by copies alone is one its pipeline can prefetch):

    dsplit [T, 3, 2 KH] bf16   row 0 [dmix_hi | dmix_hi], row 1 [dmix_lo | 0], row 2 [dmix_hi | dmix_lo]
    coef   [T, coef_width(n)]  H_pre per lane, then 2 ds (ds: the gradient of sum(x^2)), then zeros

KH = gemm_depth(n) is the GEMMs' K per half. dtok [T, n^2+2n+EXTRA] holds kernel 1's per-token dlogit and extras.
"""


import tilelang.language as T

from mhc_lab.kernels._coefficients import mixes_width
from mhc_lab.kernels._target import round_up

EXTRA = 4  # per-token extras of kernel 1: d alpha_pre, d alpha_post, d alpha_res, d sum(x^2)


def coef_width(n: int) -> int:
    """Columns of kernel 1's per-token coef output on CUDA: H_pre per lane, 2 ds, padding to 16 bytes."""
    return round_up(n + 1, 4)


def gemm_depth(n: int) -> int:
    """K of kernel 2's GEMMs per split half: n^2 + 2n rounded up to 32, so that both halves together (the M
    of the transposed dphi GEMM) are a multiple of 64, the warpgroup MMA's M."""
    return round_up(mixes_width(n), 32)


def kernel2_operand_macros(n: int):
    """How kernel 1 writes kernel 2's CUDA operands, one entry at a time (both its CUDA forms call these):
    ``split_entry(dsplit, tok, k, dmix_at)`` writes column k of the token's three rows of dmix split into bf16
    hi and lo (``dmix_at(q)`` reads the token's dmix[q]); ``coef_entry(coef, tok, j, pre, ds)`` writes
    coef[tok, j] = H_pre[j] (j < n), then 2 ds, then padding zeros."""
    M, KH = mixes_width(n), gemm_depth(n)

    @T.macro
    def split_entry(dsplit, tok, k, dmix_at):
        q = k % KH
        d = T.if_then_else(q < M, dmix_at(T.min(q, M - 1)), T.float32(0))
        dh = T.cast(d, "bfloat16")
        dl = T.cast(d - T.cast(dh, "float32"), "bfloat16")
        dsplit[tok, 0, k] = dh  # [dmix_hi | dmix_hi]: hi.hi + hi.lo with phi [hi; lo]
        dsplit[tok, 1, k] = T.if_then_else(k < KH, dl, T.cast(0, "bfloat16"))  # [dmix_lo | 0]: lo.hi
        dsplit[tok, 2, k] = T.if_then_else(k < KH, dh, dl)  # [dmix_hi | dmix_lo]: for dphi

    @T.macro
    def coef_entry(coef, tok, j, pre, ds):
        coef[tok, j] = T.if_then_else(j < n, pre[tok, T.min(j, n - 1)],
                                      T.if_then_else(j == n, T.float32(2) * ds, T.float32(0)))

    return split_entry, coef_entry
