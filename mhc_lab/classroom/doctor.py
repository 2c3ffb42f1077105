"""What this machine can run: versions, device, TileLang known-answer runs on the CPU and the GPU, and which labs
and cells run live here and which show recorded GPU results.

    mhc-lab doctor            # the report, in words
    mhc-lab doctor --json     # the same, machine-readable

Exit status (``mhc-lab doctor``): 0 when the machine is ready for every lab, 1 when something a lab needs is
missing or broken (a package, a working C++ compiler for TileLang's C target, TileLang's known-answer run); each
such problem is listed with its fix (``problems`` in the JSON, ``ready`` true or false).
"""

from __future__ import annotations

import importlib
import io
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import tokenize
from pathlib import Path

try:
    import torch
except ImportError:  # reported as a missing package, not a crash
    torch = None

NEEDED = ("torch", "tilelang", "numpy", "plotly", "ipywidgets", "jupyterlab", "ipykernel")  # what the labs use
OPTIONAL = ("papermill", "nbval")  # the instructor's tools (handouts, grading, tests): not needed by a learner
PACKAGES = NEEDED + OPTIONAL


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


# ---- a C++ compiler: TileLang's C target builds each kernel into a shared library with one ------------------


def find_compiler() -> str | None:
    """The C++ compiler TileLang would use, as it chooses one: $CXX or $CC, else g++, clang++ or c++ on the PATH
    (a path, or None when there is none)."""
    chosen = os.environ.get("CXX") or os.environ.get("CC")
    if chosen:
        return shutil.which(chosen) or (chosen if os.path.isfile(chosen) and os.access(chosen, os.X_OK) else None)
    return next((found for found in map(shutil.which, ("g++", "clang++", "c++")) if found), None)


def compiler_fix() -> str:
    """How to install a C++ compiler on this platform."""
    system = platform.system()
    if system == "Darwin":
        return "install Apple's command line tools: `xcode-select --install`"
    if system == "Windows":
        return "install Visual Studio Build Tools with the C++ workload (or work in WSL: `sudo apt install g++`)"
    return ("install one: `sudo apt install g++` (Debian, Ubuntu), `sudo dnf install gcc-c++` (Fedora), or in a "
            "conda environment `conda install -c conda-forge gxx`; or set CXX to a compiler's path")


def compiler_check(timeout: float = 120) -> dict:
    """Find the C++ compiler and build a one-line shared library with it, the way TileLang's C target does.
    Returns {"path", "ok", "error"}; never raises."""
    path = find_compiler()
    chosen = os.environ.get("CXX") or os.environ.get("CC")
    if path is None:
        where = f"CXX/CC is set to {chosen!r}, which is not an executable" if chosen else \
            "none of g++, clang++, c++ is on the PATH and CXX is not set"
        return {"path": None, "ok": False, "error": f"no C++ compiler: {where}"}
    with tempfile.TemporaryDirectory(prefix="mhc-doctor-") as folder:
        source = Path(folder) / "probe.cc"
        source.write_text('extern "C" int mhc_probe(int x) { return x + 1; }\n')
        try:
            done = subprocess.run([path, "-std=c++17", "-fPIC", "-shared", str(source), "-o",
                                   str(Path(folder) / "probe.so")], capture_output=True, text=True, timeout=timeout)
        except (OSError, subprocess.TimeoutExpired) as error:
            return {"path": path, "ok": False, "error": f"the C++ compiler {path} did not run: {error}"}
    if done.returncode != 0:
        tail = " | ".join((done.stderr or done.stdout).strip().splitlines()[-3:])
        return {"path": path, "ok": False,
                "error": f"the C++ compiler {path} could not build a shared library (exit {done.returncode}): {tail}"}
    return {"path": path, "ok": True, "error": None}


def problems(info: dict) -> list[dict]:
    """What keeps a lab from running here: [{"what", "fix"}, ...] (empty: ready)."""
    found = []
    missing = [name for name in NEEDED if info["versions"].get(name) is None]
    if missing:
        found.append({"what": f"missing Python package{'s' if len(missing) > 1 else ''}: {', '.join(missing)}",
                      "fix": f"`{Path(sys.executable).name} -m pip install {' '.join(missing)}` in this environment "
                             "(or install the course's wheel, which brings them)"})
    compiler = info.get("compiler")
    if compiler and not compiler["ok"]:
        found.append({"what": f"{compiler['error']}; TileLang's C target cannot build its kernels, so the TileLang "
                              "cells of the labs fail on the CPU",
                      "fix": compiler_fix()})
    if info.get("native"):
        found.append({"what": f"the site's C++ ops did not build, so the fused kernels do not run on this GPU "
                              f"(backend 'auto' runs the reference): {info['native']}",
                      "fix": f"`{Path(sys.executable).name} -m pip install ninja` and a C++ compiler (the one "
                             "TileLang's CUDA builds use), then `mhc-lab doctor` again"})
    for key, where in (("tilelang_cpu", "the CPU (C target)"), ("tilelang_gpu", "the GPU (CUDA)")):
        result = info.get(key)
        if result and not result["ok"] and not (key == "tilelang_cpu" and compiler and not compiler["ok"]):
            failure = result["error"] or result["max_error"]
            found.append({"what": f"TileLang's known answer failed on {where}: {failure}",
                          "fix": f"reinstall the TileLang the course pins (`pip install --force-reinstall "
                                 f"'{_requirement('tilelang')}'`) and run `mhc-lab doctor` again; the error names "
                                 "what failed"})
    return found


