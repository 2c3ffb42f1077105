"""Grade submitted notebooks: each one executed headless in a kernel of its own, then scored exercise by exercise.

    mhc-lab grade submissions/                      # every notebook below the folder
    mhc-lab grade alice_00_setup.ipynb --json report.json
    mhc-lab grade submissions/ --variants handout/variants.json   # re-run each with the variant it was given

For each submission a worker process executes the notebook with errors allowed (papermill's parameter
injection, nbclient; a cell that runs past ``cell_timeout`` is interrupted and the rest goes on) from the top to
its last exercise check cell (the cells after it only measure and reflect; ``whole_notebook`` runs them too).
Then the worker grades in its own process, calling the learner's functions in their kernel across a narrow
channel (arguments in, plain data out: grading_channel), for every exercise of the lab:

* the **visible check** (the one the learner ran, ``checks.run_check``), and
* the **hidden checks**: those written for the exercise in ``tests/hidden/labNN.py`` (more shapes, edge cases;
  never inside a lab notebook, never sent to the learner's kernel), and three generic ones where they apply: the
  visible check again on fresh random inputs, the learner's function leaves its inputs unchanged, and its
  gradients match the library's,

against the learner's function found by the name the lab's check cell uses (``check("3.2", sinkhorn_mine)``).
Scores (``grading_worker.exercise_score``): an exercise whose visible check fails scores 0; one whose visible
check passes scores 0.5 plus 0.5 times the fraction of its hidden checks passed (1 with none). While an exercise
is graded, the library functions that answer it are withheld in the kernel (``withheld``: every function and
holder of their code swapped for code that raises), so an answer that reaches one scores 0, *uses the library*.
A stub scores 0 with its "not done" message. A learner's function that ends its kernel costs its own exercise
only (*crashed*; the notebook runs again in a fresh kernel for the others). A submission whose worker runs past
``timeout`` is reported *timed out*, a kernel that dies while the notebook runs *crashed*, a worker killed by a
signal *killed*; those score zero. Code in the learner's own cells that reaches for the grader rather than the
exercise (code_review) flags the submission for review. The result: a score table on stdout, ``report.json``
(machine-readable), ``report.csv`` and one feedback file per submission, which never repeats the hidden checks'
code (report.SecretFilter).

What the grader trusts. Every path is made absolute before anything runs. The hidden check files are read once,
before the first submission runs, and their text goes to the worker only. The job travels to the worker over its
stdin, together with a random token made for that job; the worker keeps its real stdout as a private,
non-inherited descriptor, points the descriptors the kernel inherits at /dev/null and sends its progress and its
result on that private descriptor, each line led by the token. The parent takes a result only from a worker
that exited with 0 and only on a line that carries the token. The worker and the kernel run in an empty temporary
folder of their own; the worker cannot be read or traced by a kernel of its user (not dumpable). Each kernel is
boxed (sandbox): limits on address space, file size and open files; run as root, a user id of its own for each
kernel, or no grading without ``allow_root`` (kernel_box). The executed notebook is written after every cell and
when the worker is stopped, its stored outputs capped per cell and per notebook.

What it does not guard against: copying between learners; code pasted from elsewhere (the library's source
included, or read from disk at run time); a notebook that replaces its own side of the grading channel or the
withholding (code_review flags it); files and command lines that the kernel's user may read (as an ordinary
user, grader and kernels are one user). The executed notebooks are kept next to the report for review.
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

from mhc_lab.classroom.code_review import suspicious_cells
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
from mhc_lab.classroom.sandbox import DEFAULT_MEMORY
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
        names[path] = _unused_name(name, taken)
    return names


def _unused_name(name: str, taken: set[str]) -> str:
    """``name`` (a notebook file name), or name__2, name__3, ... where it is taken; the one returned is added to
    ``taken``."""
    base, number, chosen = name[: -len(".ipynb")], 2, name
    while chosen in taken:
        chosen, number = f"{base}__{number}.ipynb", number + 1
    taken.add(chosen)
    return chosen


def _kill_group(pid: int | None) -> None:
    if not pid:
        return
    for kill in (os.killpg, os.kill):
        try:
            kill(pid, signal.SIGKILL)
            return
        except (ProcessLookupError, PermissionError, OSError):
            continue


# What the worker and the learner's kernel inherit of the grader's environment: what finding Python, the
# compilers and the GPU needs, nothing that names the grader's folders (PWD, OLDPWD, the shell's own variables).
ENVIRONMENT_KEPT = ("PATH", "HOME", "USER", "LOGNAME", "LANG", "LANGUAGE", "TZ", "TMPDIR", "PYTHONPATH",
                    "VIRTUAL_ENV", "CONDA_PREFIX", "CC", "CXX", "OMP_NUM_THREADS", "CUDA_VISIBLE_DEVICES", "CUDA_HOME",
                    "CUDA_PATH", "LD_LIBRARY_PATH")
ENVIRONMENT_PREFIXES = ("LC_", "TILELANG_", "TVM_", "NVIDIA_", "XDG_")


def worker_environment(workdir: Path) -> dict[str, str]:
    """The environment a grading worker starts with (see ENVIRONMENT_KEPT); PWD is its empty work folder. Figures
    get no static picture while grading (nobody looks at them, and starting a browser costs seconds a notebook)."""
    kept = {k: v for k, v in os.environ.items() if k in ENVIRONMENT_KEPT or k.startswith(ENVIRONMENT_PREFIXES)}
    return {**kept, "PWD": str(workdir), "MHC_LAB_STATIC_FIGURES": "off"}


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
              max_cell_output: int = MAX_CELL_OUTPUT, max_output: int = MAX_OUTPUT, stop_grace: float = 10.0,
              box: dict | None = None) -> dict:
    """Grade one submission in a worker process with a time budget; never raises (but for a folder of hidden
    checks without checks for its lab). ``hidden=None``: the visible checks only. ``box``: how its kernels are
    boxed ({"memory": bytes of address space or None, "drop": run them as a user of their own}; see
    kernel_box)."""
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
    handout_path = solutions_dir.parent / "labs" / solution.name
    handout = nbformat.read(handout_path, as_version=4) if handout_path.exists() else None
    flags = suspicious_cells(nb, handout)
    sources = hidden.for_lab(solution.name, [i for i, _ in exercises]) if hidden is not None else None
    executed = out_dir / "executed" / (executed_name or f"{_slug(submission)}")
    if executed.suffix != ".ipynb":
        executed = executed.with_name(executed.name + ".ipynb")
    executed.unlink(missing_ok=True)  # a notebook from an earlier run is not this run's
    token = secrets.token_hex(32)
    job = {"submission": str(submission), "exercises": [list(e) for e in exercises], "parameters": parameters,
           "hidden": sources, "generic": hidden is not None, "cell_timeout": cell_timeout,
           "check_timeout": check_timeout, "whole_notebook": whole_notebook, "executed": str(executed),
           "max_cell_output": max_cell_output, "max_output": max_output,
           "sandbox": box or {"memory": DEFAULT_MEMORY, "drop": False}}
    # The worker and the kernel start in an empty folder of their own: nothing of the grader's beside or above.
    workdir = Path(tempfile.mkdtemp(prefix="mhc-grade-"))
    state: dict[str, Any] = {"progress": {}, "capped": [], "result": None}
    lock = threading.Lock()
    worker = subprocess.Popen([sys.executable, "-m", "mhc_lab.classroom.grading_worker", "--worker"], cwd=workdir,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              start_new_session=True, env=worker_environment(workdir))
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
    if flags:
        row["flags"] = flags
        row.setdefault("warnings", []).append(
            "flagged for review: " + "; ".join(f"cell {f['cell']} {f['what']} (`{f['line']}`)" for f in flags))
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


def kernel_box(memory: int | None, allow_root: bool) -> tuple[dict, str, list[str]]:
    """How the kernels of this run are boxed, in words for the report, and warnings. Running as root, each kernel
    runs as a user of its own (sandbox); when no unprivileged user can run this Python, grading refuses
    (GradingInputError) unless ``allow_root``: then the kernels run as root, and a notebook can forge its
    result or a classmate's."""
    from mhc_lab.classroom import sandbox

    box = {"memory": memory or None, "drop": False}
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return box, "the grader's own user", []
    reason = sandbox.can_drop_to_another_user(worker_environment(Path("/")))
    if reason is None:
        return {**box, "drop": True}, "a user of their own each (the grader runs as root)", []
    if not allow_root:
        raise GradingInputError(
            "running as root, the grader runs each notebook as a user of its own, and no unprivileged user can run "
            f"{sys.executable} with the course ({reason}). Grade as an ordinary user, or install Python and the "
            "course where every user may read them (a container's /usr/local or /opt); --allow-root grades with "
            "the notebooks running as root, where one can forge its own result and a classmate's")
    return box, "root (--allow-root)", [
        "the notebooks ran as root (--allow-root): a notebook can read the grader's memory and forge its result "
        f"or a classmate's; no unprivileged user can run {sys.executable} with the course ({reason})"]


