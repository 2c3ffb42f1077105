"""One timer, one device choice, and the tags that make a measurement repeatable (device, versions, date)."""

from __future__ import annotations

import datetime as _dt
import platform
import statistics
import subprocess
import time
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


def time_fn(fn: Callable[[], object], *, warmup: int = 3, repeat: int = 10, device=None) -> dict:
    """Median, min and max seconds of ``fn()`` after warm-up; CUDA work is timed with events.

    Returns {"median_s", "min_s", "max_s", "repeat"}.
    """
    dev = torch.device(device) if device is not None else None
    on_cuda = torch.cuda.is_available() and (dev is None or dev.type == "cuda")
    for _ in range(warmup):
        fn()
    times = []
    if on_cuda:
        torch.cuda.synchronize()
        for _ in range(repeat):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
    else:
        for _ in range(repeat):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return {"median_s": statistics.median(times), "min_s": min(times), "max_s": max(times), "repeat": repeat}


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
