# pre on CUDA: the coefficients and the layer input of one mHC site in two passes over the lanes.
#
#   phi split:      phi_hl = [bf16(phi); bf16(phi - bf16(phi)); 0]                       (once per call)
#   projection:     partial[s, t, :] = x[t, K_s] . phi_hl[:, K_s]^T (hi + lo rows added), sum(x[t, K_s]^2)
#   coefficients:   mixes = sum_s partial[s]; r = rsqrt(sum(x^2)/(nC) + eps); H_pre, H_post, Sinkhorn(H_res)
#   lane mix:       y[t, c] = sum_j H_pre[t, j] x[t, j, c]
#
# Why two passes: H_pre needs the projection of a token's whole nC row before y = H_pre x can start, and an SM
# cannot hold enough rows to amortise phi ([n^2+2n, nC] float32, re-read from L2 by every token tile). So the
# projection pass streams x once into the tensor cores and writes a few float32 partial sums per token; the
# apply pass (coefficients, then the lane mix) reads x again. Bytes per token (bf16 lanes, n = 4): 18 C against
# the 10 C a pre must move; in a stack of sites the previous site's post projects the lanes it writes
# (post_project.py) and only the apply pass runs, which brings a site to the least it must move.
#
# Precision: the bf16 tensor cores multiply x (exact in bf16) by phi split as hi + lo, both bf16, so the
# products carry ~16 bits of phi's mantissa and accumulate in float32.
#
# The apply pass is two kernels: the per-token coefficients first (every token's Sinkhorn at once, over all
# SMs), then a lane mix shaped like the post kernel (16-byte loads, many small CTAs). Where n is a power of two
# the coefficient kernel spreads each token over n R threads of a warp, its line sums by warp shuffles
# (_coefficients.spread_coefficient_macros): one thread per token leaves a few long dependent chains per SM.
# Other n run one thread per token; the C target runs the same math in loops.
"""pre on CUDA (and the apply pass on the C target): phi split, projection pass, coefficients, lane mix."""


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
    canonical_target,
    ceil_div,
    check_lanes_and_width,
    check_target_dtype,
    compile_program,
    round_up,
    shared_memory_limit,
)

# Column splits of the projection pass: each split is a grid column of CTAs writing its own partial sums, which
# the coefficient kernel adds. Four give a 16384-token call enough CTAs to fill the GPU.
PROJECTION_SPLITS = 4


def phi_rows(n: int) -> int:
    """Rows of the split phi: hi (n^2+2n), lo (n^2+2n), zero padding up to a multiple of 16."""
    return round_up(2 * mixes_width(n), 16)


def phi_tile_rows(n: int) -> int:
    """Rows of a shared phi tile: phi's hi and lo rows padded to whole 64-row tiles, phi being the A operand of
    the tensor cores' m64nNk16 products (the rows past phi_rows are never loaded, and the product rows they
    give never read). With x as A and phi's rows as the N side the products would be m64n8k16, three times as
    many instructions at n = 4."""
    return round_up(phi_rows(n), 64)


def _check_gpu(n, C, dtype, target):
    t = canonical_target(target)
    if t == "c":
        raise ValueError("pre on CUDA: the C target uses pre.pre_program and pre_split's coefficient and mix programs")
    if dtype != "bfloat16":
        raise ValueError(f"pre on CUDA: expected dtype 'bfloat16' lanes, got {dtype!r}")
    check_lanes_and_width("pre on CUDA", n, C, max_lanes=8)
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


def projection_tiles(n: int, target: str) -> tuple[int, int]:
    """(tokens per CTA, stages) of the projection pass on a CUDA target: the first of 256 tokens in three
    stages, 256 in two, 128 in two, 128 in one, whose tiles fit the shared memory a block of that architecture
    may use (on sm_90 256 in three for every n; on the 99 KB GPUs fewer, and fewer as n grows)."""
    limit = shared_memory_limit(target)
    rows = phi_tile_rows(n)
    for block_m, stages in ((256, 3), (256, 2), (128, 2), (128, 1)):
        if max(stages * (block_m + rows) * 64 * 2, rows * block_m * 4) <= limit:
            return block_m, stages
    return 128, 1


