"""Lab 08, section 2's training loop: a stack of pre-norm MLP layers trained one step at a time, read on three
clocks (launched, the kernels' GPU time, a CUDA graph) from the training recording's stack part, measured live on a
CUDA GPU, and, on the CPU, where a tiny stack's host time goes.

    stack_rows, stack_table, stack_reading     the recorded (or live) stack, per shape and kind, with exercise 8.3
    stack_host_table                           the fused stack's host profile: Python's functions per step
    measure_stack_live, profile_host_cpu, cpu_host_table
                                               the same stack on this machine (a CUDA GPU; the CPU's host)
"""

from __future__ import annotations

import sys

import torch

from mhc_lab.bench.host import python_profile
from mhc_lab.bench.stack import PROFILED, STACK_KINDS, plain_of
from mhc_lab.course.step_time import host_per_site

# ---- section 2, a training loop: a stack of layers on two clocks ----------------------------------------------

# The stack's kinds (mhc_lab.bench.stack.STACK_KINDS) by name; a kind "<known>_<variant>" takes the known kind's
# label and the variant's, any other kind its own name.
STACK_LABELS = {"residual": "plain residual", "mhc_kernels": "mHC, fused kernels",
                "mhc_reference": "mHC, reference (PyTorch)", "mhc_tilekernels": "mHC, TileKernels"}
STACK_VARIANTS = {"compiled": "compiled", "reduce_overhead": "compiled, reduce-overhead",
                  "recompute": "recompute"}
HOST_TOP = 8  # host functions listed per profile


def stack_label(kind: str) -> str:
    """A stack kind's name for the tables: STACK_LABELS, "<known>_<variant>" as both, else the kind itself."""
    if kind in STACK_LABELS:
        return STACK_LABELS[kind]
    for variant, label in STACK_VARIANTS.items():
        base = kind.removesuffix("_" + variant)
        if base != kind and base in STACK_LABELS:
            return f"{STACK_LABELS[base]}, {label}"
    return kind


def stack_kinds(shape: dict) -> list[str]:
    """The kinds one shape of a stack section measured: those of STACK_KINDS in its order, then any other in the
    recording's order."""
    seen = list(dict.fromkeys([*(shape.get("launched_ms") or {}), *(shape.get("gpu_ms") or {}),
                               *(shape.get("graph_ms") or {})]))
    return [k for k in STACK_KINDS if k in seen] + [k for k in seen if k not in STACK_KINDS]


def _ratio(shape: dict, mode: str, figure: str, kind: str) -> float | None:
    """A kind's figure over the plain residual's: the section's own ratio (the median of the rounds' ratios for
    the launched and graph times) where it has one, else the quotient of the two figures (a live measurement)."""
    recorded = ((shape.get("over_residual") or {}).get(mode) or {}).get(kind)
    if recorded is not None:
        return recorded["median"] if isinstance(recorded, dict) else recorded
    measured = shape.get(figure) or {}
    ours, plain = measured.get(kind), measured.get(plain_of(kind, measured))
    return ours / plain if ours is not None and plain else None


def stack_rows(stack: dict | None) -> list[dict]:
    """Per shape of a stack section and kind: launched, GPU and graph ms per step with their ratios to the plain
    residual, kernels per step; for the mHC kinds what each site adds (GPU ms, kernels) and exercise 8.3's host
    ms per site; and 8.3's verdict on the launched step (None where a figure is missing)."""
    rows = []
    for shape in (stack or {}).get("shapes") or []:
        launched, gpu = shape.get("launched_ms") or {}, shape.get("gpu_ms") or {}
        kernels, graph = shape.get("kernels_per_step") or {}, shape.get("graph_ms") or {}
        layers = shape.get("layers")
        for kind in stack_kinds(shape):
            row = {"tokens": shape["tokens"], "C": shape["C"], "n": shape.get("n"), "layers": layers, "kind": kind,
                   "label": stack_label(kind), "launched_ms": launched.get(kind), "gpu_ms": gpu.get(kind),
                   "kernels": kernels.get(kind), "graph_ms": graph.get(kind), "launched_ratio": None,
                   "gpu_ratio": None, "graph_ratio": None, "site_gpu_ms": None, "site_kernels": None,
                   "host_ms": None, "host_bound": None}
            plain, is_plain = plain_of(kind, launched), kind.startswith("residual")  # the plain step run alike
            if not is_plain:
                row["launched_ratio"] = _ratio(shape, "launched", "launched_ms", kind)
                row["gpu_ratio"] = _ratio(shape, "gpu", "gpu_ms", kind)
                row["graph_ratio"] = _ratio(shape, "graph", "graph_ms", kind)
            if launched.get(kind) is not None and gpu.get(kind) is not None:
                base = plain if plain in launched and plain in gpu else kind
                host_ms, row["host_bound"] = host_per_site(launched[kind], gpu[kind], launched[base], gpu[base],
                                                           layers or 1)
                if not is_plain and base == plain and layers:
                    row["host_ms"], row["site_gpu_ms"] = host_ms, (gpu[kind] - gpu[plain]) / layers
            if not is_plain and layers and kind in kernels and plain in kernels:
                row["site_kernels"] = (kernels[kind] - kernels[plain]) / layers
            rows.append(row)
    return rows