def _requirement(name: str) -> str:
    """The course's requirement on a package (its pin), as installed; the bare name when unknown."""
    try:
        from importlib.metadata import requires

        return next((r.split(";")[0].strip() for r in requires("mhc-lab") or []
                     if re.match(rf"{re.escape(name)}\b(?!-)", r)), name)
    except Exception:
        return name


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
                     if tilelang_ok is not False else "needs TileLang, which cannot run here (see 'not ready')"),
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
        if counts["tilelang"] and tilelang_ok is False:
            whole = "CANNOT RUN its TileLang cells here"
        plans.append({"lab": path.name, "verdict": whole, "summary": "; ".join(parts), "cells": cells})
    return plans


def _cells(indices: list[int]) -> str:
    return ("cell " if len(indices) == 1 else "cells ") + ", ".join(str(i) for i in indices)


def recordings() -> list[str]:
    """The recorded GPU results shipped with the package (mhc_lab/recorded/)."""
    return sorted(p.name for p in (Path(__file__).resolve().parents[1] / "recorded").glob("*.json"))


def report(run_tilelang: bool = True, plan: bool = True, labs_dir: Path | None = None) -> dict:
    """Everything the doctor knows about this machine; ``ready`` and ``problems`` (see ``problems``) say whether
    every lab runs here. ``labs_dir``: the lab notebooks to read (default: the course's solutions)."""
    info = {"versions": versions(), "cuda": bool(torch and torch.cuda.is_available()),
            "cpu_threads": torch.get_num_threads() if torch else os.cpu_count(),
            "platform": f"{platform.system()} {platform.machine()}"}
    run_tilelang = run_tilelang and torch is not None
    if info["cuda"]:
        from mhc_lab.ops.dispatch import cuda_device_facts, kernel_paths

        name, capability, shared = cuda_device_facts(torch.device("cuda", 0))
        info["gpu"], info["compute_capability"] = name, f"{capability[0]}.{capability[1]}"
        info["kernel_paths"] = kernel_paths(capability, 4, shared_bytes=shared)  # per op, backend 'auto', n = 4
        from mhc_lab.ops.native import native_refusal

        info["native"] = native_refusal()  # "" where the site's C++ ops build (about 30 s the first time)
    info["compiler"] = compiler_check()
    if run_tilelang:
        info["tilelang_cpu"] = tilelang_known_answer("cpu")
        if info["cuda"]:
            info["tilelang_gpu"] = tilelang_known_answer("cuda")
    info["problems"] = problems(info)
    info["ready"] = not info["problems"]
    if plan:
        tilelang_ok = info["tilelang_cpu"]["ok"] if "tilelang_cpu" in info else None
        if not info["compiler"]["ok"] or info["versions"].get("tilelang") is None:
            tilelang_ok = False
        info["recordings"] = recordings()
        info["labs"] = lab_plan(info["cuda"], tilelang_ok, solutions_dir=labs_dir)
    return info


def format_report(info: dict, cells: bool = False) -> str:
    """The report in words."""
    v = info["versions"]
    lines = ["mhc-lab doctor", ""]
    lines.append("versions: " + ", ".join(f"{name} {version or ('MISSING' if name in NEEDED else 'not installed')}"
                                          for name, version in v.items())
                 + (f" ({', '.join(OPTIONAL)}: the instructor's tools, not needed by the labs)"
                    if any(v.get(name) is None for name in OPTIONAL) else ""))
    device = (f"CUDA GPU: {info['gpu']} (compute capability {info['compute_capability']})" if info["cuda"] else
              "no CUDA GPU (torch sees none): the CPU")
    lines.append(f"device:   {device}; {info['cpu_threads']} CPU threads; {info['platform']}")
    if info.get("kernel_paths"):
        lines.append("mHC ops with backend 'auto' on this GPU (n = 4 lanes): "
                     + "; ".join(f"{op}: {path}" for op, path in info["kernel_paths"].items()))
    if "native" in info:
        lines.append("the site's CUDA ops in C++ (mhc_lab/ops/native.cpp): "
                     + ("built" if not info["native"] else f"FAILED: {info['native']}"))
    elif not info["cuda"]:
        lines.append("mHC ops with backend 'auto': the reference (PyTorch) on the CPU; backend='kernels' runs "
                     "TileLang's C target")
    for key, label in (("tilelang_cpu", "TileLang known answer on the CPU (C target)"),
                       ("tilelang_gpu", "TileLang known answer on the GPU (CUDA)")):
        if key in info:
            r = info[key]
            lines.append(f"{label}: " + ("OK, exact" if r["ok"] else f"FAILED: {r['error'] or r['max_error']}"))
    if "tilelang_cpu" in info and "tilelang_gpu" not in info:
        lines.append("TileLang known answer on the GPU (CUDA): not run, no GPU here")
    if "compiler" in info:
        c = info["compiler"]
        lines.append("C++ compiler (TileLang's C target): "
                     + (f"OK, {c['path']}" if c["ok"] else f"FAILED: {c['error']}"))
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
        if not info["labs"]:
            lines.append("  no lab notebooks found to read (run it with --labs FOLDER, the folder of the labs)")
        lines.append(f"  recorded GPU results shipped: {', '.join(info['recordings']) or 'none yet'} "
                     "(mhc_lab/recorded/)")
    if "ready" in info:
        lines.append("")
        if info["ready"]:
            lines.append("ready: every lab's needs are met on this machine")
        else:
            lines.append(f"NOT READY: {len(info['problems'])} problem{'s' if len(info['problems']) > 1 else ''} "
                         "(exit status 1)")
            for problem in info["problems"]:
                lines += [f"  - {problem['what']}", f"    fix: {problem['fix']}"]
    return "\n".join(lines) + "\n"
