# RMSNorm, fused: one read of x, one write of y.
#
#   y[r, c] = x[r, c] * rsqrt(mean_c x[r, c]^2 + eps) * w[c]        (RMSNorm, Zhang & Sennrich 2019, arXiv
#                                                                     1910.07467, Eq. 4; the norm of mHC's Eq. 7)
#
# Bytes for N rows of C elements of s bytes (every input read once, every output written once):
#   reads  N C s (x) + C s (w),  writes N C s (y)    -> 2 N C s + C s;  about 4 N C FLOPs (0.5 per byte in bf16)
# The eager PyTorch recipe (upcast, pow, mean, add eps, rsqrt, multiply, downcast, multiply by w) is 8 kernels
# and moves about 36 N C bytes in bf16 (rmsnorm_bytes counts them pass by pass): 9 times the fused count.
# Fuses: the upcast, the square, the row sum, the rsqrt, both multiplies and the downcast. The row stays on chip
# (registers) between the reduction and the scaling, so x is read from HBM once, not twice.
#
# The per-row sum of squares (row_sum_of_squares_program) is the reduction alone, the step before the fused
# kernel: reads N C s, writes 4 N bytes.
#
# One factory per kernel, two programs chosen by target, computing the same function:
# - CUDA: a thread block of `threads` threads owns block_rows whole rows. T.copy brings them into registers
#   (a fragment padded to a multiple of threads x one 16-byte vector; the padding is filled with zeros, which
#   add nothing to the sum; the mean divides by C, never by the padded width); a parallel loop squares in
#   float32; T.reduce_sum sums each row across the block (per-thread sums, then warp shuffles and a small
#   shared-memory exchange); a parallel loop scales; T.copy stores y, skipping the padding and missing rows.
# - C target: one program instance per block_rows rows; each row is copied into a local array (the on-chip
#   copy), summed, then scaled from that local copy.
"""Fused RMSNorm and the per-row sum of squares: tile programs for CUDA and TileLang's C target."""


import functools

import tilelang.language as T
import torch

from mhc_lab.kernels._target import compile_program
from mhc_lab.kernels.elementwise import (TORCH_DTYPES, check_kernel_args, check_rows, round_up,
                                       target_for)

DEFAULT_EPS = 1e-6


def _check(name: str, C: int, dtype: str, target: str) -> str:
    t = check_kernel_args(name, C, dtype, target)
    if t != "c" and C > 32768:
        raise ValueError(f"{name} on CUDA holds whole rows in registers: expected C <= 32768, got C = {C}")
    return t


