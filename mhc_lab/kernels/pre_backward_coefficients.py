# Kernel 1 of the pre backward: the coefficient gradients of one mHC site's pre.
#
#   dH_pre[t, j] = <dy[t], x[t, j]>                     a reduction over the width (reads x and dy: 5C at n = 4)
#   then per token, from the forward's raw projections and sum of squares (partial, summed over its splits):
#   the backward of the sigmoids, of Sinkhorn (recomputed on chip, only each step's line sums kept: arXiv
#   2512.24880 Sec. 4.3.1) and of the norm -> dmix [n^2 + 2n] (the gradient of the raw projections), dlogit
#   (= the bias gradient per token), the three alpha gradients and ds (the gradient of sum(x^2)).
#
# Two CUDA forms, chosen by n (coefficients_programs):
#   n a power of two: two kernels. dpre_program streams dH_pre (a warp per token, 16-byte loads, a shuffle
#     reduction) at full occupancy; spread_coefficients_program then runs each token's backward over n R threads
#     of one warp (_coefficients.spread_coefficient_macros: line sums by warp shuffles, each Sinkhorn step's sums
#     kept in shared memory), so a token's serial chain per step is two shuffles and a multiply, with sixteen
#     times the warps of a thread per token to hide it. The butterflies need n a power of two.
#   other n: one kernel (fused_coefficients_program). A CTA owns 64 tokens: all its threads stream their x and
#     dy in [64 x BC] TMA tiles for dH_pre, then one thread per token runs the backward.
# Both write kernel 2's operands (pre_backward_operands.py). The C target runs the fused program's math in
# plain loops, a token per program instance.
"""pre backward, kernel 1: per-token coefficient gradients (CUDA: spread over a warp or fused; C target)."""


import tilelang.language as T

from mhc_lab.kernels._coefficients import (
    coefficient_backward_macro,
    mixes_width,
    partial_sum_macro,
    sinkhorn_steps,
    spread_coefficient_macros,
    spread_fits,
    spread_layout,
)
from mhc_lab.kernels._target import (
    canonical_target,
    check_lanes_and_width,
    check_target_dtype,
    compile_program,
    shared_memory_limit,
)
from mhc_lab.kernels.pre_backward_operands import EXTRA, coef_width, gemm_depth, kernel2_operand_macros

ITERATIONS = 20  # Sinkhorn rounds (DeepSeek-V4, mhc_lab.reference)


def _check(name: str, n: int, C: int, dtype: str, target: str) -> str:
    check_lanes_and_width(name, n, C, max_lanes=8)
    return check_target_dtype(name, dtype, target, ("bfloat16",))


def _dpre_row_macro(n: int, C: int):
    """A T.macro ``dpre_row(x, dy, tok, acc)`` (C target): acc[j] = <dy[tok], x[tok, j]>, dH_pre of one token."""
    lanes = list(range(n))

    @T.macro
    def dpre_row(x, dy, tok, acc):
        for j in T.serial(n):
            acc[j] = T.float32(0)
        for c in T.serial(C):
            d = T.cast(dy[tok, c], "float32")
            for j in lanes:
                acc[j] += d * T.cast(x[tok, j, c], "float32")

    return dpre_row


