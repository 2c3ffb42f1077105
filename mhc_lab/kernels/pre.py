# pre kernel: coefficients and layer input of one mHC site.
#
#   mixes = x_flat phi^T, sq = sum(x^2) (one pass over the nC stream), r = rsqrt(sq / nC + 1e-6)
#   H_pre = sigmoid(a0 r mixes_pre + b) + 1e-6, H_post = 2 sigmoid(a1 r mixes_post + b),
#   H_res = Sinkhorn_20(a2 r mixes_res + b) (DeepSeek-V4 convention), y = sum_j H_pre[j] x_j
#   (arXiv 2512.24880 Eqs. 14-19 and Eq. 3's H_pre x; the norm is applied after the matmul, Eq. 16)
#
# Bytes per token, the least a pre must move (n = 4, bf16 lanes): read nC elements (8C bytes), write C
# (2C bytes) and 4 (2n + n^2) = 96 bytes of float32 coefficients (pre, post and res; pre is kept for a
# later backward). phi ([n^2+2n, nC] float32, 384 C bytes) is read once per token *tile*, so its cost per token
# is 384 C / tokens_per_tile bytes of L2 traffic.
# FLOPs per token: 2 (n^2 + 2n) nC = 192 C for the projection, ~1.5k for the sigmoids and 20 Sinkhorn rounds,
# 2 nC for H_pre x: ~20 FLOP per byte, far below any roofline ridge (memory-bound).
#
# This file holds the C-target programs: a program instance owns a tile of tokens and walks each token's whole
# nC row twice in plain loops (projection + squared norm, then H_pre x), with the per-token coefficient code of
# _coefficients.py between the two walks. On CUDA the pre runs in two passes (pre_split.py: a projection pass
# on the tensor cores, then the apply pass), launched by pre_cuda.run_pre_cuda.
"""pre: H_pre, H_post, H_res and the layer input H_pre x of one mHC site."""

import functools

import tilelang.language as T

from mhc_lab.kernels._coefficients import coefficient_macro, mixes_width, store_coefficients_macro
from mhc_lab.kernels._target import canonical_target, compile_program, check_lanes_and_width


def _project_row_macro(n: int, C: int):
    """A T.macro ``project_row(x, phi, tok, mix)``: mix[:M] = x[tok] . phi^T, mix[M] = sum(x[tok]^2) (C target)."""
    M = mixes_width(n)

    @T.macro
    def project_row(x, phi, tok, mix):
        for q in T.serial(M + 1):
            mix[q] = T.float32(0)
        for j, c in T.grid(n, C):
            v = T.cast(x[tok, j, c], "float32")
            mix[M] += v * v
            for q in T.serial(M):
                mix[q] += v * phi[q, j * C + c]

    return project_row


