# pre, split plan: the coefficients and the layer input of one mHC site in two passes over the lanes.
#
#   pass 1 (project): partial[s, t, :] = x[t, K_s] . [phi_hi; phi_lo][:, K_s]^T  and  sum(x[t, K_s]^2)
#   pass 2 (apply):   mixes = sum_s partial[s]; r = rsqrt(sum(x^2)/(nC) + eps); H_pre, H_post, Sinkhorn(H_res);
#                     y[t, c] = sum_j H_pre[t, j] x[t, j, c]
#
# Bytes per token (bf16 lanes, n = 4): pass 1 reads nC elements (8C bytes) and writes splits * (n^2+2n+1)
# float32 partials; pass 2 reads the partials and the nC lanes again (8C bytes), writes C (2C bytes) and
# 4(n^2 + 2n) bytes of coefficients. Together 18C bytes + partials against the 10C a pre must move: the second
# read of x is the price of not holding a token's whole nC row on chip while its H_pre is unknown.
# phi (n^2+2n rows of nC float32, 1.5 MB at C = 4096) is read from L2 by every token tile: 384 C / block_m
# bytes per token (1.5C at block_m = 256).
# FLOPs per token: 2 (2 (n^2+2n)) nC for the split-precision projection (tensor cores), ~1.5k for Sinkhorn.
# Fuses: the squared norm into the projection pass; the norm (applied after the matmul, arXiv 2512.24880
# Eqs. 14-16), the sigmoids, the 20 Sinkhorn rounds and H_pre x into the apply pass.
#
# Precision: the bf16 tensor cores multiply x (exact in bf16) by phi split as phi = hi + lo, both bf16, so the
# products carry ~16 bits of phi's mantissa (float32 keeps 24, tf32 10) and accumulate in float32.
# This plan serves every n on CUDA and is the default ('auto'): on an H200 (2026-11-29) at 16384 x 4096 the
# projection pass takes 0.196 ms (2.7 TB/s, 64% of the copy bandwidth), the apply pass 0.198 ms (3.4 TB/s,
# 79%), the phi split 5 us. The projection pass reads x in TMA boxes whose rows are 128 bytes long (the 128-byte
# swizzle's limit); longer-row tilings (128x256, 64x256, 128x128 tokens x columns) timed the same.
# The apply pass runs as two kernels by default (apply_phases="split": coefficients with one thread per token,
# then a post-shaped lane mix; SPLIT_DEFAULTS in pre_cuda.py has the timings). In a stack of sites the
# projection pass is not needed at all: the previous site's post projects the lanes it writes
# (kernels/post_project.py).
"""pre, split plan (CUDA): a phi split kernel, a projection pass and an apply pass."""


import functools

import tilelang.language as T

from mhc_lab.kernels._coefficients import (
    TOKEN_THREADS,
    coefficient_macro,
    mixes_width,
    partial_sum_macro,
    spread_coefficient_macros,
    spread_fits,
    spread_layout,
    store_coefficients_macro,
)
from mhc_lab.kernels._target import (
    NO_WARP_SPECIALIZATION,
    canonical_target,
    ceil_div,
    check_lanes_and_width,
    check_target_dtype,
    compile_program,
    round_up,
)


def phi_rows(n: int) -> int:
    """Rows of the split phi: hi (n^2+2n), lo (n^2+2n), zero padding up to a multiple of 16."""
    return round_up(2 * mixes_width(n), 16)


def phi_tile_rows(n: int) -> int:
    """Rows of a shared phi tile: phi's hi and lo rows padded to whole 64-row tiles, phi being the A operand of
    the tensor cores' m64nNk16 products (the rows past phi_rows are never loaded, and the product rows they
    give never read). With x as A and phi's 48 rows (n = 4) as the N side, TileLang issued m64n8k16, three
    times as many instructions as m64n32k16 with phi as A."""
    return round_up(phi_rows(n), 64)