def fused_coefficients_program(n: int, C: int, dtype: str = "bfloat16", target: str = "cuda", *, splits: int = 1):
    """Kernel 1 as one kernel: the C target's, and CUDA's where n is not a power of two.

    Arguments: x [T, n, C], dy [T, C], partial [splits, T, n^2+2n+1] f32 (the forward's raw projections and sum
    of squares, summed over splits), bias, alpha, dpost [T, n] f32, dres [T, n, n] f32, (CUDA only: pre [T, n]
    f32); outputs dpre [T, n], dtok [T, n^2+2n+4] (per token: dlogit, the bias gradient, then extra, the three
    alpha gradients and ds, the gradient of sum(x^2): one buffer, so that one sum over tokens gives bias's and
    alpha's gradients), dmix [T, n^2+2n] (all f32), and on CUDA
    kernel 2's operands dsplit [T, 3, 2 gemm_depth(n)] bf16 and coef [T, coef_width(n)] f32.

    CUDA: a CTA of 256 threads owns 64 tokens and streams their x and dy in [64 x BC] tiles (two stages) for
    dH_pre, BC the most columns whose n float32 accumulators take at most 128 registers per thread; then one
    thread per token runs the coefficient backward and writes kernel 2's operands."""
    t = _check("pre backward (coefficients)", n, C, dtype, target)
    M = mixes_width(n)
    NT = T.dynamic("T")
    S = splits
    lanes = list(range(n))
    backward = coefficient_backward_macro(n, C, iterations=ITERATIONS)
    gather = partial_sum_macro(n, S)
    NI = sinkhorn_steps(ITERATIONS) * n

    def token_scratch():
        """One thread's local arrays for the coefficient backward of its token: mix, dpre, dpost, dres, comb,
        dcomb, Sinkhorn's kept sums, dlogit, dmix, extra."""
        sizes = (M + 1, n, n, n * n, n * n, n * n, NI, M, M, EXTRA)
        return tuple(T.alloc_local((size,), "float32") for size in sizes)

    @T.macro
    def per_token(tok, partial, bias, alpha, dpre_l, dpost, dres, mix, dpost_l, dres_l, comb, dcomb, kept, dlogit_l,
                  dmix_l, extra_l, dpre, dtok, dmix):
        gather(partial, tok, mix)
        for i in T.unroll(n):
            dpost_l[i] = dpost[tok, i]
            for j in T.unroll(n):
                dres_l[i * n + j] = dres[tok, i, j]
        backward(mix, alpha, bias, dpre_l, dpost_l, dres_l, comb, dcomb, kept, dlogit_l, dmix_l, extra_l)
        for i in T.unroll(n):
            dpre[tok, i] = dpre_l[i]
        for q in T.unroll(M):
            dtok[tok, q] = dlogit_l[q]
            dmix[tok, q] = dmix_l[q]
        for q in T.unroll(EXTRA):
            dtok[tok, M + q] = extra_l[q]

    if t == "c":
        dpre_row = _dpre_row_macro(n, C)

        @T.prim_func
        def coefficients_backward_c(
            x: T.Tensor((NT, n, C), dtype), dy: T.Tensor((NT, C), dtype),
            partial: T.Tensor((S, NT, M + 1), "float32"), bias: T.Tensor((M,), "float32"),
            alpha: T.Tensor((3,), "float32"), dpost: T.Tensor((NT, n), "float32"),
            dres: T.Tensor((NT, n, n), "float32"), dpre: T.Tensor((NT, n), "float32"),
            dtok: T.Tensor((NT, M + EXTRA), "float32"), dmix: T.Tensor((NT, M), "float32"),
        ):
            with T.Kernel(NT) as tok:
                mix, dpre_l, dpost_l, dres_l, comb, dcomb, kept, dlogit_l, dmix_l, extra_l = token_scratch()
                dpre_row(x, dy, tok, dpre_l)
                per_token(tok, partial, bias, alpha, dpre_l, dpost, dres, mix, dpost_l, dres_l, comb, dcomb, kept,
                          dlogit_l, dmix_l, extra_l, dpre, dtok, dmix)

        return coefficients_backward_c

    K2 = 2 * gemm_depth(n)
    CP = coef_width(n)
    threads = 256
    BT = 64
    # the n reduction accumulators, n x [BT x BC] float32, take at most 128 registers per thread
    BC = 1 << (max(32, min(128, 128 * threads // (n * BT))).bit_length() - 1)  # a power of two: layouts exist
    while BC > 32 and 2 * (n + 1) * BT * BC * 2 > shared_memory_limit(t):  # two stages within a block's memory
        BC //= 2
    BC = min(BC, max(64, 1 << (C - 1).bit_length()))  # a power of two: layouts exist
    NC = (C + BC - 1) // BC

    split_entry, coef_entry = kernel2_operand_macros(n)

    @T.macro
    def lane_operands(tok, dmix_l, extra_l, pre, dsplit, coef):
        """Kernel 2's operands of one token, by one thread: dmix split into bf16 hi and lo, and coef."""
        for k in T.serial(K2):
            split_entry(dsplit, tok, k, lambda q: dmix_l[q])
        for j in T.unroll(CP):
            coef_entry(coef, tok, j, pre, extra_l[3])

    @T.prim_func
    def coefficients_backward_cuda(
        x: T.Tensor((NT, n, C), dtype), dy: T.Tensor((NT, C), dtype),
        partial: T.Tensor((S, NT, M + 1), "float32"), bias: T.Tensor((M,), "float32"),
        alpha: T.Tensor((3,), "float32"), dpost: T.Tensor((NT, n), "float32"),
        dres: T.Tensor((NT, n, n), "float32"), pre: T.Tensor((NT, n), "float32"),
        dpre: T.Tensor((NT, n), "float32"), dtok: T.Tensor((NT, M + EXTRA), "float32"),
        dmix: T.Tensor((NT, M), "float32"),
        dsplit: T.Tensor((NT, 3, K2), "bfloat16"), coef: T.Tensor((NT, CP), "float32"),
    ):
        with T.Kernel(T.ceildiv(NT, BT), threads=threads) as b:
            xs = [T.alloc_shared((BT, BC), dtype) for _ in lanes]
            dys = T.alloc_shared((BT, BC), dtype)
            acc = [T.alloc_fragment((BT, BC), "float32") for _ in lanes]
            sums = [T.alloc_fragment((BT,), "float32") for _ in lanes]
            sums_s = T.alloc_shared((BT, n), "float32")
            mix, dpre_l, dpost_l, dres_l, comb, dcomb, kept, dlogit_l, dmix_l, extra_l = token_scratch()
            t0 = b * BT
            # phase 1, the whole CTA: dH_pre[t, j] = <dy, x_j>, streamed in [BT x BC] tiles
            for q in lanes:
                T.clear(acc[q])
            for cb in T.Pipelined(NC, num_stages=2):
                for j in lanes:
                    T.copy(x[t0 : t0 + BT, j, cb * BC : cb * BC + BC], xs[j])
                T.copy(dy[t0 : t0 + BT, cb * BC : cb * BC + BC], dys)
                for tt, c in T.Parallel(BT, BC):
                    d = T.cast(dys[tt, c], "float32")
                    for j in lanes:
                        acc[j][tt, c] += d * T.cast(xs[j][tt, c], "float32")
            for q in lanes:
                T.reduce_sum(acc[q], sums[q], dim=1)
            for tt in T.Parallel(BT):
                for q in lanes:
                    sums_s[tt, q] = sums[q][tt]
            T.sync_threads()
            # phase 2, one thread per token: the coefficient backward, then kernel 2's operands
            tx = T.get_thread_binding()
            if tx < BT:
                tok = t0 + tx
                if tok < NT:
                    for j in T.unroll(n):
                        dpre_l[j] = sums_s[tx, j]
                    per_token(tok, partial, bias, alpha, dpre_l, dpost, dres, mix, dpost_l, dres_l, comb, dcomb,
                              kept, dlogit_l, dmix_l, extra_l, dpre, dtok, dmix)
                    lane_operands(tok, dmix_l, extra_l, pre, dsplit, coef)

    return coefficients_backward_cuda


def dpre_program(n: int, C: int, dtype: str = "bfloat16", target: str = "cuda"):
    """The first kernel of the spread kernel 1 (CUDA): dpre[t, j] = <dy[t], x[t, j]> (dH_pre), one warp of a
    256-thread CTA per token walking its width in 16-byte vectors, shuffle-reduced (deterministic). Arguments
    x [T, n, C], dy [T, C], then the output dpre [T, n] f32. Reads x and dy once: 5C elements per token at
    n = 4."""
    t = _check("pre backward (dH_pre)", n, C, dtype, target)
    if t == "c":
        raise ValueError("pre backward (dH_pre): a CUDA kernel; the C target's kernel 1 is "
                         "fused_coefficients_program")
    NT = T.dynamic("T")
    threads = 256
    V = 8 if C % 8 == 0 else 1
    WARPS = threads // 32
    STEP = 32 * V
    NS = (C + STEP - 1) // STEP

    @T.prim_func
    def dpre_reduce(x: T.Tensor((NT, n, C), dtype), dy: T.Tensor((NT, C), dtype),
                    dpre: T.Tensor((NT, n), "float32")):
        with T.Kernel(T.ceildiv(NT, WARPS), threads=threads) as b:
            acc = T.alloc_local((n,), "float32")
            xv = T.alloc_local((n, V), dtype)
            dv = T.alloc_local((V,), dtype)
            tx = T.get_thread_binding()
            lane = tx % 32
            tok = b * WARPS + tx // 32
            if tok < NT:
                for j in T.unroll(n):
                    acc[j] = T.float32(0)
                for s in T.serial(NS):
                    c0 = s * STEP + lane * V
                    if c0 < C:
                        for j in T.unroll(n):
                            for v in T.vectorized(V):
                                xv[j, v] = x[tok, j, c0 + v]
                        for v in T.vectorized(V):
                            dv[v] = dy[tok, c0 + v]
                        for v in T.unroll(V):
                            d = T.cast(dv[v], "float32")
                            for j in T.unroll(n):
                                acc[j] += d * T.cast(xv[j, v], "float32")
                for j in T.unroll(n):
                    acc[j] = T.warp_reduce_sum(acc[j])
                if lane == 0:
                    for j in T.unroll(n):
                        dpre[tok, j] = acc[j]

    return dpre_reduce


def spread_coefficients_program(n: int, C: int, dtype: str = "bfloat16", target: str = "cuda", *,
                                splits: int = 1):
    """The second kernel of the spread kernel 1 (CUDA, n a power of two): each token's coefficient backward over
    P = n R threads of one warp (``spread_layout``), 128 threads per CTA, after dpre_program. Arguments partial,
    bias, alpha, dpost, dres, pre, dpre (dH_pre, an input here), then the outputs dtok, dmix, dsplit and
    coef, as fused_coefficients_program's."""
    t = _check("pre backward (coefficients)", n, C, dtype, target)
    if t == "c":
        raise ValueError("pre backward (coefficients): the spread kernel spreads a token over a warp's threads, "
                         "CUDA only; the C target's kernel 1 is fused_coefficients_program")
    M = mixes_width(n)
    NT = T.dynamic("T")
    S = splits
    K2 = 2 * gemm_depth(n)
    CP = coef_width(n)
    layout = spread_layout(n)
    P, E, M2 = layout.threads, layout.entries, layout.gates
    threads = 128
    TPC = threads // P  # tokens per CTA
    spread = spread_coefficient_macros(n, C, S, iterations=ITERATIONS)
    split_entry, coef_entry = kernel2_operand_macros(n)

    @T.macro
    def spread_tokens(partial, bias, alpha, dpost, dres, pre, dpre, dtok, dmix, dsplit, coef):
        with T.Kernel(T.ceildiv(dpre.shape[0], TPC), threads=threads) as b:
            dmix_s = T.alloc_shared((TPC, M), "float32")
            kept = T.alloc_shared((spread.kept_count, threads), "float32")
            mx, c, dc, line, pp, red = spread.scratch()
            tx = T.get_thread_binding()
            g = tx % P
            slot = tx // P
            token = b * TPC + slot
            tok = T.min(token, dpre.shape[0] - 1)  # every thread of a warp runs the shuffles; stores are guarded
            spread.backward(tok, g, tx, partial, bias, alpha, dpre, dpost, dres, mx, c, dc, line, kept, pp, red)
            r = red[3]
            # the gradient of sum(x^2): kept in dtok's last column, and doubled in coef
            ds = ((alpha[0] * red[0] + alpha[1] * red[1] + alpha[2] * red[2]) * T.float32(-0.5) * r * r * r
                  / T.float32(n * C))
            if token < dpre.shape[0]:
                for e in T.unroll(E):
                    q = 2 * n + layout.row(g, e) * n + layout.column(g)
                    dtok[tok, q] = dc[e]
                    dmix[tok, q] = dc[e] * (alpha[2] * r)
                    dmix_s[slot, q] = dc[e] * (alpha[2] * r)
                for p in T.unroll(M2):
                    q = layout.gate(g, p)
                    if q < 2 * n:
                        d = pp[p] * (T.if_then_else(q < n, alpha[0], alpha[1]) * r)
                        dtok[tok, q] = pp[p]
                        dmix[tok, q] = d
                        dmix_s[slot, q] = d
                if g == 0:
                    for i in T.unroll(3):
                        dtok[tok, M + i] = red[i] * r
                    dtok[tok, M + 3] = ds
            T.sync_threads()
            if token < dpre.shape[0]:
                # kernel 2's operands, spread over the token's threads
                for p in T.unroll((K2 + P - 1) // P):
                    if g + P * p < K2:
                        split_entry(dsplit, tok, g + P * p, lambda q: dmix_s[slot, q])
                for p in T.unroll((CP + P - 1) // P):
                    if g + P * p < CP:
                        coef_entry(coef, tok, g + P * p, pre, ds)

    @T.prim_func
    def coefficients_backward_tokens(
        partial: T.Tensor((S, NT, M + 1), "float32"), bias: T.Tensor((M,), "float32"),
        alpha: T.Tensor((3,), "float32"), dpost: T.Tensor((NT, n), "float32"),
        dres: T.Tensor((NT, n, n), "float32"), pre: T.Tensor((NT, n), "float32"),
        dpre: T.Tensor((NT, n), "float32"), dtok: T.Tensor((NT, M + EXTRA), "float32"),
        dmix: T.Tensor((NT, M), "float32"),
        dsplit: T.Tensor((NT, 3, K2), "bfloat16"), coef: T.Tensor((NT, CP), "float32"),
    ):
        spread_tokens(partial, bias, alpha, dpost, dres, pre, dpre, dtok, dmix, dsplit, coef)

    return coefficients_backward_tokens


def coefficient_programs(n: int, C: int, dtype: str = "bfloat16", target: str = "cuda", *,
                         splits: int = 1) -> tuple:
    """Kernel 1's programs in the order they run: (dpre_program, spread_coefficients_program) on CUDA where n is
    a power of two, else (fused_coefficients_program,)."""
    t = canonical_target(target)
    if t != "c" and spread_fits(n):
        return (dpre_program(n, C, dtype, t), spread_coefficients_program(n, C, dtype, t, splits=splits))
    return (fused_coefficients_program(n, C, dtype, t, splits=splits),)


def coefficients_kernel(n: int, C: int, dtype: str = "bfloat16", target: str = "cuda", *, splits: int = 1):
    """Kernel 1 compiled (coefficient_programs), as one function with fused_coefficients_program's arguments
    whichever form runs: ``coefficients(x, dy, partial, bias, alpha, dpost, dres, [pre,] dpre, dtok, dmix[,
    dsplit, coef])`` (pre, dsplit and coef on CUDA only)."""
    t = canonical_target(target)
    programs = coefficient_programs(n, C, dtype, t, splits=splits)
    if len(programs) == 1:
        return compile_program(programs[0], t)
    reduce, tokens = (compile_program(p, t) for p in programs)

    def coefficients(x, dy, partial, bias, alpha, dpost, dres, pre, dpre, *outputs):
        reduce(x, dy, dpre)
        tokens(partial, bias, alpha, dpost, dres, pre, dpre, *outputs)

    coefficients.reduce, coefficients.tokens = reduce, tokens
    return coefficients
