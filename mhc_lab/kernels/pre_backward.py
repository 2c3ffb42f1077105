# pre backward: the gradients of one mHC site's pre (coefficients and layer input), in two kernels.
#
#   forward (pre.py): mix = x_flat phi^T, s = sum(x^2), r = rsqrt(s / nC + eps), coefficients from r * mix
#                     (sigmoids and 20 Sinkhorn rounds), y = sum_j H_pre[j] x_j
#   backward, given dy = dL/dy, dH_post and dH_res (from the post backward):
#     kernel 1 (coefficients): dH_pre[j] = sum_c dy[c] x_j[c] (a reduction over the width), then per token
#              the backward of the sigmoids, of Sinkhorn (recomputed on chip, arXiv 2512.24880 Sec. 4.3.1)
#              and of the norm: dmix [n^2 + 2n] (the gradient of the raw projections), dlogit (= the bias
#              gradient per token), the alpha gradients per token and ds (the gradient of s).
#     kernel 2 (lanes and phi): dx[t, j, c] = H_pre[j] dy[c] + sum_q dmix[q] phi[q, jC + c] + 2 ds x
#              (+ dx_post[t, j, c] in the linked site: the post's gradient of the same lanes, so that the two
#              are summed here and not by autograd in another pass)
#              and dphi[q, k] = sum_t dmix[t, q] x_flat[t, k] (a reduction over tokens: per-split partials,
#              summed afterwards in a fixed order, so deterministic).
#
# Bytes per token (bf16, n = 4): kernel 1 reads x and dy (5C elements); kernel 2 reads x, dy (and dx_post in
# the linked site: 4C more) and writes dx (4C): 9C or 13C. phi (1.5 MB at C = 4096) is read
# from L2 once per CTA and dphi written once per split.
# FLOPs per token: 2 (n^2 + 2n) nC twice (dmix phi and dmix^T x: 384 C at n = 4) on tensor cores, as three
# bf16 products (dmix and phi each split into bf16 hi + lo, ~16 bits kept) accumulated in float32.
#
# CUDA kernel 1, as the ops run it (phases="spread", n a power of two): a streaming kernel reduces dH_pre (one
# warp per token, 16-byte loads), then a kernel spreads each token's coefficient backward over n R threads of a
# warp (_coefficients.py's spread_coefficient_macros: the matrix's line sums by warp shuffles, each Sinkhorn
# step's sums kept in shared memory) and writes kernel 2's operands: dmix split into bf16 hi and lo, laid out
# for the three products, and H_pre with 2 ds. phases="fused" (other n): a CTA owns 64 tokens, all its threads
# stream their x and dy in [64 x 128] TMA tiles for dH_pre, then one thread per token runs the per-token
# backward (the same macro as the C target). CUDA kernel 2: a CTA owns a block of columns of up to 4 lanes
# (lane_tiling), split between one or two consumer warpgroups, for a range of token tiles; phi's columns are
# split into bf16 hi/lo once per CTA; every operand of the token loop arrives by copies, so the loop is
# pipelined; each token tile runs two GEMMs per lane for dx and one for the dphi partial, which stays in
# registers until the end.
# H200, 16384 x 4096 (2026-11-30, mhc_lab/recorded/training_h200.json, sweeps): kernel 1 0.189 ms spread
# (dH_pre 0.164, per token 0.028; fused 0.275, split 0.260), kernel 2 0.321 ms (3.76 TB/s on its 9C bytes),
# 0.435 ms when it adds the linked site's dx_post (4.0 TB/s on 13C), 0.555 ms when it adds H_res^T g (run AV,
# AZ); docs/kernel-notes.md has the versions before these and what limits them.
"""pre backward: coefficient gradients (kernel 1), lane and phi gradients (kernel 2); CUDA or C target."""


import functools

import tilelang.language as T
from tilelang.layout import make_swizzled_layout

from mhc_lab.kernels._coefficients import (
    TOKEN_THREADS,
    coefficient_backward_macro,
    mixes_width,
    partial_sum_macro,
    sinkhorn_steps,
    spread_coefficient_macros,
    spread_layout,
)
from mhc_lab.kernels._target import (
    canonical_target,
    check_lanes_and_width,
    check_target_dtype,
    compile_program,
    leave_out_prefix,
    round_up,
    shared_per_cta,
)

EXTRA = 4  # per-token extras of kernel 1: d alpha_pre, d alpha_post, d alpha_res, d sum(x^2)
LANE_LEAVE_OUT_STEPS = ("dphi", "dx_gemm", "dmix_loads")  # kernel 2's timing steps, left out in this order
HELD_TERMS = ("g", "acc")  # kernel 2's held_terms with g_once: H_res^T g held, or every term in the accumulators
JOINED_LEAVE_OUT = ("row_sums", "outputs", "second_barrier")  # the joined epilogue's, in any combination


def _present(*buffers) -> list:
    """The buffers given, lists of buffers flattened, Nones left out (a macro's conditional operands)."""
    out = []
    for b in buffers:
        out += [c for c in b if c is not None] if isinstance(b, list) else [] if b is None else [b]
    return out


def lane_dx_c(x, dy, pre, dmix, extra, phi, tok, j, col, M: int, C: int):
    """Kernel 2's dx of lane j at one token and column, float32 (C target): the projection's term
    sum_q dmix[q] phi[q, jC + col], H_pre[j] dy and the norm's 2 ds x; without the post's gradient."""
    return sum([dmix[tok, q] * phi[q, j * C + col] for q in range(M)],
               pre[tok, j] * T.cast(dy[tok, col], "float32")
               + T.float32(2) * extra[tok, 3] * T.cast(x[tok, j, col], "float32"))


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


