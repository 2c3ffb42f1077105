# pre, lookback plan (CUDA): one launch, x read once from HBM, its second read served by L2.
#
# A token tile of BT tokens is split over S CTAs by columns: CTA (s, b) owns columns [s CW, (s+1) CW) of every
# lane of tokens [b BT, (b+1) BT). Each CTA
#   1. streams its slice through shared memory (cp.async pipeline) into the tensor cores: partial projections
#      [BT, n^2+2n] against phi split as hi + lo bf16 (phi_hl, prepared once per call), and partial sums of
#      squares, which it adds (float32 atomics) into a zeroed [T, n^2+2n+1] scratch;
#   2. arrives on its tile's counter (fence, atomic add). The last of the S to arrive reads the tile's sums,
#      runs the per-token coefficient code (norm after the matmul, sigmoids, 20 Sinkhorn rounds; one thread per
#      token), writes pre/post/res and raises the tile's flag; the others wait for the flag;
#   3. reads H_pre of its tokens and applies it to its own slice again -- just streamed, so an L2 hit -- and
#      writes its columns of y.
# CTAs of one tile are consecutive in launch order, so a waiting CTA's peers are already resident or will be
# as soon as earlier tiles finish (no CTA waits on a later tile): the wait cannot deadlock under the in-order
# dispatch of CUDA thread blocks that this plan assumes.
#
# Bytes per token from HBM: nC read + C written (+ coefficients and partials): the 10 C of a pre at bf16.
# L2 -> SM per token: 2 nC (x twice), phi 2 (n^2+2n) 2 nC / BT bytes = 6 C at BT = 64 (hi + lo bf16), and
# S (n^2+2n+1) float32 atomics. The L2 must hold every resident CTA's slice between its two reads: resident
# CTAs x BT x 2 nC / S bytes (33 MB at BT = 64, S = 16, C = 4096, two CTAs per SM).
# The float32 atomics make the sums' rounding order, and so the last bits of the coefficients, vary between
# runs (the split plan is deterministic).
# Measured (H200, 2026-11-29, pre alone): 0.35 / 0.55 / 0.43 ms at 16384x2560 / 16384x4096 / 8192x7168, slower
# than the split plan's 0.27 / 0.39 / 0.33 although it moves fewer HBM bytes: every CTA of a tile waits for
# the last one's coefficient phase (sums, Sinkhorn), so an SM idles unless other CTAs fill it, and each CTA
# re-reads its slice through L2 with phi re-read per tile (6 C bytes per token at BT = 64).
"""pre, lookback plan: one launch, tile-level hand-off through a counter and a flag in global memory."""

import functools

import tilelang.language as T

from mhc_lab.kernels._coefficients import coefficient_macro, mixes_width, store_coefficients_macro
from mhc_lab.kernels._target import NO_WARP_SPECIALIZATION, canonical_target, ceil_div, compile_program, round_up
from mhc_lab.kernels.pre_split import phi_rows


_PRELUDE = r"""
// Loads that bypass L1 (data written by other SMs during this launch), and the tile hand-off.
__device__ __forceinline__ float mhc_ldcg(const float* p) { return __ldcg(p); }
__device__ __forceinline__ void mhc_fence() { __threadfence(); }
__device__ __forceinline__ int mhc_arrive(int* counter) { __threadfence(); return atomicAdd(counter, 1); }
__device__ __forceinline__ void mhc_raise(int* flag) { __threadfence(); atomicExch(flag, 1); }
__device__ __forceinline__ int mhc_wait(int* flag) {
  while (atomicAdd(flag, 0) == 0) { __nanosleep(64); }
  __threadfence();
  return 1;
}
"""


def lookback_config(n: int, C: int, *, splits: int = 16, block_tokens: int = 64, block_k: int = 128,
                    stages: int = 3, apply_c: int = 64, apply_stages: int = 2, threads: int = 256) -> dict:
    cw = round_up(ceil_div(C, splits), max(block_k, apply_c))
    return {"n": n, "C": C, "splits": splits, "block_tokens": block_tokens, "block_k": block_k, "stages": stages,
            "apply_c": apply_c, "apply_stages": apply_stages, "threads": threads, "cw": cw,
            # n = 1 does not build (TileLang lowering error); the split plan serves it
            "fits": 2 <= n <= 8 and (n * C) % 8 == 0}