def _cell(value, spec: str, suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


def stack_table(stack: dict | None) -> str:
    """Table: a stack of pre-norm MLP layers trained one step at a time, per shape and kind: the step launched
    from Python (ms, and over the plain residual's), its kernels' GPU time (ms, and over the plain residual's)
    and count, the step as a CUDA graph (ms, and over the plain residual's), and whether the launched step is
    host-bound; then per mHC site, what it adds to the plain step's GPU time, kernels and host time (exercise
    8.3)."""
    rows = stack_rows(stack)
    if not rows:
        return "(no stack measurements)"
    lines = []

    def step_line(r):
        lines.append(f"  {r['label'][:46]:<46}{_cell(r['launched_ms'], '.2f', ' ms'):>11}"
                     f"{_cell(r['launched_ratio'], '.2f', 'x'):>8}{_cell(r['gpu_ms'], '.2f', ' ms'):>11}"
                     f"{_cell(r['gpu_ratio'], '.2f', 'x'):>8}{_cell(r['kernels'], '.0f'):>9}"
                     f"{_cell(r['graph_ms'], '.2f', ' ms'):>11}{_cell(r['graph_ratio'], '.2f', 'x'):>8}   "
                     + ("-" if r["host_bound"] is None else "host-bound" if r["host_bound"] else "GPU-bound"))

    shapes = list(dict.fromkeys((r["tokens"], r["C"]) for r in rows))
    for k, (tokens, C) in enumerate(shapes):
        mine = [r for r in rows if (r["tokens"], r["C"]) == (tokens, C)]
        lanes = f", n = {mine[0]['n']} lanes" if mine[0]["n"] else ""
        if k:
            lines.append("")
        lines.append(f"{tokens} tokens x C = {C}, {mine[0]['layers']} layers{lanes}: one training step")
        lines.append(f"  {'':<46}{'launched':>19}{'GPU time':>19}{'kernels':>9}{'as a graph':>19}   launched step")
        for r in mine:
            step_line(r)
        sites = [r for r in mine if r["site_gpu_ms"] is not None or r["host_ms"] is not None]
        if sites:
            lines.append(f"  {'per site, over the plain residual':<46}{'GPU time':>18}{'kernels':>9}{'host':>11}")
            for r in sites:
                lines.append(f"  {r['label'][:46]:<46}{_cell(r['site_gpu_ms'], '+.3f', ' ms'):>18}"
                             f"{_cell(r['site_kernels'], '+.1f'):>9}{_cell(r['host_ms'], '+.3f', ' ms'):>11}")
    for shape in (stack or {}).get("shapes") or []:
        dynamo = shape.get("dynamo")
        if dynamo:
            lines.append(f"  torch.compile at {shape['tokens']} x {shape['C']}: {dynamo['unique_graphs']} graphs for "
                         f"the compiled rows, {dynamo['graph_breaks']} graph breaks, {dynamo['recompiles']} "
                         "recompilations")
        for kind, text in (shape.get("errors") or {}).items():
            lines.append(f"  failed at {shape['tokens']} x {shape['C']}: {kind}: {text[:90]}")
    lines.append("(x: over the plain residual's figure, the plain residual compiled alike where it was measured;\n"
                 " compiled: torch.compile, reduce-overhead: its mode that replays CUDA graphs; host-bound: the GPU\n"
                 " waits for the host for more than half of the launched step; host: the launched time a site adds\n"
                 " beyond its kernels' GPU time)")
    return "\n".join(lines)


def stack_reading(stack: dict | None) -> str:
    """A line per shape and mHC kind: its GPU work and kernels per site, the host time per site beyond them, and
    what the launched step is bound by."""
    out = []
    for r in stack_rows(stack):
        if r["host_ms"] is None or r["site_gpu_ms"] is None:
            continue
        kernels = f", {r['site_kernels']:.1f} kernels" if r["site_kernels"] is not None else ""
        times = f" ({r['host_ms'] / r['site_gpu_ms']:.1f} times its GPU work)" if r["site_gpu_ms"] > 0 \
            and r["host_ms"] > r["site_gpu_ms"] else ""
        out.append(f"{r['tokens']} x {r['C']}, {r['label']}: a site is {r['site_gpu_ms']:.3f} ms of GPU work"
                   f"{kernels}; the host adds {r['host_ms']:+.3f} ms per site{times}; the launched step is "
                   + ("host-bound" if r["host_bound"] else "GPU-bound"))
    return "\n".join(out)


# What the host's busiest functions in a stack's profile are, by a part of the name cProfile gives them.
HOST_FUNCTION_NAMES = (
    ("run_backward", "the autograd engine: the backward"),
    ("_nn.linear", "the linear layers"),
    ("mhc_lab_native.joint", "mHC op: a post with the next pre"),
    ("mhc_lab_native.pre", "mHC op: the first pre"),
    ("rms_norm", "RMSNorm"),
    ("_nn.gelu", "GELU"),
    ("named_modules", "zero_grad: walking the modules"),
    ("(zero_grad)", "zero_grad"),
    ("_cuda_synchronize", "waiting for the GPU"),
    ("method 'sum'", "tensor sums"),
    ("site_ops.py", "mHC op (Python)"),
    ("reference/", "mHC reference math"),
)


def host_function_name(function: str) -> str:
    """A host function's plain name for the tables ("" where it has none)."""
    return next((plain for part, plain in HOST_FUNCTION_NAMES if part in function), "")


def host_functions_table(rows: list[dict], key: str = "us", top: int = HOST_TOP) -> str:
    """The ``top`` host functions of a profile by ``key`` ("us": own time; "cumulative_us": with what they call),
    per step: time, calls, where."""
    if not rows:
        return "  (no host profile)"
    title = "own time" if key == "us" else "cumulative"
    lines = [f"  {title:>10}{'calls':>8}  {'what':<36}function"]
    for row in sorted(rows, key=lambda r: -r[key])[:top]:
        lines.append(f"  {row[key] / 1e3:>7.2f} ms{row['calls']:>8.1f}  {host_function_name(row['function']):<36}"
                     f"{row['function']}")
    return "\n".join(lines)


def stack_host_table(stack: dict | None, key: str = "us", top: int = HOST_TOP) -> str:
    """Per shape with a host profile (the launched step of the kind the benchmark profiles, PROFILED): the host's
    wall time per step in the forward (with the loss) and the backward, and its ``top`` functions by ``key`` per
    step."""
    lines = []
    for shape in (stack or {}).get("shapes") or []:
        host = shape.get("host")
        if not host:
            continue
        rows = host.get("by_own_time" if key == "us" else "by_cumulative_time") or []
        lines.append(f"{shape['tokens']} x {shape['C']}, {stack_label(PROFILED)}: the host's time per launched "
                     f"step: forward and loss {host['forward_ms']:.2f} ms, backward {host['backward_ms']:.2f} ms; "
                     f"Python's functions, per step:")
        lines.append(host_functions_table(rows, key, top))
    return "\n".join(lines) or "(no host profile recorded)"


# ---- section 2, live: the stack on this machine --------------------------------------------------------------


def measure_stack_live(shapes, *, kinds=("residual", "mhc_kernels"), layers: int = 8, steps: int = 20,
                       log=print) -> dict:
    """On a CUDA GPU, the stack of mhc_lab.bench.stack at each (tokens, C) of ``shapes``, each of ``kinds``
    trained one step at a time: launched (wall clock per step over ``steps`` steps, the GPU synchronised at both
    ends), its kernels' GPU time and count per step (torch.profiler), and its CUDA graph replayed (wall clock per
    replay, the GPU's time alone; not for a compiled kind, "<kind>_compiled" or "<kind>_reduce_overhead", whose
    first step compiles it). {"device", "stack": {"shapes": [...]}}, each shape as a recording's; a kind that
    fails is listed in its shape's "errors"."""
    from mhc_lab.bench.common import N, graph_replay
    from mhc_lab.bench.host import wall_ms
    from mhc_lab.bench.kernels import kernel_times, kernel_totals
    from mhc_lab.bench.stack import compile_every_stack, compile_mode, stack_step

    if any(compile_mode(kind)[1] for kind in kinds):
        compile_every_stack()
    out = []
    for tokens, C in shapes:
        shape = {"tokens": tokens, "C": C, "n": N, "layers": layers, "hidden": 4 * C, "launched_ms": {},
                 "gpu_ms": {}, "kernels_per_step": {}, "graph_ms": {}, "errors": {}}
        for kind in kinds:
            try:
                step = stack_step(C, tokens, kind, layers=layers)
                step()  # the first step builds the kernels
                torch.cuda.synchronize()
                shape["launched_ms"][kind] = wall_ms(step, steps)
                shape["gpu_ms"][kind], shape["kernels_per_step"][kind] = kernel_totals(kernel_times(step))
                if compile_mode(kind)[1] is None:
                    shape["graph_ms"][kind] = wall_ms(graph_replay(step), steps)
            except Exception as e:  # noqa: BLE001 - shown in the table, the other kinds still measured
                shape["errors"][kind] = f"{type(e).__name__}: {e}"
            log(f"  stack {tokens} x {C}, {stack_label(kind)}: measured")
            step = None
            torch.cuda.empty_cache()
        out.append(shape)
    return {"device": torch.cuda.get_device_name(), "stack": {"shapes": out}}


def profile_host_cpu(*, width: int = 64, tokens: int = 32, layers: int = 8, steps: int = 3) -> dict:
    """On the CPU, the stack of mhc_lab.bench.stack, tiny (``tokens`` x ``width``, bf16), plain and as
    MHCResidualStream with the reference backend, trained one step at a time: ms per step of each (wall clock
    over ``steps`` steps), and cProfile over ``steps`` steps of the mHC stack: per step, each Python function's
    own and cumulative time and calls. Here the host does all the work, so the profile is the whole step."""
    import time

    from mhc_lab.bench.stack import Stack

    out = {"tokens": tokens, "C": width, "layers": layers, "steps": steps, "ms": {}}
    for kind in ("residual", "mhc_reference"):
        torch.manual_seed(0)
        stack = Stack(width, layers, kind)
        h = torch.randn(1, tokens, width, dtype=torch.bfloat16, requires_grad=True)
        w = torch.randn(1, tokens, width, dtype=torch.bfloat16)

        def step():
            h.grad = None
            stack.zero_grad(set_to_none=True)
            (stack(h) * w).sum().backward()

        step()  # warm-up
        start = time.perf_counter()
        for _ in range(steps):
            step()
        out["ms"][kind] = (time.perf_counter() - start) / steps * 1e3
    rows = python_profile(step, steps, top=sys.maxsize, synchronize=False)["by_own_time"]
    out["functions"] = [row for row in rows if not row["function"].endswith(f"({step.__name__})")
                        or "stack_clocks.py" not in row["function"]]  # step() is ours
    return out


def cpu_host_table(profile: dict, top: int = HOST_TOP) -> str:
    """profile_host_cpu's result: the two stacks' ms per step, then the mHC stack's functions per step by
    cumulative time (with what they call) and by own time."""
    ms = profile["ms"]
    per_site = (ms["mhc_reference"] - ms["residual"]) / profile["layers"]
    label = stack_label("mhc_reference")
    return "\n".join([
        f"{profile['tokens']} tokens x C = {profile['C']}, {profile['layers']} layers, on the CPU: "
        f"{stack_label('residual')} {ms['residual']:.1f} ms per step, {label} {ms['mhc_reference']:.1f} ms: "
        f"{per_site:+.2f} ms per site",
        f"{label}: Python's functions per step, by cumulative time (with what they call):",
        host_functions_table(profile["functions"], "cumulative_us", top),
        "and by own time:",
        host_functions_table(profile["functions"], "us", top)])