def _check_gpu(n, C, dtype, target):
    t = canonical_target(target)
    if t == "c":
        raise ValueError("pre split plan: CUDA only; the C target uses pre.pre_program (target='c')")
    if dtype != "bfloat16":
        raise ValueError(f"pre split plan: expected dtype 'bfloat16' lanes on CUDA, got {dtype!r}")
    check_lanes_and_width("pre split plan", n, C, max_lanes=8)
    return t


def phi_split_program(n: int, C: int, target: str = "cuda"):
    """phi [n^2+2n, nC] float32 -> phi_hl [phi_rows(n), nC] bfloat16: hi rows, lo rows, zero rows."""
    _check_gpu(n, C, "bfloat16", target)
    M, K, NP = mixes_width(n), n * C, phi_rows(n)
    BK = 256

    @T.prim_func
    def phi_split(phi: T.Tensor((M, K), "float32"), phi_hl: T.Tensor((NP, K), "bfloat16")):
        with T.Kernel(T.ceildiv(K, BK), threads=256) as bk:
            for m, k in T.Parallel(NP, BK):
                kk = bk * BK + k
                if kk < K:
                    if m < M:
                        phi_hl[m, kk] = T.cast(phi[m, kk], "bfloat16")
                    elif m < 2 * M:
                        v = phi[m - M, kk]
                        phi_hl[m, kk] = T.cast(v - T.cast(T.cast(v, "bfloat16"), "float32"), "bfloat16")
                    else:
                        phi_hl[m, kk] = T.cast(0, "bfloat16")

    return phi_split


def project_program(n: int, C: int, dtype: str = "bfloat16", target: str = "cuda", *,
                    block_m: int = 256, block_k: int = 64, splits: int = 4, stages: int = 3, threads: int = 256):
    """Pass 1: partial [splits, T, n^2+2n+1] float32 from x_flat [T, nC] and phi_hl [phi_rows, nC]."""
    _check_gpu(n, C, dtype, target)
    M, K, NP, NA = mixes_width(n), n * C, phi_rows(n), phi_tile_rows(n)
    BM, BK, S = block_m, block_k, splits
    KS = round_up(ceil_div(K, S), BK)  # K per split, whole chunks
    NK = KS // BK
    NT = T.dynamic("T")

    @T.prim_func
    def project(
        x: T.Tensor((NT, K), dtype),
        phi_hl: T.Tensor((NP, K), "bfloat16"),
        partial: T.Tensor((S, NT, M + 1), "float32"),
    ):
        with T.Kernel(T.ceildiv(NT, BM), S, threads=threads) as (bm, s):
            xs = T.alloc_shared((BM, BK), dtype)
            ps = T.alloc_shared((NA, BK), "bfloat16")
            acc = T.alloc_fragment((NA, BM), "float32")  # phi's rows x tokens (phi_tile_rows)
            xf = T.alloc_fragment((BM, BK), dtype)
            sq_acc = T.alloc_fragment((BM, BK), "float32")
            sq = T.alloc_fragment((BM,), "float32")
            out_s = T.alloc_shared((NA, BM), "float32")
            T.clear(acc)
            T.clear(sq_acc)
            for kk in T.Pipelined(NK, num_stages=stages):
                k0 = s * KS + kk * BK
                T.copy(x[bm * BM : bm * BM + BM, k0 : k0 + BK], xs)
                T.copy(phi_hl[0:NP, k0 : k0 + BK], ps[0:NP, 0:BK])
                T.gemm(ps, xs, acc, transpose_B=True)
                T.copy(xs, xf)
                for i, k in T.Parallel(BM, BK):
                    v = T.cast(xf[i, k], "float32")
                    sq_acc[i, k] += v * v
            T.reduce_sum(sq_acc, sq, dim=1)
            T.copy(acc, out_s)
            for i, m in T.Parallel(BM, M + 1):
                tok = bm * BM + i
                if tok < NT:
                    if m < M:
                        partial[s, tok, m] = out_s[m, i] + out_s[M + m, i]
            for i in T.Parallel(BM):
                tok = bm * BM + i
                if tok < NT:
                    partial[s, tok, M] = sq[i]

    return project


