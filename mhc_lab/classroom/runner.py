"""Execute notebooks headless: the course's main job (papermill, with parameters) and refreshing the stored
outputs of the solution notebooks (in place, for nbval)."""

from __future__ import annotations

import contextlib
import os

import json
import re
import time
from pathlib import Path

import nbformat

from mhc_lab.classroom.notebook_build import SOLUTIONS_DIR, solution_notebooks

PASSED = re.compile(r"^Exercise (\d+\.\d+) \(.*\): passed", re.M)


def _stream_text(nb) -> str:
    texts = []
    for cell in nb.cells:
        for output in cell.get("outputs", []):
            if output.get("output_type") == "stream":
                texts.append(output.get("text", ""))
    return "".join(texts)


def _errors(nb) -> list[dict]:
    found = []
    for index, cell in enumerate(nb.cells):
        for output in cell.get("outputs", []):
            if output.get("output_type") == "error":
                found.append({"cell": index, "ename": output.get("ename"), "evalue": output.get("evalue")})
    return found


@contextlib.contextmanager
def pictures_on():
    """Headless runs store a static picture beside each figure (mhc_lab.course.display), for viewers without
    JavaScript (GitHub, nbconvert's HTML); a value the caller set is kept."""
    from mhc_lab.course.display import SWITCH

    before = os.environ.get(SWITCH)
    os.environ.setdefault(SWITCH, "on")
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(SWITCH, None)


def execute_with_papermill(source: Path, target: Path, parameters: dict, *, timeout: int = 900,
                           allow_errors: bool = False) -> dict:
    """Run one notebook with papermill; returns {"seconds", "errors", "passed", "ok"} (never raises on a
    failing cell, so one bad notebook does not stop the others)."""
    import papermill

    target.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    failure = None
    try:
        with pictures_on():
            papermill.execute_notebook(
                str(source), str(target), parameters=parameters, cwd=str(source.parent), kernel_name="python3",
                progress_bar=False, execution_timeout=timeout, report_mode=False, log_output=False,
            )
    except Exception as error:  # papermill raises PapermillExecutionError on the first failing cell
        failure = f"{type(error).__name__}: {str(error).strip().splitlines()[-1] if str(error).strip() else ''}"
    seconds = time.perf_counter() - start
    nb = nbformat.read(target, as_version=4) if target.exists() else None
    errors = _errors(nb) if nb is not None else []
    passed = sorted(set(PASSED.findall(_stream_text(nb)))) if nb is not None else []
    ok = failure is None and not errors
    return {"seconds": round(seconds, 1), "errors": errors, "failure": failure, "passed": passed, "ok": ok}


def run_course(out: Path, size: str = "small", device: str = "auto", names: list[str] | None = None) -> int:
    """Execute every solution notebook (or those named) with papermill; write the executed notebooks and a
    summary (summary.md, summary.json) under ``out``. Returns the number of notebooks that failed."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for path in solution_notebooks():
        if names and not any(path.name.startswith(n) for n in names):
            continue
        print(f"running {path.name} (SIZE={size}, DEVICE={device}) ...", flush=True)
        result = execute_with_papermill(path, out / path.name, {"SIZE": size, "DEVICE": device})
        result["notebook"] = path.name
        rows.append(result)
        state = "ok" if result["ok"] else "FAILED"
        print(f"  {state} in {result['seconds']} s, exercises passed: {', '.join(result['passed']) or 'none'}")
        if not result["ok"]:
            print(f"  {result['failure'] or result['errors']}")
    from mhc_lab.measure import environment_tags

    env = environment_tags()
    lines = [
        "# mhc-lab course run",
        "",
        f"SIZE={size}, DEVICE={device}; {env['date']}; torch {env['torch']}, tilelang {env['tilelang']}; "
        f"GPU: {env['gpu'] or 'none'}",
        "",
        "| notebook | result | seconds | exercises passed |",
        "|---|---|---|---|",
    ]
    for r in rows:
        lines.append(f"| {r['notebook']} | {'ok' if r['ok'] else 'FAILED'} | {r['seconds']} | "
                     f"{', '.join(r['passed']) or '-'} |")
    failed = sum(not r["ok"] for r in rows)
    lines += ["", f"{len(rows) - failed} of {len(rows)} notebooks ran without error.", ""]
    (out / "summary.md").write_text("\n".join(lines))
    (out / "summary.json").write_text(json.dumps({"environment": env, "size": size, "device": device,
                                                  "notebooks": rows}, indent=2) + "\n")
    print(f"summary: {out / 'summary.md'}")
    return failed


def execute_allowing_errors(source: Path, parameters: dict, *, timeout: int = 900):
    """Inject ``parameters`` the way papermill does, execute every cell even after errors (nbclient), and
    return (executed notebook, [{"cell", "ename", "evalue"}, ...]). Used to run the student notebooks."""
    from nbclient import NotebookClient
    from papermill.iorw import load_notebook_node
    from papermill.parameterize import parameterize_notebook

    nb = parameterize_notebook(load_notebook_node(str(source)), parameters, report_mode=False)
    client = NotebookClient(nb, timeout=timeout, kernel_name="python3", allow_errors=True, record_timing=False,
                            resources={"metadata": {"path": str(Path(source).parent)}})
    client.execute()
    return nb, _errors(nb)


def refresh_solution(path: Path, timeout: int = 900) -> None:
    """Execute a solution notebook in place (default parameters), so its stored outputs are current."""
    from nbclient import NotebookClient

    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(nb, timeout=timeout, kernel_name="python3", record_timing=False,
                            resources={"metadata": {"path": str(Path(path).parent)}})
    with pictures_on():
        client.execute()
    for cell in nb.cells:
        cell.metadata.pop("execution", None)
    Path(path).write_text(nbformat.writes(nb, version=4) + "\n")


def refresh_solutions(names: list[str] | None = None) -> None:
    for path in solution_notebooks(SOLUTIONS_DIR):
        if names and not any(path.name.startswith(n) for n in names):
            continue
        print(f"executing {path.name} in place ...", flush=True)
        start = time.perf_counter()
        refresh_solution(path)
        print(f"  done in {time.perf_counter() - start:.1f} s")