def default_tiles(C: int, dtype: str) -> tuple[int, int, int]:
    """(block_rows, threads, padded width) for CUDA: whole rows per block, at most ~32 elements per thread."""
    vec = 16 // torch.empty((), dtype=TORCH_DTYPES[dtype]).element_size()
    threads = min(1024, max(32, 1 << (max(1, -(-C // 32)) - 1).bit_length()))
    width = round_up(C, threads * vec)
    block_rows = max(1, (threads * vec * 4) // width)
    return block_rows, threads, width


def _gpu_tiles(C, dtype, block_rows, threads):
    d_br, d_th, _ = default_tiles(C, dtype)
    TH = threads or d_th
    vec = 16 // torch.empty((), dtype=TORCH_DTYPES[dtype]).element_size()
    return block_rows or d_br, TH, round_up(C, TH * vec)


def row_sum_of_squares_for_c(C: int, block_rows: int, dtype: str = "float32"):
    """The per-row sum of squares for TileLang's C target: a running sum in a register, reset every row."""
    N = T.dynamic("N")

    @T.prim_func
    def row_sum_of_squares_c(x: T.Tensor((N, C), dtype), out: T.Tensor((N,), "float32")):
        with T.Kernel(T.ceildiv(N, block_rows)) as b:
            total = T.alloc_local((1,), "float32")  # the running sum: one register
            for i in T.serial(block_rows):
                r = b * block_rows + i
                if r < N:
                    total[0] = 0.0  # a fresh sum for every row
                    for c in T.serial(C):
                        total[0] += x[r, c] * x[r, c]
                    out[r] = total[0]

    return row_sum_of_squares_c


def row_sum_of_squares_for_cuda(C: int, block_rows: int, threads: int, width: int, dtype: str = "bfloat16"):
    """The per-row sum of squares for CUDA: whole rows per block, padded to ``width``, T.reduce_sum."""
    N = T.dynamic("N")
    BR, CP = block_rows, width

    @T.prim_func
    def row_sum_of_squares_cuda(x: T.Tensor((N, C), dtype), out: T.Tensor((N,), "float32")):
        with T.Kernel(T.ceildiv(N, BR), threads=threads) as b:
            xt = T.alloc_fragment((BR, CP), dtype)
            sq = T.alloc_fragment((BR, CP), "float32")
            total = T.alloc_fragment((BR,), "float32")
            T.copy(x[b * BR : b * BR + BR, 0:CP], xt)  # zeros beyond C and beyond the last row
            for i, c in T.Parallel(BR, CP):
                v = T.cast(xt[i, c], "float32")
                sq[i, c] = v * v
            T.reduce_sum(sq, total, dim=1)  # per-thread sums, then across the block's threads
            T.copy(total, out[b * BR : b * BR + BR])

    return row_sum_of_squares_cuda


def row_sum_of_squares_program(C: int, block_rows: int | None = None, *, dtype: str = "float32",
                               target: str = "c", threads: int | None = None):
    """The tile program of ``out[r] = sum_c x[r, c]^2`` (float32): arguments x [N, C], out [N] (N dynamic)."""
    if _check("row sum of squares program", C, dtype, target) == "c":
        return row_sum_of_squares_for_c(C, block_rows or 4, dtype)
    return row_sum_of_squares_for_cuda(C, *_gpu_tiles(C, dtype, block_rows, threads), dtype)


def rmsnorm_for_c(C: int, block_rows: int, eps: float, dtype: str = "float32"):
    """The fused RMSNorm for TileLang's C target: each row is copied once into a local array, then summed and
    scaled from there."""
    N = T.dynamic("N")

    @T.prim_func
    def rmsnorm_c(x: T.Tensor((N, C), dtype), w: T.Tensor((C,), dtype), y: T.Tensor((N, C), dtype)):
        with T.Kernel(T.ceildiv(N, block_rows)) as b:
            row = T.alloc_local((C,), "float32")  # one row on the countertop
            total = T.alloc_local((1,), "float32")
            for i in T.serial(block_rows):
                r = b * block_rows + i
                if r < N:
                    total[0] = 0.0
                    for c in T.serial(C):  # the only read of x
                        row[c] = x[r, c]
                        total[0] += row[c] * row[c]
                    scale = T.rsqrt(total[0] / C + eps)  # the mean divides by C
                    for c in T.serial(C):  # the only write of y, from the local copy
                        y[r, c] = row[c] * scale * w[c]

    return rmsnorm_c


def rmsnorm_for_cuda(C: int, block_rows: int, threads: int, width: int, eps: float, dtype: str = "bfloat16"):
    """The fused RMSNorm for CUDA: block_rows whole rows per block of ``threads`` threads, held in registers
    (padded to ``width`` with zeros), squared, reduced across the block, scaled and stored."""
    N = T.dynamic("N")
    BR, CP = block_rows, width

    @T.prim_func
    def rmsnorm_cuda(x: T.Tensor((N, C), dtype), w: T.Tensor((C,), dtype), y: T.Tensor((N, C), dtype)):
        with T.Kernel(T.ceildiv(N, BR), threads=threads) as b:
            xt = T.alloc_fragment((BR, CP), dtype)  # the rows, in registers
            sq = T.alloc_fragment((BR, CP), "float32")
            scale = T.alloc_fragment((BR,), "float32")
            yt = T.alloc_fragment((BR, CP), dtype)
            T.copy(x[b * BR : b * BR + BR, 0:CP], xt)  # one read; zeros beyond C and beyond the last row
            for i, c in T.Parallel(BR, CP):
                v = T.cast(xt[i, c], "float32")
                sq[i, c] = v * v
            T.reduce_sum(sq, scale, dim=1)  # per-thread sums, then across the block's threads
            for i in T.Parallel(BR):
                scale[i] = T.rsqrt(scale[i] / C + eps)  # divide by C, not by the padded width CP
            for i, c in T.Parallel(BR, CP):
                yt[i, c] = T.cast(T.cast(xt[i, c], "float32") * scale[i] * T.cast(w[c], "float32"), dtype)
            T.copy(yt, y[b * BR : b * BR + BR, 0:CP])  # one write; the padding is never stored

    return rmsnorm_cuda


def rmsnorm_program(C: int, block_rows: int | None = None, eps: float = DEFAULT_EPS, *, dtype: str = "float32",
                    target: str = "c", threads: int | None = None):
    """The tile program of the fused RMSNorm: arguments x [N, C], w [C], y [N, C] (N dynamic; C, eps baked in).

    ``target='c'`` (the default, the course's CPU path) gives one program instance per ``block_rows`` rows;
    a CUDA target gives ``block_rows`` whole rows per thread block of ``threads`` threads.
    """
    t = _check("rmsnorm program", C, dtype, target)
    if not isinstance(eps, (int, float)) or isinstance(eps, bool) or eps < 0:
        raise ValueError(f"rmsnorm program: expected eps >= 0 (a float), got {eps!r}")
    if t == "c":
        return rmsnorm_for_c(C, block_rows or 4, float(eps), dtype)
    return rmsnorm_for_cuda(C, *_gpu_tiles(C, dtype, block_rows, threads), float(eps), dtype)


@functools.lru_cache(maxsize=None)
def row_sum_of_squares_kernel(C: int, block_rows: int | None = None, *, dtype: str = "float32",
                              target: str = "c", threads: int | None = None):
    """The compiled per-row sum of squares (cached per process): call it as ``kernel(x, out)``."""
    program = row_sum_of_squares_program(C, block_rows, dtype=dtype, target=target, threads=threads)
    return compile_program(program, target)


@functools.lru_cache(maxsize=None)
def rmsnorm_kernel(C: int, block_rows: int | None = None, eps: float = DEFAULT_EPS, *, dtype: str = "float32",
                   target: str = "c", threads: int | None = None):
    """The compiled fused RMSNorm (cached per process): call it as ``kernel(x, w, y)``."""
    program = rmsnorm_program(C, block_rows, eps, dtype=dtype, target=target, threads=threads)
    return compile_program(program, target)


def row_sum_of_squares(x: torch.Tensor, *, block_rows: int | None = None) -> torch.Tensor:
    """``(x.float() ** 2).sum(-1)`` by the tile program, on x's device (C target on the CPU)."""
    N, C, dtype = check_rows("row_sum_of_squares: x", x)
    out = torch.empty(N, dtype=torch.float32, device=x.device)
    if N:
        row_sum_of_squares_kernel(C, block_rows, dtype=dtype, target=target_for(x))(x, out)
    return out


def rmsnorm(x: torch.Tensor, w: torch.Tensor, eps: float = DEFAULT_EPS, *, block_rows: int | None = None,
            threads: int | None = None) -> torch.Tensor:
    """The fused RMSNorm of the rows of x [N, C] with weight w [C], on x's device (C target on the CPU)."""
    N, C, dtype = check_rows("rmsnorm: x", x)
    if not isinstance(w, torch.Tensor) or tuple(w.shape) != (C,) or w.dtype != x.dtype or w.device != x.device:
        got = f"{tuple(w.shape)} {w.dtype} on {w.device}" if isinstance(w, torch.Tensor) else type(w).__name__
        raise ValueError(f"rmsnorm: expected w of shape ({C},), {x.dtype} on {x.device}, got {got}")
    w = w.contiguous()
    y = torch.empty_like(x)
    if N:
        rmsnorm_kernel(C, block_rows, float(eps), dtype=dtype, target=target_for(x), threads=threads)(x, w, y)
    return y


def rmsnorm_reference(x: torch.Tensor, w: torch.Tensor, eps: float = DEFAULT_EPS) -> torch.Tensor:
    """The RMSNorm in float64: what every kernel is compared with (returns float64)."""
    x64, w64 = x.detach().to(torch.float64), w.detach().to(torch.float64)
    return x64 * torch.rsqrt(x64.pow(2).mean(dim=-1, keepdim=True) + eps) * w64


def rmsnorm_eager(x: torch.Tensor, w: torch.Tensor, eps: float = DEFAULT_EPS) -> torch.Tensor:
    """The usual eager PyTorch RMSNorm (as in Hugging Face's Llama): 8 kernels, each a pass over HBM."""
    dtype = x.dtype
    h = x.to(torch.float32)  # pass 1: upcast (a copy unless x is already float32)
    variance = h.pow(2).mean(-1, keepdim=True)  # passes 2 and 3: square, then the row mean
    h = h * torch.rsqrt(variance + eps)  # passes 4, 5 (tiny: one number per row) and 6
    return w * h.to(dtype)  # passes 7 (downcast, a copy unless float32) and 8


def rmsnorm_bytes(N: int, C: int, dtype: str = "bfloat16") -> dict:
    """Bytes moved by the fused RMSNorm and by rmsnorm_eager, pass by pass, for N rows of width C.

    Returns {"fused", "eager", "eager_passes": [(what, bytes read, bytes written), ...]}; each kernel reads its
    inputs once and writes its output once. The eager casts are free (no kernel) when dtype is float32.
    """
    s = {"bfloat16": 2, "float16": 2, "float32": 4}[dtype]
    cast = s != 4
    passes = []
    if cast:
        passes.append(("x.to(float32)", N * C * s, N * C * 4))
    passes += [
        ("h.pow(2)", N * C * 4, N * C * 4),
        (".mean(-1)", N * C * 4, N * 4),
        ("variance + eps", N * 4, N * 4),
        ("torch.rsqrt", N * 4, N * 4),
        ("h * rsqrt", N * C * 4 + N * 4, N * C * 4),
    ]
    if cast:
        passes.append(("h.to(dtype)", N * C * 4, N * C * s))
    passes.append(("w * h", C * s + N * C * s, N * C * s))
    eager = sum(r + w for _, r, w in passes)
    fused = 2 * N * C * s + C * s
    return {"fused": fused, "eager": eager, "eager_passes": passes}