def apply_program(n: int, C: int, dtype: str = "bfloat16", target: str = "cuda", *, splits: int = 4,
                  block_tokens: int = 16, block_c: int = 256, threads: int = 256, stages: int = 2,
                  iterations: int = 20):
    """Pass 2: coefficients from the partials (one thread per token), then y = H_pre x over the lanes,
    streamed through shared memory in [block_tokens x block_c] tiles of every lane."""
    _check_gpu(n, C, dtype, target)
    M = mixes_width(n)
    S, BT, BC = splits, block_tokens, min(block_c, round_up(C, 64))
    NC = ceil_div(C, BC)
    NT = T.dynamic("T")
    lanes = list(range(n))
    coefficients = coefficient_macro(n, C, iterations=iterations)
    gather = partial_sum_macro(n, S)
    store = store_coefficients_macro(n)

    @T.prim_func
    def apply(
        x: T.Tensor((NT, n, C), dtype),
        partial: T.Tensor((S, NT, M + 1), "float32"),
        bias: T.Tensor((M,), "float32"),
        alpha: T.Tensor((3,), "float32"),
        y: T.Tensor((NT, C), dtype),
        pre_out: T.Tensor((NT, n), "float32"),
        post_out: T.Tensor((NT, n), "float32"),
        res_out: T.Tensor((NT, n, n), "float32"),
    ):
        with T.Kernel(T.ceildiv(NT, BT), threads=threads) as b:
            mix = T.alloc_local((M + 1,), "float32")
            pre_l = T.alloc_local((n,), "float32")
            post_l = T.alloc_local((n,), "float32")
            comb = T.alloc_local((n * n,), "float32")
            pre_s = T.alloc_shared((BT, n), "float32")
            xs = [T.alloc_shared((BT, BC), dtype) for _ in lanes]
            yf = T.alloc_fragment((BT, BC), dtype)
            t0 = b * BT
            tx = T.get_thread_binding()
            if tx < BT:
                tok = t0 + tx
                if tok < NT:
                    gather(partial, tok, mix)
                    coefficients(mix, alpha, bias, pre_l, post_l, comb)
                    store(tok, pre_l, post_l, comb, pre_out, post_out, res_out)
                    for i in T.unroll(n):
                        pre_s[tx, i] = pre_l[i]
                else:
                    for i in T.unroll(n):
                        pre_s[tx, i] = T.float32(0)
            T.sync_threads()
            for cb in T.Pipelined(NC, num_stages=stages):
                c0 = cb * BC
                for j in lanes:
                    T.copy(x[t0 : t0 + BT, j, c0 : c0 + BC], xs[j])
                for tt, c in T.Parallel(BT, BC):
                    yf[tt, c] = T.cast(sum([pre_s[tt, j] * T.cast(xs[j][tt, c], "float32") for j in lanes]), dtype)
                T.copy(yf, y[t0 : t0 + BT, c0 : c0 + BC])

    return apply


