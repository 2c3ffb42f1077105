# pre, cluster plan (CUDA, sm_90): the coefficients and the layer input of one mHC site in ONE pass over x.
#
# Why a cluster: H_pre needs the projection of a token's whole nC row before y = H_pre x can start, and one
# SM cannot hold enough rows to amortise phi ([n^2+2n, nC] float32, 1.5 MB at C = 4096): re-reading phi for
# every handful of tokens would cost more L2 traffic than x itself. So a cluster of S CTAs splits the
# C columns: CTA r owns columns [r CW, (r+1) CW) of every lane, keeps ITS slice of phi resident in shared
# memory for its whole life (split as hi + lo bf16 for the tensor cores), and streams its slice of each token
# tile through shared memory once:
#
#   per tile of BT tokens, CTA r:  partial_r = x_slice . phi_slice^T (tensor cores), sq_r = sum x_slice^2
#                                  cluster barrier; every CTA reads the S partials from the others' shared
#                                  memory (DSMEM), forms the mixes, runs the coefficient code (norm after the
#                                  matmul, sigmoids, 20 Sinkhorn rounds) for the BT tokens, and applies
#                                  H_pre to the x slice it still holds: y[:, r-th columns]
#
# Bytes per token from HBM: nC read + C written (the 10 C of a pre at bf16, n = 4) + float32 coefficients;
# phi is read once per cluster life (ITERS tiles): 384 C / (BT ITERS) bytes per token.
# On-chip traffic per tile and CTA: phi slice from shared memory by the tensor cores (NP x n CW bf16),
# S (n^2+2n+1) floats per token over DSMEM.
# Limits: shared memory holds NP n CW (phi) + stages BT n CW (x) bf16: C up to about 5k at S = 16; n = 4.
# Launch: grid = S x ceil(tiles / ITERS) CTAs in clusters of S (non-portable size 16 where S = 16).
# Measured (H200, 2026-11-29, pre alone, 16384 tokens): 2.6 ms at C = 2560, 2.4 ms at C = 4096 -- correct, but
# 6-10x slower than the split plan. With 215 KB of shared memory one CTA fits per SM, and a tile's critical
# path (the tensor cores reading the whole phi slice from shared memory, the cluster barrier, the DSMEM
# gather, the one-thread-per-token Sinkhorn, the apply) is several times the ~1 us it takes HBM to deliver
# the tile; nothing overlaps it. Kept as a measured lesson, not used by 'auto'.
"""pre, cluster plan: one pass over the lanes with phi resident across a thread-block cluster."""

import functools

import tilelang
import tilelang.language as T

from mhc_lab.kernels._coefficients import coefficient_macro, mixes_width, store_coefficients_macro
from mhc_lab.kernels._target import SMEM_LIMIT, canonical_target, compile_program, round_up, ceil_div

_PRELUDE = r"""
#include <cooperative_groups.h>
// Read a float from the shared memory of CTA `rank` of this cluster (distributed shared memory).
__device__ __forceinline__ float mhc_cluster_load(const float* p, int rank) {
  return *cooperative_groups::this_cluster().map_shared_rank(const_cast<float*>(p), rank);
}
"""


