"""Grade submitted notebooks: each one executed headless in a kernel of its own, then scored exercise by exercise.

    mhc-lab grade submissions/                      # every notebook below the folder
    mhc-lab grade alice_00_setup.ipynb --json report.json
    mhc-lab grade submissions/ --variants handout/variants.json   # re-run each with the variant it was given

For each submission a worker process executes the notebook with errors allowed (papermill's parameter
injection, nbclient; a cell that runs past ``cell_timeout`` is interrupted and the rest goes on) from the top to
its last exercise check cell (the cells after it only measure and reflect; ``whole_notebook`` runs them too),
then, in that same kernel, runs for every exercise of the lab:

* the **visible check** (the one the learner ran, ``checks.run_check``), and
* the **hidden checks**: those written for the exercise in ``tests/hidden/labNN.py`` (more shapes, edge cases;
  never inside a lab notebook), and three generic ones where they apply: the visible check again on fresh random
  inputs, the learner's function leaves its inputs unchanged, and its gradients match the reference's,

against the learner's function found by the name the lab's check cell uses (``check("3.2", sinkhorn_mine)``).
An exercise scores the fraction of its checks passed (1 point each); a stub scores 0 with its "not done" message.
A submission whose worker runs past ``timeout`` is reported *timed out*, a dead kernel *crashed*; the others are
graded all the same. The result: a score table on stdout, ``report.json`` (machine-readable) and ``report.csv``.

Grading runs the learner's code with your privileges: grade untrusted submissions in a container or as an
unprivileged user. The checks run in the learner's kernel, so a determined learner could tamper with them; the
executed notebooks are kept next to the report for review.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import csv
import datetime as _dt
import functools
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Callable

from mhc_lab.classroom.notebook_build import (
    CHECK_CALL,
    SOLUTIONS_DIR,
    identify_lab,
    notebook_parameters,
)
from mhc_lab.classroom.hidden_checks import HIDDEN_DIR, generic_checks, load_hidden, recorder

MARKER = "<<mhc-lab-grade>>"
GRADING_TAG = "mhc-lab-grading"
DEFAULT_PARAMETERS = {"SIZE": "small", "DEVICE": "cpu"}  # grading is about answers: small and on the CPU


# ---- running one check with a time limit --------------------------------------------------------------------


class CheckTimeout(BaseException):
    """A check ran past its time limit (a BaseException, so the learner's ``except Exception`` cannot eat it)."""


@contextlib.contextmanager
def _time_limit(seconds: float | None):
    if not seconds or threading.current_thread() is not threading.main_thread() or not hasattr(signal, "SIGALRM"):
        yield
        return

    def expire(signum, frame):
        raise CheckTimeout(f"timed out after {seconds:g} s (an endless loop?)")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _message(error: BaseException) -> str:
    text = str(error).strip()
    return f"{type(error).__name__}: {text}" if not text or not isinstance(error, AssertionError) else text


def _attempt(fn: Callable[[], object], seconds: float | None) -> tuple[bool, str]:
    try:
        with _time_limit(seconds):
            result = fn()
    except CheckTimeout as error:
        return False, str(error)
    except KeyboardInterrupt:
        raise
    except BaseException as error:  # the learner's code may raise anything, SystemExit included
        return False, _message(error)
    return True, (f"passed {len(result)} cases" if isinstance(result, (list, tuple)) else "passed")


# ---- grading one answer (in the learner's kernel, or directly in tests) -------------------------------------


def grade_answer(exercise_id: str, answer: Any, *, hidden_dir: Path | str | None = HIDDEN_DIR,
                 check_timeout: float | None = 60.0, generic: bool = True) -> dict:
    """Visible and hidden checks of one exercise on ``answer``; returns the exercise's result (see module doc)."""
    from mhc_lab.course.checks import ExerciseIncomplete, get_exercise, run_check

    exercise = get_exercise(exercise_id)
    result = {"id": exercise.id, "title": exercise.title, "checks": []}
    learner, learner_calls = recorder(answer) if callable(answer) else (answer, None)
    try:
        with _time_limit(check_timeout):
            cases = run_check(exercise.id, learner)
        visible = {"name": "visible check", "kind": "visible", "passed": True,
                   "message": f"passed {len(cases)} cases"}
    except ExerciseIncomplete as error:
        result.update(status="not done", score=0.0, message=str(error),
                      checks=[{"name": "visible check", "kind": "visible", "passed": False, "message": str(error)}])
        return result
    except CheckTimeout as error:
        visible = {"name": "visible check", "kind": "visible", "passed": False, "message": str(error)}
    except KeyboardInterrupt:
        raise
    except BaseException as error:
        if isinstance(error, NotImplementedError) and str(error).startswith("Exercise"):
            message = f"{error} -- not done yet: replace the `raise NotImplementedError` line"
            result.update(status="not done", score=0.0, message=message,
                          checks=[{"name": "visible check", "kind": "visible", "passed": False, "message": message}])
            return result
        visible = {"name": "visible check", "kind": "visible", "passed": False, "message": _message(error)}
    checks = [visible]
    if "timed out after" in visible["message"]:  # the hidden checks would only time out again
        result.update(status="timed out", score=0.0, checks=checks, message=f"visible check: {visible['message']}")
        return result
    candidates = list(load_hidden(hidden_dir).get(exercise.id, [])) if hidden_dir else []
    if generic:
        candidates += generic_checks(exercise, answer, learner_calls)
    for check in candidates:
        passed, message = _attempt(functools.partial(check.run, answer), check_timeout)
        checks.append({"name": check.name, "kind": "hidden", "passed": passed, "message": message})
    passed = sum(c["passed"] for c in checks)
    timed_out = any("timed out after" in c["message"] for c in checks if not c["passed"])
    status = "passed" if passed == len(checks) else ("timed out" if timed_out and passed == 0 else
                                                     "partial" if passed else "failed")
    failures = [f"{c['name']}: {c['message']}" for c in checks if not c["passed"]]
    result.update(status=status, score=round(passed / len(checks), 3), checks=checks,
                  message=failures[0] if failures else "")
    return result


def grade_in_kernel(exercises: list[list[str]], hidden_dir: str | None, check_timeout: float | None) -> None:
    """Run in the learner's kernel after their notebook: grade each (id, function name); print JSON."""
    from IPython import get_ipython

    from mhc_lab.course.checks import get_exercise, variant

    namespace = get_ipython().user_ns
    results = []
    for exercise_id, name in exercises:
        if name not in namespace:
            exercise = get_exercise(exercise_id)
            results.append({"id": exercise_id, "title": exercise.title, "status": "missing", "score": 0.0,
                            "message": f"no `{name}` defined in the notebook (the lab's check cell uses that name)",
                            "checks": []})
            continue
        try:
            result = grade_answer(exercise_id, namespace[name], hidden_dir=hidden_dir, check_timeout=check_timeout)
        except Exception as error:  # a grader bug must not lose the other exercises
            result = {"id": exercise_id, "status": "error", "score": 0.0, "checks": [],
                      "message": f"grader error: {type(error).__name__}: {error}"}
        result["function"] = name
        results.append(result)
    print(MARKER + json.dumps({"variant": _jsonable(variant()), "exercises": results}))


def _jsonable(value):
    try:
        json.dumps(value)
        return value
    except TypeError:
        return {k: repr(v) for k, v in value.items()} if isinstance(value, dict) else repr(value)


# ---- which lab, which exercises -----------------------------------------------------------------------------


def lab_exercises(solution: Path) -> list[tuple[str, str]]:
    """(exercise id, name of the learner's function) for each check cell of a lab, in the lab's order."""
    import nbformat

    nb = nbformat.read(solution, as_version=4)
    found = {}
    for cell in nb.cells:
        if cell.cell_type == "code":
            for exercise_id, name in CHECK_CALL.findall(cell.source):
                found.setdefault(exercise_id, name)
    return list(found.items())


# ---- the worker: one submission, one kernel -----------------------------------------------------------------


def _first_line(source: str) -> str:
    """A cell's first line of code (comments skipped), to name the cell in a report."""
    lines = [line for line in source.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    if not lines:
        lines = source.strip().splitlines() or [""]
    return lines[0].strip()[:80]


def _worker(job: dict) -> dict:
    """Execute one submission and grade it; returns the submission's result (without its path fields)."""
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import DeadKernelError
    from papermill.iorw import load_notebook_node
    from papermill.parameterize import parameterize_notebook

    progress = Path(job["progress"])
    nb = load_notebook_node(job["submission"])  # papermill's reader: every cell gets metadata.tags
    nb.cells = [c for c in nb.cells if GRADING_TAG not in c.metadata.get("tags", [])]
    # Keep what papermill injected when the notebook was handed out (its variant), then apply the grader's.
    parameters = {**notebook_parameters(nb, tags=("injected-parameters",)), **job["parameters"]}
    nb = parameterize_notebook(nb, parameters, report_mode=False)
    if not job.get("whole_notebook"):
        # The cells after the last exercise check only measure and reflect (a lab never uses the learner's
        # functions after their check), so grading stops there: much faster, same scores.
        ids = {exercise_id for exercise_id, _ in job["exercises"]}
        last = max((i for i, c in enumerate(nb.cells) if c.cell_type == "code"
                    and any(found in ids for found, _ in CHECK_CALL.findall(c.source))), default=None)
        if last is not None:
            nb.cells = nb.cells[: last + 1]
    code = (f"from mhc_lab.classroom.grading import grade_in_kernel as _mhc_grade\n"
            f"_mhc_grade({json.dumps(job['exercises'])}, {json.dumps(job['hidden_dir'])}, {job['check_timeout']!r})")
    nb.cells.append(nbformat.v4.new_code_cell(code, metadata={"tags": [GRADING_TAG]}))
    grading_index = len(nb.cells) - 1
    # Cells are named by their place in the submission, counted from 1 over all its cells as JupyterLab's status
    # bar does ("Cell 3/26"); the injected parameters and the grading cell are not counted.
    ordinal, number = {}, 0
    for index, cell in enumerate(nb.cells):
        tags = cell.metadata.get("tags", [])
        if "injected-parameters" not in tags and GRADING_TAG not in tags:
            number += 1
            ordinal[index] = number
    workdir = Path(job["workdir"])
    workdir.mkdir(parents=True, exist_ok=True)
    started: dict[int, float] = {}
    durations: dict[int, float] = {}

    def on_start(**_):
        pid = getattr(getattr(client.km, "provisioner", None), "pid", None)
        progress.write_text(json.dumps({"kernel_pid": pid, "cell": None}))

    def on_execute(cell, cell_index, **_):
        started[cell_index] = time.monotonic()
        state = json.loads(progress.read_text()) if progress.exists() else {}
        state.update(cell=ordinal.get(cell_index), source=_first_line(cell.source), grading=cell_index == grading_index)
        progress.write_text(json.dumps(state))

    def on_executed(cell, cell_index, **_):
        durations[cell_index] = time.monotonic() - started.get(cell_index, time.monotonic())

    client = NotebookClient(
        nb, timeout=job["cell_timeout"], interrupt_on_timeout=True, allow_errors=True, kernel_name="python3",
        record_timing=True, resources={"metadata": {"path": str(workdir)}}, on_notebook_start=on_start,
        on_cell_execute=on_execute, on_cell_executed=on_executed,
    )
    result: dict[str, Any] = {"parameters": parameters}
    try:
        client.execute()
    except DeadKernelError:
        state = json.loads(progress.read_text()) if progress.exists() else {}
        what = ("while grading" if state.get("grading") else
                f"in cell {state.get('cell')} (`{state.get('source', '')}`)")
        result.update(status="crashed", detail=f"the kernel died {what}")
    except Exception as error:
        result.update(status="crashed", detail=f"{type(error).__name__}: {error}")
    Path(job["executed"]).parent.mkdir(parents=True, exist_ok=True)
    nbformat.write(nb, job["executed"])
    errors = []
    for index, cell in enumerate(nb.cells[:grading_index]):
        for output in cell.get("outputs", []):
            if output.get("output_type") == "error":
                error = {"cell": ordinal.get(index), "source": _first_line(cell.source), "ename": output.get("ename"),
                         "evalue": (output.get("evalue") or "")[:300]}
                if output.get("ename") == "KeyboardInterrupt" and durations.get(index, 0) >= job["cell_timeout"] * 0.9:
                    error["evalue"] = f"interrupted: the cell ran past {job['cell_timeout']} s"
                    error["ename"] = "timed out"
                errors.append(error)
    result["cell_errors"] = errors
    if result.get("status") != "crashed":
        payload = None
        for output in nb.cells[grading_index].get("outputs", []):
            if output.get("output_type") == "stream" and MARKER in output.get("text", ""):
                payload = output["text"].split(MARKER, 1)[1].strip().splitlines()[0]
        if payload is None:
            failure = next((o for o in nb.cells[grading_index].get("outputs", []) if o.get("output_type") == "error"),
                           None)
            detail = f"{failure.get('ename')}: {failure.get('evalue')}" if failure else "no result"
            result.update(status="crashed", detail=f"grading did not complete: {detail}")
        else:
            data = json.loads(payload)
            for exercise in data["exercises"]:
                # A value exercise's stub raises where the value is computed, so the name is never defined.
                stub = next((e for e in errors if e["ename"] in ("NotImplementedError", "ExerciseIncomplete")
                             and re.match(rf"Exercise {re.escape(exercise['id'])}\b", e["evalue"])), None)
                if exercise["status"] == "missing" and stub is not None:
                    exercise.update(status="not done", message=stub["evalue"].split(" -- ")[0]
                                    + " -- not done yet: replace the `raise NotImplementedError` line")
            result.update(status="graded", variant=data["variant"], exercises=data["exercises"])
    return result


def _worker_main(job_path: str) -> int:
    job = json.loads(Path(job_path).read_text())
    try:
        result = _worker(job)
    except Exception as error:
        result = {"status": "crashed", "detail": f"{type(error).__name__}: {error}",
                  "traceback": traceback.format_exc()[-2000:]}
    Path(job["result"]).write_text(json.dumps(result))
    return 0


# ---- the parent: many submissions ---------------------------------------------------------------------------


def find_submissions(paths: list[Path | str]) -> list[Path]:
    """Notebooks named by ``paths``: files as given, folders searched recursively (checkpoints skipped)."""
    found = []
    for path in map(Path, paths):
        if path.is_dir():
            found += sorted(p for p in path.rglob("*.ipynb") if ".ipynb_checkpoints" not in p.parts
                            and not any(part.startswith(".") for part in p.relative_to(path).parts))
        elif path.exists():
            found.append(path)
        else:
            raise FileNotFoundError(f"no such notebook or folder: {path}")
    return found


def _slug(path: Path) -> str:
    text = re.sub(r"[^A-Za-z0-9_.-]+", "__", str(path).strip("/"))
    return text[-120:]


def _kill_group(pid: int | None) -> None:
    if not pid:
        return
    for kill in (os.killpg, os.kill):
        try:
            kill(pid, signal.SIGKILL)
            return
        except (ProcessLookupError, PermissionError, OSError):
            continue


def grade_one(submission: Path, *, out_dir: Path, timeout: float, cell_timeout: float, check_timeout: float,
              parameters: dict, hidden_dir: Path | None, solutions_dir: Path = SOLUTIONS_DIR,
              whole_notebook: bool = False) -> dict:
    """Grade one submission in a worker process with a time budget; never raises."""
    import nbformat

    start = time.monotonic()
    row: dict[str, Any] = {"submission": str(submission), "status": None, "lab": None, "score": 0.0,
                           "max_score": 0, "exercises": []}
    try:
        nb = nbformat.read(submission, as_version=4)
    except Exception as error:
        row.update(status="unreadable", detail=f"not a notebook: {type(error).__name__}: {error}")
        return row
    solution = identify_lab(nb, submission, solutions_dir)
    if solution is None:
        row.update(status="unknown lab", detail="no exercise check cells of a course lab found")
        return row
    exercises = lab_exercises(solution)
    row.update(lab=solution.name, max_score=len(exercises))
    slug = _slug(submission)
    out_dir.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="grade-", dir=out_dir))
    job = {"submission": str(submission), "exercises": [list(e) for e in exercises], "parameters": parameters,
           "hidden_dir": str(hidden_dir) if hidden_dir else None, "cell_timeout": cell_timeout,
           "check_timeout": check_timeout, "whole_notebook": whole_notebook, "executed": str(out_dir / "executed" / f"{slug}"),
           "workdir": str(scratch / "work"), "progress": str(scratch / "progress.json"),
           "result": str(scratch / "result.json")}
    if not job["executed"].endswith(".ipynb"):
        job["executed"] += ".ipynb"
    (scratch / "job.json").write_text(json.dumps(job))
    worker = subprocess.Popen([sys.executable, "-m", "mhc_lab.classroom.grading", "--worker", str(scratch / "job.json")],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        log, _ = worker.communicate(timeout=timeout)
        timed_out = False
    except subprocess.TimeoutExpired:
        timed_out = True
        state = json.loads(Path(job["progress"]).read_text()) if Path(job["progress"]).exists() else {}
        _kill_group(state.get("kernel_pid"))
        _kill_group(worker.pid)
        log, _ = worker.communicate()
    row["seconds"] = round(time.monotonic() - start, 1)
    row["executed"] = job["executed"] if Path(job["executed"]).exists() else None
    if timed_out:
        where = (" while grading" if state.get("grading") else
                 f" in cell {state['cell']} (`{state.get('source', '')}`)" if state.get("cell") else "")
        row.update(status="timed out", detail=f"still running after {timeout:g} s{where}; stopped")
    elif Path(job["result"]).exists():
        row.update(json.loads(Path(job["result"]).read_text()))
    else:
        tail = (log or b"").decode(errors="replace").strip().splitlines()[-5:]
        row.update(status="crashed", detail=f"the grader's worker exited with {worker.returncode}: {' | '.join(tail)}")
    titles = dict(_titles(exercises))
    by_id = {e["id"]: e for e in row.get("exercises") or []}
    row["exercises"] = [by_id.get(exercise_id) or {"id": exercise_id, "title": titles.get(exercise_id, ""),
                                                    "function": name, "status": row["status"], "score": 0.0,
                                                    "checks": [], "message": row.get("detail", "")}
                        for exercise_id, name in exercises]
    row["score"] = round(sum(e["score"] for e in row["exercises"]), 3)
    for path in (Path(job["progress"]), Path(job["result"]), scratch / "job.json"):
        path.unlink(missing_ok=True)
    _remove_tree(scratch)
    return row


def _titles(exercises):
    from mhc_lab.course.checks import get_exercise

    for exercise_id, _ in exercises:
        try:
            yield exercise_id, get_exercise(exercise_id).title
        except Exception:
            yield exercise_id, ""


def _remove_tree(path: Path) -> None:
    import shutil

    shutil.rmtree(path, ignore_errors=True)


def grade_paths(paths: list[Path | str], *, out_dir: Path | str = Path("build/grading"), timeout: float = 900,
                cell_timeout: float = 300, check_timeout: float = 60, parameters: dict | None = None,
                variants: Path | str | None = None, hidden_dir: Path | str | None = HIDDEN_DIR, jobs: int = 1,
                solutions_dir: Path = SOLUTIONS_DIR, whole_notebook: bool = False,
                log: Callable[[str], None] | None = print) -> dict:
    """Grade every submission under ``paths``; write report.json and report.csv in ``out_dir``; return the
    report."""
    out_dir = Path(out_dir)
    submissions = find_submissions(paths)
    hidden = Path(hidden_dir) if hidden_dir and Path(hidden_dir).is_dir() else None
    manifest = None
    if variants:
        from mhc_lab.classroom.variants import read_manifest

        manifest = read_manifest(variants)

    def run(submission: Path) -> dict:
        chosen = {**DEFAULT_PARAMETERS, **(parameters or {})}
        assigned = None
        if manifest is not None:
            from mhc_lab.classroom.variants import assigned_variant

            assigned = assigned_variant(manifest, submission)
            if assigned is not None:
                chosen.update(assigned["parameters"])
        row = grade_one(submission, out_dir=out_dir, timeout=timeout, cell_timeout=cell_timeout,
                        check_timeout=check_timeout, parameters=chosen, hidden_dir=hidden,
                        solutions_dir=solutions_dir, whole_notebook=whole_notebook)
        if manifest is not None:
            row["student"] = assigned["student"] if assigned else None
            if assigned is None:
                row.setdefault("warnings", []).append("not in the variants manifest: graded with its own parameters")
        if log:
            log(f"{row['status']:>11}  {row['score']:g}/{row['max_score']}  {submission}")
        return row

    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        rows = list(pool.map(run, submissions))
    report = {
        "graded_at": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "settings": {"timeout_s": timeout, "cell_timeout_s": cell_timeout, "check_timeout_s": check_timeout,
                     "parameters": {**DEFAULT_PARAMETERS, **(parameters or {})},
                     "hidden_checks": str(hidden) if hidden else None, "variants": str(variants) if variants else None,
                     "whole_notebook": whole_notebook},
        "submissions": rows,
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    write_csv(report, out_dir / "report.csv")
    return report


def write_csv(report: dict, path: Path) -> None:
    ids = sorted({e["id"] for r in report["submissions"] for e in r["exercises"]},
                 key=lambda i: tuple(int(p) for p in i.split(".")))
    with open(path, "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["submission", "student", "lab", "status", "score", "max_score", *ids])
        for r in report["submissions"]:
            scores = {e["id"]: e["score"] for e in r["exercises"]}
            writer.writerow([r["submission"], r.get("student") or "", r["lab"] or "", r["status"], r["score"],
                             r["max_score"], *[scores.get(i, "") for i in ids]])


def format_report(report: dict, details: bool = True) -> str:
    """The score table, one block per lab, then what each non-perfect exercise failed on."""
    lines = []
    rows = report["submissions"]
    labs = sorted({r["lab"] or "-" for r in rows})
    for lab in labs:
        group = [r for r in rows if (r["lab"] or "-") == lab]
        ids = [e["id"] for e in group[0]["exercises"]] if group[0]["exercises"] else []
        width = max([len("submission")] + [len(r["submission"]) for r in group])
        lines.append(f"lab {lab}")
        lines.append(f"  {'submission':<{width}}  {'status':<11}" + "".join(f"{i:>6}" for i in ids) + "   total")
        for r in group:
            scores = {e["id"]: e for e in r["exercises"]}
            cells = "".join(f"{scores[i]['score']:>6.2f}" if r["status"] == "graded" else f"{'-':>6}" for i in ids)
            lines.append(f"  {r['submission']:<{width}}  {r['status']:<11}{cells}   {r['score']:g}/{r['max_score']}")
        lines.append("")
    if details:
        for r in rows:
            notes = []
            if r["status"] != "graded":
                notes.append(f"  {r['status']}: {r.get('detail', '')}")
            for warning in r.get("warnings", []):
                notes.append(f"  warning: {warning}")
            if r.get("variant") and (r.get("student") or r["variant"] != {"SEED": 0}):
                notes.append(f"  variant: {', '.join(f'{k}={v}' for k, v in r['variant'].items())}")
            for e in r["exercises"]:
                if r["status"] == "graded" and e["score"] < 1:
                    notes.append(f"  {e['id']} {e.get('title', '')}: {e['status']}, {e['score']:g}: {e['message']}")
            for error in r.get("cell_errors", []):
                notes.append(f"  cell {error['cell']} (`{error['source']}`): {error['ename']}: {error['evalue']}")
            if notes:
                lines.append(r["submission"])
                lines += [n if len(n) <= 220 else n[:217] + "..." for n in notes]
                lines.append("")
    return "\n".join(lines).rstrip() + "\n"


if __name__ == "__main__":
    if len(sys.argv) != 3 or sys.argv[1] != "--worker":
        sys.exit("usage: python -m mhc_lab.classroom.grading --worker JOB (graders run `mhc-lab grade`)")
    sys.exit(_worker_main(sys.argv[2]))
