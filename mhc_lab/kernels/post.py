# post kernel: the next residual lanes of one mHC site, in one pass over HBM.
#
#   out[t, i, c] = sum_j H_res[t, i, j] x[t, j, c] + H_post[t, i] f[t, c]        (arXiv 2512.24880, Eq. 3)
#
# Bytes per token (lanes x and layer output f in the stream dtype, 2 bytes for bf16):
#   reads  (n + 1) C elements (n lanes of x, one f) + n^2 + n float32 coefficients
#   writes n C elements (the new lanes)
#   n = 4, bf16: 10 C + 80 bytes read, 8 C bytes written, 9 C elements of the 14 C a whole site must move.
# FLOPs per token: 2 (n + 1) n C = 40 C at n = 4 -> 2.2 FLOP per byte: memory-bound by two orders of magnitude.
# Fuses: the H_res lane mix, the H_post broadcast of the layer output and the residual merge (the paper's
# F_post,res: reads (3n+1)C -> (n+1)C and writes 3nC -> nC, arXiv 2512.24880 Sec. 4.3.1).
#
# One factory, two targets. CUDA: a CTA owns a [block_tokens x block_c] patch of every lane; it copies its
# tokens' n^2 + n coefficients to shared memory, loads the n lane tiles and the f tile into registers with
# 16-byte vector loads (tails masked by T.copy), mixes in float32 and stores n output tiles. C target: the
# same arithmetic in plain loops, one program instance per token tile.
"""post: out = H_res x + H_post (x) f for one mHC site (CUDA tiles or TileLang's C target)."""


import functools

import tilelang.language as T

from mhc_lab.kernels._target import check_lanes_and_width, check_target_dtype, compile_program

DTYPES = ("bfloat16", "float16", "float32")


def _check(n: int, C: int, dtype: str, target: str) -> str:
    check_lanes_and_width("post kernel", n, C, max_lanes=16)
    return check_target_dtype("post kernel", dtype, target, DTYPES)


def post_tiles(C: int, dtype: str) -> tuple[int, int, int]:
    """(block_tokens, block_c, threads) on CUDA: 256 threads, each owning whole 16-byte vectors; column blocks of
    512 (1 KB rows in bf16) where C allows, so the loads run along long contiguous rows."""
    threads = 256
    vec = 8 if dtype in ("bfloat16", "float16") else 4
    block_c = 512 if C >= 512 else max(64, 1 << (C - 1).bit_length())
    block_tokens = max(8, (threads * vec) // block_c)
    return block_tokens, block_c, threads


def post_kernel_program(n: int, C: int, dtype: str = "bfloat16", target: str = "cuda"):
    """The tile program (a TileLang PrimFunc) of the post kernel for n lanes of width C.

    Arguments at run time: x [T, n, C], f [T, C], post [T, n] f32, res [T, n, n] f32, out [T, n, C];
    T (tokens) is dynamic, n, C and dtype are baked in. CUDA tiles: post_tiles; C target: 4 tokens per program
    instance.
    """
    t = _check(n, C, dtype, target)
    NT = T.dynamic("T")
    lanes = list(range(n))

    if t == "c":
        bt = 4

        @T.prim_func
        def post_c(
            x: T.Tensor((NT, n, C), dtype),
            f: T.Tensor((NT, C), dtype),
            post: T.Tensor((NT, n), "float32"),
            res: T.Tensor((NT, n, n), "float32"),
            out: T.Tensor((NT, n, C), dtype),
        ):
            with T.Kernel(T.ceildiv(NT, bt)) as b:
                for tt in T.serial(bt):
                    tok = b * bt + tt
                    if tok < NT:
                        for c in T.serial(C):
                            xs = [T.cast(x[tok, j, c], "float32") for j in lanes]
                            fv = T.cast(f[tok, c], "float32")
                            for i in T.unroll(n):
                                acc = sum([res[tok, i, j] * xs[j] for j in lanes], post[tok, i] * fv)
                                out[tok, i, c] = T.cast(acc, dtype)

        return post_c

    BT, BC, TH = post_tiles(C, dtype)
    NCOEF = n * n + n

    @T.prim_func
    def post_cuda(
        x: T.Tensor((NT, n, C), dtype),
        f: T.Tensor((NT, C), dtype),
        post: T.Tensor((NT, n), "float32"),
        res: T.Tensor((NT, n, n), "float32"),
        out: T.Tensor((NT, n, C), dtype),
    ):
        with T.Kernel(T.ceildiv(C, BC), T.ceildiv(NT, BT), threads=TH) as (bc, bt):
            cs = T.alloc_shared((BT, NCOEF), "float32")
            xf = [T.alloc_fragment((BT, BC), dtype) for _ in lanes]
            ff = T.alloc_fragment((BT, BC), dtype)
            of = [T.alloc_fragment((BT, BC), dtype) for _ in lanes]
            t0 = bt * BT
            c0 = bc * BC
            for tt, k in T.Parallel(BT, NCOEF):
                tok = t0 + tt
                if k < n * n:
                    cs[tt, k] = T.if_then_else(tok < NT, res[tok, k // n, k % n], T.float32(0))
                else:
                    cs[tt, k] = T.if_then_else(tok < NT, post[tok, k - n * n], T.float32(0))
            for j in lanes:
                T.copy(x[t0 : t0 + BT, j, c0 : c0 + BC], xf[j])
            T.copy(f[t0 : t0 + BT, c0 : c0 + BC], ff)
            for tt, c in T.Parallel(BT, BC):
                xs = [T.cast(xf[j][tt, c], "float32") for j in lanes]
                fv = T.cast(ff[tt, c], "float32")
                for i in lanes:
                    acc = sum([cs[tt, i * n + j] * xs[j] for j in lanes], cs[tt, n * n + i] * fv)
                    of[i][tt, c] = T.cast(acc, dtype)
            for i in lanes:
                T.copy(of[i], out[t0 : t0 + BT, i, c0 : c0 + BC])

    return post_cuda


@functools.lru_cache(maxsize=None)
def post_kernel(n: int, C: int, dtype: str = "bfloat16", target: str = "cuda"):
    """The compiled post kernel (cached per process): call it as ``kernel(x, f, post, res, out)``. Every call
    checks the tensors against n, C, dtype and target, and that they hold the same number of tokens
    (kernels.checked.CheckedKernel)."""
    from mhc_lab.kernels.checked import CheckedKernel

    return CheckedKernel(compile_program(post_kernel_program(n, C, dtype, target), target),
                         f"post_kernel({n}, {C}, {dtype!r}, {target!r})")


def post_bytes(n: int, C: int, itemsize: int = 2) -> dict:
    """Least bytes per token the post kernel must move, and its FLOPs per token."""
    read = (n + 1) * C * itemsize + (n * n + n) * 4
    write = n * C * itemsize
    return {"read": read, "write": write, "total": read + write, "flops": 2 * (n + 1) * n * C}