def pre_program(n: int, C: int, dtype: str = "float32", target: str = "c"):
    """The C-target tile program of the whole pre kernel (one launch), 4 tokens per program instance.

    Arguments at run time: x [T, n, C], phi [n^2+2n, nC] f32, bias [n^2+2n] f32, alpha [3] f32, then outputs
    y [T, C], pre [T, n], post [T, n], res [T, n, n] (f32); T is dynamic.
    """
    if canonical_target(target) != "c":
        raise ValueError("pre_program is the C-target program; on CUDA use pre_cuda.run_pre_cuda")
    if dtype != "float32":
        raise ValueError(f"pre kernel on the C target: expected dtype 'float32', got {dtype!r}")
    check_lanes_and_width("pre kernel", n, C, max_lanes=8)
    M = mixes_width(n)
    BT = 4
    NT = T.dynamic("T")
    lanes = list(range(n))
    coefficients = coefficient_macro(n, C)
    project_row = _project_row_macro(n, C)
    store = store_coefficients_macro(n)

    @T.prim_func
    def pre_c(
        x: T.Tensor((NT, n, C), dtype),
        phi: T.Tensor((M, n * C), "float32"),
        bias: T.Tensor((M,), "float32"),
        alpha: T.Tensor((3,), "float32"),
        y: T.Tensor((NT, C), dtype),
        pre_out: T.Tensor((NT, n), "float32"),
        post_out: T.Tensor((NT, n), "float32"),
        res_out: T.Tensor((NT, n, n), "float32"),
    ):
        with T.Kernel(T.ceildiv(NT, BT)) as b:
            mix = T.alloc_local((M + 1,), "float32")
            pre_l = T.alloc_local((n,), "float32")
            post_l = T.alloc_local((n,), "float32")
            comb = T.alloc_local((n * n,), "float32")
            for tt in T.serial(BT):
                tok = b * BT + tt
                if tok < NT:
                    # pass 1 over the token's row: the n^2+2n projections and the sum of squares
                    project_row(x, phi, tok, mix)
                    coefficients(mix, alpha, bias, pre_l, post_l, comb)
                    store(tok, pre_l, post_l, comb, pre_out, post_out, res_out)
                    # pass 2 over the row: the layer input
                    for c in T.serial(C):
                        y[tok, c] = T.cast(sum([pre_l[j] * T.cast(x[tok, j, c], "float32") for j in lanes]), dtype)

    return pre_c


def projection_program(n: int, C: int, dtype: str = "float32", target: str = "c"):
    """The C-target projection alone: partial [1, T, n^2+2n+1] = (x_flat phi^T, sum(x^2)) per token, what the
    backward needs from the forward (the CUDA projection pass writes the same, in splits)."""
    if canonical_target(target) != "c":
        raise ValueError("projection_program is the C-target program; on CUDA pre_split.project_program does this")
    if dtype != "float32":
        raise ValueError(f"projection on the C target: expected dtype 'float32', got {dtype!r}")
    check_lanes_and_width("projection", n, C, max_lanes=8)
    M = mixes_width(n)
    BT = 4
    NT = T.dynamic("T")
    project_row = _project_row_macro(n, C)

    @T.prim_func
    def projection_c(
        x: T.Tensor((NT, n, C), dtype),
        phi: T.Tensor((M, n * C), "float32"),
        partial: T.Tensor((1, NT, M + 1), "float32"),
    ):
        with T.Kernel(T.ceildiv(NT, BT)) as b:
            mix = T.alloc_local((M + 1,), "float32")
            for tt in T.serial(BT):
                tok = b * BT + tt
                if tok < NT:
                    project_row(x, phi, tok, mix)
                    for q in T.serial(M + 1):
                        partial[0, tok, q] = mix[q]

    return projection_c


@functools.lru_cache(maxsize=None)
def projection_kernel_c(n: int, C: int):
    """The compiled C-target projection (cached per process): ``kernel(x, phi, partial)``."""
    return compile_program(projection_program(n, C), "c")


@functools.lru_cache(maxsize=None)
def pre_kernel_c(n: int, C: int, dtype: str = "float32"):
    """The compiled C-target pre kernel (cached per process): ``kernel(x, phi, bias, alpha, y, pre, post, res)``.
    Every call checks the tensors against n, C and dtype, and that they hold the same number of tokens
    (kernels.checked.CheckedKernel)."""
    from mhc_lab.kernels.checked import CheckedKernel

    return CheckedKernel(compile_program(pre_program(n, C, dtype, "c"), "c"), f"pre_kernel_c({n}, {C}, {dtype!r})",
                         ("x", "phi", "bias", "alpha", "y", "pre", "post", "res"))


def pre_bytes(n: int, C: int, itemsize: int = 2) -> dict:
    """Least bytes per token a pre must move (lanes once, layer input once, coefficients), and FLOPs."""
    read = n * C * itemsize
    write = C * itemsize + 4 * (2 * n + n * n)
    return {"read": read, "write": write, "total": read + write,
            "flops": 2 * mixes_width(n) * n * C + 2 * n * C}
