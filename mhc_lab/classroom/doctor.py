"""What this machine can run: versions, device, TileLang known-answer runs on the CPU and the GPU, and which labs
and cells run live here and which show recorded GPU results.

    mhc-lab doctor            # the report, in words
    mhc-lab doctor --json     # the same, machine-readable
"""

from __future__ import annotations

import importlib
import io
import platform
import re
import tokenize
from pathlib import Path

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


# ---- which cells run live here ------------------------------------------------------------------------------

# Matched on a cell's code with its strings and comments removed (a message that mentions a recording is not one).
REPLAY = re.compile(r"\b\w*record(?:ing|ed)\w*\b|\bload_recording\b")
# A statement `if cfg.on_gpu:` (a conditional expression that only picks a dtype or a size runs live either way).
GPU_BRANCH = re.compile(r"^[ \t]*(?:el)?if\s+(?:not\s+)?\(?\s*(?:cfg\.on_gpu|torch\.cuda\.is_available\(\))[^\n]*:[ \t]*$",
                        re.M)
TILELANG = re.compile(r"\btilelang\b|\bcompile_program\b|\bprim_func\b|\bmhc_lab\.kernels\b|\bkernels\.\w+|"
                      r"\btilelang_known_answer\b|_program\(")
# Cell tags a lab may set to say it outright (they win over the code's reading).
TAG_MODES = {"replay": "replay", "gpu-replay": "replay", "gpu-only": "gpu branch", "tilelang": "tilelang"}


def _code_only(source: str) -> str:
    """The cell's code with comments and string literals blanked out (IPython magics dropped)."""
    lines = [l if not l.lstrip().startswith(("%", "!")) else "" for l in source.splitlines()]
    blank = {tokenize.COMMENT, tokenize.STRING, getattr(tokenize, "FSTRING_MIDDLE", -1)}
    chars = [list(l) for l in lines]
    try:
        for token in tokenize.generate_tokens(io.StringIO("\n".join(lines) + "\n").readline):
            if token.type in blank:
                (r0, c0), (r1, c1) = token.start, token.end
                for row in range(r0 - 1, r1):
                    lo = c0 if row == r0 - 1 else 0
                    hi = c1 if row == r1 - 1 else len(chars[row])
                    chars[row][lo:hi] = " " * (hi - lo)
    except (tokenize.TokenError, IndentationError, SyntaxError):
        pass
    return "\n".join("".join(c) for c in chars)


def classify_cell(source: str, tags=()) -> str:
    """'replay', 'gpu branch', 'tilelang' or 'live' for one code cell of a lab."""
    for tag in tags:
        if tag in TAG_MODES:
            return TAG_MODES[tag]
    code = _code_only(source)
    if REPLAY.search(code):
        return "replay"
    if GPU_BRANCH.search(code):
        return "gpu branch"
    if TILELANG.search(code):
        return "tilelang"
    return "live"


def _heading(markdown: str) -> str | None:
    for line in markdown.splitlines():
        if line.lstrip().startswith("#"):
            return line.lstrip("# ").strip()
    return None