def cluster_config(n: int, C: int, *, cluster: int = 16, block_tokens: int = 16, stages: int = 2,
                   iters: int = 16, threads: int = 256) -> dict:
    """Tile sizes and shared-memory bytes of the cluster plan; 'fits' says whether it can run."""
    m = mixes_width(n)
    np_rows = 64 if 2 * m <= 64 else round_up(2 * m, 64)
    cw = round_up(ceil_div(C, cluster), 8)
    kl = n * cw
    smem = (np_rows * kl * 2 + stages * block_tokens * kl * 2 + block_tokens * cw * 2
            + np_rows * block_tokens * 4 + 2 * block_tokens * (m + 1) * 4 + block_tokens * (m + 1) * 4
            + block_tokens * (threads // block_tokens) * 4 + block_tokens * n * 4)
    return {"n": n, "C": C, "cluster": cluster, "block_tokens": block_tokens, "stages": stages, "iters": iters,
            "threads": threads, "np_rows": np_rows, "cw": cw, "kl": kl, "smem": smem,
            "fits": n == 4 and smem <= SMEM_LIMIT - 2048 and threads % block_tokens == 0}


def cluster_program(n: int, C: int, dtype: str = "bfloat16", target: str = "cuda", *, cluster: int = 16,
                    block_tokens: int = 16, stages: int = 2, iters: int = 16, threads: int = 256,
                    iterations: int = 20):
    cfg = cluster_config(n, C, cluster=cluster, block_tokens=block_tokens, stages=stages, iters=iters,
                         threads=threads)
    if canonical_target(target) == "c":
        raise ValueError("pre cluster plan: CUDA (sm_90) only")
    if dtype != "bfloat16":
        raise ValueError(f"pre cluster plan: expected dtype 'bfloat16', got {dtype!r}")
    if not cfg["fits"]:
        raise ValueError(f"pre cluster plan does not fit for n = {n}, C = {C}: {cfg}")
    M = mixes_width(n)
    S, BT, ITERS, TH = cluster, block_tokens, iters, threads
    NP, CW, KL = cfg["np_rows"], cfg["cw"], cfg["kl"]
    SQ = TH // BT  # threads summing squares per token
    NT = T.dynamic("T")
    lanes = list(range(n))
    ranks = list(range(S))
    coefficients = coefficient_macro(n, C, iterations=iterations)
    store = store_coefficients_macro(n)
    GQ = BT * (M + 1)

    @T.prim_func
    def pre_cluster(
        x: T.Tensor((NT, n, C), dtype),
        phi: T.Tensor((M, n * C), "float32"),
        bias: T.Tensor((M,), "float32"),
        alpha: T.Tensor((3,), "float32"),
        y: T.Tensor((NT, C), dtype),
        pre_out: T.Tensor((NT, n), "float32"),
        post_out: T.Tensor((NT, n), "float32"),
        res_out: T.Tensor((NT, n, n), "float32"),
    ):
        with T.Kernel(S * T.ceildiv(T.ceildiv(NT, BT), ITERS), threads=TH, cluster_dims=(S, 1, 1),
                      prelude=_PRELUDE) as bx:
            phi_s = T.alloc_shared((NP, KL), "bfloat16")
            x_s = T.alloc_shared((BT, KL), dtype)
            y_s = T.alloc_shared((BT, CW), dtype)
            acc = T.alloc_fragment((NP, BT), "float32")
            acc_s = T.alloc_shared((NP, BT), "float32")
            part_s = T.alloc_shared((2, BT, M + 1), "float32")
            mix_s = T.alloc_shared((BT, M + 1), "float32")
            sq_s = T.alloc_shared((BT, SQ), "float32")
            pre_s = T.alloc_shared((BT, n), "float32")
            mix = T.alloc_local((M + 1,), "float32")
            pre_l = T.alloc_local((n,), "float32")
            post_l = T.alloc_local((n,), "float32")
            comb = T.alloc_local((n * n,), "float32")
            sacc = T.alloc_local((1,), "float32")
            tx = T.get_thread_binding()
            rank = bx % S
            first_tile = (bx // S) * ITERS
            c0 = rank * CW
            # this CTA's slice of phi, split phi = hi + lo in bf16, resident for the CTA's life
            for m, k in T.Parallel(NP, KL):
                cc = c0 + k % CW
                v = T.if_then_else(cc < C and m < 2 * M, phi[m % M, (k // CW) * C + cc], T.float32(0))
                hi = T.cast(v, "bfloat16")
                phi_s[m, k] = T.if_then_else(m < M, hi, T.cast(v - T.cast(hi, "float32"), "bfloat16"))
            for it in T.Pipelined(ITERS, num_stages=stages):
                t0 = (first_tile + it) * BT
                for j in lanes:
                    T.copy(x[t0 : t0 + BT, j, c0 : c0 + CW], x_s[0:BT, j * CW : (j + 1) * CW])
                # partial projections (hi and lo rows) of the BT tokens over this CTA's columns
                T.gemm(phi_s, x_s, acc, transpose_B=True, clear_accum=True)
                T.copy(acc, acc_s)
                # partial sums of squares: SQ threads per token, strided over the columns
                sacc[0] = T.float32(0)
                for kk in T.serial(ceil_div(KL, SQ)):
                    k = kk * SQ + tx % SQ
                    if k < KL:
                        v = T.cast(x_s[tx // SQ, k], "float32")
                        sacc[0] += v * v
                sq_s[tx // SQ, tx % SQ] = sacc[0]
                T.sync_threads()
                par = it % 2
                for g0 in T.serial(ceil_div(GQ, TH)):
                    g = g0 * TH + tx
                    if g < GQ:
                        t = g // (M + 1)
                        q = g % (M + 1)
                        if q < M:
                            part_s[par, t, q] = acc_s[q, t] + acc_s[M + q, t]
                        else:
                            part_s[par, t, q] = sum([sq_s[t, u] for u in range(SQ)])
                T.cluster_sync()
                # every CTA sums the S partials of every token of the tile (DSMEM reads)
                for g0 in T.serial(ceil_div(GQ, TH)):
                    g = g0 * TH + tx
                    if g < GQ:
                        t = g // (M + 1)
                        q = g % (M + 1)
                        mix_s[t, q] = sum([
                            T.call_extern("float32", "mhc_cluster_load", T.address_of(part_s[par, t, q]), r)
                            for r in ranks
                        ])
                T.sync_threads()
                if tx < BT:
                    tok = t0 + tx
                    for q in T.unroll(M + 1):
                        mix[q] = mix_s[tx, q]
                    coefficients(mix, alpha, bias, pre_l, post_l, comb)
                    for i in T.unroll(n):
                        pre_s[tx, i] = pre_l[i]
                    if rank == 0 and tok < NT:
                        store(tok, pre_l, post_l, comb, pre_out, post_out, res_out)
                T.sync_threads()
                for g0 in T.serial(ceil_div(BT * CW, TH)):
                    g = g0 * TH + tx
                    if g < BT * CW:
                        t = g // CW
                        c = g % CW
                        y_s[t, c] = T.cast(
                            sum([pre_s[t, j] * T.cast(x_s[t, j * CW + c], "float32") for j in lanes]), dtype)
                T.sync_threads()
                T.copy(y_s, y[t0 : t0 + BT, c0 : c0 + CW])
            # no CTA may leave while a peer can still read its shared memory
            T.cluster_sync()

    return pre_cluster


PASS_CONFIGS = {tilelang.PassConfigKey.TL_DISABLE_WARP_SPECIALIZED: True}


@functools.lru_cache(maxsize=None)
def cluster_kernel(n: int, C: int, dtype: str = "bfloat16", target: str = "cuda", *, cluster: int = 16,
                   block_tokens: int = 16, stages: int = 2, iters: int = 16, threads: int = 256):
    """Compiled cluster-plan pre kernel (cached per process). Warp specialisation stays off: a producer
    warpgroup running ahead would never reach the cluster barrier its consumers wait on."""
    program = cluster_program(n, C, dtype, target, cluster=cluster, block_tokens=block_tokens, stages=stages,
                              iters=iters, threads=threads)
    return compile_program(program, target, pass_configs=PASS_CONFIGS)
