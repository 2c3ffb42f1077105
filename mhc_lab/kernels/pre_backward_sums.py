# pre backward, the parameters' sums over the tokens, in one launch after kernel 2 (CUDA):
#
#   dphi[q, k]  = sum_s partial[s, q, k] + partial[s, KH + q, k]      q < M = n^2 + 2n, k < nC
#   dtok_sum[j] = sum_t dtok[t, j]                                    j < M + EXTRA
#
# partial is kernel 2's dphi output [S, 2 KH, nC] (per token split s, the dmix_hi rows, then the dmix_lo rows,
# each padded to KH = gemm_depth(n)); dtok is kernel 1's per-token [dlogit | alpha's three gradients | ds]
# (pre_backward_operands.EXTRA). dtok_sum holds bias's gradient, then alpha's, then the tokens' summed ds.
#
# Two reductions of different shapes share the launch: CTAs 0 .. D-1 take dphi, one entry per thread (2 S
# reads, coalesced along k); the last W = M + EXTRA CTAs take one column of dtok each: thread i adds rows i,
# i + 1024, ... into U accumulators (U loads in flight per thread, not one), then the CTA adds its threads'
# sums pairwise in shared memory. Every sum is taken in a fixed order, so the gradients repeat bit for bit. A
# column's entries are 4 W bytes apart: the W CTAs read the same 32-byte sectors, which L2 serves after the
# first; a [16384, 28] dtok is 1.8 MB. (The CPU's C target sums with torch: site_ops._parameter_grads.)
"""The pre backward's parameter sums (dphi over kernel 2's splits and halves, kernel 1's per-token gradients
over the tokens) as one CUDA kernel."""


import functools

import tilelang.language as T

from mhc_lab.kernels._coefficients import mixes_width
from mhc_lab.kernels._target import canonical_target, ceil_div, compile_program
from mhc_lab.kernels.pre_backward_operands import EXTRA, gemm_depth

THREADS = 1024  # per CTA: a dtok column's rows are spread over them
UNROLL = 4  # loads in flight per thread in a dtok column


def pre_backward_sums_program(n: int, C: int, splits: int, target: str = "cuda"):
    """The sums for n lanes of width C and kernel 2's `splits` token splits: arguments partial [splits, 2
    gemm_depth(n), nC], dtok [T, n^2+2n+EXTRA] (T dynamic), dphi [n^2+2n, nC], dtok_sum [n^2+2n+EXTRA], all
    float32."""
    if canonical_target(target) == "c":
        raise ValueError("pre backward sums: a CUDA program (the C target's pre backward sums with torch)")
    if splits < 1:
        raise ValueError(f"pre backward sums: expected splits >= 1, got {splits}")
    M, KH, NC, W = mixes_width(n), gemm_depth(n), n * C, mixes_width(n) + EXTRA
    NT = T.dynamic("T")
    D = ceil_div(M * NC, THREADS)  # CTAs of dphi entries
    steps = [THREADS >> k for k in range(1, THREADS.bit_length())]  # 512, 256, ..., 1: the pairwise sums

    @T.prim_func
    def pre_backward_sums(partial: T.Tensor((splits, 2 * KH, NC), "float32"), dtok: T.Tensor((NT, W), "float32"),
                          dphi: T.Tensor((M, NC), "float32"), dtok_sum: T.Tensor((W,), "float32")):
        with T.Kernel(D + W, threads=THREADS) as b:
            tx = T.get_thread_binding()
            acc = T.alloc_local((UNROLL,), "float32")
            sums = T.alloc_shared((THREADS,), "float32")
            for u in T.unroll(UNROLL):
                acc[u] = T.float32(0)
            if b < D:
                e = b * THREADS + tx
                if e < M * NC:
                    q = e // NC
                    k = e % NC
                    for s in T.serial(splits):
                        acc[0] += partial[s, q, k]
                        acc[0] += partial[s, KH + q, k]
                    dphi[q, k] = acc[0]
            if b >= D:
                j = b - D
                for r in T.serial(T.ceildiv(NT, THREADS * UNROLL)):
                    for u in T.unroll(UNROLL):
                        t = (r * UNROLL + u) * THREADS + tx
                        if t < NT:
                            acc[u] += dtok[t, j]
                sums[tx] = sum([acc[u] for u in range(UNROLL)])
                T.sync_threads()
                for step in steps:
                    if tx < step:
                        sums[tx] = sums[tx] + sums[tx + step]
                    T.sync_threads()
                if tx == 0:
                    dtok_sum[j] = sums[0]

    return pre_backward_sums


@functools.lru_cache(maxsize=None)
def pre_backward_sums_kernel(n: int, C: int, splits: int, target: str = "cuda"):
    """The compiled sums (cached per process): ``kernel(partial, dtok, dphi, dtok_sum)``."""
    return compile_program(pre_backward_sums_program(n, C, splits, target), target)