def readable_by_everyone(folder: Path) -> bool:
    """Whether any user may list and read ``folder`` (it and every folder above it open to others)."""
    import stat

    try:
        if not folder.stat().st_mode & stat.S_IROTH:
            return False
        return all(p.stat().st_mode & stat.S_IXOTH for p in [folder, *folder.parents])
    except OSError:
        return False


class GradingInputError(ValueError):
    """An input of ``grade_paths`` that cannot be used: no submissions, a variants manifest, roster or parameter
    that does not fit, an earlier report that cannot be merged into. Raised before any submission runs."""


def _read_submissions(submissions: list[Path], solutions_dir: Path) -> dict[Path, dict]:
    """For each submission: {"lab": its solution notebook or None, "nb": the notebook or None} (an unreadable
    one is left to grade_one, which reports it)."""
    import nbformat

    found = {}
    for submission in submissions:
        try:
            nb = nbformat.read(submission, as_version=4)
        except Exception:
            found[submission] = {"lab": None, "nb": None}
            continue
        found[submission] = {"lab": identify_lab(nb, submission, solutions_dir), "nb": nb}
    return found


def _roots(paths: list[Path], submissions: list[Path]) -> dict[Path, Path]:
    """The folder above which a submission's path says nothing about its author: above the folder the grader was
    pointed at, or above a named notebook's own folder (the instructor's folders never name a student)."""
    roots = {}
    for submission in submissions:
        for path in paths:
            if submission == path:
                roots[submission] = path.parent.parent
                break
            if path in submission.parents:
                roots[submission] = path.parent
                break
    return roots


