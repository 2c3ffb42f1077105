"""One timer (and its interleaved form, for comparisons), one device choice, and the tags that make a
measurement repeatable (device, versions, date)."""

from __future__ import annotations

import datetime as _dt
import platform
import statistics
import subprocess
import time
from pathlib import Path
from typing import Callable

import torch


def resolve_device(device: str = "auto") -> torch.device:
    """'auto' picks CUDA when present, else the CPU; 'cuda' without a GPU is an error that says so."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("DEVICE='cuda' was asked for, but torch sees no CUDA GPU here; use 'auto' or 'cpu'")
    if device not in ("cpu", "cuda"):
        raise ValueError(f"DEVICE: expected 'auto', 'cpu' or 'cuda', got {device!r}")
    return torch.device(device)


def synchronize(device: torch.device | str | None = None) -> None:
    if torch.cuda.is_available() and (device is None or torch.device(device).type == "cuda"):
        torch.cuda.synchronize()


def keep_freed_memory() -> bool:
    """Ask the C library's malloc to keep the memory the process frees, so that a later allocation reuses pages
    an earlier call already touched; returns whether it applied (glibc only; elsewhere nothing changes).

    Why a timer needs it: PyTorch's CPU tensors come from malloc, and glibc hands a large block back to the
    operating system when it is freed (munmap, or trimming the top of the heap). The next call's tensor then
    sits in fresh pages, and the first write to each 4 KiB page is a page fault: the kernel maps and zeroes it,
    a microsecond or more per page (several in a virtual machine). A 2 MB residual add pays 512 of them in some
    calls and none in others, and its time differs tenfold between the two. With the thresholds raised, memory
    stays mapped and every call after the warm-up finds its pages ready, as every call on a GPU does (PyTorch's
    CUDA caching allocator keeps freed blocks for reuse). The setting lasts for the process: memory it has used
    stays reserved for it until it exits."""
    global _FREED_MEMORY_KEPT
    if _FREED_MEMORY_KEPT is None:
        _FREED_MEMORY_KEPT = False
        try:
            import ctypes

            libc = ctypes.CDLL("libc.so.6")
            mallopt = libc.mallopt
        except (OSError, AttributeError):  # not glibc (macOS, Windows, musl)
            return False
        mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
        largest = 2**31 - 1
        # M_TRIM_THRESHOLD (-1): never give the top of the heap back; M_MMAP_THRESHOLD (-3): serve large blocks
        # from the heap, not from mmap (glibc may refuse a threshold past its heap size; then take its largest)
        trimmed = mallopt(-1, largest) == 1
        mapped = mallopt(-3, largest) == 1 or mallopt(-3, 32 * 2**20) == 1
        _FREED_MEMORY_KEPT = trimmed and mapped
    return _FREED_MEMORY_KEPT


_FREED_MEMORY_KEPT: bool | None = None  # keep_freed_memory() asks malloc once per process


def cpu_clock() -> Callable[[], float]:
    """The clock of CPU timings: the calling thread's CPU time (``time.thread_time``) while PyTorch runs on
    one thread (the labs' setup() pins it), else the wall clock (``time.perf_counter``).

    On one thread the work runs on the calling thread alone, and its CPU time is its wall time less the spells
    it waited for a core: on a machine whose cores other programs share, the scheduler takes the core away for
    milliseconds at a time, which stretches a call of 20 ms most of the times it runs and one of 0.2 ms seldom,
    so wall-clock ratios between them grow with the load. The thread's CPU time leaves those spells out (it
    keeps the time the kernel spends on the thread's behalf, page faults included). With several threads the
    work also runs on threads this clock does not see, so the wall clock it is."""
    return time.thread_time if torch.get_num_threads() == 1 else time.perf_counter


def _on_cuda(device) -> bool:
    dev = torch.device(device) if device is not None else None
    return torch.cuda.is_available() and (dev is None or dev.type == "cuda")


def _timed_calls(fn: Callable[[], object], calls: int, on_cuda: bool,
                 before: Callable[[], object] | None = None) -> list[float]:
    times = []
    if on_cuda:
        torch.cuda.synchronize()
        for _ in range(calls):
            if before is not None:
                before()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
    else:
        clock = cpu_clock()
        for _ in range(calls):
            if before is not None:
                before()
            t0 = clock()
            fn()
            times.append(clock() - t0)
    return times


def time_fn(fn: Callable[[], object], *, warmup: int = 3, repeat: int = 10, device=None) -> dict:
    """Median, min and max seconds of ``fn()`` after warm-up; CUDA work is timed with events, CPU work after
    :func:`keep_freed_memory`.

    Returns {"median_s", "min_s", "max_s", "repeat"}. To compare several calls with each other on a machine
    that others use, :func:`time_interleaved` is the steadier clock.
    """
    on_cuda = _on_cuda(device)
    if not on_cuda:
        keep_freed_memory()
    for _ in range(warmup):
        fn()
    times = _timed_calls(fn, repeat, on_cuda)
    return {"median_s": statistics.median(times), "min_s": min(times), "max_s": max(times), "repeat": repeat}


def last_level_cache_bytes(device=None) -> int | None:
    """Bytes of the largest cache between the cores (or a GPU's SMs) and memory: the GPU's L2, or on Linux
    the CPU's last level as /sys reports it; None where it cannot be read."""
    if _on_cuda(device):
        return int(getattr(torch.cuda.get_device_properties(torch.cuda.current_device()), "L2_cache_size", 0)) or None
    sizes = []
    for entry in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = entry.read_text().strip()
        units = {"K": 2**10, "M": 2**20, "G": 2**30}
        if text and text[-1] in units and text[:-1].isdigit():
            sizes.append(int(text[:-1]) * units[text[-1]])
        elif text.isdigit():
            sizes.append(int(text))
    return max(sizes) if sizes else None


def cache_flush(device=None) -> Callable[[], object]:
    """A call that evicts the caches: it reads (on a GPU, writes) a buffer of twice the last-level cache, at
    least 64 MiB, so whatever ran before is out of them and the next call fetches its data from memory."""
    cache = last_level_cache_bytes(device) or 0
    numel = max(2 * cache, 64 * 2**20) // 4
    if _on_cuda(device):
        buffer = torch.empty(numel, dtype=torch.float32, device=device or "cuda")
        return buffer.zero_
    buffer = torch.ones(numel, dtype=torch.float32)
    return buffer.sum  # reading is enough: the lines it brings in push everything else out


def time_interleaved(fns: dict[str, Callable[[], object]], *, rounds: int = 5, calls: int = 3,
                     warmup_s: float = 0.05, cold: bool = False, device=None) -> dict[str, dict]:
    """Time several calls against each other, in interleaved rounds; {name: {"median_s", "min_s", "max_s",
    "repeat", "rounds", "calls"}}.

    Each round times every call ``calls`` times back to back and keeps the fastest of those; ``median_s`` is
    the median over the rounds of that fastest time, ``min_s`` and ``max_s`` its extremes. Why each piece:

    - warm-up: every call runs at least twice and for at least ``warmup_s`` seconds in all, so its memory has
      been touched (with :func:`keep_freed_memory`, on a CPU) and its caches and clocks are up;
    - the fastest of a few back-to-back calls: the work is the same each call and other programs only add
      time, so the fastest one is the call's own cost;
    - rounds: a busy spell of the machine lands in one round, not on one call alone; interleaving the calls
      makes it land on all of them alike, so their ratios hold;
    - the median over rounds: one round disturbed throughout, or one lucky round, moves nothing;
    - ``cold``: each timed call starts after :func:`cache_flush` (not timed), so it fetches its inputs from
      memory, as a layer inside a model does and as the roof's copy does. Warm, a call whose data fit in the
      cache finds them there or not depending on what ran in between (on a shared machine, other programs),
      and its time swings with that.

    On a CPU the clock is :func:`cpu_clock`.
    """
    for value, name in ((rounds, "rounds"), (calls, "calls")):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}: expected a positive int, got {value!r}")
    if not fns:
        raise ValueError("fns: expected at least one call to time, got none")
    on_cuda = _on_cuda(device)
    if not on_cuda:
        keep_freed_memory()
    for fn in fns.values():
        fn()
        synchronize(device)
        start, runs = time.perf_counter(), 0
        while runs < 1 or time.perf_counter() - start < warmup_s / len(fns):
            fn()
            synchronize(device)
            runs += 1
    flush = cache_flush(device) if cold else None
    best: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            best[name].append(min(_timed_calls(fn, calls, on_cuda, flush)))
    return {name: {"median_s": statistics.median(times), "min_s": min(times), "max_s": max(times),
                   "repeat": rounds * calls, "rounds": rounds, "calls": calls} for name, times in best.items()}


def gigabytes_per_second(nbytes: float, seconds: float) -> float:
    return nbytes / seconds / 1e9


def environment_tags() -> dict:
    """What a measurement needs to be repeatable: device, driver, library versions, date."""
    tags = {
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu": platform.processor() or platform.machine(),
        "cpu_threads": torch.get_num_threads(),
    }
    try:
        import tilelang

        tags["tilelang"] = tilelang.__version__
    except Exception:  # tilelang is optional at run time on machines where it cannot load
        tags["tilelang"] = None
    try:
        import triton

        tags["triton"] = triton.__version__
    except Exception:
        tags["triton"] = None
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        tags.update(
            gpu=props.name,
            gpu_memory_gib=round(props.total_memory / 2**30, 1),
            sm_count=props.multi_processor_count,
            cuda=torch.version.cuda,
            driver=_nvidia_driver(),
        )
    else:
        tags["gpu"] = None
    return tags


def _nvidia_driver() -> str | None:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=10,
        )
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None
    except (OSError, subprocess.SubprocessError):
        return None
