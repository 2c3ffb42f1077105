"""Counting what a PyTorch layer really launches and moves: every aten operation it runs (with the bytes of its
inputs and outputs), the kernels the profiler sees, time per operator group, eager against torch.compile.

Two instruments, because a CPU has no kernel launches to count:

- :func:`trace_ops` watches the operations PyTorch dispatches (a TorchDispatchMode). Each operation that
  computes is one pass over memory, one kernel on a GPU; views (reshape, transpose, ...) move nothing and are
  not counted; reading a number back to the host (``.item()``, ``if tensor``) is a *sync*, counted apart.
  The bytes of an operation are its inputs read once and its outputs written once. It sees the same operations
  on any device, so its counts are exact and repeatable.
- :func:`profile_run` runs the layer under torch.profiler: on CUDA it counts the GPU kernels and their time;
  on a CPU it reports the time of each aten operator. Both are grouped into operator groups.
"""

from __future__ import annotations

import collections
import contextlib
import os
import re
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from mhc_lab.measure import synchronize, time_fn

GROUPS = ("matmul", "reduction", "elementwise", "copy / cast", "compiled (fused)", "other")

_MATMUL = {"mm", "bmm", "mv", "addmm", "addmv", "baddbmm", "matmul", "linear", "dot", "_scaled_mm"}
_REDUCTION = {"sum", "mean", "amax", "amin", "max", "min", "any", "all", "_softmax", "softmax", "log_softmax",
              "_log_softmax", "native_layer_norm", "layer_norm", "norm", "linalg_vector_norm", "logsumexp",
              "var", "var_mean", "std", "prod", "cumsum", "_fused_rms_norm", "rms_norm", "argmax"}
_COPY = {"copy_", "_to_copy", "to", "clone", "contiguous", "_local_scalar_dense", "item", "_copy_from",
         "_copy_from_and_resize", "lift_fresh", "cat", "stack"}
# Operations that move no data: a view or an alias of an existing tensor, or bare metadata.
_NO_DATA = {"detach", "alias", "_unsafe_view", "_reshape_alias", "view", "reshape", "t", "transpose", "permute",
            "expand", "unsqueeze", "squeeze", "select", "slice", "as_strided", "split", "split_with_sizes",
            "unbind", "chunk", "narrow", "flatten", "unflatten", "view_as", "expand_as", "resolve_conj",
            "resolve_neg", "empty", "empty_like", "empty_strided", "result_type", "is_nonzero", "sym_size",
            "sym_stride", "sym_numel", "lift_fresh", "set_", "diagonal", "movedim", "real", "conj"}
_SYNC = {"_local_scalar_dense"}


def _short(name: str) -> str:
    """'aten::add', 'aten.add.Tensor' -> 'add'."""
    name = name.split("::")[-1]
    if name.startswith("aten."):
        name = name[len("aten."):].split(".")[0]
    return name


def op_group(name: str) -> str:
    """The group of an aten operator name (any of 'aten::mm', 'aten.mm.default', 'mm')."""
    short = _short(name)
    if short in _MATMUL:
        return "matmul"
    if short in _REDUCTION:
        return "reduction"
    if short in _COPY:
        return "copy / cast"
    if short in _NO_DATA:
        return "other"
    if re.match(r"^[a-z_0-9]+_?$", short):
        return "elementwise"
    return "other"


def kernel_group(name: str) -> str:
    """The group of a GPU kernel, from its name (eager PyTorch, cuBLAS, or torch.compile's Triton kernels)."""
    low = name.lower()
    if low.startswith("triton") or "fused" in low:
        return "compiled (fused)"
    if any(key in low for key in ("gemm", "gemv", "cutlass", "nvjet", "xmma", "cublas", "matmul", "splitk")):
        return "matmul"
    if "memcpy" in low or "memset" in low or "copy" in low:
        return "copy / cast"
    if any(key in low for key in ("reduce", "softmax", "norm", "welford")):
        return "reduction"
    if "elementwise" in low or "vectorized" in low or "pointwise" in low:
        return "elementwise"
    return "other"


# ---- the operation tracer ---------------------------------------------------------------------------------


