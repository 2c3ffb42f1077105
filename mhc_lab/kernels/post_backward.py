# post backward: the gradients of one mHC site's post, in one pass over HBM.
#
#   forward:  out[t, i, c] = sum_j H_res[t, i, j] x[t, j, c] + H_post[t, i] f[t, c]      (arXiv 2512.24880, Eq. 3)
#   backward, g = dL/dout:
#     dx[t, j, c]     = sum_i H_res[t, i, j] g[t, i, c]        (the lanes' gradient through H_res)
#     df[t, c]        = sum_i H_post[t, i] g[t, i, c]          (the layer output's gradient)
#     dH_res[t, i, j] = sum_c g[t, i, c] x[t, j, c]            (per-token reductions over the width)
#     dH_post[t, i]   = sum_c g[t, i, c] f[t, c]
#
# Bytes per token (bf16, n = 4): reads g, x (nC each) and f (C): 9C elements; writes dx (nC) and df (C): 5C;
# plus n^2 + n float32 coefficients in and out. FLOPs: 4 n (n + 1) C = 80 C: memory-bound.
#
# CUDA: a warp owns a token and walks its width in 16-byte vectors (8 bf16 columns per thread, 256 per warp
# step), keeping the n^2 + n reduction sums in registers; one shuffle reduction per token at the end, so the
# result does not depend on timing (deterministic, no atomics). C target: the same arithmetic in plain loops.
"""post backward: dx, df, dH_post, dH_res of one mHC site (CUDA warps or TileLang's C target)."""


import functools

import tilelang.language as T

from mhc_lab.kernels._target import check_lanes_and_width, check_target_dtype, compile_program

DTYPES = ("bfloat16", "float16", "float32")


def _check(n: int, C: int, dtype: str, target: str) -> str:
    check_lanes_and_width("post backward kernel", n, C, max_lanes=16)
    return check_target_dtype("post backward kernel", dtype, target, DTYPES)


def vector_width(C: int, dtype: str) -> int:
    """Elements per 16-byte vector when every row of C elements starts 16-byte aligned; else 1."""
    vec = 4 if dtype == "float32" else 8
    return vec if C % vec == 0 else 1


THREADS = 256  # CUDA: eight warps per CTA, a token per warp
BLOCK_TOKENS = 4  # C target: tokens per program instance


def post_backward_program(n: int, C: int, dtype: str = "bfloat16", target: str = "cuda", *,
                          lanes_grad: bool = True):
    """The tile program of the post backward for n lanes of width C.

    Arguments at run time: x [T, n, C], f [T, C], g [T, n, C], post [T, n] f32, res [T, n, n] f32, then the
    outputs dx [T, n, C], df [T, C], dpost [T, n] f32, dres [T, n, n] f32. T is dynamic.

    lanes_grad=False: no dx (no dx argument either). A linked site's pre backward can add H_res^T g to its own
    dx in the pass that writes it, from g itself (pre_backward_lanes_program's post_grad), so the post's
    backward need not write dx for it to read back: 4C fewer bytes per token at n = 4 (10C instead of 14C).
    """
    t = _check(n, C, dtype, target)
    NT = T.dynamic("T")
    lanes = list(range(n))
    NR = n * n  # dH_res sums, then the n dH_post sums
    NQ = NR + n

    if t == "c":
        BT = BLOCK_TOKENS

        @T.macro
        def body_c(x, f, g, post, res, dx, df, dpost, dres):
            with T.Kernel(T.ceildiv(NT, BT)) as b:
                acc = T.alloc_local((NQ,), "float32")
                for tt in T.serial(BT):
                    tok = b * BT + tt
                    if tok < NT:
                        for q in T.serial(NQ):
                            acc[q] = T.float32(0)
                        for c in T.serial(C):
                            gs = [T.cast(g[tok, i, c], "float32") for i in lanes]
                            for j in lanes:
                                if dx is not None:
                                    dx[tok, j, c] = T.cast(sum([res[tok, i, j] * gs[i] for i in lanes]), dtype)
                                for i in lanes:
                                    acc[i * n + j] += gs[i] * T.cast(x[tok, j, c], "float32")
                            df[tok, c] = T.cast(sum([post[tok, i] * gs[i] for i in lanes]), dtype)
                            for i in lanes:
                                acc[NR + i] += gs[i] * T.cast(f[tok, c], "float32")
                        for i in T.serial(n):
                            dpost[tok, i] = acc[NR + i]
                            for j in T.serial(n):
                                dres[tok, i, j] = acc[i * n + j]

        return _post_backward_func(body_c, n, C, dtype, NT, lanes_grad)

    V = vector_width(C, dtype)
    threads = THREADS
    WARPS = threads // 32
    STEP = 32 * V
    NS = (C + STEP - 1) // STEP

    @T.macro
    def body_cuda(x, f, g, post, res, dx, df, dpost, dres):
        with T.Kernel(T.ceildiv(NT, WARPS), threads=threads) as b:
            coef = T.alloc_local((NQ,), "float32")
            acc = T.alloc_local((NQ,), "float32")
            xv = T.alloc_local((n, V), dtype)
            gv = T.alloc_local((n, V), dtype)
            fv = T.alloc_local((V,), dtype)
            dxv = T.alloc_local((n, V), dtype)
            dfv = T.alloc_local((V,), dtype)
            tx = T.get_thread_binding()
            lane = tx % 32
            tok = b * WARPS + tx // 32
            if tok < NT:
                for i in T.unroll(n):
                    coef[NR + i] = post[tok, i]
                    for j in T.unroll(n):
                        coef[i * n + j] = res[tok, i, j]
                for q in T.unroll(NQ):
                    acc[q] = T.float32(0)
                for s in T.serial(NS):
                    c0 = s * STEP + lane * V
                    if c0 < C:
                        for j in T.unroll(n):
                            for v in T.vectorized(V):
                                xv[j, v] = x[tok, j, c0 + v]
                            for v in T.vectorized(V):
                                gv[j, v] = g[tok, j, c0 + v]
                        for v in T.vectorized(V):
                            fv[v] = f[tok, c0 + v]
                        for v in T.unroll(V):
                            gs = [T.cast(gv[i, v], "float32") for i in lanes]
                            fs = T.cast(fv[v], "float32")
                            xs = [T.cast(xv[j, v], "float32") for j in lanes]
                            if dx is not None:
                                for j in lanes:
                                    dxv[j, v] = T.cast(sum([coef[i * n + j] * gs[i] for i in lanes]), dtype)
                            dfv[v] = T.cast(sum([coef[NR + i] * gs[i] for i in lanes]), dtype)
                            for i in lanes:
                                for j in lanes:
                                    acc[i * n + j] += gs[i] * xs[j]
                                acc[NR + i] += gs[i] * fs
                        if dx is not None:
                            for j in T.unroll(n):
                                for v in T.vectorized(V):
                                    dx[tok, j, c0 + v] = dxv[j, v]
                        for v in T.vectorized(V):
                            df[tok, c0 + v] = dfv[v]
                for q in T.unroll(NQ):
                    acc[q] = T.warp_reduce_sum(acc[q])
                if lane == 0:
                    for i in T.unroll(n):
                        dpost[tok, i] = acc[NR + i]
                        for j in T.unroll(n):
                            dres[tok, i, j] = acc[i * n + j]

    return _post_backward_func(body_cuda, n, C, dtype, NT, lanes_grad)


