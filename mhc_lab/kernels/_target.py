"""Targets and compilation shared by every kernel factory.

A factory takes compile-time parameters (n, C, dtype, tile sizes, target) and returns a tile program; the
``compile_*`` helpers turn a program into a callable kernel once per process (``functools.lru_cache``) and
TileLang's own on-disk cache makes the next process cheap too.

Targets, as accepted everywhere in ``mhc_lab.kernels``:

- ``"c"`` (or ``"cpu"``): TileLang's C target. The program runs on the CPU, one program instance after
  another; GPU-only constructs (threads, fragments, shared memory, tensor cores) are replaced by plain loops.
- ``"cuda"``: the current GPU torch sees (its compute capability), or sm_90a when torch sees none.
- ``"sm_90"`` (any ``"sm_XY"``): a CUDA build for that architecture, also on a machine without a GPU
  (compile-only check: nvcc must be on PATH or in /usr/local/cuda/bin). From sm_90 on, ``"sm_XY"`` means
  ``"sm_XYa"``, the build with that architecture's own instructions: on Hopper the warpgroup MMA (wgmma), and
  from Hopper on setmaxnreg, which TileLang's warp-specialised pipelines use.

Which programs a target takes: the Hopper programs (TMA, wgmma) on sm_90 (is_hopper); the portable ones
(cp.async and mma.sync where TileLang lowers to them, TMA where the architecture has it) on sm_80 and later.
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
import threading

_CUDA_HOME_BIN = "/usr/local/cuda/bin"
_lock = threading.Lock()


def canonical_target(target: str) -> str:
    """'cpu' and 'c' -> 'c'; 'cuda' -> 'sm_XY' of the visible GPU (sm_90 if none); 'sm_XY' unchanged."""
    if not isinstance(target, str):
        raise ValueError(f"target: expected 'c', 'cpu', 'cuda' or 'sm_XY', got {target!r}")
    t = target.lower()
    if t in ("c", "cpu"):
        return "c"
    if t == "cuda":
        try:
            import torch

            if torch.cuda.is_available():
                major, minor = torch.cuda.get_device_capability()
                return canonical_target(f"sm_{major}{minor}")
        except Exception:  # torch without CUDA: fall through to the default build
            pass
        return "sm_90a"
    if t.startswith("sm_") and t[3:].rstrip("a").isdigit():
        # from sm_90 on, the architecture's own instructions (wgmma on Hopper, setmaxnreg) need the "a" build
        return t + "a" if int(t[3:].rstrip("a")) >= 90 and not t.endswith("a") else t
    raise ValueError(f"target: expected 'c', 'cpu', 'cuda' or 'sm_XY', got {target!r}")


def memoize(fn):
    """functools.lru_cache for the host-side decisions that torch.compile traces as well (which backend, which
    program, which target): a plain dict, which Dynamo reads through, where every lru_cache it traces draws a
    warning (it ignores the cache and traces the function). Positional, hashable arguments only."""
    cache = {}

    @functools.wraps(fn)
    def memoized(*args):
        value = cache.get(args)
        if value is None:
            value = cache[args] = fn(*args)
        return value

    return memoized


@memoize
def device_target(capability: tuple[int, int]) -> str:
    """The canonical target of a GPU of this compute capability: (8, 6) -> 'sm_86', (9, 0) -> 'sm_90a'."""
    major, minor = capability
    return canonical_target(f"sm_{major}{minor}")


def tensor_target(tensor) -> str:
    """The canonical target of the GPU a CUDA tensor is on (whatever the current device); where torch sees no
    GPU (tensors that stand in for CUDA ones), the default build, as canonical_target('cuda')."""
    return _index_target(tensor.device.index)


@functools.lru_cache(maxsize=None)
def _index_target(index: int | None) -> str:
    # cached per device: asking torch took 8 us of host time, on every launch of the ops
    import torch

    if not torch.cuda.is_available():
        return canonical_target("cuda")
    return device_target(torch.cuda.get_device_capability(index))


def arch_number(target: str) -> int:
    """A CUDA target's architecture as a number: 'sm_86' -> 86, 'sm_90a' -> 90 (ValueError for the C target)."""
    t = canonical_target(target)
    if t == "c":
        raise ValueError("arch_number: expected a CUDA target ('cuda' or 'sm_XY'), got the C target")
    return int(t[3:].rstrip("a"))


def is_hopper(target: str) -> bool:
    """Whether a CUDA target is Hopper (sm_90), the one architecture with both TMA and the warpgroup MMA (wgmma)
    that the Hopper programs use; Blackwell (sm_100, sm_120) has TMA but not wgmma."""
    return 90 <= arch_number(target) < 100


def is_gpu(target: str) -> bool:
    return canonical_target(target) != "c"


def tilelang_target(target: str):
    """What ``tilelang.compile`` takes for our canonical target names."""
    t = canonical_target(target)
    if t == "c":
        return "c"
    return {"kind": "cuda", "arch": t}


