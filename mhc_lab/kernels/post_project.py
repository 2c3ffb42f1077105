# post of one site fused with the projection of the next site's pre: the lanes a post writes are the lanes the
# next pre must project, so project them while they are still on chip.
#
#   out[t, i, c]    = sum_j H_res[t, i, j] x[t, j, c] + H_post[t, i] f[t, c]          (post, arXiv 2512.24880 Eq. 3)
#   partial[s, t, q] = sum_{i, c in split s} out[t, i, c] phi'[q, i C + c]            (next pre's projection)
#   partial[s, t, M] = sum_{i, c in split s} out[t, i, c]^2                           (next pre's squared norm)
#
# where phi' is the next site's phi, out is rounded to the lanes' dtype before it is projected (so the partial
# sums are those of the lanes the next pre reads), and M = n^2 + 2n. The next pre then needs only its apply
# pass (pre_split.apply_kernel), which reads the lanes once: a stack of sites moves per site
#   post + projection: reads (n + 1) C, writes n C;   apply: reads n C, writes C     -> (3n + 2) C elements,
# 14 C at n = 4, the least a site must move, instead of the 18 C of post + split pre (which reads x twice).
# The first site of a stack still needs one projection pass of its own.
#
# One factory, two targets. CUDA, Hopper only (elsewhere the sites run unchained): a CTA owns 64 tokens and one of
# `splits` ranges of columns; per column block TileLang's producer warpgroup copies the n lane tiles, the f tile and
# the next phi's columns (bf16 hi and lo rows, as the projection pass takes them) into shared memory by TMA; the
# consumer warpgroups mix the lanes in float32, store each result to global memory from the registers and into an
# output tile in shared memory, and multiply phi's rows with that tile on the tensor cores into a [(2M padded to 64)
# x 64] float32 accumulator (phi is the A operand, so each wgmma is m64n32k16; with the output tile as A they would
# be m64n8k16, three times as many); the squared norm is summed on the way. C target: the same arithmetic in plain
# loops.
"""post fused with the next site's projection: out = H_res x + H_post f, and the partial sums the next pre's
apply pass starts from (CUDA tiles or TileLang's C target)."""


import functools

import tilelang.language as T

from mhc_lab.kernels._coefficients import mixes_width
from mhc_lab.kernels._target import (
    SMEM_LIMIT,
    canonical_target,
    ceil_div,
    check_lanes_and_width,
    check_target_dtype,
    compile_program,
    is_hopper,
    round_up,
)
from mhc_lab.kernels.pre_split import PROJECTION_SPLITS, phi_rows, phi_tile_rows


def _check(n: int, C: int, dtype: str, target: str) -> str:
    check_lanes_and_width("post + projection kernel", n, C, max_lanes=8)
    t = check_target_dtype("post + projection kernel", dtype, target, ("bfloat16",))
    if t != "c" and not is_hopper(t):
        raise ValueError(f"post + projection kernel: a Hopper program (TMA, wgmma) for sm_90, got target {t!r}; on "
                         f"other GPUs a stack of sites runs unchained, the post kernel and then the next pre's own "
                         f"projection pass (mhc_lab.ops.dispatch.fused_projection_applies)")
    if t != "c" and C % 8:
        raise ValueError(f"post + projection kernel: CUDA copies 16-byte rows of each lane, so C must be a multiple "
                         f"of 8, got C = {C}")
    return t


def cuda_tiles(n: int) -> dict:
    """The CUDA tiles for n lanes: 64 tokens x 64 columns (128-byte rows, the widest TMA box under the 128-byte
    swizzle) in 2 stages, 256 threads (a producer and two consumer warpgroups). n > 4 takes 32-column blocks in
    one stage to fit in shared memory (shared_bytes)."""
    if n <= 4:
        return {"block_m": 64, "block_k": 64, "stages": 2, "threads": 256}
    return {"block_m": 64, "block_k": 32, "stages": 1, "threads": 256}


def shared_bytes(n: int, block_m: int, block_k: int, stages: int) -> int:
    """Shared memory of the CUDA program, at most (TileLang may let buffers share space): per stage the n lane
    tiles, the f tile and the phi tiles; once the n output tiles, and either the tokens' coefficients or the
    accumulator's copy (the first is dead before the second is written, and TileLang puts them in the same
    place)."""
    rows = phi_tile_rows(n)
    staged = (n + 1) * block_m * block_k * 2 + n * rows * block_k * 2
    return stages * staged + n * block_m * block_k * 2 + max(block_m * (n * n + n), rows * block_m) * 4