def _distinct_bytes(t: torch.Tensor) -> int:
    """Bytes of the distinct elements a tensor covers: a broadcast (stride-0) dimension is read once."""
    count = 1
    for size, stride in zip(t.shape, t.stride()):
        if stride != 0:
            count *= size
    return count * t.element_size()


def _tensors(tree) -> list[torch.Tensor]:
    return [v for v in tree_flatten(tree)[0] if isinstance(v, torch.Tensor)]


@dataclass
class OpRecord:
    name: str
    group: str
    bytes_read: int
    bytes_written: int


@dataclass
class OpTrace:
    """The operations a call ran: launches (operations that compute), syncs, bytes, by group and by name."""

    records: list[OpRecord] = field(default_factory=list)
    syncs: int = 0

    @property
    def launches(self) -> int:
        return len(self.records)

    @property
    def bytes_read(self) -> int:
        return sum(r.bytes_read for r in self.records)

    @property
    def bytes_written(self) -> int:
        return sum(r.bytes_written for r in self.records)

    @property
    def bytes_moved(self) -> int:
        return self.bytes_read + self.bytes_written

    def by_name(self) -> dict[str, int]:
        """Launches per operator, most frequent first."""
        return dict(collections.Counter(r.name for r in self.records).most_common())

    def by_group(self) -> dict[str, dict]:
        """{group: {"launches", "bytes"}} for the groups that occur, in GROUPS order."""
        out = {}
        for group in GROUPS:
            mine = [r for r in self.records if r.group == group]
            if mine:
                out[group] = {"launches": len(mine), "bytes": sum(r.bytes_read + r.bytes_written for r in mine)}
        return out


class _Tracer(TorchDispatchMode):
    def __init__(self, trace: OpTrace):
        super().__init__()
        self.trace = trace

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        short = _short(str(func))
        if short in _SYNC:
            self.trace.syncs += 1
        elif not (getattr(func, "is_view", False) or short in _NO_DATA):
            read = sum(_distinct_bytes(t) for t in _tensors((args, kwargs)))
            written = sum(_distinct_bytes(t) for t in _tensors(out))
            self.trace.records.append(OpRecord(short, op_group(short), read, written))
        return out


def trace_ops(fn: Callable, *args, **kwargs) -> OpTrace:
    """Run ``fn(*args, **kwargs)`` once and record every operation it dispatches (see the module docstring)."""
    trace = OpTrace()
    with _Tracer(trace):
        fn(*args, **kwargs)
    return trace


def sinkhorn_launches(iterations: int) -> int:
    """Operations that ``mhc_lab.reference.sinkhorn_deepseek_v4`` launches for t iterations: the input check
    (``(logits - logits).any()``, NaN wherever a logit is NaN or infinite: sub, any: 2), softmax (1), + eps (1),
    one column normalisation (sum, + eps, divide: 3), then t - 1 times a row and a column normalisation (6 each):
    6t + 1. (The check's ``if`` reads one value back: a sync.)"""
    return 6 * iterations + 1


# ---- the profiler -----------------------------------------------------------------------------------------


@dataclass
class Profile:
    """One profiled call: what was counted (kernels on CUDA, aten operators on a CPU), time per group."""

    device: str
    launches: int | None  # None on a CPU, which launches no kernels
    counted: str
    group_seconds: dict[str, float]
    group_launches: dict[str, int]
    launch_calls: int = 0  # CUDA: runtime launch calls seen on the CPU side (a cross-check of `launches`)

    @property
    def total_seconds(self) -> float:
        return sum(self.group_seconds.values())


_LAUNCH_CALLS = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx",
                 "cudaLaunchCooperativeKernel")