def cuda_tool(name: str) -> str | None:
    """A CUDA toolkit binary (nvcc, cuobjdump, ...) on PATH or in /usr/local/cuda/bin; None if neither."""
    found = shutil.which(name)
    if found:
        return found
    candidate = os.path.join(_CUDA_HOME_BIN, name)
    return candidate if os.path.exists(candidate) else None


def nvcc_path() -> str | None:
    """nvcc on PATH or in /usr/local/cuda/bin; None if neither."""
    return cuda_tool("nvcc")


def _ensure_nvcc_on_path() -> None:
    nvcc = nvcc_path()
    if nvcc is None:
        raise RuntimeError(
            "building a CUDA kernel needs nvcc, found neither on PATH nor in /usr/local/cuda/bin; "
            "install the CUDA toolkit or use target='c' for the CPU path"
        )
    folder = os.path.dirname(nvcc)
    if folder not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = folder + os.pathsep + os.environ.get("PATH", "")


def quiet_tilelang() -> None:
    """TileLang logs every compile at INFO; keep the course's output readable."""
    import logging

    logging.getLogger("TileLang").setLevel(logging.WARNING)
    for name in list(logging.root.manager.loggerDict):
        if name.startswith("tilelang") or name.startswith("TileLang"):
            logging.getLogger(name).setLevel(logging.WARNING)


# TileLang builds C-target kernels with the C compiler's defaults (no optimisation); -O3 makes the same loops
# about 7 times faster on a laptop CPU and costs no extra compile time.
C_TARGET_FLAGS = ["-O3"]

SMEM_LIMIT = 227 * 1024  # bytes of shared memory one CTA may use on Hopper (sm_90)
# bytes of shared memory one CTA may use on every GPU from sm_80 on: 99 KB on sm_86, sm_89 and sm_120 (163 KB
# on sm_80, 227 KB on sm_90 and sm_100)
PORTABLE_SMEM_LIMIT = 99 * 1024
# How a portable program is lowered on every GPU, Hopper and Blackwell included: T.copy to cp.async (no TMA),
# T.gemm to mma.sync (no wgmma), no warp specialisation. A portable program is written for products that are
# done where they are issued; lowered Hopper-style it would not be the program sm_80 runs (and is not right).
PORTABLE_LOWERING = {"tl.disable_warp_specialized": True, "tl.disable_tma_lower": True, "tl.disable_wgmma": True}


# A pair of bf16 values to float32. TileLang's generated CUDA converts a pair with __bfloat1622float2, which ptxas
# turns into three instructions (the high half moved down by a PRMT, then each half shifted up); the same values,
# bit for bit, take two (the low half shifted up, the high half masked in place). In kernel 2 of the pre backward
# that is about 140 of its 1560 instructions per tile and consumer warp (SASS, kernel notes).
BF16X2_TO_FLOAT2 = """
__device__ __forceinline__ float2 mhc_bf16x2_to_float2(const __nv_bfloat162 pair) {
  const unsigned int bits = *reinterpret_cast<const unsigned int*>(&pair);
  return make_float2(__uint_as_float(bits << 16), __uint_as_float(bits & 0xffff0000u));
}
"""
_CUDA_POSTPROC = "tilelang_callback_cuda_postproc"
# a call converting a bf16 pair in generated CUDA, before or after two_instruction_bf16_pairs (regular expression)
BF16_PAIR_CONVERSION = r"(?:__bfloat1622float2|mhc_bf16x2_to_float2)\(\("
# nvcc flags of every CUDA build: a macro naming the version of two_instruction_bf16_pairs, so that TileLang's
# kernel cache (keyed on the flags, not on the post-processing) builds kernels cached before it again
CUDA_FLAGS = ["-DMHC_LAB_CUDA_POSTPROC=1"]


def two_instruction_bf16_pairs(code: str) -> str:
    """Generated CUDA with every __bfloat1622float2 call replaced by mhc_bf16x2_to_float2 (defined before the
    first kernel); code without such calls unchanged."""
    if "__bfloat1622float2(" not in code:
        return code
    first = code.find("__global__")
    start = code.rfind("\n", 0, first) + 1 if first >= 0 else len(code)
    body = code[start:].replace("__bfloat1622float2(", "mhc_bf16x2_to_float2(")
    return code[:start] + BF16X2_TO_FLOAT2.lstrip("\n") + body


@contextlib.contextmanager
def code_generation():
    """One TileLang code generation at a time (thread-safe); within it, generated CUDA passes through
    two_instruction_bf16_pairs, after any post-processing registered before, which is restored afterwards."""
    import tvm_ffi

    with _lock:
        previous = tvm_ffi.get_global_func(_CUDA_POSTPROC, allow_missing=True)

        def postproc(code, target):
            return two_instruction_bf16_pairs(previous(code, target) if previous is not None else code)

        tvm_ffi.register_global_func(_CUDA_POSTPROC, f=postproc, override=True)
        try:
            yield
        finally:
            if previous is not None:
                tvm_ffi.register_global_func(_CUDA_POSTPROC, f=previous, override=True)
            else:
                tvm_ffi.remove_global_func(_CUDA_POSTPROC)