def post_project_program(n: int, C: int, dtype: str = "bfloat16", target: str = "cuda", *,
                         splits: int = PROJECTION_SPLITS):
    """The tile program of post + next projection for n lanes of width C (CUDA tiles: cuda_tiles(n); C target:
    4 tokens per program instance).

    Arguments at run time: x [T, n, C], f [T, C], post [T, n] f32, res [T, n, n] f32, then the next site's phi:
    on CUDA phi_hl [phi_rows(n), nC] bf16 (pre_split.phi_split_program's hi and lo rows), on the C target phi
    [n^2+2n, nC] f32; then the outputs out [T, n, C] and partial [S, T, n^2+2n+1] f32 with S = splits on CUDA
    (column ranges, summed by the apply pass) and S = 1 on the C target. T is dynamic.

    The mix binds each lane tile's value to a name, so it is read from shared memory and unpacked once for all
    n output lanes (written as a list of expressions, the generated code re-read all n + 1 tiles for every
    output lane). The output lanes leave from the registers that mixed them. The n lanes' products are issued
    without a wait each and waited for once per column block; phi's staged tiles are read once more after that
    wait, so that the pipeline hands their stage back to the producer only when the products are done.
    """
    t = _check(n, C, dtype, target)
    M = mixes_width(n)
    K = n * C
    NT = T.dynamic("T")
    lanes = list(range(n))

    if t == "c":
        BT = 4

        @T.prim_func
        def post_project_c(
            x: T.Tensor((NT, n, C), dtype), f: T.Tensor((NT, C), dtype), post: T.Tensor((NT, n), "float32"),
            res: T.Tensor((NT, n, n), "float32"), phi: T.Tensor((M, K), "float32"),
            out: T.Tensor((NT, n, C), dtype), partial: T.Tensor((1, NT, M + 1), "float32"),
        ):
            with T.Kernel(T.ceildiv(NT, BT)) as b:
                mix = T.alloc_local((M + 1,), "float32")
                for tt in T.serial(BT):
                    tok = b * BT + tt
                    if tok < NT:
                        for q in T.serial(M + 1):
                            mix[q] = T.float32(0)
                        for c in T.serial(C):
                            xs = [T.cast(x[tok, j, c], "float32") for j in lanes]
                            fv = T.cast(f[tok, c], "float32")
                            for i in T.unroll(n):
                                o = T.cast(sum([res[tok, i, j] * xs[j] for j in lanes], post[tok, i] * fv), dtype)
                                out[tok, i, c] = o
                                v = T.cast(o, "float32")
                                mix[M] += v * v
                                for q in T.serial(M):
                                    mix[q] += v * phi[q, i * C + c]
                        for q in T.serial(M + 1):
                            partial[0, tok, q] = mix[q]

        return post_project_c

    tiles = cuda_tiles(n)
    block_m, block_k, stages, threads = tiles["block_m"], tiles["block_k"], tiles["stages"], tiles["threads"]
    NP = phi_rows(n)
    NA = phi_tile_rows(n)
    smem = shared_bytes(n, block_m, block_k, stages)
    if smem > SMEM_LIMIT:
        raise ValueError(f"post + projection kernel: n = {n} with {block_m} tokens x {block_k} columns in {stages} "
                         f"stages needs up to {smem} bytes of shared memory, more than the {SMEM_LIMIT} a CTA may "
                         f"use")
    NCOEF = n * n + n
    BM, BK, S = block_m, block_k, splits
    KS = round_up(ceil_div(C, S), BK)  # columns per split, whole blocks
    NK = KS // BK

    @T.prim_func
    def post_project_cuda(
        x: T.Tensor((NT, n, C), dtype), f: T.Tensor((NT, C), dtype), post: T.Tensor((NT, n), "float32"),
        res: T.Tensor((NT, n, n), "float32"), phi_hl: T.Tensor((NP, K), "bfloat16"),
        out: T.Tensor((NT, n, C), dtype), partial: T.Tensor((S, NT, M + 1), "float32"),
    ):
        with T.Kernel(T.ceildiv(NT, BM), S, threads=threads) as (bm, s):
            cs = T.alloc_shared((BM, NCOEF), "float32")
            xs = [T.alloc_shared((BM, BK), dtype) for _ in lanes]
            fs = T.alloc_shared((BM, BK), dtype)
            ps = [T.alloc_shared((NA, BK), "bfloat16") for _ in lanes]
            os = [T.alloc_shared((BM, BK), dtype) for _ in lanes]
            acc = T.alloc_fragment((NA, BM), "float32")
            sq_acc = T.alloc_fragment((BM, BK), "float32")
            sq = T.alloc_fragment((BM,), "float32")
            out_s = T.alloc_shared((NA, BM), "float32")
            keep = T.alloc_local((1,), "float32")  # phi's tiles read after the products' wait
            t0 = bm * BM
            for tt, k in T.Parallel(BM, NCOEF):
                tok = t0 + tt
                if k < n * n:
                    cs[tt, k] = T.if_then_else(tok < NT, res[T.min(tok, NT - 1), k // n, k % n], T.float32(0))
                else:
                    cs[tt, k] = T.if_then_else(tok < NT, post[T.min(tok, NT - 1), k - n * n], T.float32(0))
            T.clear(acc)
            T.clear(sq_acc)
            for kk in T.Pipelined(NK, num_stages=stages):
                c0 = s * KS + kk * BK
                for j in lanes:
                    T.copy(x[t0 : t0 + BM, j, c0 : c0 + BK], xs[j])
                    # rows NP..NA of the tile are never written; the product rows they give are never read
                    T.copy(phi_hl[0:NP, j * C + c0 : j * C + c0 + BK], ps[j][0:NP, 0:BK])
                T.copy(f[t0 : t0 + BM, c0 : c0 + BK], fs)
                for tt, c in T.Parallel(BM, BK):
                    # each lane's value bound to a name (a let), so the mix reads it once; as list items the
                    # expressions were repeated for every output lane, and nvcc could not reuse the loads
                    # across the output tile's shared stores (names past n are bound to 0 and never used)
                    x0, x1, x2, x3, x4, x5, x6, x7 = [T.cast(xs[j][tt, c], "float32") if j < n else T.float32(0)
                                                      for j in range(8)]
                    xv = [x0, x1, x2, x3, x4, x5, x6, x7][:n]
                    fv = T.cast(fs[tt, c], "float32")
                    for i in lanes:
                        o = T.cast(sum([cs[tt, i * n + j] * xv[j] for j in lanes], cs[tt, n * n + i] * fv), dtype)
                        # past the last column o is 0 (x and f arrive zero-filled), so phi columns that belong to
                        # the next lane, read there, add nothing
                        # the tile goes to shared memory for the GEMM, and leaves from the registers: stored
                        # from shared memory, each lane's store had to finish before the next
                        os[i][tt, c] = o
                        if (t0 + tt < NT) & (c0 + c < C):
                            out[t0 + tt, i, c0 + c] = o
                        v = T.cast(o, "float32")
                        sq_acc[tt, c] += v * v
                for i in lanes:  # issued without T.gemm's own wait, waited for once below
                    T.gemm(ps[i], os[i], acc, transpose_B=True, annotations={"wg_wait": -1})
                T.wait_wgmma(0)
                # the staged phi tiles' last use: after the wait, so the stage is released only then
                keep[0] = sum([T.cast(ps[i][0, 0], "float32") for i in lanes], T.float32(0))
            T.reduce_sum(sq_acc, sq, dim=1)
            T.copy(acc, out_s)
            for tt, q in T.Parallel(BM, M):
                tok = t0 + tt
                if tok < NT:
                    partial[s, tok, q] = out_s[q, tt] + out_s[M + q, tt]
            for tt in T.Parallel(BM):
                tok = t0 + tt
                if tok < NT:
                    partial[s, tok, M] = sq[tt]

    return post_project_cuda


@functools.lru_cache(maxsize=None)
def post_project_kernel(n: int, C: int, dtype: str = "bfloat16", target: str = "cuda", *,
                        splits: int = PROJECTION_SPLITS):
    """The compiled post + next projection (cached per process):
    ``kernel(x, f, post, res, phi_next, out, partial)``."""
    t = canonical_target(target)
    return compile_program(post_project_program(n, C, dtype, t, splits=splits), t)


def post_project_bytes(n: int, C: int, itemsize: int = 2, splits: int = 4) -> dict:
    """Least bytes per token the fused kernel moves (the post's, plus the partial sums it writes)."""
    read = (n + 1) * C * itemsize + (n * n + n) * 4
    write = n * C * itemsize + splits * (mixes_width(n) + 1) * 4
    return {"read": read, "write": write, "total": read + write,
            "flops": 2 * (n + 1) * n * C + 2 * 2 * mixes_width(n) * n * C}