def _previous_report(path: Path) -> dict | None:
    """The class report an earlier run left in the --out folder, to merge this run into (None: there is none)."""
    if not path.exists():
        return None
    expected = ("expected the report.json of an earlier `mhc-lab grade` run, to merge this run into (pass --fresh "
                "to start a new report there, or choose another --out)")
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise GradingInputError(f"{path}: {expected}, got {type(error).__name__}: {error}") from None
    rows = data.get("submissions") if isinstance(data, dict) else None
    if not isinstance(rows, list) or not all(isinstance(r, dict) and isinstance(r.get("submission"), str)
                                             and isinstance(r.get("exercises"), list) for r in rows):
        raise GradingInputError(f"{path}: {expected}, got JSON without a list of submission rows")
    return data


def _stable_names(submissions: list[Path], earlier: list[dict]) -> dict[Path, str]:
    """Executed-notebook names: a submission graded before keeps its name, a new one gets a name that no row kept
    from earlier runs uses (a regrade never overwrites another submission's notebook)."""
    names = _executed_names(submissions)
    ours = {str(s) for s in submissions}
    old = {r["submission"]: Path(r["executed"]).name for r in earlier if r.get("executed")}
    taken = {Path(r["executed"]).name for r in earlier if r.get("executed") and r["submission"] not in ours}
    chosen = {}
    for submission in sorted(submissions, key=lambda s: str(s) not in old):
        name = old.get(str(submission)) or names[submission]
        chosen[submission] = _unused_name(name, taken)
    return chosen


SETTINGS_COMPARED = ("checks", "hidden_checks_sha256", "parameters", "variants", "whole_notebook")


