# Elementwise tile programs: the copy and the residual add, the yardsticks of every memory-bound kernel.
#
#   copy:          out[r, c] = x[r, c]
#   residual add:  out[r, c] = x[r, c] + f[r, c]          (the residual of arXiv 1603.05027, Eq. 3, with the
#                                                          layer's output f = F(x) already computed)
#
# Bytes for N rows of C elements of s bytes (every input read once, every output written once):
#   copy          reads N C s,    writes N C s    -> 2 N C s
#   residual add  reads 2 N C s,  writes N C s    -> 3 N C s;  N C FLOPs, 1 FLOP per 3 s bytes
# Both do (almost) no arithmetic: their time is their bytes divided by the memory bandwidth, which makes them
# the measuring stick for the fused kernels of labs 05 and 06. Fuses nothing (there is nothing to fuse).
#
# One factory per kernel, two programs chosen by target, computing the same function:
# - CUDA: a thread block owns a [block_rows x block_cols] tile; T.copy moves it from HBM into registers
#   (fragments) with 16-byte vector loads, masking the tail rows and columns; a parallel loop adds in float32;
#   T.copy stores the tile back.
# - C target (TileLang's CPU backend): one program instance per tile of block_rows rows, one after another;
#   plain loops, the tail rows guarded by `if r < N`.
"""Elementwise tile programs (copy, residual add) for CUDA and for TileLang's C target, with their wrappers."""


import functools

import tilelang.language as T
import torch

from mhc_lab.kernels._target import canonical_target, compile_program, round_up

GPU_DTYPES = ("bfloat16", "float16", "float32")
TORCH_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def check_kernel_args(name: str, C: int, dtype: str, target: str) -> str:
    """Validate a width and dtype for ``target``; returns the canonical target."""
    if isinstance(C, bool) or not isinstance(C, int) or C < 1:
        raise ValueError(f"{name}: expected a positive width C (an int), got C = {C!r}")
    t = canonical_target(target)
    allowed = ("float32",) if t == "c" else GPU_DTYPES
    if dtype not in allowed:
        raise ValueError(f"{name} on target {t!r}: expected dtype in {allowed}, got {dtype!r}")
    return t


