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
A submission whose worker runs past ``timeout`` is reported *timed out*, a dead kernel *crashed*, a worker killed
by a signal *killed*; those score zero, the others are graded all the same. The result: a score table on stdout,
``report.json`` (machine-readable) and ``report.csv``.

What the grader trusts. Every path is made absolute before anything runs. The hidden check files are read once,
before the first submission runs, and their text is handed to each kernel (only the files for its lab): no path to
them is given to the worker or the kernel. The job travels to the worker over its stdin, together with a random
token made for that job; the worker keeps its real stdout as a private, non-inherited descriptor, points the
descriptors the kernel inherits at /dev/null and sends its progress and its result on that private descriptor,
each line led by the token. The parent takes a result only from a worker that exited with 0 and only on a line
that carries the token; a worker that dies, is killed or times out scores zero. The worker and the kernel run
in an empty temporary folder of their own. The executed notebook is written after every cell and when the
worker is stopped (so a timed-out or killed submission keeps the notebook as far as it got), its stored outputs
capped per cell and per notebook.

What it does not guard against yet: the checks still run in the learner's kernel, so code in the notebook can
tamper with them there (patch the grader's functions, or call the reference solutions that the course's check
registry keeps); copying between learners is not detected. Grading runs the learner's code with your privileges:
grade untrusted submissions in a container or as an unprivileged user who cannot write the course or the hidden
checks; the executed notebooks are kept next to the report for review.
"""

from __future__ import annotations

import concurrent.futures
import datetime as _dt
import json
import os
import re
import secrets
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable

from mhc_lab.classroom.notebook_build import (
    SOLUTIONS_DIR,
    identify_lab,
)
from mhc_lab.classroom.hidden_checks import (
    HIDDEN_DIR,
    HiddenChecksError,
    exercises_of_sources,
    read_hidden,
    sources_digest,
)

from mhc_lab.classroom.report import format_report, write_csv  # noqa: F401  (format_report: the CLI's)
from mhc_lab.classroom.grading_worker import (
    DEFAULT_PARAMETERS,
    MAX_CELL_OUTPUT,
    MAX_OUTPUT,
    human_size,
    lab_exercises,
)


# ---- the parent: many submissions ---------------------------------------------------------------------------


def _absolute(path: Path | str) -> Path:
    """``path`` made absolute against the current folder (``..`` folded, symbolic links kept)."""
    return Path(os.path.abspath(os.path.expanduser(str(path))))


def find_submissions(paths: list[Path | str]) -> list[Path]:
    """Notebooks named by ``paths`` (made absolute): files as given, folders searched recursively (checkpoints
    and hidden folders skipped)."""
    found = []
    for path in map(_absolute, paths):
        if path.is_dir():
            found += sorted(p for p in path.rglob("*.ipynb") if ".ipynb_checkpoints" not in p.parts
                            and not any(part.startswith(".") for part in p.relative_to(path).parts))
        elif path.exists():
            found.append(path)
        else:
            raise FileNotFoundError(f"submission {path}: expected a notebook or a folder of notebooks, found nothing "
                                    "there")
    return found


def _slug(path: Path) -> str:
    text = re.sub(r"[^A-Za-z0-9_.-]+", "__", str(path).strip("/"))
    return text[-120:]


def _executed_names(submissions: list[Path]) -> dict[Path, str]:
    """A distinct file name under executed/ for each submission: its path below their common folder."""
    if not submissions:
        return {}
    common = Path(os.path.commonpath([str(p.parent) for p in submissions]))
    names: dict[Path, str] = {}
    taken: set[str] = set()
    for path in submissions:
        name = _slug(path.relative_to(common))
        name = name if name.endswith(".ipynb") else f"{name}.ipynb"
        base, number = name[: -len(".ipynb")], 2
        while name in taken:
            name, number = f"{base}__{number}.ipynb", number + 1
        taken.add(name)
        names[path] = name
    return names


def _kill_group(pid: int | None) -> None:
    if not pid:
        return
    for kill in (os.killpg, os.kill):
        try:
            kill(pid, signal.SIGKILL)
            return
        except (ProcessLookupError, PermissionError, OSError):
            continue


class HiddenChecks:
    """The hidden check files of one folder, read once before any submission runs: their text, which exercises
    each covers, and a digest to notice a change on disk."""

    def __init__(self, directory: Path | str):
        self.folder = _absolute(directory)
        self.sources = read_hidden(self.folder)
        self.digest = sources_digest(self.sources)
        self.covers = exercises_of_sources(self.sources, f"hidden checks in {self.folder}")

    def for_lab(self, lab: str, exercise_ids: list[str]) -> dict[str, str]:
        """The files with checks for these exercises; none is an error naming the folder and the lab."""
        chosen = {name: text for name, text in self.sources.items() if self.covers[name] & set(exercise_ids)}
        if not chosen:
            covered = sorted({i for ids in self.covers.values() for i in ids},
                             key=lambda i: tuple(map(int, i.split("."))))
            raise HiddenChecksError(
                f"hidden checks folder {self.folder}: expected checks for lab {lab} (exercises "
                f"{', '.join(exercise_ids)}), found checks for exercises {', '.join(covered) or 'none'} only "
                "(add them, point --hidden at the right folder, or grade with --no-hidden)")
        return chosen

    def changed(self) -> str | None:
        """What changed on disk since the files were read, or None."""
        try:
            now = read_hidden(self.folder)
        except HiddenChecksError as error:
            return str(error)
        if sources_digest(now) == self.digest:
            return None
        edited = {name for name in now if name in self.sources and now[name] != self.sources[name]}
        differ = sorted((set(now) ^ set(self.sources)) | edited)
        return f"{', '.join(differ)} differ from what was read before grading"


def _read_lines(stream, token: str, state: dict, lock: threading.Lock) -> None:
    """The parent's side of the worker's channel: lines led by the token are its messages; others are noise."""
    prefix = token.encode() + b" "
    for line in iter(stream.readline, b""):
        if not line.startswith(prefix):
            continue
        try:
            kind, data = line[len(prefix):].decode().split(" ", 1)
            data = json.loads(data)
        except ValueError:
            continue
        with lock:
            if kind == "progress":
                state["progress"].update(data)
            elif kind == "capped":
                state["capped"].append(data)
            elif kind == "result":
                state["result"] = data


def _read_tail(stream, keep: list, limit: int = 8000) -> None:
    tail = b""
    for chunk in iter(lambda: stream.read(4096), b""):
        tail = (tail + chunk)[-limit:]
    keep.append(tail)


def grade_one(submission: Path, *, out_dir: Path, timeout: float, cell_timeout: float, check_timeout: float,
              parameters: dict, hidden: HiddenChecks | None, solutions_dir: Path = SOLUTIONS_DIR,
              whole_notebook: bool = False, executed_name: str | None = None,
              max_cell_output: int = MAX_CELL_OUTPUT, max_output: int = MAX_OUTPUT, stop_grace: float = 10.0) -> dict:
    """Grade one submission in a worker process with a time budget; never raises (but for a folder of hidden
    checks without checks for its lab). ``hidden=None``: the visible checks only."""
    import nbformat

    submission, out_dir = _absolute(submission), _absolute(out_dir)
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
    sources = hidden.for_lab(solution.name, [i for i, _ in exercises]) if hidden is not None else None
    executed = out_dir / "executed" / (executed_name or f"{_slug(submission)}")
    if executed.suffix != ".ipynb":
        executed = executed.with_name(executed.name + ".ipynb")
    executed.unlink(missing_ok=True)  # a notebook from an earlier run is not this run's
    token = secrets.token_hex(32)
    job = {"submission": str(submission), "exercises": [list(e) for e in exercises], "parameters": parameters,
           "hidden": sources, "generic": hidden is not None, "cell_timeout": cell_timeout,
           "check_timeout": check_timeout, "whole_notebook": whole_notebook, "executed": str(executed),
           "max_cell_output": max_cell_output, "max_output": max_output}
    # The worker and the kernel start in an empty folder of their own: nothing of the grader's beside or above.
    workdir = Path(tempfile.mkdtemp(prefix="mhc-grade-"))
    state: dict[str, Any] = {"progress": {}, "capped": [], "result": None}
    lock = threading.Lock()
    worker = subprocess.Popen([sys.executable, "-m", "mhc_lab.classroom.grading_worker", "--worker"], cwd=workdir,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              start_new_session=True)
    tail: list[bytes] = []
    readers = [threading.Thread(target=_read_lines, args=(worker.stdout, token, state, lock), daemon=True),
               threading.Thread(target=_read_tail, args=(worker.stderr, tail), daemon=True)]
    for reader in readers:
        reader.start()
    timed_out = False
    try:
        worker.stdin.write(json.dumps({"token": token, "job": job}).encode())
        worker.stdin.close()
    except (BrokenPipeError, OSError):
        pass
    try:
        worker.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        worker.send_signal(signal.SIGTERM)  # the worker writes the notebook as far as it got, then dies
        try:
            worker.wait(timeout=stop_grace)
        except subprocess.TimeoutExpired:
            pass
    with lock:
        progress, capped, result = dict(state["progress"]), list(state["capped"]), state["result"]
    clean = not timed_out and worker.returncode == 0
    if not clean:  # whatever the worker left running (its kernel first)
        _kill_group(progress.get("kernel_pid"))
        _kill_group(worker.pid)
        worker.wait()
    for reader in readers:
        reader.join(timeout=10)
    with lock:
        capped, result = list(state["capped"]), state["result"]
    _remove_tree(workdir)
    row["seconds"] = round(time.monotonic() - start, 1)
    row["executed"] = str(executed) if executed.exists() else None
    where = (" while grading" if progress.get("grading") else
             f" in cell {progress['cell']} (`{progress.get('source', '')}`)" if progress.get("cell") else "")
    if timed_out:
        row.update(status="timed out", detail=f"still running after {timeout:g} s{where}; stopped")
    elif worker.returncode < 0:
        try:
            name = signal.Signals(-worker.returncode).name
        except ValueError:
            name = f"signal {-worker.returncode}"
        row.update(status="killed", detail=f"the grader's worker was killed by {name}{where}: not graded "
                                           "(a submission that stops its grader scores zero)")
    elif worker.returncode != 0 or result is None:
        lines = (tail[0] if tail else b"").decode(errors="replace").strip().splitlines()[-5:]
        row.update(status="crashed", detail=f"the grader's worker exited with {worker.returncode} without a result"
                                            f"{where}: {' | '.join(lines)}")
    else:
        row.update({k: v for k, v in result.items() if k not in ("submission", "lab", "score", "max_score",
                                                                  "executed", "seconds", "warnings")})
    if capped or row.get("output_capped"):
        row["output_capped"] = row.get("output_capped") or capped
        cells = ", ".join(str(c.get("cell")) for c in row["output_capped"])
        row.setdefault("warnings", []).append(
            f"output capped in cell {cells}: stored {human_size(max_cell_output)} a cell and {human_size(max_output)} a "
            "notebook at most (see the executed notebook)")
    titles = dict(_titles(exercises))
    by_id = {e["id"]: e for e in row.get("exercises") or []
             if isinstance(e, dict) and isinstance(e.get("score"), (int, float))} if row["status"] == "graded" else {}
    for exercise in by_id.values():
        exercise["score"] = min(1.0, max(0.0, float(exercise["score"])))
    row["exercises"] = [by_id.get(exercise_id) or {"id": exercise_id, "title": titles.get(exercise_id, ""),
                                                    "function": name, "status": row["status"], "score": 0.0,
                                                    "checks": [], "message": row.get("detail", "")}
                        for exercise_id, name in exercises]
    row["score"] = round(sum(e["score"] for e in row["exercises"]), 3)
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


def _labs_of(submissions: list[Path], solutions_dir: Path) -> dict[str, list[str]]:
    """{lab: its exercise ids} for the labs the submissions belong to (unreadable ones left to grade_one)."""
    import nbformat

    labs = {}
    for submission in submissions:
        try:
            solution = identify_lab(nbformat.read(submission, as_version=4), submission, solutions_dir)
        except Exception:
            continue
        if solution is not None and solution.name not in labs:
            labs[solution.name] = [i for i, _ in lab_exercises(solution)]
    return labs


def grade_paths(paths: list[Path | str], *, out_dir: Path | str = Path("build/grading"), timeout: float = 900,
                cell_timeout: float = 300, check_timeout: float = 60, parameters: dict | None = None,
                variants: Path | str | None = None, hidden_dir: Path | str | None = HIDDEN_DIR, jobs: int = 1,
                solutions_dir: Path = SOLUTIONS_DIR, whole_notebook: bool = False,
                max_cell_output: int = MAX_CELL_OUTPUT, max_output: int = MAX_OUTPUT,
                log: Callable[[str], None] | None = print) -> dict:
    """Grade every submission under ``paths``; write report.json and report.csv in ``out_dir``; return the
    report. ``hidden_dir=None`` grades with the visible checks only; a folder of hidden checks that is missing,
    empty, or has no checks for a lab being graded raises HiddenChecksError before anything runs."""
    out_dir = _absolute(out_dir)
    solutions_dir = _absolute(solutions_dir)
    variants = _absolute(variants) if variants else None
    submissions = find_submissions(paths)
    hidden = HiddenChecks(hidden_dir) if hidden_dir is not None else None
    if hidden is not None:
        for lab, ids in _labs_of(submissions, solutions_dir).items():
            hidden.for_lab(lab, ids)
    manifest = None
    if variants:
        from mhc_lab.classroom.variants import read_manifest

        manifest = read_manifest(variants)
    names = _executed_names(submissions)

    def run(submission: Path) -> dict:
        chosen = {**DEFAULT_PARAMETERS, **(parameters or {})}
        assigned = None
        if manifest is not None:
            from mhc_lab.classroom.variants import assigned_variant

            assigned = assigned_variant(manifest, submission)
            if assigned is not None:
                chosen.update(assigned["parameters"])
        row = grade_one(submission, out_dir=out_dir, timeout=timeout, cell_timeout=cell_timeout,
                        check_timeout=check_timeout, parameters=chosen, hidden=hidden,
                        solutions_dir=solutions_dir, whole_notebook=whole_notebook, executed_name=names[submission],
                        max_cell_output=max_cell_output, max_output=max_output)
        if manifest is not None:
            row["student"] = assigned["student"] if assigned else None
            if assigned is None:
                row.setdefault("warnings", []).append("not in the variants manifest: graded with its own parameters")
        if log:
            log(f"{row['status']:>11}  {row['score']:g}/{row['max_score']}  {submission}")
        return row

    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        rows = list(pool.map(run, submissions))
    warnings = []
    if hidden is not None:
        changed = hidden.changed()
        if changed:
            warnings.append(f"the hidden checks in {hidden.folder} changed on disk while grading ({changed}); every "
                            "submission was graded with the files as read before the first one ran: restore the "
                            "folder from your own copy, and read the executed notebooks of this run")
    report = {
        "graded_at": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "settings": {"timeout_s": timeout, "cell_timeout_s": cell_timeout, "check_timeout_s": check_timeout,
                     "parameters": {**DEFAULT_PARAMETERS, **(parameters or {})},
                     "checks": "visible and hidden" if hidden is not None else "visible only (--no-hidden)",
                     "hidden_checks": str(hidden.folder) if hidden else None,
                     "hidden_checks_sha256": hidden.digest if hidden else None,
                     "variants": str(variants) if variants else None, "whole_notebook": whole_notebook,
                     "max_cell_output_chars": max_cell_output, "max_output_chars": max_output},
        "warnings": warnings,
        "submissions": rows,
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    write_csv(report, out_dir / "report.csv")
    return report