def _setting(value) -> str:
    """A setting as a warning shows it (a digest shortened)."""
    return f"{value[:12]}..." if isinstance(value, str) and re.fullmatch(r"[0-9a-f]{64}", value) else repr(value)


def _merge(previous: dict | None, rows: list[dict], run: dict) -> tuple[list[dict], list[dict], list[str]]:
    """(rows, runs, warnings) of the class report once this run's rows are in: a row of a submission graded
    again replaces its old row (matched by path), the others are kept; each run says what it graded when."""
    if previous is None:
        return rows, [run], []
    runs = previous.get("runs") if isinstance(previous.get("runs"), list) else [
        {"graded_at": previous.get("graded_at"), "submissions": [r["submission"] for r in previous["submissions"]],
         "settings": previous.get("settings"), "warnings": previous.get("warnings") or []}]
    new = {r["submission"]: r for r in rows}
    merged, replaced = [], []
    for old in previous["submissions"]:
        if old["submission"] in new:
            merged.append(new[old["submission"]])
            replaced.append(old["submission"])
        else:
            old.setdefault("graded_at", previous.get("graded_at"))
            merged.append(old)
    merged += [r for r in rows if r["submission"] not in set(replaced)]
    run["replaced"] = replaced
    warnings = []
    kept_at = {r.get("graded_at") for r in merged if r["submission"] not in new}
    for earlier in runs:
        settings = earlier.get("settings") or {}
        if earlier.get("graded_at") not in kept_at:
            continue
        differ = [key for key in SETTINGS_COMPARED if key in settings and settings[key] != run["settings"][key]]
        if differ:
            warnings.append(
                f"rows kept from the run of {earlier.get('graded_at')} were graded with other settings ("
                + "; ".join(f"{key}: {_setting(settings[key])} then, {_setting(run['settings'][key])} now"
                            for key in differ)
                + "): grade them again with these settings, or start a new report with --fresh")
    return merged, [*runs, run], warnings


def _identity_warnings(rows: list[dict], rosters: dict[str, list[str]]) -> list[str]:
    """Class-wide: a student with more than one submission of a lab, and the students on the roster with none."""
    warnings = []
    by_student: dict[tuple, list[str]] = {}
    for row in rows:
        if row.get("student"):
            by_student.setdefault((row["student"], row.get("lab")), []).append(row["submission"])
    for (student, lab), paths in sorted(by_student.items(), key=lambda item: (str(item[0][1]), item[0][0])):
        if len(paths) > 1:
            warnings.append(f"duplicate: {student} has {len(paths)} submissions of {lab} ({', '.join(paths)}); each "
                            "is graded and listed: keep one")
    for lab, students in sorted(rosters.items()):
        handed_in = {row.get("student") for row in rows if row.get("lab") == lab}
        missing = [s for s in students if s not in handed_in]
        if missing:
            warnings.append(f"no submission of {lab} from {len(missing)} student{'s' if len(missing) > 1 else ''} "
                            f"on the roster: {', '.join(missing)}")
    return warnings


def _remove_unlisted(folder: Path, pattern: str, listed: set[str]) -> None:
    """Files of an earlier report (executed notebooks, feedback) that the new report does not list."""
    for path in folder.glob(pattern) if folder.is_dir() else []:
        if str(path) not in listed:
            path.unlink(missing_ok=True)