def compile_program(program, target: str, pass_configs: dict | None = None):
    """``tilelang.compile`` for one of our canonical targets (thread-safe; logs quieted; C target with -O3; CUDA
    with its bf16 pairs converted by two_instruction_bf16_pairs and CUDA_FLAGS).

    A program compiled before in this process comes from TileLang's memory cache, without its warning."""
    import logging

    import tilelang

    quiet_tilelang()
    t = canonical_target(target)
    if t != "c":
        _ensure_nvcc_on_path()
    extra = {"compile_flags": C_TARGET_FLAGS if t == "c" else CUDA_FLAGS}
    cache_log = logging.getLogger("tilelang.cache.kernel_cache")
    was_disabled, cache_log.disabled = cache_log.disabled, True
    try:
        with code_generation():
            kernel = tilelang.compile(program, target=tilelang_target(t), pass_configs=pass_configs or None, **extra)
    finally:
        cache_log.disabled = was_disabled
    _launch_directly(kernel)
    return kernel


def _launch_directly(kernel) -> None:
    """Route a compiled kernel's calls straight to its entry function where TileLang runs it through TVM FFI
    with every argument passed in (no output allocated by the call): TileLang's adapter (its argument loop in
    Python), the executable's JIT check and the entry function's lookup took about 7 us of host time per
    launch, on the critical path of a small model's step. The entry function keeps the checks compiled into
    the kernel's host code (each tensor's dtype, shape, device). Other adapters (the C target's) unchanged."""
    adapter = getattr(kernel, "adapter", None)
    if (type(adapter).__name__ != "TVMFFIKernelAdapter" or adapter.result_idx
            or getattr(adapter, "_ffi_callee_allocated_output_abi", False)):
        return
    executable = adapter._get_executable()  # a TVM FFI module, or an Executable to JIT into one
    module = executable.jit() if getattr(type(executable), "jit", None) else executable
    kernel.torch_function = module.main


def check_lanes_and_width(name: str, n, C, max_lanes: int) -> None:
    """The n and C checks every mHC kernel factory makes: 1 <= n <= max_lanes lanes, a positive width C."""
    if not isinstance(n, int) or not 1 <= n <= max_lanes:
        raise ValueError(f"{name}: expected 1 <= n <= {max_lanes} lanes, got n = {n!r}")
    if not isinstance(C, int) or C < 1:
        raise ValueError(f"{name}: expected a positive width C, got C = {C!r}")


def check_target_dtype(name: str, dtype: str, target: str, gpu_dtypes: tuple[str, ...]) -> str:
    """The canonical target, after checking the dtype: float32 on the C target, one of gpu_dtypes on CUDA."""
    t = canonical_target(target)
    allowed = ("float32",) if t == "c" else tuple(gpu_dtypes)
    if dtype not in allowed:
        raise ValueError(f"{name} on target {t!r}: expected dtype in {allowed}, got {dtype!r}")
    return t


def round_up(value: int, multiple: int) -> int:
    return (value + multiple - 1) // multiple * multiple


def ceil_div(a: int, b: int) -> int:
    return (a + b - 1) // b


# The most shared memory one block may use, by compute capability (CUDA C++ Programming Guide, technical
# specifications per compute capability). Capabilities not listed get the least of their major version's, and
# from 13 on that of 12.
SHARED_BYTES_PER_BLOCK = {
    (7, 0): 96 * 1024, (7, 2): 96 * 1024, (7, 5): 64 * 1024,
    (8, 0): 163 * 1024, (8, 6): 99 * 1024, (8, 7): 163 * 1024, (8, 9): 99 * 1024,
    (9, 0): 227 * 1024,
    (10, 0): 227 * 1024, (10, 3): 227 * 1024, (11, 0): 227 * 1024,
    (12, 0): 99 * 1024, (12, 1): 99 * 1024,
}


def shared_bytes_per_block(capability: tuple[int, int]) -> int:
    """The most shared memory a block may use on a GPU of this compute capability (SHARED_BYTES_PER_BLOCK)."""
    if capability in SHARED_BYTES_PER_BLOCK:
        return SHARED_BYTES_PER_BLOCK[capability]
    major = min(capability[0], 12)
    same = [b for (ma, _), b in SHARED_BYTES_PER_BLOCK.items() if ma == major]
    return min(same) if same else min(SHARED_BYTES_PER_BLOCK.values())


def shared_memory_limit(target: str) -> int:
    """The most shared memory a block may use on the GPUs of a CUDA target's architecture
    (shared_bytes_per_block)."""
    arch = arch_number(target)
    return shared_bytes_per_block((arch // 10, arch % 10))