def coefficients_program(n: int, C: int, target: str = "cuda", *, splits: int = 4, iterations: int = 20,
                         spread: bool | None = None):
    """The apply pass's first half as a kernel of its own (apply_phases='split'): one thread per token (a loop
    on the C target) sums the partials and writes H_pre, H_post and H_res; on CUDA every token's math runs at
    once instead of on 16 threads of a CTA that then streams. Arguments partial [S, T, n^2+2n+1], bias, alpha,
    then pre, post, res (f32).

    spread (CUDA; None: when n is a power of two): each token over n R threads of a warp instead of one
    thread, its line sums by warp shuffles (``spread_coefficient_macros``): one thread per token ran 4 warps
    per SM at 16384 tokens, each a long dependent chain, and spread there are n R times as many warps."""
    check_lanes_and_width("pre coefficients", n, C, max_lanes=8)
    t = canonical_target(target)
    M, S = mixes_width(n), splits
    NT = T.dynamic("T")
    if spread is None:
        spread = t != "c" and spread_fits(n)
    if spread and t == "c":
        raise ValueError("pre coefficients: spread=True spreads a token over a warp's threads, CUDA only")
    coefficients = coefficient_macro(n, C, iterations=iterations)
    gather = partial_sum_macro(n, S)
    store = store_coefficients_macro(n)
    threads = 1 if t == "c" else TOKEN_THREADS

    @T.macro
    def one_thread_per_token(partial, bias, alpha, pre_out, post_out, res_out):
        with T.Kernel(T.ceildiv(NT, threads), **({} if t == "c" else {"threads": threads})) as b:
            mix = T.alloc_local((M + 1,), "float32")
            pre_l = T.alloc_local((n,), "float32")
            post_l = T.alloc_local((n,), "float32")
            comb = T.alloc_local((n * n,), "float32")
            tok = b * threads + (0 if t == "c" else T.get_thread_binding())
            if tok < NT:
                gather(partial, tok, mix)
                coefficients(mix, alpha, bias, pre_l, post_l, comb)
                store(tok, pre_l, post_l, comb, pre_out, post_out, res_out)

    body = _spread_tokens_macro(n, C, splits=splits, iterations=iterations) if spread else one_thread_per_token

    @T.prim_func
    def token_coefficients(
        partial: T.Tensor((S, NT, M + 1), "float32"), bias: T.Tensor((M,), "float32"),
        alpha: T.Tensor((3,), "float32"), pre_out: T.Tensor((NT, n), "float32"),
        post_out: T.Tensor((NT, n), "float32"), res_out: T.Tensor((NT, n, n), "float32"),
    ):
        body(partial, bias, alpha, pre_out, post_out, res_out)

    return token_coefficients


def _spread_tokens_macro(n: int, C: int, *, splits: int, iterations: int, threads: int = 128):
    """coefficients_program's body with spread=True, a T.macro of its arguments: T // (threads / (n R)) CTAs."""
    layout = spread_layout(n)
    P, E, M2 = layout.threads, layout.entries, layout.gates
    TPC = threads // P  # tokens per CTA
    spread = spread_coefficient_macros(n, C, splits, iterations=iterations)

    @T.macro
    def spread_tokens(partial, bias, alpha, pre_out, post_out, res_out):
        with T.Kernel(T.ceildiv(pre_out.shape[0], TPC), threads=threads) as b:
            mx, c, _, line, pp, red = spread.scratch()
            tx = T.get_thread_binding()
            g = tx % P
            token = b * TPC + tx // P
            tok = T.min(token, pre_out.shape[0] - 1)  # every thread of a warp runs the shuffles; stores guarded
            spread.coefficients(tok, g, partial, bias, alpha, mx, c, line, pp, red)
            if token < pre_out.shape[0]:
                for e in T.unroll(E):
                    res_out[tok, layout.column(g), layout.row(g, e)] = c[e]  # comb is H_res transposed
                for p in T.unroll(M2):
                    q = layout.gate(g, p)
                    if q < n:
                        pre_out[tok, q] = pp[p]
                    elif q < 2 * n:
                        post_out[tok, q - n] = pp[p]

    return spread_tokens