def project_program(n: int, C: int, dtype: str = "bfloat16", target: str = "cuda", *,
                    splits: int = PROJECTION_SPLITS):
    """The projection pass: partial [splits, T, n^2+2n+1] float32 from x_flat [T, nC] and phi_hl [phi_rows, nC].

    A CTA owns block_m tokens and one of `splits` column ranges (projection_tiles: on Hopper 256 tokens, 3
    stages); TileLang pipelines [block_m x 64] tiles of x and phi's columns through shared memory (on Hopper TMA
    and a producer warpgroup, elsewhere cp.async) into products with phi's rows as A ([phi_tile_rows x block_m]
    accumulator; wgmma on Hopper, mma.sync elsewhere), and sums x^2 from the same tiles. 64 columns of bf16 are
    128-byte rows, the widest TMA box under the 128-byte swizzle; longer tiles became several such boxes."""
    t = _check_gpu(n, C, dtype, target)
    M, K, NP, NA = mixes_width(n), n * C, phi_rows(n), phi_tile_rows(n)
    (BM, stages), BK, S, threads = projection_tiles(n, t), 64, splits, 256
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


def coefficients_program(n: int, C: int, target: str = "cuda", *, splits: int = PROJECTION_SPLITS):
    """The apply pass's first kernel: sums each token's partials and writes H_pre, H_post and H_res. Arguments
    partial [S, T, n^2+2n+1], bias, alpha, then pre, post, res (f32).

    CUDA, n a power of two: each token over n R threads of a warp (spread_coefficient_macros); other n: one
    thread per token, 128 tokens per CTA. C target: one token per loop iteration."""
    check_lanes_and_width("pre coefficients", n, C, max_lanes=8)
    t = canonical_target(target)
    M, S = mixes_width(n), splits
    NT = T.dynamic("T")
    spread = t != "c" and spread_fits(n)
    coefficients = coefficient_macro(n, C)
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

    body = _spread_tokens_macro(n, C, splits=splits) if spread else one_thread_per_token

    @T.prim_func
    def token_coefficients(
        partial: T.Tensor((S, NT, M + 1), "float32"), bias: T.Tensor((M,), "float32"),
        alpha: T.Tensor((3,), "float32"), pre_out: T.Tensor((NT, n), "float32"),
        post_out: T.Tensor((NT, n), "float32"), res_out: T.Tensor((NT, n, n), "float32"),
    ):
        body(partial, bias, alpha, pre_out, post_out, res_out)

    return token_coefficients


def _spread_tokens_macro(n: int, C: int, *, splits: int):
    """coefficients_program's CUDA body for n a power of two, a T.macro of its arguments: 128-thread CTAs, each
    token over n R of them."""
    threads = 128
    layout = spread_layout(n)
    P, E, M2 = layout.threads, layout.entries, layout.gates
    TPC = threads // P  # tokens per CTA
    spread = spread_coefficient_macros(n, C, splits)

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


def mix_program(n: int, C: int, dtype: str = "bfloat16", target: str = "cuda"):
    """The apply pass's second kernel: y = sum_j H_pre[j] x_j. Arguments x [T, n, C], pre [T, n] f32, then
    y [T, C]. CUDA: streamed like the post kernel (a CTA owns [block_tokens x block_c] of every lane, 16-byte
    vector loads, H_pre of its tokens in shared memory; post.post_tiles); C target: plain loops."""
    from mhc_lab.kernels.post import post_tiles

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

    BT, BC, threads = post_tiles(C, dtype)

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
    """The compiled phi split (cached per process): ``kernel(phi, phi_hl)``."""
    return compile_program(phi_split_program(n, C, target), target)


@functools.lru_cache(maxsize=None)
def project_kernel(n: int, C: int, dtype: str = "bfloat16", target: str = "cuda", *,
                   splits: int = PROJECTION_SPLITS):
    """The compiled projection pass (cached per process): ``kernel(x_flat, phi_hl, partial)``."""
    return compile_program(project_program(n, C, dtype, target, splits=splits), target)


@functools.lru_cache(maxsize=None)
def apply_kernel(n: int, C: int, dtype: str = "bfloat16", target: str = "cuda", *, splits: int = PROJECTION_SPLITS):
    """The apply pass, compiled (cached per process): one callable ``apply(x, partial, bias, alpha, y, pre, post,
    res)`` that runs the coefficient kernel, then the lane mix. dtype: the lanes' (float32 on the C target)."""
    coefficients = compile_program(coefficients_program(n, C, target, splits=splits), target)
    mix = compile_program(mix_program(n, C, dtype, target), target)

    def apply(x, partial, bias, alpha, y, pre, post, res):
        coefficients(partial, bias, alpha, pre, post, res)
        mix(x, pre, y)

    apply.coefficients, apply.mix = coefficients, mix
    return apply
