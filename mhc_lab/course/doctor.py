"""What this machine can run: versions, device, and TileLang known-answer runs on the CPU and the GPU."""

from __future__ import annotations

import importlib
import platform

import torch

PACKAGES = ("torch", "tilelang", "numpy", "plotly", "ipywidgets", "jupyterlab", "papermill", "nbval")


def versions() -> dict[str, str | None]:
    found = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            found[name] = importlib.import_module(name).__version__
        except Exception:
            found[name] = None
    return found


def _vector_add(size: int, target):
    import tilelang
    import tilelang.language as T

    @T.prim_func
    def vector_add(a: T.Tensor((size,), "float32"), b: T.Tensor((size,), "float32"),
                   out: T.Tensor((size,), "float32")):
        if isinstance(target, str) and target == "c":
            with T.Kernel(1):
                for i in T.serial(size):
                    out[i] = a[i] + b[i]
        else:
            with T.Kernel(T.ceildiv(size, 128), threads=128) as block:
                for i in T.Parallel(128):
                    if block * 128 + i < size:
                        out[block * 128 + i] = a[block * 128 + i] + b[block * 128 + i]

    return tilelang.compile(vector_add, target=target)


def tilelang_known_answer(device: str = "cpu", size: int = 1000) -> dict:
    """Compile and run a vector add with TileLang on ``device`` ('cpu' uses the C target); compare with torch.

    Returns {"device", "ok", "max_error", "error"}; never raises, so a doctor report always completes.
    """
    try:
        target = "c" if device == "cpu" else "cuda"
        kernel = _vector_add(size, target)
        g = torch.Generator().manual_seed(0)
        a, b = torch.randn(size, generator=g), torch.randn(size, generator=g)
        a, b = a.to(device), b.to(device)
        out = torch.full_like(a, float("nan"))
        kernel(a, b, out)
        error = (out - (a + b)).abs().max().item()
        return {"device": device, "ok": error == 0.0, "max_error": error, "error": None}
    except Exception as error:  # report, don't crash: the doctor's job is to say what works
        return {"device": device, "ok": False, "max_error": None, "error": f"{type(error).__name__}: {error}"}


def report(run_tilelang: bool = True) -> dict:
    """Everything the doctor knows about this machine."""
    info = {"versions": versions(), "cuda": torch.cuda.is_available(), "cpu_threads": torch.get_num_threads()}
    if info["cuda"]:
        info["gpu"] = torch.cuda.get_device_name(0)
    if run_tilelang:
        info["tilelang_cpu"] = tilelang_known_answer("cpu")
        if info["cuda"]:
            info["tilelang_gpu"] = tilelang_known_answer("cuda")
    return info