def _post_backward_func(body, n, C, dtype, NT, lanes_grad):
    """The PrimFunc around a target's body (C or CUDA), with or without the dx output."""
    if not lanes_grad:

        @T.prim_func
        def post_backward_without_dx(
            x: T.Tensor((NT, n, C), dtype), f: T.Tensor((NT, C), dtype), g: T.Tensor((NT, n, C), dtype),
            post: T.Tensor((NT, n), "float32"), res: T.Tensor((NT, n, n), "float32"),
            df: T.Tensor((NT, C), dtype), dpost: T.Tensor((NT, n), "float32"), dres: T.Tensor((NT, n, n), "float32"),
        ):
            body(x, f, g, post, res, None, df, dpost, dres)

        return post_backward_without_dx

    @T.prim_func
    def post_backward(
        x: T.Tensor((NT, n, C), dtype), f: T.Tensor((NT, C), dtype), g: T.Tensor((NT, n, C), dtype),
        post: T.Tensor((NT, n), "float32"), res: T.Tensor((NT, n, n), "float32"),
        dx: T.Tensor((NT, n, C), dtype), df: T.Tensor((NT, C), dtype), dpost: T.Tensor((NT, n), "float32"),
        dres: T.Tensor((NT, n, n), "float32"),
    ):
        body(x, f, g, post, res, dx, df, dpost, dres)

    return post_backward


@functools.lru_cache(maxsize=None)
def post_backward_kernel(n: int, C: int, dtype: str = "bfloat16", target: str = "cuda", *,
                         lanes_grad: bool = True):
    """The compiled post backward (cached per process): ``kernel(x, f, g, post, res, dx, df, dpost, dres)``,
    without dx when lanes_grad is False."""
    return compile_program(post_backward_program(n, C, dtype, target, lanes_grad=lanes_grad), target)


def post_backward_bytes(n: int, C: int, itemsize: int = 2, lanes_grad: bool = True) -> dict:
    """Least bytes per token the post backward must move (without dx when lanes_grad is False), and its FLOPs
    per token."""
    read = (2 * n + 1) * C * itemsize + (n * n + n) * 4
    write = ((n + 1) if lanes_grad else 1) * C * itemsize + (n * n + n) * 4
    return {"read": read, "write": write, "total": read + write, "flops": 4 * n * (n + 1) * C}