def mix_program(n: int, C: int, dtype: str = "bfloat16", target: str = "cuda", *, threads: int = 256):
    """The apply pass's second half as a kernel of its own (apply_phases='split'): y = sum_j H_pre[j] x_j. CUDA:
    streamed like the post kernel (a CTA owns [block_tokens x block_c] of every lane, 16-byte vector loads,
    H_pre of its tokens in shared memory); C target: plain loops. Arguments x [T, n, C], pre [T, n] f32, then
    y [T, C]."""
    from mhc_lab.kernels.post import default_tiles

    check_lanes_and_width("pre lane mix", n, C, max_lanes=8)
    t = check_target_dtype("pre lane mix", dtype, target, ("bfloat16",))
    NT = T.dynamic("T")
    lanes = list(range(n))
    if t == "c":

        @T.prim_func
        def mix_lanes_c(x: T.Tensor((NT, n, C), dtype), pre: T.Tensor((NT, n), "float32"),
                        y: T.Tensor((NT, C), dtype)):
            with T.Kernel(NT) as tok:
                for c in T.serial(C):
                    y[tok, c] = T.cast(sum([pre[tok, j] * T.cast(x[tok, j, c], "float32") for j in lanes]), dtype)

        return mix_lanes_c

    BT, BC, _ = default_tiles(C, dtype)

    @T.prim_func
    def mix_lanes(x: T.Tensor((NT, n, C), dtype), pre: T.Tensor((NT, n), "float32"), y: T.Tensor((NT, C), dtype)):
        with T.Kernel(T.ceildiv(C, BC), T.ceildiv(NT, BT), threads=threads) as (bc, bt):
            ps = T.alloc_shared((BT, n), "float32")
            xf = [T.alloc_fragment((BT, BC), dtype) for _ in lanes]
            yf = T.alloc_fragment((BT, BC), dtype)
            t0, c0 = bt * BT, bc * BC
            for tt, j in T.Parallel(BT, n):
                ps[tt, j] = T.if_then_else(t0 + tt < NT, pre[T.min(t0 + tt, NT - 1), j], T.float32(0))
            for j in lanes:
                T.copy(x[t0 : t0 + BT, j, c0 : c0 + BC], xf[j])
            for tt, c in T.Parallel(BT, BC):
                yf[tt, c] = T.cast(sum([ps[tt, j] * T.cast(xf[j][tt, c], "float32") for j in lanes]), dtype)
            T.copy(yf, y[t0 : t0 + BT, c0 : c0 + BC])

    return mix_lanes


@functools.lru_cache(maxsize=None)
def phi_split_kernel(n: int, C: int, target: str = "cuda"):
    """The compiled phi split kernel (cached per process)."""
    return compile_program(phi_split_program(n, C, target), target)


@functools.lru_cache(maxsize=None)
def split_kernels(n: int, C: int, dtype: str = "bfloat16", target: str = "cuda", *, block_m: int = 256,
                  block_k: int = 64, splits: int = 4, stages: int = 3, block_tokens: int = 16, block_c: int = 256,
                  apply_stages: int = 2, project_ws: bool = True, apply_phases: str = "fused",
                  spread_coefficients: bool = True):
    """(phi_split, project, apply) compiled kernels, cached per process. apply_phases="split": apply is the
    per-token coefficient kernel then the lane-mixing kernel (one callable, apply's arguments);
    spread_coefficients: the coefficient kernel spreads each token over a warp's threads when n is a power
    of two (coefficients_program's spread)."""
    if apply_phases not in ("fused", "split"):
        raise ValueError(f"pre split plan: apply_phases: expected 'fused' or 'split', got {apply_phases!r}")
    project = compile_program(project_program(n, C, dtype, target, block_m=block_m, block_k=block_k,
                                              splits=splits, stages=stages), target,
                              pass_configs=None if project_ws else NO_WARP_SPECIALIZATION)
    if apply_phases == "split":
        spread = None if spread_coefficients else False  # None: where coefficients_program can spread
        coefficients = compile_program(coefficients_program(n, C, target, splits=splits, spread=spread), target)
        mix = compile_program(mix_program(n, C, dtype, target), target)

        def apply(x, partial, bias, alpha, y, pre, post, res):
            coefficients(partial, bias, alpha, pre, post, res)
            mix(x, pre, y)

        return phi_split_kernel(n, C, target), project, apply
    return (
        phi_split_kernel(n, C, target),
        project,
        # the apply pass runs without warp specialisation: a producer warpgroup would hold registers that are
        # better spent on more resident CTAs, whose coefficient phases then overlap other CTAs' streaming
        compile_program(apply_program(n, C, dtype, target, splits=splits, block_tokens=block_tokens,
                                      block_c=block_c, stages=apply_stages), target,
                        pass_configs=NO_WARP_SPECIALIZATION),
    )