def lookback_program(n: int, C: int, dtype: str = "bfloat16", target: str = "cuda", *, splits: int = 16,
                     block_tokens: int = 64, block_k: int = 128, stages: int = 3, apply_c: int = 64,
                     apply_stages: int = 2, threads: int = 256, iterations: int = 20):
    """Arguments at run time: x [T, n, C] bf16, phi_hl [phi_rows, nC] bf16 (pre_split.phi_split_program),
    bias, alpha, then scratch: mixes [T, n^2+2n+1] f32 and sync [2, ceil(T / block_tokens)] int32, both zeroed
    before every launch; then outputs y, pre, post, res."""
    if canonical_target(target) == "c":
        raise ValueError("pre lookback plan: CUDA only")
    if dtype != "bfloat16":
        raise ValueError(f"pre lookback plan: expected dtype 'bfloat16', got {dtype!r}")
    cfg = lookback_config(n, C, splits=splits, block_tokens=block_tokens, block_k=block_k, stages=stages,
                          apply_c=apply_c, apply_stages=apply_stages, threads=threads)
    M = mixes_width(n)
    NP = phi_rows(n)
    S, BT, BK, TH = splits, block_tokens, block_k, threads
    CW = cfg["cw"]
    NCW = CW // BK  # k-chunks per lane
    BA = apply_c
    NA = CW // BA
    K = n * C
    G = BT * (M + 1)
    NT = T.dynamic("T")
    lanes = list(range(n))
    coefficients = coefficient_macro(n, C, iterations=iterations)
    store = store_coefficients_macro(n)

    @T.prim_func
    def pre_lookback(
        x: T.Tensor((NT, n, C), dtype),
        phi_hl: T.Tensor((NP, K), "bfloat16"),
        bias: T.Tensor((M,), "float32"),
        alpha: T.Tensor((3,), "float32"),
        mixes: T.Tensor((NT, M + 1), "float32"),
        sync: T.Tensor((2, T.ceildiv(NT, BT)), "int32"),
        y: T.Tensor((NT, C), dtype),
        pre_out: T.Tensor((NT, n), "float32"),
        post_out: T.Tensor((NT, n), "float32"),
        res_out: T.Tensor((NT, n, n), "float32"),
    ):
        with T.Kernel(S, T.ceildiv(NT, BT), threads=TH, prelude=_PRELUDE) as (s, b):
            xs = T.alloc_shared((BT, BK), dtype)
            ps = T.alloc_shared((NP, BK), "bfloat16")
            acc = T.alloc_fragment((BT, NP), "float32")
            xf = T.alloc_fragment((BT, BK), dtype)
            sq_acc = T.alloc_fragment((BT, BK), "float32")
            sq = T.alloc_fragment((BT,), "float32")
            acc_s = T.alloc_shared((BT, NP), "float32")
            sq_s = T.alloc_shared((BT,), "float32")
            mix_s = T.alloc_shared((BT, M + 1), "float32")
            pre_s = T.alloc_shared((BT, n), "float32")
            last_s = T.alloc_shared((1,), "int32")
            xa = [T.alloc_shared((BT, BA), dtype) for _ in lanes]
            ya = T.alloc_fragment((BT, BA), dtype)
            mix = T.alloc_local((M + 1,), "float32")
            pre_l = T.alloc_local((n,), "float32")
            post_l = T.alloc_local((n,), "float32")
            comb = T.alloc_local((n * n,), "float32")
            tx = T.get_thread_binding()
            t0 = b * BT
            c0 = s * CW
            T.clear(acc)
            T.clear(sq_acc)
            # 1. this CTA's slice -- every lane j, columns [c0, c0 + CW) -- through the tensor cores
            for q in T.Pipelined(n * NCW, num_stages=stages):
                j = q // NCW
                cc = c0 + (q % NCW) * BK
                T.copy(x[t0 : t0 + BT, j, cc : cc + BK], xs)
                T.copy(phi_hl[0:NP, j * C + cc : j * C + cc + BK], ps)
                T.gemm(xs, ps, acc, transpose_B=True)
                T.copy(xs, xf)
                for t, k in T.Parallel(BT, BK):
                    v = T.cast(xf[t, k], "float32")
                    sq_acc[t, k] += v * v
            T.reduce_sum(sq_acc, sq, dim=1)
            T.copy(acc, acc_s)
            T.copy(sq, sq_s)
            T.sync_threads()
            # add the partial mixes of these columns into the tile's float32 sums (red.global.add)
            for g0 in T.serial(ceil_div(G, TH)):
                g = g0 * TH + tx
                if g < G:
                    t = g // (M + 1)
                    m = g % (M + 1)
                    if t0 + t < NT:
                        T.atomic_add(mixes[t0 + t, m],
                                     T.if_then_else(m < M, acc_s[t, T.min(m, M - 1)] + acc_s[t, M + T.min(m, M - 1)],
                                                    sq_s[t]))
            T.call_extern("handle", "mhc_fence")
            # 2. hand-off: the last CTA of the tile to arrive makes the coefficients, the others wait for them
            T.sync_threads()
            if tx == 0:
                old = T.call_extern("int32", "mhc_arrive", T.address_of(sync[0, b]))
                last_s[0] = T.if_then_else(old == S - 1, 1, 0)
            T.sync_threads()
            if last_s[0] == 1:
                for g0 in T.serial(ceil_div(G, TH)):
                    g = g0 * TH + tx
                    if g < G:
                        t = g // (M + 1)
                        m = g % (M + 1)
                        mix_s[t, m] = T.if_then_else(
                            t0 + t < NT, T.call_extern("float32", "mhc_ldcg", T.address_of(mixes[t0 + t, m])),
                            T.float32(1))
                T.sync_threads()
                for tt in T.serial(ceil_div(BT, TH)):
                    t = tt * TH + tx
                    if t < BT:
                        for q in T.unroll(M + 1):
                            mix[q] = mix_s[t, q]
                        coefficients(mix, alpha, bias, pre_l, post_l, comb)
                        for i in T.unroll(n):
                            pre_s[t, i] = pre_l[i]
                        if t0 + t < NT:
                            store(t0 + t, pre_l, post_l, comb, pre_out, post_out, res_out)
                T.sync_threads()
                if tx == 0:
                    T.call_extern("handle", "mhc_raise", T.address_of(sync[1, b]))
            else:
                if tx == 0:
                    last_s[0] = T.call_extern("int32", "mhc_wait", T.address_of(sync[1, b]))
                T.sync_threads()
                for g0 in T.serial(ceil_div(BT * n, TH)):
                    g = g0 * TH + tx
                    if g < BT * n:
                        t = g // n
                        i = g % n
                        pre_s[t, i] = T.if_then_else(
                            t0 + t < NT, T.call_extern("float32", "mhc_ldcg", T.address_of(pre_out[t0 + t, i])),
                            T.float32(0))
            T.sync_threads()
            # 3. y over this CTA's columns, re-reading its slice (an L2 hit: it was streamed moments ago)
            for a in T.Pipelined(NA, num_stages=apply_stages):
                ca = c0 + a * BA
                for j in lanes:
                    T.copy(x[t0 : t0 + BT, j, ca : ca + BA], xa[j])
                for t, c in T.Parallel(BT, BA):
                    ya[t, c] = T.cast(sum([pre_s[t, j] * T.cast(xa[j][t, c], "float32") for j in lanes]), dtype)
                T.copy(ya, y[t0 : t0 + BT, ca : ca + BA])

    return pre_lookback


@functools.lru_cache(maxsize=None)
def lookback_kernel(n: int, C: int, dtype: str = "bfloat16", target: str = "cuda", **tiles):
    return compile_program(lookback_program(n, C, dtype, target, **tiles), target,
                           pass_configs=NO_WARP_SPECIALIZATION)