def grade_paths(paths: list[Path | str], *, out_dir: Path | str = Path("build/grading"), timeout: float = 900,
                cell_timeout: float = 300, check_timeout: float = 60, parameters: dict | None = None,
                variants: Path | str | None = None, hidden_dir: Path | str | None = HIDDEN_DIR, jobs: int = 1,
                solutions_dir: Path = SOLUTIONS_DIR, whole_notebook: bool = False,
                max_cell_output: int = MAX_CELL_OUTPUT, max_output: int = MAX_OUTPUT,
                roster: Path | str | list[str] | None = None, roster_header: bool | None = None,
                fresh: bool = False, memory_limit: int | None = DEFAULT_MEMORY, allow_root: bool = False,
                log: Callable[[str], None] | None = print) -> dict:
    """Grade every submission under ``paths``; write report.json, report.csv and one feedback file a submission
    (feedback/NAME.md) in ``out_dir``; return the report.

    ``hidden_dir=None`` grades with the visible checks only; a folder of hidden checks that is missing, empty, or
    has no checks for a lab being graded raises HiddenChecksError before anything runs, and so do (as
    GradingInputError) no submissions, an unreadable ``variants`` manifest or ``roster``, a ``parameters`` name
    that no lab being graded declares, and an ``out_dir`` whose report.json is not a report.

    Who: with a ``roster`` (ids, or a roster file) or a ``variants`` manifest (its students, lab by lab), each row
    names the student its path names (``student``), and is flagged when its path names no one on the roster or
    differs from the id its handout recorded; the report warns about a student with two submissions of a lab and
    lists the students with none.

    Merging: when ``out_dir`` already holds a class report, this run's rows replace the rows of the same
    submissions (by path) and the others are kept; ``runs`` in the report says what each run graded when, and
    each row has its ``graded_at``. ``fresh=True`` starts a new report (and drops the executed notebooks and
    feedback files that it does not list).

    Each kernel is boxed (sandbox): at most ``memory_limit`` bytes of address space (None: no limit), limits on
    file size and open files; running as root, a user of its own, or a GradingInputError unless ``allow_root``
    (kernel_box)."""
    import nbformat

    from mhc_lab.classroom.notebook_build import notebook_parameters
    from mhc_lab.classroom.report import write_feedback
    from mhc_lab.classroom.variants import RosterError, identify, read_manifest, read_roster

    out_dir = _absolute(out_dir)
    solutions_dir = _absolute(solutions_dir)
    variants = _absolute(variants) if variants else None
    paths = [_absolute(p) for p in paths]
    submissions = find_submissions(paths)
    if not submissions:
        raise GradingInputError(f"submissions {', '.join(map(str, paths))}: expected notebooks (*.ipynb) or folders "
                                "holding some, found none (checkpoint and hidden folders are skipped)")
    found = _read_submissions(submissions, solutions_dir)
    labs = {item["lab"].name: item["lab"] for item in found.values() if item["lab"] is not None}
    hidden = HiddenChecks(hidden_dir) if hidden_dir is not None else None
    if hidden is not None:
        for name, solution in sorted(labs.items()):
            hidden.for_lab(name, [i for i, _ in lab_exercises(solution)])
    manifest = None
    if variants:
        try:
            manifest = read_manifest(variants)
        except ValueError as error:
            raise GradingInputError(str(error)) from None
    roster_ids = None
    if roster is not None and not isinstance(roster, (list, tuple)):
        notes: list[str] = []
        try:
            roster_ids = read_roster(_absolute(roster), header=roster_header, notes=notes)
        except RosterError as error:
            raise GradingInputError(str(error)) from None
        for note in notes if log else []:
            log(f"note: {note}")
    elif roster is not None:
        roster_ids = list(roster)
    if parameters:
        declared = {name: set(notebook_parameters(nbformat.read(solution, as_version=4), tags=("parameters",)))
                    for name, solution in sorted(labs.items())}
        for name in parameters:
            if declared and not any(name in names for names in declared.values()):
                raise GradingInputError(
                    f"--param {name}: no lab being graded declares {name}; expected one of the parameters their "
                    "parameters cells declare: " + "; ".join(f"{lab}: {', '.join(sorted(names))}"
                                                             for lab, names in declared.items()))
    box, kernels_run_as, box_warnings = kernel_box(memory_limit, allow_root)
    if hidden is not None and box["drop"] and readable_by_everyone(hidden.folder):
        box_warnings.append(f"the hidden checks folder {hidden.folder} can be read by every user, the notebooks' "
                            f"users included: close it to others (chmod 700 {hidden.folder})")
    if log and hidden is not None:
        log(f"hidden checks: {hidden.folder}")
    previous = None if fresh else _previous_report(out_dir / "report.json")
    names = _stable_names(submissions, previous["submissions"] if previous else [])
    roots = _roots(paths, submissions)
    graded_at = _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")

    def roster_of(lab: str | None) -> list[str] | None:
        if roster_ids is not None:
            return roster_ids
        if manifest is not None and lab in manifest["labs"]:
            return list(manifest["labs"][lab]["students"])
        return None

    def run(submission: Path) -> dict:
        item = found[submission]
        lab = item["lab"].name if item["lab"] is not None else None
        chosen = {**DEFAULT_PARAMETERS, **(parameters or {})}
        students = roster_of(lab)
        who = identify(submission, students, item["nb"], roots.get(submission)) if students is not None else None
        warnings = list(who["warnings"]) if who else []
        if manifest is not None and lab is not None:
            entry = manifest["labs"].get(lab)
            if entry is None:
                warnings.append(f"{lab} is not in the variants manifest: graded with the parameters in the notebook")
            elif who and who["student"] in entry["students"]:
                chosen.update(entry["students"][who["student"]]["parameters"])
            elif who and who["student"]:
                warnings.append(f"{who['student']} has no variant of {lab} in the variants manifest: graded with the "
                                "parameters in the notebook")
        row = grade_one(submission, out_dir=out_dir, timeout=timeout, cell_timeout=cell_timeout,
                        check_timeout=check_timeout, parameters=chosen, hidden=hidden,
                        solutions_dir=solutions_dir, whole_notebook=whole_notebook, executed_name=names[submission],
                        max_cell_output=max_cell_output, max_output=max_output, box=box)
        if manifest is not None or roster_ids is not None:
            row["student"] = who["student"] if who else None
            if who and who["made_for"]:
                row["made_for"] = who["made_for"]
        if warnings:
            row["warnings"] = warnings + list(row.get("warnings") or [])
        row["graded_at"] = graded_at
        row["feedback"] = str(out_dir / "feedback" / (names[submission][: -len(".ipynb")] + ".md"))
        if log:
            log(f"{row['status']:>11}  {row['score']:g}/{row['max_score']}  {submission}")
        return row

    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        rows = list(pool.map(run, submissions))
    warnings = list(box_warnings)
    if hidden is not None:
        changed = hidden.changed()
        if changed:
            warnings.append(f"the hidden checks in {hidden.folder} changed on disk while grading ({changed}); every "
                            "submission was graded with the files as read before the first one ran: restore the "
                            "folder from your own copy, and read the executed notebooks of this run")
    settings = {"timeout_s": timeout, "cell_timeout_s": cell_timeout, "check_timeout_s": check_timeout,
                "parameters": {**DEFAULT_PARAMETERS, **(parameters or {})},
                "checks": "visible and hidden" if hidden is not None else "visible only (--no-hidden)",
                "hidden_checks": str(hidden.folder) if hidden else None,
                "hidden_checks_sha256": hidden.digest if hidden else None,
                "variants": str(variants) if variants else None, "whole_notebook": whole_notebook,
                "max_cell_output_chars": max_cell_output, "max_output_chars": max_output,
                "kernels_run_as": kernels_run_as, "kernel_memory_bytes": box["memory"]}
    run_record = {"graded_at": graded_at, "submissions": [r["submission"] for r in rows], "settings": settings,
                  "warnings": list(warnings)}
    merged, runs, merge_warnings = _merge(previous, rows, run_record)
    rosters = {lab: roster_of(lab) for lab in sorted({r["lab"] for r in merged if r.get("lab")})
               if roster_of(lab) is not None}
    report = {
        "graded_at": graded_at,
        "settings": settings,
        "warnings": warnings + merge_warnings + _identity_warnings(merged, rosters),
        "runs": runs,
        "submissions": merged,
    }
    out_dir.mkdir(parents=True, exist_ok=True)
    private = [p for p in (hidden.folder if hidden else None, hidden_dir, solutions_dir, out_dir, variants) if p]
    write_feedback(report, private=private, secrets=hidden.sources.values() if hidden else ())
    (out_dir / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    write_csv(report, out_dir / "report.csv")
    if fresh:
        _remove_unlisted(out_dir / "executed", "*.ipynb", {r.get("executed") for r in merged if r.get("executed")})
        _remove_unlisted(out_dir / "feedback", "*.md", {r.get("feedback") for r in merged if r.get("feedback")})
    return report