def default_tiles(C: int, dtype: str) -> tuple[int, int, int]:
    """(block_rows, block_cols, threads) for CUDA: each thread moves whole 16-byte vectors, two per tensor."""
    threads = 256
    vec = 16 // torch.empty((), dtype=TORCH_DTYPES[dtype]).element_size()
    block_cols = 512 if C >= 512 else max(64, 1 << (C - 1).bit_length())
    block_rows = max(1, 2 * threads * vec // block_cols)
    return block_rows, block_cols, threads


def copy_for_c(C: int, block_rows: int, dtype: str = "float32"):
    """The copy for TileLang's C target: one program instance per tile of block_rows rows."""
    N = T.dynamic("N")  # the row count is known only when the kernel runs

    @T.prim_func
    def copy_c(x: T.Tensor((N, C), dtype), out: T.Tensor((N, C), dtype)):
        with T.Kernel(T.ceildiv(N, block_rows)) as b:  # the grid: instances 0 .. ceil(N / block_rows) - 1
            for i in T.serial(block_rows):
                r = b * block_rows + i
                if r < N:  # the last tile may hang over the end
                    for c in T.serial(C):
                        out[r, c] = x[r, c]

    return copy_c


def copy_for_cuda(C: int, block_rows: int, block_cols: int, threads: int, dtype: str = "bfloat16"):
    """The copy for CUDA: a thread block per [block_rows x block_cols] tile, staged through registers."""
    N = T.dynamic("N")
    BR, BC = block_rows, block_cols

    @T.prim_func
    def copy_cuda(x: T.Tensor((N, C), dtype), out: T.Tensor((N, C), dtype)):
        with T.Kernel(T.ceildiv(C, BC), T.ceildiv(N, BR), threads=threads) as (bc, br):
            tile = T.alloc_fragment((BR, BC), dtype)  # registers, spread over the block's threads
            T.copy(x[br * BR : br * BR + BR, bc * BC : bc * BC + BC], tile)  # vector loads, edges masked
            T.copy(tile, out[br * BR : br * BR + BR, bc * BC : bc * BC + BC])

    return copy_cuda


def residual_add_for_c(C: int, block_rows: int, dtype: str = "float32"):
    """The residual add for TileLang's C target: one program instance per tile of block_rows rows."""
    N = T.dynamic("N")

    @T.prim_func
    def residual_add_c(x: T.Tensor((N, C), dtype), f: T.Tensor((N, C), dtype), out: T.Tensor((N, C), dtype)):
        with T.Kernel(T.ceildiv(N, block_rows)) as b:
            for i in T.serial(block_rows):
                r = b * block_rows + i
                if r < N:
                    for c in T.serial(C):
                        out[r, c] = x[r, c] + f[r, c]

    return residual_add_c


def residual_add_for_cuda(C: int, block_rows: int, block_cols: int, threads: int, dtype: str = "bfloat16"):
    """The residual add for CUDA: a thread block per [block_rows x block_cols] tile; adds in float32."""
    N = T.dynamic("N")
    BR, BC = block_rows, block_cols

    @T.prim_func
    def residual_add_cuda(x: T.Tensor((N, C), dtype), f: T.Tensor((N, C), dtype), out: T.Tensor((N, C), dtype)):
        with T.Kernel(T.ceildiv(C, BC), T.ceildiv(N, BR), threads=threads) as (bc, br):
            xt = T.alloc_fragment((BR, BC), dtype)
            ft = T.alloc_fragment((BR, BC), dtype)
            ot = T.alloc_fragment((BR, BC), dtype)
            T.copy(x[br * BR : br * BR + BR, bc * BC : bc * BC + BC], xt)
            T.copy(f[br * BR : br * BR + BR, bc * BC : bc * BC + BC], ft)
            for i, c in T.Parallel(BR, BC):  # the threads of the block share out the tile's elements
                ot[i, c] = T.cast(T.cast(xt[i, c], "float32") + T.cast(ft[i, c], "float32"), dtype)
            T.copy(ot, out[br * BR : br * BR + BR, bc * BC : bc * BC + BC])

    return residual_add_cuda


def _gpu_tiles(C, dtype, block_rows, block_cols, threads):
    d_br, d_bc, d_th = default_tiles(C, dtype)
    return block_rows or d_br, min(block_cols or d_bc, round_up(C, 64)), threads or d_th


def copy_program(C: int, block_rows: int | None = None, *, dtype: str = "float32", target: str = "c",
                 block_cols: int | None = None, threads: int | None = None):
    """The tile program of ``out = x`` for rows of width C: arguments x [N, C], out [N, C] (N dynamic)."""
    if check_kernel_args("copy program", C, dtype, target) == "c":
        return copy_for_c(C, block_rows or 4, dtype)
    return copy_for_cuda(C, *_gpu_tiles(C, dtype, block_rows, block_cols, threads), dtype)


def residual_add_program(C: int, block_rows: int | None = None, *, dtype: str = "float32", target: str = "c",
                         block_cols: int | None = None, threads: int | None = None):
    """The tile program of ``out = x + f`` for rows of width C: arguments x, f, out, each [N, C] (N dynamic).

    ``target='c'`` (the default, the course's CPU path) gives one program instance per ``block_rows`` rows;
    a CUDA target gives [block_rows x block_cols] tiles per thread block of ``threads`` threads.
    """
    if check_kernel_args("residual add program", C, dtype, target) == "c":
        return residual_add_for_c(C, block_rows or 4, dtype)
    return residual_add_for_cuda(C, *_gpu_tiles(C, dtype, block_rows, block_cols, threads), dtype)


@functools.lru_cache(maxsize=None)
def copy_kernel(C: int, block_rows: int | None = None, *, dtype: str = "float32", target: str = "c",
                block_cols: int | None = None, threads: int | None = None):
    """The compiled copy (cached per process): call it as ``kernel(x, out)``."""
    program = copy_program(C, block_rows, dtype=dtype, target=target, block_cols=block_cols, threads=threads)
    return compile_program(program, target)


@functools.lru_cache(maxsize=None)
def residual_add_kernel(C: int, block_rows: int | None = None, *, dtype: str = "float32", target: str = "c",
                        block_cols: int | None = None, threads: int | None = None):
    """The compiled residual add (cached per process): call it as ``kernel(x, f, out)``."""
    program = residual_add_program(C, block_rows, dtype=dtype, target=target, block_cols=block_cols,
                                   threads=threads)
    return compile_program(program, target)


def target_for(tensor: torch.Tensor) -> str:
    """'c' for a CPU tensor, 'cuda' for a GPU tensor: where a wrapper runs its kernel."""
    return "cuda" if tensor.device.type == "cuda" else "c"


def check_rows(name: str, x, C: int | None = None) -> tuple[int, int, str]:
    """A contiguous [N, C] tensor of a dtype the target supports; returns (N, C, dtype name)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 2 or x.shape[1] < 1:
        raise ValueError(f"{name}: expected a 2-D tensor [rows, C] with C >= 1, got shape {tuple(x.shape)}")
    if C is not None and x.shape[1] != C:
        raise ValueError(f"{name}: expected width C = {C}, got shape {tuple(x.shape)}")
    dtype = next((k for k, v in TORCH_DTYPES.items() if v == x.dtype), None)
    allowed = ("float32",) if x.device.type == "cpu" else GPU_DTYPES
    if dtype not in allowed:
        raise ValueError(f"{name} on {x.device.type}: expected dtype in {allowed}, got {x.dtype}"
                         + (" (the C target computes in float32: pass x.float())" if x.device.type == "cpu" else ""))
    if not x.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous tensor; call .contiguous() first")
    return x.shape[0], x.shape[1], dtype


def copy(x: torch.Tensor, *, block_rows: int | None = None) -> torch.Tensor:
    """``x.clone()`` by the copy tile program, on x's device (C target on the CPU)."""
    N, C, dtype = check_rows("copy: x", x)
    out = torch.empty_like(x)
    if N:
        copy_kernel(C, block_rows, dtype=dtype, target=target_for(x))(x, out)
    return out


def residual_add(x: torch.Tensor, f: torch.Tensor, *, block_rows: int | None = None) -> torch.Tensor:
    """``x + f`` by the residual-add tile program, on x's device (C target on the CPU)."""
    N, C, dtype = check_rows("residual_add: x", x)
    check_rows("residual_add: f", f, C)
    if f.shape != x.shape or f.dtype != x.dtype or f.device != x.device:
        raise ValueError(f"residual_add: expected f like x {tuple(x.shape)} {x.dtype} on {x.device}, "
                         f"got {tuple(f.shape)} {f.dtype} on {f.device}")
    out = torch.empty_like(x)
    if N:
        residual_add_kernel(C, block_rows, dtype=dtype, target=target_for(x))(x, f, out)
    return out


def copy_bytes(N: int, C: int, itemsize: int = 2) -> dict:
    """Least bytes a copy of N x C elements must move."""
    return {"read": N * C * itemsize, "write": N * C * itemsize, "total": 2 * N * C * itemsize, "flops": 0}


def residual_add_bytes(N: int, C: int, itemsize: int = 2) -> dict:
    """Least bytes the residual add of two N x C tensors must move, and its FLOPs."""
    return {"read": 2 * N * C * itemsize, "write": N * C * itemsize, "total": 3 * N * C * itemsize,
            "flops": N * C}