def lab_plan(on_gpu: bool, tilelang_ok: bool | None = True, solutions_dir: Path | None = None) -> list[dict]:
    """For each lab: its code cells with what each does on this machine, and a one-line summary."""
    import nbformat

    from mhc_lab.classroom.notebook_build import SOLUTIONS_DIR, solution_notebooks

    meaning = {
        "live": "runs live",
        "gpu branch": "runs its GPU branch live" if on_gpu else "runs its CPU branch (its GPU branch needs CUDA)",
        "tilelang": ("runs TileLang live" + (" (CUDA and C targets)" if on_gpu else " on the C target")
                     if tilelang_ok is not False else "needs TileLang, which failed its known-answer run here"),
        "replay": "replays recorded GPU results" + (" (shown next to this GPU's live measurements)" if on_gpu else ""),
    }
    plans = []
    for path in solution_notebooks(solutions_dir or SOLUTIONS_DIR):
        nb = nbformat.read(path, as_version=4)
        cells, heading = [], None
        for index, cell in enumerate(nb.cells):
            if cell.cell_type == "markdown":
                heading = _heading(cell.source) or heading
                continue
            if cell.cell_type != "code":
                continue
            mode = classify_cell(cell.source, cell.metadata.get("tags", []))
            # Cells are counted from 1 over all cells, as JupyterLab's status bar does ("Cell 7/26").
            cells.append({"cell": index + 1, "section": heading, "mode": mode, "meaning": meaning[mode]})
        counts = {mode: [c["cell"] for c in cells if c["mode"] == mode] for mode in meaning}
        parts = [f"{len(counts['live'])} code cells live"]
        if counts["tilelang"]:
            parts.append(f"TileLang in {_cells(counts['tilelang'])} "
                         + ("live" + ("" if on_gpu else " (C target)") if tilelang_ok is not False else "BROKEN here"))
        if counts["gpu branch"]:
            parts.append(f"{_cells(counts['gpu branch'])} "
                         + ("GPU branch" if on_gpu else "CPU branch (GPU branch needs CUDA)"))
        if counts["replay"]:
            parts.append(f"{_cells(counts['replay'])} replay{'s' if len(counts['replay']) == 1 else ''} "
                         "recorded GPU results")
        whole = ("replays part of its GPU results" if counts["replay"] else "runs live")
        plans.append({"lab": path.name, "verdict": whole, "summary": "; ".join(parts), "cells": cells})
    return plans


def _cells(indices: list[int]) -> str:
    return ("cell " if len(indices) == 1 else "cells ") + ", ".join(str(i) for i in indices)


def recordings() -> list[str]:
    from mhc_lab.measure import RECORDED_DIR

    return sorted(p.name for p in Path(RECORDED_DIR).glob("*.json"))


def report(run_tilelang: bool = True, plan: bool = True) -> dict:
    """Everything the doctor knows about this machine."""
    info = {"versions": versions(), "cuda": torch.cuda.is_available(), "cpu_threads": torch.get_num_threads(),
            "platform": f"{platform.system()} {platform.machine()}"}
    if info["cuda"]:
        info["gpu"] = torch.cuda.get_device_name(0)
    if run_tilelang:
        info["tilelang_cpu"] = tilelang_known_answer("cpu")
        if info["cuda"]:
            info["tilelang_gpu"] = tilelang_known_answer("cuda")
    if plan:
        tilelang_ok = info["tilelang_cpu"]["ok"] if "tilelang_cpu" in info else None
        info["recordings"] = recordings()
        info["labs"] = lab_plan(info["cuda"], tilelang_ok)
    return info


def format_report(info: dict, cells: bool = False) -> str:
    """The report in words."""
    v = info["versions"]
    lines = ["mhc-lab doctor", ""]
    lines.append("versions: " + ", ".join(f"{name} {version or 'MISSING'}" for name, version in v.items()))
    device = f"CUDA GPU: {info['gpu']}" if info["cuda"] else "no CUDA GPU (torch sees none): the CPU"
    lines.append(f"device:   {device}; {info['cpu_threads']} CPU threads; {info['platform']}")
    for key, label in (("tilelang_cpu", "TileLang known answer on the CPU (C target)"),
                       ("tilelang_gpu", "TileLang known answer on the GPU (CUDA)")):
        if key in info:
            r = info[key]
            lines.append(f"{label}: " + ("OK, exact" if r["ok"] else f"FAILED: {r['error'] or r['max_error']}"))
    if "tilelang_cpu" in info and "tilelang_gpu" not in info:
        lines.append("TileLang known answer on the GPU (CUDA): not run, no GPU here")
    if "labs" in info:
        lines += ["", "labs on this machine" + (" (GPU present: every cell runs live)" if info["cuda"] else
                                                " (CPU only: GPU results are replayed from recordings)")]
        width = max([len(p["lab"]) for p in info["labs"]] + [4])
        for p in info["labs"]:
            lines.append(f"  {p['lab']:<{width}}  {p['verdict']}: {p['summary']}")
            if cells:
                for c in p["cells"]:
                    if c["mode"] != "live":
                        lines.append(f"  {'':<{width}}    cell {c['cell']:>3} ({c['section'] or '-'}): {c['meaning']}")
        lines.append(f"  recorded GPU results shipped: {', '.join(info['recordings']) or 'none yet'} "
                     "(mhc_lab/recorded/)")
    return "\n".join(lines) + "\n"