def profile_run(fn: Callable[[], object], device: torch.device | str, warmup: int = 1) -> Profile:
    """Profile one call of ``fn()`` (after ``warmup`` calls) on ``device``."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    device = torch.device(device)
    for _ in range(warmup):
        fn()
    synchronize(device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with _native_stderr_silenced(), profile(activities=activities) as prof:
        fn()
        synchronize(device)
    events = list(prof.events())
    seconds: dict[str, float] = collections.defaultdict(float)
    launches: dict[str, int] = collections.defaultdict(int)
    if device.type == "cuda":
        kernels = [e for e in events if e.device_type == DeviceType.CUDA]
        for e in kernels:
            group = kernel_group(e.name)
            seconds[group] += e.time_range.elapsed_us() / 1e6
            if not e.name.lower().startswith(("memcpy", "memset")):
                launches[group] += 1
        calls = sum(1 for e in events if e.device_type == DeviceType.CPU and e.name in _LAUNCH_CALLS)
        total = sum(launches.values())
        counted = "CUDA kernels (profiler)"
        if total == 0 and calls:  # no kernel records (CUPTI unavailable): count the launch calls instead
            total, counted = calls, "CUDA launch calls (profiler)"
        return Profile(device.type, total, counted, _ordered(seconds), _ordered(launches), calls)
    for e in events:  # a CPU: time per aten operator (self time, so nested operators are not counted twice)
        if e.device_type != DeviceType.CPU:
            continue
        if e.name.startswith("aten::"):
            seconds[op_group(e.name)] += e.self_cpu_time_total / 1e6
        elif "CompiledFxGraph" in e.name:  # a torch.compile graph: its fused C++ loops run inside this call
            seconds["compiled (fused)"] += e.self_cpu_time_total / 1e6
            launches["compiled (fused)"] += 1
    return Profile(device.type, None, "no kernels on a CPU (trace_ops counts its operations)",
                   _ordered(seconds), _ordered(launches))


@contextlib.contextmanager
def _native_stderr_silenced():
    """The profiler's native library logs its start and stop to file descriptor 2; keep that out of notebooks."""
    try:
        saved = os.dup(2)
    except OSError:  # no usable descriptor 2: nothing to silence
        yield
        return
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def _ordered(d: dict) -> dict:
    return {g: d[g] for g in GROUPS if g in d}


def launches(fn: Callable[[], object], device: torch.device | str) -> int:
    """Kernels one call of ``fn()`` launches: counted by the profiler on CUDA; on a CPU, the operations that
    compute (trace_ops), each of which would be one kernel on a GPU."""
    device = torch.device(device)
    if device.type == "cuda":
        return profile_run(fn, device, warmup=1).launches
    return trace_ops(fn).launches


# ---- eager against torch.compile --------------------------------------------------------------------------


def compile_call(fn: Callable[[], object], device: torch.device | str, *, warmup: int = 2,
                 repeat: int = 10) -> dict:
    """``torch.compile`` a no-argument call from cold (a CPU needs a C++ compiler) and measure it:
    {"timing" (measure.time_fn), "launches" (None on a CPU: a compiled graph runs its fused loops inside one
    call), "compile_s" (the first call, which compiles)}."""
    import time

    device = torch.device(device)
    torch._dynamo.reset()  # a cold compile every time, so compile times compare
    fast = torch.compile(fn)
    start = time.perf_counter()
    fast()
    synchronize(device)
    compile_s = time.perf_counter() - start
    return {"timing": time_fn(fast, warmup=warmup, repeat=repeat, device=device),
            "launches": launches(fast, device) if device.type == "cuda" else None, "compile_s": compile_s}


def compare_compile(fn: Callable[[], object], device: torch.device | str, *, compile: bool = True,
                    warmup: int = 2, repeat: int = 10) -> dict:
    """``fn`` eager and, if ``compile``, compiled: {"eager": {"timing", "launches"}, "compiled": {"timing",
    "launches", "compile_s"} or None}."""
    device = torch.device(device)
    eager = {"timing": time_fn(fn, warmup=warmup, repeat=repeat, device=device), "launches": launches(fn, device)}
    return {"eager": eager,
            "compiled": compile_call(fn, device, warmup=warmup, repeat=repeat) if compile else None}


# ---- figures ----------------------------------------------------------------------------------------------


def group_figure(profiles: dict[str, Profile], title: str = "Time per operator group"):
    """Stacked bars: each profiled layer's time split by operator group, launches in the hover text (plotly)."""
    import plotly.graph_objects as go

    fig = go.Figure()
    names = list(profiles)
    for group in GROUPS:
        ys = [profiles[k].group_seconds.get(group, 0.0) * 1e3 for k in names]
        if not any(ys):
            continue
        hover = [f"{profiles[k].group_launches.get(group, 0)} launches" for k in names]
        fig.add_trace(go.Bar(name=group, x=names, y=ys, hovertext=hover))
    fig.update_layout(barmode="stack", title=title, yaxis_title="ms (profiled, one call)", height=400)
    return fig