def pre_backward_coefficients_program(n: int, C: int, dtype: str = "bfloat16", target: str = "cuda", *,
                                      splits: int = 1, iterations: int = 20, threads: int = 256,
                                      block_tokens: int = 64, block_c: int | None = None, stages: int = 2,
                                      phases: str = "fused", spread: dict | None = None):
    """Kernel 1. Arguments: x [T, n, C], dy [T, C], partial [splits, T, n^2+2n+1] f32 (the forward's raw
    projections and sum of squares, summed over splits), bias, alpha, dpost [T, n] f32, dres [T, n, n] f32,
    (CUDA only: pre [T, n] f32); outputs dpre [T, n], dlogit [T, n^2+2n], dmix [T, n^2+2n], extra [T, 4] (all
    f32), and on CUDA kernel 2's operands: dsplit [T, 3, 2 gemm_depth(n)] bf16 (dmix split into bf16 hi and
    lo, laid out for the three products) and coef [T, coef_width(n)] f32 (H_pre, then 2 ds).

    The same kernel serves both sites (mhc_lab.ops.training's separate and linked ones).

    phases: "fused", one kernel (on CUDA a CTA streams its tokens' x and dy for dH_pre, then one thread per
    token runs the rest); "split", the program of the per-token part alone (arguments from partial on, dpre
    holding dH_pre as an input), run after dpre_program's streaming reduction, so that on CUDA the stream runs
    at full occupancy and the per-token math of all tokens at once (the C target has the same split);
    "spread" (CUDA only), the same with the per-token part spread over n R threads of a warp per token, the
    line sums by warp shuffles (``spread_coefficient_macros``; ``spread``: its tuning, {"threads"}).
    On the H200 (2026-11-30, run AF, ``training_h200.json`` sweeps) "spread" took 0.132 / 0.189 / 0.162 ms at
    16384 x 2560 / 16384 x 4096 / 8192 x 7168 (its per-token kernel 0.028 / 0.028 / 0.018 of it) against
    0.223 / 0.275 / 0.201 fused and 0.204 / 0.260 / 0.221 split (per-token kernel 0.100 / 0.099 / 0.077)."""
    if phases not in ("fused", "split", "spread"):
        raise ValueError("pre backward (coefficients): phases: expected 'fused', 'split' or 'spread', "
                         f"got {phases!r}")
    t = _check("pre backward (coefficients)", n, C, dtype, target)
    if phases == "spread" and t == "c":
        raise ValueError("pre backward (coefficients): phases='spread' spreads a token over a warp's threads, "
                         "CUDA only; on the C target 'split' runs the same math")
    M = mixes_width(n)
    NT = T.dynamic("T")
    S = splits
    lanes = list(range(n))
    backward = coefficient_backward_macro(n, C, iterations=iterations)
    gather = partial_sum_macro(n, S)
    NI = sinkhorn_steps(iterations) * n

    def token_scratch():
        """One thread's local arrays for the coefficient backward of its token: mix, dpre, dpost, dres, comb,
        dcomb, Sinkhorn's kept sums, dlogit, dmix, extra."""
        sizes = (M + 1, n, n, n * n, n * n, n * n, NI, M, M, EXTRA)
        return tuple(T.alloc_local((size,), "float32") for size in sizes)

    @T.macro
    def per_token(tok, partial, bias, alpha, dpre_l, dpost, dres, mix, dpost_l, dres_l, comb, dcomb, kept, dlogit_l,
                  dmix_l, extra_l, dpre, dlogit, dmix, extra):
        gather(partial, tok, mix)
        for i in T.unroll(n):
            dpost_l[i] = dpost[tok, i]
            for j in T.unroll(n):
                dres_l[i * n + j] = dres[tok, i, j]
        backward(mix, alpha, bias, dpre_l, dpost_l, dres_l, comb, dcomb, kept, dlogit_l, dmix_l, extra_l)
        if dpre is not None:
            for i in T.unroll(n):
                dpre[tok, i] = dpre_l[i]
        for q in T.unroll(M):
            dlogit[tok, q] = dlogit_l[q]
            dmix[tok, q] = dmix_l[q]
        for q in T.unroll(EXTRA):
            extra[tok, q] = extra_l[q]

    if t == "c":
        dpre_row = _dpre_row_macro(n, C)

        @T.prim_func
        def coefficients_backward_c(
            x: T.Tensor((NT, n, C), dtype), dy: T.Tensor((NT, C), dtype),
            partial: T.Tensor((S, NT, M + 1), "float32"), bias: T.Tensor((M,), "float32"),
            alpha: T.Tensor((3,), "float32"), dpost: T.Tensor((NT, n), "float32"),
            dres: T.Tensor((NT, n, n), "float32"), dpre: T.Tensor((NT, n), "float32"),
            dlogit: T.Tensor((NT, M), "float32"), dmix: T.Tensor((NT, M), "float32"),
            extra: T.Tensor((NT, EXTRA), "float32"),
        ):
            with T.Kernel(NT) as tok:
                mix, dpre_l, dpost_l, dres_l, comb, dcomb, kept, dlogit_l, dmix_l, extra_l = token_scratch()
                dpre_row(x, dy, tok, dpre_l)
                per_token(tok, partial, bias, alpha, dpre_l, dpost, dres, mix, dpost_l, dres_l, comb, dcomb, kept,
                          dlogit_l, dmix_l, extra_l, dpre, dlogit, dmix, extra)

        if phases == "fused":
            return coefficients_backward_c

        @T.prim_func
        def coefficients_backward_tokens_c(
            partial: T.Tensor((S, NT, M + 1), "float32"), bias: T.Tensor((M,), "float32"),
            alpha: T.Tensor((3,), "float32"), dpost: T.Tensor((NT, n), "float32"),
            dres: T.Tensor((NT, n, n), "float32"), dpre: T.Tensor((NT, n), "float32"),
            dlogit: T.Tensor((NT, M), "float32"), dmix: T.Tensor((NT, M), "float32"),
            extra: T.Tensor((NT, EXTRA), "float32"),
        ):
            # phases="split" on the C target: the per-token part, dH_pre already in dpre (dpre_program)
            with T.Kernel(NT) as tok:
                mix, dpre_l, dpost_l, dres_l, comb, dcomb, kept, dlogit_l, dmix_l, extra_l = token_scratch()
                for j in T.serial(n):
                    dpre_l[j] = dpre[tok, j]
                per_token(tok, partial, bias, alpha, dpre_l, dpost, dres, mix, dpost_l, dres_l, comb, dcomb, kept,
                          dlogit_l, dmix_l, extra_l, None, dlogit, dmix, extra)

        return coefficients_backward_tokens_c

    KH = gemm_depth(n)
    K2 = 2 * KH
    CP = coef_width(n)
    BT = block_tokens
    # the n reduction accumulators, n x [BT x BC] float32, take at most 128 registers per thread by default
    BC = block_c or max(32, min(128, 128 * threads // (n * BT)))
    BC = min(BC, max(64, 1 << (C - 1).bit_length()))  # a power of two: layouts exist
    NC = (C + BC - 1) // BC

    split_entry, coef_entry = _kernel2_operand_macros(n)

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
        dpre: T.Tensor((NT, n), "float32"), dlogit: T.Tensor((NT, M), "float32"),
        dmix: T.Tensor((NT, M), "float32"), extra: T.Tensor((NT, EXTRA), "float32"),
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
            for cb in T.Pipelined(NC, num_stages=stages):
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
                              kept, dlogit_l, dmix_l, extra_l, dpre, dlogit, dmix, extra)
                    lane_operands(tok, dmix_l, extra_l, pre, dsplit, coef)

    if phases == "fused":
        return coefficients_backward_cuda

    @T.macro
    def one_thread_per_token(partial, bias, alpha, dpost, dres, pre, dpre, dlogit, dmix, extra, dsplit, coef):
        # phases="split", the second kernel: one thread per token, dH_pre already in dpre (dpre_program)
        with T.Kernel(T.ceildiv(NT, TOKEN_THREADS), threads=TOKEN_THREADS) as b:
            mix, dpre_l, dpost_l, dres_l, comb, dcomb, kept, dlogit_l, dmix_l, extra_l = token_scratch()
            tok = b * TOKEN_THREADS + T.get_thread_binding()
            if tok < NT:
                for j in T.unroll(n):
                    dpre_l[j] = dpre[tok, j]
                per_token(tok, partial, bias, alpha, dpre_l, dpost, dres, mix, dpost_l, dres_l, comb, dcomb,
                          kept, dlogit_l, dmix_l, extra_l, None, dlogit, dmix, extra)
                lane_operands(tok, dmix_l, extra_l, pre, dsplit, coef)

    body = (_spread_tokens_macro(n, C, splits=S, iterations=iterations, **(spread or {})) if phases == "spread"
            else one_thread_per_token)

    @T.prim_func
    def coefficients_backward_tokens(
        partial: T.Tensor((S, NT, M + 1), "float32"), bias: T.Tensor((M,), "float32"),
        alpha: T.Tensor((3,), "float32"), dpost: T.Tensor((NT, n), "float32"),
        dres: T.Tensor((NT, n, n), "float32"), pre: T.Tensor((NT, n), "float32"),
        dpre: T.Tensor((NT, n), "float32"), dlogit: T.Tensor((NT, M), "float32"),
        dmix: T.Tensor((NT, M), "float32"), extra: T.Tensor((NT, EXTRA), "float32"),
        dsplit: T.Tensor((NT, 3, K2), "bfloat16"), coef: T.Tensor((NT, CP), "float32"),
    ):
        body(partial, bias, alpha, dpost, dres, pre, dpre, dlogit, dmix, extra, dsplit, coef)

    return coefficients_backward_tokens


def _spread_tokens_macro(n: int, C: int, *, splits: int, iterations: int, threads: int = 128):
    """The body of kernel 1's per-token program with phases="spread" (after dpre_program): a token over P = n R
    threads of a warp (``spread_coefficient_macros``), T // (threads / P) CTAs; a T.macro taking the split
    program's arguments."""
    M = mixes_width(n)
    KH = gemm_depth(n)
    K2 = 2 * KH
    CP = coef_width(n)
    layout = spread_layout(n)
    P, E, M2 = layout.threads, layout.entries, layout.gates
    TPC = threads // P  # tokens per CTA
    if threads % 32 or not 32 <= threads <= 1024:
        raise ValueError(f"pre backward (coefficients, spread): expected threads a multiple of 32 in [32, 1024], "
                         f"got {threads}")
    spread = spread_coefficient_macros(n, C, splits, iterations=iterations)
    split_entry, coef_entry = _kernel2_operand_macros(n)

    @T.macro
    def spread_tokens(partial, bias, alpha, dpost, dres, pre, dpre, dlogit, dmix, extra, dsplit, coef):
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
            # the gradient of sum(x^2): kept in extra, and doubled in coef
            ds = ((alpha[0] * red[0] + alpha[1] * red[1] + alpha[2] * red[2]) * T.float32(-0.5) * r * r * r
                  / T.float32(n * C))
            if token < dpre.shape[0]:
                for e in T.unroll(E):
                    q = 2 * n + layout.row(g, e) * n + layout.column(g)
                    dlogit[tok, q] = dc[e]
                    dmix[tok, q] = dc[e] * (alpha[2] * r)
                    dmix_s[slot, q] = dc[e] * (alpha[2] * r)
                for p in T.unroll(M2):
                    q = layout.gate(g, p)
                    if q < 2 * n:
                        d = pp[p] * (T.if_then_else(q < n, alpha[0], alpha[1]) * r)
                        dlogit[tok, q] = pp[p]
                        dmix[tok, q] = d
                        dmix_s[slot, q] = d
                if g == 0:
                    for i in T.unroll(3):
                        extra[tok, i] = red[i] * r
                    extra[tok, 3] = ds
            T.sync_threads()
            if token < dpre.shape[0]:
                # kernel 2's operands, spread over the token's threads
                for p in T.unroll((K2 + P - 1) // P):
                    if g + P * p < K2:
                        split_entry(dsplit, tok, g + P * p, lambda q: dmix_s[slot, q])
                for p in T.unroll((CP + P - 1) // P):
                    if g + P * p < CP:
                        coef_entry(coef, tok, g + P * p, pre, ds)

    return spread_tokens


def dpre_program(n: int, C: int, dtype: str = "bfloat16", target: str = "cuda", *, threads: int = 256):
    """The first kernel of the split kernel 1: dpre[t, j] = <dy[t], x[t, j]> (dH_pre). CUDA: one warp per token
    walking its width in 16-byte vectors, shuffle-reduced (deterministic); C target: plain loops. Arguments
    x [T, n, C], dy [T, C], then the output dpre [T, n] f32. Reads x and dy once: 5C elements per token at
    n = 4."""
    t = _check("pre backward (dH_pre)", n, C, dtype, target)
    NT = T.dynamic("T")
    if t == "c":
        dpre_row = _dpre_row_macro(n, C)

        @T.prim_func
        def dpre_reduce_c(x: T.Tensor((NT, n, C), dtype), dy: T.Tensor((NT, C), dtype),
                          dpre: T.Tensor((NT, n), "float32")):
            with T.Kernel(NT) as tok:
                acc = T.alloc_local((n,), "float32")
                dpre_row(x, dy, tok, acc)
                for j in T.serial(n):
                    dpre[tok, j] = acc[j]

        return dpre_reduce_c

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


def coef_width(n: int) -> int:
    """Columns of kernel 1's per-token coef output on CUDA: H_pre per lane, 2 ds, padding to 16 bytes."""
    return round_up(n + 1, 4)


def gemm_depth(n: int) -> int:
    """K of kernel 2's GEMMs per split half: n^2 + 2n rounded up to 32, so that both halves together (the M
    of the transposed dphi GEMM) are a multiple of 64, the warpgroup MMA's M."""
    return round_up(mixes_width(n), 32)


def _kernel2_operand_macros(n: int):
    """How kernel 1 writes kernel 2's CUDA operands, one entry at a time (its fused, split and spread forms all
    call these): ``split_entry(dsplit, tok, k, dmix_at)`` writes column k of the token's three rows of dmix
    split into bf16 hi and lo, in the layouts kernel 2's three products take (``dmix_at(q)`` reads the token's
    dmix[q]); ``coef_entry(coef, tok, j, pre, ds)`` writes coef[tok, j] = H_pre[j] (j < n), then 2 ds, then
    padding zeros."""
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


def pre_backward_lanes_program(n: int, C: int, dtype: str = "bfloat16", target: str = "cuda", *,
                               add_dx: bool = False, splits: int = 1, block_tokens: int = 64,
                               block_c: int | None = None, lane_group: int | None = None,
                               stages: int | None = None, dx_products: int = 3, threads: int = 128,
                               trim_lo: bool = True, post_grad: bool = False, overlap_dx: bool | None = None,
                               ctas_per_sm: int = 1, swizzle_epilogue: bool = True, stage_dx: bool | None = None,
                               dy_once: bool | None = None, consumer_groups: int | None = None,
                               joined: bool = False, leave_out: tuple = (), joined_leave_out: tuple = (),
                               g_once: bool | None = None, held_terms: str | None = None):
    """Kernel 2. Arguments, C target: x [T, n, C], dy [T, C], pre [T, n] f32, dmix [T, n^2+2n] f32,
    extra [T, 4] f32, phi [n^2+2n, nC] f32; CUDA: x, dy, dsplit and coef (kernel 1's CUDA outputs), phi.
    Then (if add_dx) dx_post [T, n, C], another gradient of the lanes (the linked site's: the post's), added to
    dx in the same pass, or (if post_grad) the linked post's output gradient g [T, n, C] and its res [T, n, n]
    f32, of which H_res^T g is added to dx in the same pass (so the post's backward need not write dx: 42C per
    chained site instead of 46C; each CTA then takes all n lanes, since each lane's dx needs every lane of g);
    then the outputs dx [T, n, C] and dphi_partial: [1, n^2+2n, nC] f32 on the C target (dphi itself); on CUDA
    [splits, 2 gemm_depth(n), nC] (dphi_from_partial sums it).

    CUDA tuning: lane_group lanes per CTA (default lane_tiling(n, add_dx), which also picks block_c), token
    tiles of block_tokens, stages > 1 pipelines the token loop (default lane_stages: the most that fit in
    shared memory, up to 3 with add_dx and 2 without), dx_products 3 (dmix and phi both split into bf16
    hi + lo: hi.hi + hi.lo + lo.hi) or 1 (one GEMM, dmix_hi (phi_hi + phi_lo): dmix rounded to bf16 in the
    dmix phi term of dx); trim_lo (the default) runs the lo.hi product over the KH rows of K that are not zero
    (half the tensor-core instructions of that product, the same sums): 0.670 / 0.677 against 0.683 / 0.702 ms
    with dx_post at 16384 x 4096 in two rounds of one run, level at 16384 x 2560 and 8192 x 7168 (H200,
    2026-11-30, kernel notes, version 24). threads 256 with block_tokens 128 gives each of two consumer
    warpgroups its own 64 tokens of the tile: slower at every width, 0.728 against 0.692 ms with dx_post at
    16384 x 4096 (version 23; at 64 tokens two warpgroups split the 32 columns instead, m64n16k16, and were
    slower too: version 17).
    Each lane's dphi GEMM is waited for before the next lane starts. Issued before the dx epilogue and waited
    for at the lane's end instead (the stage's release kept behind the wait), it was no faster: 0.672 against
    0.681 ms with dx_post at 16384 x 4096, slower at the other widths (H200, 2026-11-30, kernel notes).
    With add_dx each lane's dx_post tile comes into shared memory with the token loop's other operands, so the
    pipeline fetches it ahead (read from global memory where it is added instead, the 4C cost 0.40 ms at
    16384 x 4096 on the H200; staged, 0.22 ms, 2026-11-30).

    overlap_dx (CUDA): each lane's dx GEMMs are issued before the previous lane's epilogue and its dphi GEMM
    after it, none waited for at its issue, so the tensor cores run the next lane's products while the CUDA
    cores finish this lane's dx; each lane's dx accumulator is its own. A read of each staged operand after the
    last wait keeps the pipeline's release of the stage behind it. Default (None): on (but with leave_out). With
    dx_post it was faster at every width (run AK, with lane_tiling's four lanes: 0.446 / 0.631 / 0.610 ms against
    0.489 / 0.702 / 0.653 plain at C = 2560 / 4096 / 7168); without, since stage_dx, too (run AO: 0.264 / 0.387 /
    0.377 against 0.279 / 0.402 / 0.384; before stage_dx it was not, 0.531 against 0.498 ms at C = 4096, run AJ).
    Taking dmix from registers instead of shared memory (wgmma's RS form) was slower in every case (run AK,
    0.671-0.828 ms at C = 4096), and was removed (H200, 2026-11-30, kernel notes, version 28).

    swizzle_epilogue (CUDA): the tiles only the epilogue reads (dy, dx_post, g) get the 64-byte swizzle the GEMM
    tiles (x) have, in shared memory and in their TMA loads, so that the epilogue's reads in the accumulator's
    layout (a quad of threads per row, 4 bytes each, eight rows at once) find eight different banks: unswizzled
    they met 4-way bank conflicts, 32 of the 48 million shared-load wavefronts at 16384 x 4096 (Nsight Compute,
    run AN; 2.1 million conflicts with both options, run AO).
    stage_dx (CUDA; default: when C is a multiple of 8, which TMA's 16-byte row alignment needs): each lane's dx
    tile goes from registers to its own shared buffer (stmatrix) and out by one TMA store, whose wait comes
    before that buffer's next use (LG - 1 stores later) instead of straight after it. Stored from registers, 4
    bytes per thread in the accumulator's layout, dx reached the L2 as 31 million half-sector writes for its 17
    million sectors, and the L2's request rate (83% of its throughput) held kernel 2 back; with the TMA store 8.5
    million requests. Both options together, with dx_post (run AO, H200, 2026-11-30): 0.365 / 0.521 / 0.495 ms
    against 0.448 / 0.633 / 0.611 without them (swizzle_epilogue alone: 0.423 / 0.661 / 0.626); without dx_post
    0.279 / 0.402 / 0.384 against 0.377 / 0.495 / 0.483; dx and dphi the same bit for bit.

    dy_once (CUDA): each tile's dy read from shared memory once into float32 registers for all its lanes,
    instead of once per lane in each lane's epilogue (Nsight Compute counts the consumer's issued instructions
    as kernel 2's limit since stage_dx; dy's shared loads and bf16 unpacking are a quarter of the epilogue's
    loads). Default (None): on with dx_post, whose four lanes share each dy tile: 0.348 / 0.498 / 0.474 ms
    against 0.363 / 0.520 / 0.491 at C = 2560 / 4096 / 7168; off without, where two lanes share it and the held
    registers cost more than they save: 0.276 / 0.406 / 0.386 against 0.263 / 0.385 / 0.378 (run AR, H200,
    2026-11-30; dx and dphi the same bit for bit).

    ctas_per_sm (CUDA): CTAs that must fit on one SM at once (TileLang's min_blocks_per_sm; the warpgroups then
    keep the registers they launch with), so that one CTA's consumer runs its products and epilogues while
    another's waits; the lanes, columns and stages default to the most that fit that many CTAs' shared memory.
    Two CTAs with dx_post: 0.345 / 0.518 / 0.489 ms against one's 0.365 / 0.521 / 0.495 (run AO); before
    stage_dx 0.444 / 0.658 / 0.602 against 0.450 / 0.626 / 0.616 (run AM). Not the default: one run, and no
    gain at C = 4096.

    consumer_groups (CUDA): 2 gives the CTA two consumer warpgroups (384 threads with the producer) that share
    each staged tile and split its lanes: each issues its own lanes' products into its own accumulators and runs
    their epilogues, so two warps per scheduler issue where one did, with the same tiles and stages (two CTAs
    per SM, the other way to more consumer warps, halve each CTA's shared memory). The consumer code branches
    on the thread index: TileLang then binds each branch's GEMMs and fragments to that warpgroup's 128 threads
    (a fragment used by both branches lost the second one's work, and branching on T.get_warp_group_idx()
    instead left each GEMM split across both). The first dx product overwrites its accumulator (wgmma's
    scale-d 0) instead of a T.clear, which inside a branch made ptxas serialise every wgmma (C7518). Needs
    overlap_dx, threads = 128, one CTA per SM and an even number of lanes per CTA. Default (None): two where
    each warpgroup gets two lanes or more (lane_tiling, consumer_groups_for): with dx_post 0.296 / 0.435 /
    0.441 ms against 0.350 / 0.498 / 0.473 at C = 2560 / 4096 / 7168, without it (4 lanes per CTA instead of
    2) 0.212 / 0.321 / 0.358 against 0.263 / 0.386 / 0.377 (run AV, H200, 2026-11-30; dx and dphi the same bit
    for bit as one warpgroup's, dphi within 1.2e-5 where the token splits differ).

    joined (CUDA): kernel 2 joined with the post backward of the site before this one (kernels/
    joined_backward.py has the C target and the formulas). Needs add_dx, stage_dx and two consumer warpgroups of
    all n lanes (n = 4). Each warpgroup writes its lanes' dx tiles into one shared buffer of all lanes and stores
    none of them; after a named barrier of the two warpgroups each takes from the four tiles, for its own lanes
    j, the previous site's dx_post H_res_p^T dx (16-byte stores, a quad of threads per 64-byte row) and the row
    sums of dx_i x_p,j over the block's columns (dH_res_p's partials); the first warpgroup also
    df_p = H_post_p . dx, the second the row sums of dx_i f_p (dH_post_p's); a second barrier keeps the next
    tile's writes of the buffer after these reads (the pipeline keeps a copy of the buffer per stage, which makes
    it redundant at two stages: without it 1.298 ms against 1.345, the same outputs, run BD; it stays until the
    CUDA tests have run without it). Extra arguments after
    dx_post: x_prev [T, n, C], f_prev [T, C], post_prev [T, n] f32, res_prev [T, n, n] f32; outputs dx_prev
    [T, n, C], df_prev [T, C], dphi_partial, coef_partial [T, ceil(C / block_c), n^2 + n] f32 (dH_res_p, then
    dH_post_p). Written to the lanes' dx tiles (BT x BC) one element per thread in the accumulator's layout,
    and compiled for sm_90 with 168 registers, no spills, 219136 bytes of shared memory in two stages.
    On the H200 it gives the two kernels' dx_prev, df_prev and dphi bit for bit (row sums to 1.5e-7) and is
    slower than the two together: 0.904 / 1.333 / 1.219 ms against 0.582 / 0.897 / 0.845 at 16384 x 2560,
    16384 x 4096, 8192 x 7168 (run BC). Without its epilogue's row sums and outputs it takes 0.647 ms at
    16384 x 4096 (run BD): the epilogue's instructions, not memory, hold it (Nsight Compute, run BF: about
    1620 instructions per consumer warp and tile, issued on 35% of cycles with two warps per scheduler).

    g_once (CUDA, post_grad with overlap_dx; None: on wherever those hold): each consumer warpgroup reads the
    tile's n lanes of g from shared memory once and forms H_res^T g for each of its lanes in float32 registers,
    right after issuing its first lane's dx products (so the CUDA cores work while the tensor cores do); each
    lane's epilogue then adds one value. Without it, each lane's epilogue reads and unpacks all n tiles of g
    again: at n = 4 with two lanes per warpgroup, 4 unpacks and the loads of 4 tiles per element and lane (about
    320 of the 920-950 instructions a warpgroup issues per tile are bf16 unpacking; SASS, kernel notes). On the
    H200 at 16384 x 4096: 0.512 against 0.551 ms alone, 0.592 against 0.686 behind GEMMs at the power cap (run
    BO; 0.353 / 0.417 against 0.385 / 0.480 at C = 2560).
    held_terms (with g_once; None: "acc" wherever g_once is on): what each warpgroup forms per lane beside its
    products. "g": H_res^T g, held in registers and added after each wait. "acc": every term of dx but the
    products (H_pre[j] dy + 2 ds x_j + H_res^T g, dy converted once for the warpgroup's lanes) written into each
    lane's accumulator before its products are issued, which then add onto them (wgmma's scale-d 1): after each
    wait the epilogue only converts and stores (run BS: the consumers waited on the products in 9% of their
    samples, with the dy and x terms still to form after each wait). On the H200 at 16384 x 4096: 0.490 against
    0.503 ms alone, 0.550 against 0.584 behind GEMMs (0.331 / 0.371 against 0.351 / 0.421 at C = 2560; run BV).
    A third way, "all" (the same terms held in registers, added after each wait), took 0.582 / 0.399 behind GEMMs
    and was dropped.

    leave_out (CUDA, timing experiments only: the results are wrong) drops parts of the kernel to see what each
    costs: "dphi" the dphi GEMM, "dx_gemm" also the dx GEMMs, "dmix_loads" also the dmix operands' loads;
    what is left is the stream of x, dy (and dx_post) through the pipeline and the dx epilogue.
    joined_leave_out does the same for the joined epilogue, any of JOINED_LEAVE_OUT: "row_sums" (the partial
    sums of dH_res_p and dH_post_p), "outputs" (dx_prev and df_prev), "second_barrier"."""
    t = _check("pre backward (lanes)", n, C, dtype, target)
    joined_left = set(joined_leave_out)
    if joined_left - set(JOINED_LEAVE_OUT) or (joined_left and not joined):
        raise ValueError(f"pre backward (lanes): joined_leave_out takes parts of the joined kernel's epilogue, any "
                         f"of {JOINED_LEAVE_OUT}; got {tuple(joined_leave_out)} with joined = {joined}")
    if joined and t == "c":
        raise ValueError("pre backward (lanes): the joined kernel's C target is kernels/joined_backward.py "
                         "(joined_backward_program)")
    if add_dx and post_grad:
        raise ValueError("pre backward (lanes): add_dx (the post's dx) and post_grad (the post's g, whose H_res^T g "
                         "this kernel computes) are two ways to the same term; got both")
    M = mixes_width(n)
    K = n * C
    NT = T.dynamic("T")
    S = splits
    lanes = list(range(n))

    if t == "c":
        BCc = 8

        @T.macro
        def body(x, dy, pre, dmix, extra, phi, dx_post, g, res, dx, dphi_partial):
            with T.Kernel(T.ceildiv(C, BCc)) as bc:
                acc = T.alloc_local((1,), "float32")
                for cc in T.serial(BCc):
                    col = bc * BCc + cc
                    if col < C:
                        for j in T.serial(n):
                            for tok in T.serial(NT):
                                v = lane_dx_c(x, dy, pre, dmix, extra, phi, tok, j, col, M, C)
                                if dx_post is not None:
                                    v = v + T.cast(dx_post[tok, j, col], "float32")
                                if g is not None:
                                    v = v + sum([res[tok, i, j] * T.cast(g[tok, i, col], "float32") for i in lanes])
                                dx[tok, j, col] = T.cast(v, dtype)
                            for q in T.serial(M):
                                acc[0] = T.float32(0)
                                for tok in T.serial(NT):
                                    acc[0] += dmix[tok, q] * T.cast(x[tok, j, col], "float32")
                                dphi_partial[0, q, j * C + col] = acc[0]

        if add_dx:

            @T.prim_func
            def lanes_backward_c_add(
                x: T.Tensor((NT, n, C), dtype), dy: T.Tensor((NT, C), dtype), pre: T.Tensor((NT, n), "float32"),
                dmix: T.Tensor((NT, M), "float32"), extra: T.Tensor((NT, EXTRA), "float32"),
                phi: T.Tensor((M, K), "float32"), dx_post: T.Tensor((NT, n, C), dtype),
                dx: T.Tensor((NT, n, C), dtype), dphi_partial: T.Tensor((1, M, K), "float32"),
            ):
                body(x, dy, pre, dmix, extra, phi, dx_post, None, None, dx, dphi_partial)

            return lanes_backward_c_add

        if post_grad:

            @T.prim_func
            def lanes_backward_c_post_grad(
                x: T.Tensor((NT, n, C), dtype), dy: T.Tensor((NT, C), dtype), pre: T.Tensor((NT, n), "float32"),
                dmix: T.Tensor((NT, M), "float32"), extra: T.Tensor((NT, EXTRA), "float32"),
                phi: T.Tensor((M, K), "float32"), g: T.Tensor((NT, n, C), dtype), res: T.Tensor((NT, n, n), "float32"),
                dx: T.Tensor((NT, n, C), dtype), dphi_partial: T.Tensor((1, M, K), "float32"),
            ):
                body(x, dy, pre, dmix, extra, phi, None, g, res, dx, dphi_partial)

            return lanes_backward_c_post_grad

        @T.prim_func
        def lanes_backward_c(
            x: T.Tensor((NT, n, C), dtype), dy: T.Tensor((NT, C), dtype), pre: T.Tensor((NT, n), "float32"),
            dmix: T.Tensor((NT, M), "float32"), extra: T.Tensor((NT, EXTRA), "float32"),
            phi: T.Tensor((M, K), "float32"),
            dx: T.Tensor((NT, n, C), dtype), dphi_partial: T.Tensor((1, M, K), "float32"),
        ):
            body(x, dy, pre, dmix, extra, phi, None, None, None, dx, dphi_partial)

        return lanes_backward_c

    left = leave_out_prefix("pre backward (lanes)", LANE_LEAVE_OUT_STEPS, leave_out)
    if overlap_dx is None:
        overlap_dx = not left
    if overlap_dx and left:
        raise ValueError(f"pre backward (lanes): leave_out times parts of the plain lane loop; overlap_dx has its "
                         f"own order of GEMMs and epilogues, so the two do not go together, got leave_out = "
                         f"{tuple(leave_out)}")
    if ctas_per_sm not in (1, 2):
        raise ValueError(f"pre backward (lanes): ctas_per_sm is 1 or 2, got {ctas_per_sm}")
    if consumer_groups not in (None, 1, 2):
        raise ValueError(f"pre backward (lanes): consumer_groups is 1 or 2, got {consumer_groups}")
    if stage_dx is None:
        stage_dx = C % 8 == 0
    if dy_once is None:
        dy_once = add_dx
    if stage_dx and C % 8:
        raise ValueError(f"pre backward (lanes): stage_dx stores dx by TMA, whose rows must start on 16 bytes, so C "
                         f"must be a multiple of 8, got C = {C}")
    KH = gemm_depth(n)
    K2 = 2 * KH
    BT = block_tokens
    consumer_groups = consumer_groups_asked(consumer_groups, threads, overlap_dx, leave_out)
    default_lanes, default_columns, default_groups = lane_tiling(n, add_dx, post_grad, ctas_per_sm, block_tokens,
                                                                 consumer_groups)
    LG, BC = lane_group or default_lanes, block_c or default_columns
    if n % LG:
        raise ValueError(f"pre backward (lanes): lane_group must divide n, got lane_group = {LG}, n = {n}")
    if post_grad and LG != n:
        raise ValueError(f"pre backward (lanes): post_grad needs every lane in each CTA (each lane's dx takes all n "
                         f"lanes of g), so lane_group = n = {n}, got lane_group = {LG}")
    group = list(range(LG))
    CG = consumer_groups or (default_groups if lane_group is None
                             else consumer_groups_for(LG, ctas_per_sm=ctas_per_sm, block_tokens=BT))
    if CG > 1 and not (overlap_dx and threads == 128 and ctas_per_sm == 1 and LG % CG == 0):
        raise ValueError(f"pre backward (lanes): consumer_groups = {CG} gives each of {CG} consumer warpgroups "
                         f"(128 threads each) its own lanes with overlapped waits, so it needs overlap_dx, no "
                         f"leave_out, threads = 128, ctas_per_sm = 1 and lanes per CTA divisible by {CG}; got "
                         f"overlap_dx = {overlap_dx}, threads = {threads}, ctas_per_sm = {ctas_per_sm}, "
                         f"lane_group = {LG}")
    if joined and not (add_dx and CG == 2 and LG == n and n == 4 and stage_dx):
        raise ValueError(f"pre backward (lanes): joined needs add_dx, stage_dx and two consumer warpgroups of all n "
                         f"lanes (n = 4); got add_dx = {add_dx}, stage_dx = {stage_dx}, consumer_groups = {CG}, "
                         f"lane_group = {LG}, n = {n}")
    if g_once is None:
        g_once = post_grad and overlap_dx
    if held_terms is None:
        held_terms = "acc" if g_once else "g"
    if held_terms not in HELD_TERMS or (held_terms != "g" and not g_once):
        raise ValueError(f"pre backward (lanes): held_terms is one of {', '.join(HELD_TERMS)}, and other than 'g' "
                         f"it needs g_once; got held_terms = {held_terms!r}, g_once = {g_once}")
    into_acc = held_terms == "acc"  # every term but the products written into the accumulators (g_once, above)
    if g_once and not (post_grad and overlap_dx):
        raise ValueError(f"pre backward (lanes): g_once holds H_res^T g of the post's output gradient g for the "
                         f"overlapped lanes, so it needs post_grad and overlap_dx; got post_grad = {post_grad}, "
                         f"overlap_dx = {overlap_dx}")
    # each consumer warpgroup's lanes (all of them in one group)
    group_lanes = [group[k * (LG // CG) : (k + 1) * (LG // CG)] for k in range(CG)]
    stages = stages or lane_stages(n, LG, BT, BC, add_dx, post_grad, ctas_per_sm, stage_dx, joined)
    CP = coef_width(n)
    smem = lanes_shared_bytes(n, LG, BT, BC, stages, add_dx, post_grad, stage_dx, joined)
    budget = shared_per_cta(ctas_per_sm)
    if smem > budget:
        raise ValueError(f"pre backward (lanes): {LG} lanes x {BC} columns x {BT} tokens in {stages} stages "
                         f"{'with dx_post ' if add_dx else 'with g ' if post_grad else ''}need {smem} bytes of "
                         f"shared memory, more than the {budget} each of {ctas_per_sm} CTA(s) per SM may use; take "
                         f"fewer lanes (lane_group), columns or stages")

    ASYNC = {"wg_wait": -1}  # issue the GEMM without waiting for it (T.wait_wgmma waits)

    @T.macro
    def dx_gemms(a_dx, a_l0, phi_j, acc, annotations, onto_acc=False):
        # hi (phi_hi + phi_lo), then lo phi_hi; with more than one consumer warpgroup (block_tokens 128, 256
        # threads) each takes its own 64 tokens, all 32 columns (m64n32k16); onto_acc: added to what acc holds
        if onto_acc:
            T.gemm(a_dx, phi_j, acc, policy=T.GemmWarpPolicy.FullRow, annotations=annotations)
        elif CG > 1:  # the first product overwrites the accumulator (wgmma's scale-d 0): a T.clear in a
            # warpgroup's branch made ptxas serialise every wgmma (C7518, "WG.DP in divergent path")
            T.gemm(a_dx, phi_j, acc, policy=T.GemmWarpPolicy.FullRow, clear_accum=True, annotations=annotations)
        else:
            T.clear(acc)
            T.gemm(a_dx, phi_j, acc, policy=T.GemmWarpPolicy.FullRow, annotations=annotations)
        if dx_products == 3:
            T.gemm(a_l0, phi_j[0 : KH if trim_lo else K2, 0:BC], acc, policy=T.GemmWarpPolicy.FullRow,
                   annotations=annotations)

    def res_t_terms(v, res_s, tt, j, values):
        # v + sum_i H_res[i, j] values[i], added term by term: one FFMA each (as v + sum(...) the sum began with an
        # FMUL and ended with an FADD); v None: the sum alone
        for i in lanes:
            term = res_s[tt, i, j] * values[i]
            v = term if v is None else v + term
        return v

    @T.macro
    def dx_epilogue(acc, j, x_j, dys, coef_s, dp_j, gs, res_s, dxf, dx_s, dx_tile, gh_j=None):
        for tt, c in T.Parallel(BT, BC):
            if into_acc:  # every other term is in the accumulator
                v = acc[tt, c]
            else:
                v = (acc[tt, c] + coef_s[tt, j] * T.cast(dys[tt, c], "float32")
                     + coef_s[tt, n] * T.cast(x_j[tt, c], "float32"))
            if dp_j is not None:  # the post's gradient of the same lanes, read once
                v = v + T.cast(dp_j[tt, c], "float32")
            if gh_j is not None:  # H_res^T g of this lane, held in registers (g_once)
                v = v + gh_j[tt, c]
            elif gs is not None and not into_acc:  # H_res^T g from the post's output gradient (all lanes here)
                v = res_t_terms(v, res_s, tt, j, [T.cast(gs[i][tt, c], "float32") for i in lanes])
            if joined:  # all lanes' dx in one buffer, for the joined epilogue; never stored
                dx_s[j, tt, c] = T.cast(v, dtype)
            else:
                dxf[tt, c] = T.cast(v, dtype)
        if joined:
            pass  # dx stays in shared memory for the joined epilogue
        elif dx_s is None:
            T.copy(dxf, dx_tile)
        else:  # through shared memory and a TMA store, which writes whole rows
            if T.shuffle_elect(threads):  # this buffer's store from the tile before has read it
                T.tma_store_wait(LG // CG - 1)
            T.copy(dxf, dx_s)
            T.tma_copy(dx_s, dx_tile)

    @T.macro
    def hold_g(g_held, lanes_g, lg, gs, res_s, xs, dy_src, coef_s):
        # g_once: the tile's n lanes of g read once, H_res^T g formed for each of this warpgroup's lanes (with
        # held_terms "acc", on top of H_pre[j] dy + 2 ds x_j, dy read once, into the accumulators given as g_held)
        for tt, c in T.Parallel(BT, BC):
            # bound to names, so each lane of g is read once (a list's items were repeated at every use)
            g0, g1, g2, g3, g4, g5, g6, g7 = [T.cast(gs[i][tt, c], "float32") if i < n else T.float32(0)
                                              for i in range(8)]
            gv = [g0, g1, g2, g3, g4, g5, g6, g7][:n]
            if into_acc:
                dyv = T.cast(dy_src[tt, c], "float32")
                for k, jj in enumerate(lanes_g):
                    j = lg * LG + jj
                    rest = coef_s[tt, j] * dyv + coef_s[tt, n] * T.cast(xs[jj][tt, c], "float32")
                    g_held[k][tt, c] = res_t_terms(rest, res_s, tt, j, gv)
            else:
                for k, jj in enumerate(lanes_g):
                    g_held[k][tt, c] = res_t_terms(None, res_s, tt, lg * LG + jj, gv)

    @T.macro
    def overlapped_lanes(lanes_g, t0, lg, c0, dy_src, dxf, accs, acc_phi, keep, g_held, a_dx, a_l0, a_hl, phi_s, xs,
                         coef_s, dps, gs, res_s, dx_stage, dx):
        # one consumer warpgroup's lanes: each lane's dx GEMMs issued before the previous lane's epilogue, its
        # dphi GEMM after it, none waited for at its issue
        later = 2 if dx_products == 3 else 1  # wgmma groups one lane's dx GEMMs commit
        if into_acc:  # every term but the products in the lanes' accumulators, before any of them is issued
            hold_g([accs[jj] for jj in lanes_g], lanes_g, lg, gs, res_s, xs, dy_src, coef_s)
        dx_gemms(a_dx, a_l0, phi_s[lanes_g[0]], accs[lanes_g[0]], ASYNC, into_acc)
        if g_held is not None:  # while the tensor cores run the first lane's products
            hold_g(g_held, lanes_g, lg, gs, res_s, xs, dy_src, coef_s)
        for i, jj in enumerate(lanes_g):
            if i + 1 < len(lanes_g):
                dx_gemms(a_dx, a_l0, phi_s[lanes_g[i + 1]], accs[lanes_g[i + 1]], ASYNC, into_acc)
                T.wait_wgmma(later)
            else:
                T.wait_wgmma(0)
            T.warpgroup_fence_operand(accs[jj], num_regs=BT * BC // threads)  # one thread's share
            dx_epilogue(accs[jj], lg * LG + jj, xs[jj], dy_src, coef_s, dps[jj], gs, res_s, dxf,
                        dx_stage if joined else dx_stage[jj],
                        dx[t0 : t0 + BT, lg * LG + jj, c0 : c0 + BC], None if g_held is None else g_held[i])
            T.gemm(a_hl, xs[jj], acc_phi[jj], transpose_A=True, annotations=ASYNC)
        T.wait_wgmma(0)
        # the staged operands' last use: after the wait, so the stage is released only then
        gemm_operands = [a_dx, a_hl] + [xs[jj] for jj in lanes_g] + ([a_l0] if dx_products == 3 else [])
        keep[0] = sum([T.cast(b[0, 0], "float32") for b in gemm_operands], T.float32(0))

    @T.macro
    def hold_dy(dy_held, dys):
        # dy_once: the tile's dy read once into registers for all the lanes that use it
        if dy_once:
            for tt, c in T.Parallel(BT, BC):
                dy_held[tt, c] = T.cast(dys[tt, c], "float32")

    @T.macro
    def group_work(k, t0, lg, c0, dys, dy_helds, dxfs, accs, acc_phi, keep, g_helds, operands):
        # consumer group k's share of a tile: its dy held once (dy_once), then its lanes, overlapped
        hold_dy(dy_helds[k], dys)
        overlapped_lanes(group_lanes[k], t0, lg, c0, _present(dy_helds[k], dys)[0], dxfs[k], accs, acc_phi, keep,
                         g_helds[k], *operands)

    @T.macro
    def lanes_tail(lanes_g, lg, c0, s, acc_phi, dphi_partial):
        if stage_dx:
            if T.shuffle_elect(threads):  # the last stores have read their buffers
                T.tma_store_wait(0)
        for jj in lanes_g:
            j = lg * LG + jj
            for k, c in T.Parallel(K2, BC):
                if c0 + c < C:
                    dphi_partial[s, k, j * C + c0 + c] = acc_phi[jj][k, c]

    JOIN_BARRIER = 8  # the named barrier of the two consumer warpgroups (joined)
    NB = -(-C // BC)  # column blocks: coef_partial's second axis (joined)

    @T.macro
    def row_sums(dxs, i, b, frag, red, t0, coef_partial, bc, q):
        # coef_partial[t, bc, q] = sum over the block's columns of dx_i * b (one partial per column block)
        for tt, c in T.Parallel(BT, BC):
            frag[tt, c] = T.cast(dxs[i, tt, c], "float32") * T.cast(b[tt, c], "float32")
        T.reduce_sum(frag, red, dim=1)
        for tt in T.Parallel(BT):
            if t0 + tt < NT:
                coef_partial[t0 + tt, bc, q] = red[tt]

    @T.macro
    def joined_work(k, t0, bc, c0, dx_stage, xps, fps, postp_s, resp_s, frag, out, red, dx_prev, df_prev,
                    coef_partial):
        # consumer group k, after both have staged their lanes' dx tiles: for its own lanes j the previous
        # site's dx_post (H_res_p^T dx) and dH_res_p's row sums (dx_i . x_p,j); the first group also df_p, the
        # second dH_post_p's row sums (dx_i . f_p)
        for jj in group_lanes[k]:
            if "outputs" not in joined_left:
                for tt, c in T.Parallel(BT, BC):
                    out[tt, c] = T.cast(sum([resp_s[tt, i, jj] * T.cast(dx_stage[i, tt, c], "float32")
                                             for i in lanes]), dtype)
                T.copy(out, dx_prev[t0 : t0 + BT, jj, c0 : c0 + BC])
            if "row_sums" not in joined_left:
                for i in lanes:
                    row_sums(dx_stage, i, xps[jj], frag, red, t0, coef_partial, bc, i * n + jj)
        if k == 0:
            if "outputs" not in joined_left:
                for tt, c in T.Parallel(BT, BC):
                    out[tt, c] = T.cast(sum([postp_s[tt, i] * T.cast(dx_stage[i, tt, c], "float32")
                                             for i in lanes]), dtype)
                T.copy(out, df_prev[t0 : t0 + BT, c0 : c0 + BC])
        elif "row_sums" not in joined_left:
            for i in lanes:
                row_sums(dx_stage, i, fps, frag, red, t0, coef_partial, bc, n * n + i)

    @T.macro
    def body(x, dy, dsplit, coef, phi, dx_post, g, res, dx, dphi_partial, x_prev, f_prev, post_prev, res_prev,
             df_prev, coef_partial):
        with T.Kernel(T.ceildiv(C, BC), n // LG, S, threads=threads * CG) as (bc, lg, s):
            if ctas_per_sm > 1:  # registers for that many CTAs: no warpgroup register reallocation
                T.annotate_min_blocks_per_sm(ctas_per_sm)
                T.no_set_max_nreg()
            phi_s = [T.alloc_shared((K2, BC), "bfloat16") for _ in group]  # [phi_hi; phi_lo]
            a_dx = T.alloc_shared((BT, K2), "bfloat16")  # [dmix_hi | dmix_hi]
            a_l0 = T.alloc_shared((BT, KH if trim_lo else K2), "bfloat16")  # [dmix_lo | 0]
            a_hl = T.alloc_shared((BT, K2), "bfloat16")  # [dmix_hi | dmix_lo]
            xs = [T.alloc_shared((BT, BC), dtype) for _ in group]
            dys = T.alloc_shared((BT, BC), dtype)
            coef_s = T.alloc_shared((BT, CP), "float32")  # H_pre per lane, then 2 ds
            acc = T.alloc_fragment((BT, BC), "float32")
            accs = [acc] + [T.alloc_fragment((BT, BC), "float32") for _ in (group[1:] if overlap_dx else ())]
            # with two consumer warpgroups each has its own dx and held dy fragments: a fragment is bound to the
            # threads that first use it, and one shared by both branches lost the second warpgroup's work
            dxfs = [T.alloc_fragment((BT, BC), dtype) for _ in range(CG)]
            # the post's dx tiles, one per lane (None without add_dx)
            dps = [T.alloc_shared((BT, BC), dtype) if dx_post is not None else None for _ in group]
            gs = [T.alloc_shared((BT, BC), dtype) for _ in lanes] if g is not None else None
            res_s = T.alloc_shared((BT, n, n), "float32") if g is not None else None
            acc_phi = [T.alloc_fragment((K2, BC), "float32") for _ in group]
            keep = T.alloc_local((1,), "float32") if overlap_dx else None
            dx_stage = (T.alloc_shared((LG, BT, BC), dtype) if joined  # all lanes' dx, for the joined epilogue
                        else [T.alloc_shared((BT, BC), dtype) if stage_dx else None for _ in group])
            # dy_once: the tile's dy read once into registers for all its lanes (the epilogue's dy is
            # _present(dy_held, dys)[0]: dy_held where it exists, else the shared tile)
            dy_helds = [T.alloc_fragment((BT, BC), "float32") if dy_once else None for _ in range(CG)]
            # g_once: each consumer warpgroup's H_res^T g, one float32 fragment per lane of its own
            g_helds = [[T.alloc_fragment((BT, BC), "float32") for _ in group_lanes[k]]
                       if g_once and not into_acc else None for k in range(CG)]
            if joined:  # the previous site's lanes, f and coefficients; each group's products, outputs and sums
                xps = [T.alloc_shared((BT, BC), dtype) for _ in lanes]
                fps = T.alloc_shared((BT, BC), dtype)
                postp_s = T.alloc_shared((BT, n), "float32")
                resp_s = T.alloc_shared((BT, n, n), "float32")
                jfrags = [T.alloc_fragment((BT, BC), "float32") for _ in range(CG)]
                jouts = [T.alloc_fragment((BT, BC), dtype) for _ in range(CG)]
                jreds = [T.alloc_fragment((BT,), "float32") for _ in range(CG)]
            tx = T.get_thread_binding()  # the consumer warpgroup: tx < 128 is the first (consumer numbering)
            if swizzle_epilogue:  # the epilogue's tiles that no GEMM reads, in the GEMM tiles' swizzle
                T.annotate_layout({b: make_swizzled_layout(b) for b in _present(dys, gs, dps)})
            c0 = bc * BC
            tiles = T.ceildiv(T.ceildiv(NT, BT), S)
            for jj in group:
                # this CTA's columns of phi, split into bf16 hi (rows 0..KH) and lo (rows KH..2KH) once
                j = lg * LG + jj
                for k, c in T.Parallel(K2, BC):
                    q = k % KH
                    v = T.if_then_else((q < M) & (c0 + c < C), phi[q % M, j * C + T.min(c0 + c, C - 1)],
                                       T.float32(0))
                    hi = T.cast(v, "bfloat16")
                    lo = T.cast(v - T.cast(hi, "float32"), "bfloat16")
                    phi_s[jj][k, c] = T.if_then_else(k < KH, hi, lo)
                if CG == 1:
                    T.clear(acc_phi[jj])
            if CG > 1:
                if tx < 128:
                    for jj in group_lanes[0]:
                        T.clear(acc_phi[jj])
                else:
                    for jj in group_lanes[1]:
                        T.clear(acc_phi[jj])
            for tb in T.Pipelined(tiles, num_stages=stages):
                t0 = (s * tiles + tb) * BT
                # operands arrive by copies only (zero-filled past the last token), so the pipeline may
                # prefetch the next tile while this one computes
                if "dmix_loads" not in left:
                    T.copy(dsplit[t0 : t0 + BT, 0, 0:K2], a_dx)
                    if dx_products == 3:
                        T.copy(dsplit[t0 : t0 + BT, 1, 0 : KH if trim_lo else K2], a_l0)
                    T.copy(dsplit[t0 : t0 + BT, 2, 0:K2], a_hl)
                T.copy(coef[t0 : t0 + BT, 0:CP], coef_s)
                for jj in group:
                    T.copy(x[t0 : t0 + BT, lg * LG + jj, c0 : c0 + BC], xs[jj])
                    if dx_post is not None:
                        T.copy(dx_post[t0 : t0 + BT, lg * LG + jj, c0 : c0 + BC], dps[jj])
                if gs is not None:
                    for i in lanes:
                        T.copy(g[t0 : t0 + BT, i, c0 : c0 + BC], gs[i])
                    T.copy(res[t0 : t0 + BT, 0:n, 0:n], res_s)
                T.copy(dy[t0 : t0 + BT, c0 : c0 + BC], dys)
                if joined:
                    for i in lanes:
                        T.copy(x_prev[t0 : t0 + BT, i, c0 : c0 + BC], xps[i])
                    T.copy(f_prev[t0 : t0 + BT, c0 : c0 + BC], fps)
                    T.copy(post_prev[t0 : t0 + BT, 0:n], postp_s)
                    T.copy(res_prev[t0 : t0 + BT, 0:n, 0:n], resp_s)
                operands = (a_dx, a_l0, a_hl, phi_s, xs, coef_s, dps, gs, res_s, dx_stage, dx)
                if CG > 1:  # each consumer warpgroup its own lanes, held dy and dx fragments
                    if tx < 128:
                        group_work(0, t0, lg, c0, dys, dy_helds, dxfs, accs, acc_phi, keep, g_helds, operands)
                    else:
                        group_work(1, t0, lg, c0, dys, dy_helds, dxfs, accs, acc_phi, keep, g_helds, operands)
                    if joined:  # both groups' dx tiles staged, then each takes its share; a second barrier keeps
                        # the next tile's writes of the dx buffer after these reads
                        T.sync_threads(JOIN_BARRIER, 2 * threads)
                        joined_operands = (dx_stage, xps, fps, postp_s, resp_s)
                        if tx < 128:
                            joined_work(0, t0, bc, c0, *joined_operands, jfrags[0], jouts[0], jreds[0], dx, df_prev,
                                        coef_partial)
                        else:
                            joined_work(1, t0, bc, c0, *joined_operands, jfrags[1], jouts[1], jreds[1], dx, df_prev,
                                        coef_partial)
                        if "second_barrier" not in joined_left:
                            T.sync_threads(JOIN_BARRIER, 2 * threads)
                elif overlap_dx:
                    group_work(0, t0, lg, c0, dys, dy_helds, dxfs, accs, acc_phi, keep, g_helds, operands)
                else:
                    hold_dy(dy_helds[0], dys)
                    for jj in group:
                        if "dx_gemm" in left:
                            T.clear(accs[0])
                        else:
                            dx_gemms(a_dx, a_l0, phi_s[jj], accs[0], None)
                        dx_epilogue(accs[0], lg * LG + jj, xs[jj], _present(dy_helds[0], dys)[0], coef_s, dps[jj],
                                    gs, res_s, dxfs[0], dx_stage[jj], dx[t0 : t0 + BT, lg * LG + jj, c0 : c0 + BC])
                        if "dphi" not in left:
                            T.gemm(a_hl, xs[jj], acc_phi[jj], transpose_A=True)
            if CG > 1:
                if tx < 128:
                    lanes_tail(group_lanes[0], lg, c0, s, acc_phi, dphi_partial)
                else:
                    lanes_tail(group_lanes[1], lg, c0, s, acc_phi, dphi_partial)
            else:
                lanes_tail(group, lg, c0, s, acc_phi, dphi_partial)

    if joined:

        @T.prim_func
        def lanes_backward_cuda_joined(
            x: T.Tensor((NT, n, C), dtype), dy: T.Tensor((NT, C), dtype), dsplit: T.Tensor((NT, 3, K2), "bfloat16"),
            coef: T.Tensor((NT, CP), "float32"), phi: T.Tensor((M, K), "float32"),
            dx_post: T.Tensor((NT, n, C), dtype), x_prev: T.Tensor((NT, n, C), dtype), f_prev: T.Tensor((NT, C), dtype),
            post_prev: T.Tensor((NT, n), "float32"), res_prev: T.Tensor((NT, n, n), "float32"),
            dx_prev: T.Tensor((NT, n, C), dtype), df_prev: T.Tensor((NT, C), dtype),
            dphi_partial: T.Tensor((S, K2, K), "float32"), coef_partial: T.Tensor((NT, NB, n * n + n), "float32"),
        ):
            body(x, dy, dsplit, coef, phi, dx_post, None, None, dx_prev, dphi_partial, x_prev, f_prev, post_prev,
                 res_prev, df_prev, coef_partial)

        return lanes_backward_cuda_joined

    if add_dx:

        @T.prim_func
        def lanes_backward_cuda_add(
            x: T.Tensor((NT, n, C), dtype), dy: T.Tensor((NT, C), dtype), dsplit: T.Tensor((NT, 3, K2), "bfloat16"),
            coef: T.Tensor((NT, CP), "float32"), phi: T.Tensor((M, K), "float32"),
            dx_post: T.Tensor((NT, n, C), dtype),
            dx: T.Tensor((NT, n, C), dtype), dphi_partial: T.Tensor((S, K2, K), "float32"),
        ):
            body(x, dy, dsplit, coef, phi, dx_post, None, None, dx, dphi_partial, None, None, None, None, None, None)

        return lanes_backward_cuda_add

    if post_grad:

        @T.prim_func
        def lanes_backward_cuda_post_grad(
            x: T.Tensor((NT, n, C), dtype), dy: T.Tensor((NT, C), dtype), dsplit: T.Tensor((NT, 3, K2), "bfloat16"),
            coef: T.Tensor((NT, CP), "float32"), phi: T.Tensor((M, K), "float32"),
            g: T.Tensor((NT, n, C), dtype), res: T.Tensor((NT, n, n), "float32"),
            dx: T.Tensor((NT, n, C), dtype), dphi_partial: T.Tensor((S, K2, K), "float32"),
        ):
            body(x, dy, dsplit, coef, phi, None, g, res, dx, dphi_partial, None, None, None, None, None, None)

        return lanes_backward_cuda_post_grad

    @T.prim_func
    def lanes_backward_cuda(
        x: T.Tensor((NT, n, C), dtype), dy: T.Tensor((NT, C), dtype), dsplit: T.Tensor((NT, 3, K2), "bfloat16"),
        coef: T.Tensor((NT, CP), "float32"), phi: T.Tensor((M, K), "float32"),
        dx: T.Tensor((NT, n, C), dtype), dphi_partial: T.Tensor((S, K2, K), "float32"),
    ):
        body(x, dy, dsplit, coef, phi, None, None, None, dx, dphi_partial, None, None, None, None, None, None)

    return lanes_backward_cuda


def lane_tiling(n: int, add_dx: bool = False, post_grad: bool = False, ctas_per_sm: int = 1,
                block_tokens: int = 64, consumer_groups: int | None = None) -> tuple[int, int, int]:
    """(lanes per CTA, columns per CTA, consumer warpgroups) of kernel 2 on CUDA. On the H200 at n = 4
    (2026-11-30):
    - without dx_post, 2 lanes per consumer warpgroup (1 for odd n) and the most columns (64 or 32) whose dphi
      accumulators, 2 lanes x 2 gemm_depth(n) x columns float32, stay within 128 registers per thread of a
      warpgroup. Two warpgroups of 2 lanes each (4 lanes per CTA, where n has them and their two stages fit)
      beat one of 2: 0.212 / 0.321 / 0.358 ms against 0.263 / 0.386 / 0.377 at C = 2560 / 4096 / 7168 (run AV;
      two warpgroups of one lane each were slower, 0.274 / 0.404 / 0.412). One warpgroup of 2 lanes had beaten
      one of 4, 0.513 against 0.548 ms at 16384 x 4096;
    - with dx_post, 32 columns, which beat 64 (in 3 stages against 2: 0.481 / 0.673 / 0.621 against 0.514 /
      0.723 / 0.668 ms at C = 2560 / 4096 / 7168; more CTAs, a deeper pipeline in the same shared memory), and
      the most lanes up to 4 that divide n and fit two stages: with overlap_dx, whose overlap grows with the
      lanes, 4 lanes beat 2, 0.446 / 0.631 / 0.610 against 0.470 / 0.654 / 0.611 ms (run AK). At n = 8 two
      stages of 4 lanes do not fit, and it takes 2; where no lanes fit two stages of block_tokens tokens (n = 8
      with 128-token tiles), the most lanes that fit one. Four lanes go to two warpgroups of 2
      (consumer_groups_for): 0.296 / 0.435 / 0.441 ms against one warpgroup's 0.350 / 0.498 / 0.473 (run AV).
      Without dx_post too, fewer lanes where one stage of two does not fit (n = 8 with two CTAs per SM).
    With post_grad every lane (each lane's dx takes all n lanes of g), 32 columns (16 past n = 4, to fit), and
    two warpgroups at n = 4 (consumer_groups_for).
    With ctas_per_sm CTAs per SM, the lanes whose two stages fit each one's share of the SM, one warpgroup.
    consumer_groups: None for the default above, or the warpgroups asked for (1 or 2)."""
    if post_grad:
        return n, 32 if n <= 4 else 16, consumer_groups or consumer_groups_for(n, ctas_per_sm=ctas_per_sm,
                                                                              block_tokens=block_tokens)
    budget = shared_per_cta(ctas_per_sm)
    if add_dx:
        for stages in (2, 1):
            for lanes in (4, 2, 1):
                if n % lanes == 0 and lanes_shared_bytes(n, lanes, block_tokens, 32, stages, True) <= budget:
                    return lanes, 32, consumer_groups or consumer_groups_for(lanes, ctas_per_sm=ctas_per_sm,
                                                                                   block_tokens=block_tokens)
    per_group = 2 if n % 2 == 0 else 1
    columns = 32 if per_group * 2 * gemm_depth(n) * 64 > 128 * 128 else 64
    if (consumer_groups != 1 and n % (2 * per_group) == 0
            and consumer_groups_for(2 * per_group, ctas_per_sm=ctas_per_sm, block_tokens=block_tokens) == 2
            and lanes_shared_bytes(n, 2 * per_group, block_tokens, columns, 2, False) <= budget):
        return 2 * per_group, columns, 2
    lanes = per_group
    while lanes > 1 and lanes_shared_bytes(n, lanes, block_tokens, columns, 1, False) > budget:
        lanes //= 2
    return lanes, columns, consumer_groups or 1


def consumer_groups_for(lanes: int, *, ctas_per_sm: int = 1, block_tokens: int = 64) -> int:
    """Kernel 2's consumer warpgroups by default for a CTA of `lanes` lanes: two of two lanes each where it has
    four, with one CTA per SM and 64-token tiles (the measured cases, lane_tiling); else one. With post_grad
    (four lanes at n = 4) two took 0.381 / 0.555 / 0.536 ms against one's 0.509 / 0.760 / 0.672 at C = 2560 /
    4096 / 7168 (run AZ, H200, 2026-11-30, the same bits)."""
    return 2 if lanes == 4 and ctas_per_sm == 1 and block_tokens == 64 else 1


def consumer_groups_asked(consumer_groups: int | None = None, threads: int = 128, overlap_dx: bool | None = None,
                          leave_out: tuple = ()) -> int | None:
    """The consumer warpgroups a tuning asks for: its own, else 1 where the tuning rules two out (threads other
    than 128, overlap_dx off, leave_out), else None (lane_tiling's default)."""
    if consumer_groups is None and (threads != 128 or overlap_dx is False or leave_out):
        return 1
    return consumer_groups


def lane_stages(n: int, lanes: int, block_tokens: int, block_c: int, add_dx: bool, post_grad: bool = False,
                ctas_per_sm: int = 1, stage_dx: bool = True, joined: bool = False) -> int:
    """Kernel 2's pipeline depth on CUDA: the most stages whose tiles fit in shared memory (each CTA's share
    when ctas_per_sm must fit on an SM), up to 3 with dx_post or g and 2 without (lane_tiling's measurements;
    n = 8 with dx_post fits 2)."""
    for stages in range(3 if add_dx or post_grad else 2, 1, -1):
        if (lanes_shared_bytes(n, lanes, block_tokens, block_c, stages, add_dx, post_grad, stage_dx, joined)
                <= shared_per_cta(ctas_per_sm)):
            return stages
    return 1


def lanes_shared_bytes(n: int, lanes: int, block_tokens: int, block_c: int, stages: int, add_dx: bool,
                       post_grad: bool = False, stage_dx: bool = True, joined: bool = False) -> int:
    """Shared memory of kernel 2 on CUDA, at most: phi's columns, (stage_dx) each lane's dx tile on its way
    out; per stage the three dmix operands, the coefficients, the lanes' x tiles, the dy tile and (add_dx) the
    lanes' dx_post tiles or (post_grad) the n lanes' g tiles and the tokens' H_res; (joined) per stage the
    previous site's lanes, f, H_post and H_res, and the dx tiles once per stage."""
    k2 = 2 * gemm_depth(n)
    tile = block_tokens * block_c * 2
    staged = 3 * block_tokens * k2 * 2 + block_tokens * coef_width(n) * 4 + (lanes * (2 if add_dx else 1) + 1) * tile
    if post_grad:
        staged += n * tile + block_tokens * n * n * 4
    if joined:
        staged += (n + 1) * tile + block_tokens * (n * n + n) * 4
    # the lanes' dx tiles on their way out; joined: kept for the joined epilogue, a copy per stage
    staged_dx = lanes * tile * (stages if joined else 1) if stage_dx else 0
    return lanes * k2 * block_c * 2 + staged_dx + stages * staged


def lane_splits_for(n: int, C: int, sms: int, *, add_dx: bool = False, post_grad: bool = False,
                    lane_group: int | None = None, block_c: int | None = None, ctas_per_sm: int = 1,
                    block_tokens: int = 64, consumer_groups: int | None = None, least_efficiency: float = 0.9,
                    most: int = 32) -> int:
    """Token splits S of kernel 2 on CUDA for a GPU with `sms` SMs. Its shared memory holds one CTA per SM,
    so its (column blocks x S) CTAs run in waves of `sms`; the last wave's empty SMs are lost time (at
    16384 x 2560 on the H200, 40 column blocks x 4 splits = 160 CTAs took 0.60 ms, more than 64 x 4 = 256
    CTAs at C = 4096 took). The smallest S whose waves are at least `least_efficiency` full, else the fullest
    (each split adds a dphi partial of 2 gemm_depth(n) x nC floats to write and sum). lane_group, block_c,
    ctas_per_sm, block_tokens and consumer_groups (consumer_groups_asked) as the kernel takes them (default
    lane_tiling's; with ctas_per_sm CTAs per SM, waves of ctas_per_sm x sms)."""
    default_lanes, default_columns, _ = lane_tiling(n, add_dx, post_grad, ctas_per_sm, block_tokens, consumer_groups)
    lanes, columns = lane_group or default_lanes, block_c or default_columns
    sms = sms * ctas_per_sm
    blocks = -(-C // columns) * (n // lanes)

    def fullness(splits: int) -> float:
        ctas = blocks * splits
        return ctas / (sms * -(-ctas // sms))

    candidates = range(1, most + 1)
    good = [s for s in candidates if fullness(s) >= least_efficiency]
    return good[0] if good else max(candidates, key=lambda s: (fullness(s), -s))


def dphi_partial_shape(splits: int, n: int, C: int) -> tuple[int, int, int]:
    """The shape of kernel 2's CUDA dphi output: one row block per token split, the dmix_hi and dmix_lo parts
    (each padded to gemm_depth(n) rows), nC columns (dphi_from_partial sums it)."""
    return splits, 2 * gemm_depth(n), n * C


def dphi_from_partial(partial, n: int):
    """dphi [n^2+2n, nC] from kernel 2's CUDA output [splits, 2 gemm_depth(n), nC] (rows: the dmix_hi part,
    then the dmix_lo part, each padded): sum over splits and halves, in a fixed order, in one reduction that
    reads only the rows that are not padding (summing the splits first, then adding the halves, took two
    kernels and read and wrote the whole partial once more)."""
    M, KH = mixes_width(n), gemm_depth(n)
    return partial.unflatten(1, (2, KH))[:, :, :M].sum((0, 1))


def two_phase_coefficients(n: int, C: int, dtype: str, target: str, *, splits: int, phases: str,
                           spread: dict | None = None):
    """Kernel 1 as two compiled kernels (phases "split" or "spread"): dpre_program's streaming dH_pre, then
    the per-token part. Returns a function with the fused kernel 1's arguments (on CUDA it also takes pre,
    before dpre, and writes kernel 2's operands), the two kernels as its ``reduce`` and ``tokens``."""
    t = canonical_target(target)
    reduce = compile_program(dpre_program(n, C, dtype, t), t)
    tokens = compile_program(pre_backward_coefficients_program(n, C, dtype, t, splits=splits, phases=phases,
                                                               spread=spread), t)
    if t == "c":
        def coefficients(x, dy, partial, bias, alpha, dpost, dres, dpre, *outputs):
            reduce(x, dy, dpre)
            tokens(partial, bias, alpha, dpost, dres, dpre, *outputs)
    else:
        def coefficients(x, dy, partial, bias, alpha, dpost, dres, pre, dpre, *outputs):
            reduce(x, dy, dpre)
            tokens(partial, bias, alpha, dpost, dres, pre, dpre, *outputs)
    coefficients.reduce, coefficients.tokens = reduce, tokens
    return coefficients


@functools.lru_cache(maxsize=None)
def pre_backward_kernels(n: int, C: int, dtype: str = "bfloat16", target: str = "cuda", *, splits: int = 1,
                         add_dx: bool = False, post_grad: bool = False, lane_splits: int = 1, phases: str = "fused",
                         joined: bool = False, **lane_tuning):
    """(coefficients, lanes) compiled kernels (cached per process). ``splits``: the forward partial's splits;
    ``lane_splits``: kernel 2's token splits (the first axis of dphi_partial); ``phases``: kernel 1 as one
    kernel or as two (CUDA; the returned ``coefficients`` takes the same arguments either way);
    ``lane_tuning``: kernel 2's CUDA tuning, keywords of pre_backward_lanes_program (the C target has none);
    ``joined``: ``lanes`` is the joined kernel (kernel 2 with dx_post and the previous site's post backward,
    kernels/joined_backward.py)."""
    t = canonical_target(target)
    if phases in ("split", "spread"):
        coefficients = two_phase_coefficients(n, C, dtype, t, splits=splits, phases=phases)
    else:
        coefficients = compile_program(pre_backward_coefficients_program(n, C, dtype, t, splits=splits), t)
    if joined and t == "c":
        from mhc_lab.kernels.joined_backward import joined_backward_kernel

        return coefficients, joined_backward_kernel(n, C, dtype, t)
    lanes_kw = {} if t == "c" else {"splits": lane_splits, **lane_tuning}
    lanes = compile_program(pre_backward_lanes_program(n, C, dtype, t, add_dx=add_dx, post_grad=post_grad,
                                                       joined=joined, **lanes_kw), t)
    return coefficients, lanes
