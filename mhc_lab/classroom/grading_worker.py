"""The grading worker: one submission in one kernel, and the checks that run there.

``mhc_lab.classroom.grading`` starts one worker per submission (``python -m mhc_lab.classroom.grading_worker
--worker``) with the job and a per-job token on its stdin. The worker executes the notebook in an empty folder of
its own, writes the executed notebook after every cell with its outputs capped (OutputCaps), runs the grader's
cell in the learner's kernel (grade_in_kernel: the visible check, the hidden checks handed over as text, the
generic checks), and sends its progress and its result on a private descriptor, each line led by the token.
grade_answer grades one answer directly (the tests use it).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import signal
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Callable

from mhc_lab.classroom.notebook_build import (
    CHECK_CALL,
    notebook_parameters,
)
from mhc_lab.classroom.hidden_checks import (
    HIDDEN_DIR,
    generic_checks,
    load_hidden,
    recorder,
    registry_from_sources,
)

MARKER = "<<mhc-lab-grade>>"
GRADING_TAG = "mhc-lab-grading"
DEFAULT_PARAMETERS = {"SIZE": "small", "DEVICE": "cpu"}  # grading is about answers: small and on the CPU
MAX_CELL_OUTPUT = 100_000  # characters of output stored per cell of an executed notebook
MAX_OUTPUT = 2_000_000  # ... and per notebook
MAX_GRADING_OUTPUT = 20_000_000  # the grader's own cell (its result); a larger one is not a result
MAX_MESSAGE = 2_000  # characters kept of one check's message


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
                 check_timeout: float | None = 60.0, generic: bool = True,
                 hidden_checks: dict[str, list] | None = None) -> dict:
    """Visible and hidden checks of one exercise on ``answer``; returns the exercise's result (see module doc).
    The hidden checks come from ``hidden_checks`` (a registry by exercise id) when given, else from the files in
    ``hidden_dir`` (``None``: none)."""
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
    registry = hidden_checks if hidden_checks is not None else load_hidden(hidden_dir) if hidden_dir else {}
    candidates = list(registry.get(exercise.id, []))
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


def grade_in_kernel(exercises: list[list[str]], hidden_sources: dict[str, str] | None, check_timeout: float | None,
                    generic: bool = True) -> None:
    """Run in the learner's kernel after their notebook: grade each (id, function name) with the visible check and
    the hidden checks given as text (``None``: the visible check only); print JSON."""
    from IPython import get_ipython

    from mhc_lab.course.checks import get_exercise, variant

    namespace = get_ipython().user_ns
    registry = registry_from_sources(hidden_sources) if hidden_sources else {}
    results = []
    for exercise_id, name in exercises:
        if name not in namespace:
            exercise = get_exercise(exercise_id)
            results.append({"id": exercise_id, "title": exercise.title, "status": "missing", "score": 0.0,
                            "message": f"no `{name}` defined in the notebook (the lab's check cell uses that name)",
                            "checks": []})
            continue
        try:
            result = grade_answer(exercise_id, namespace[name], hidden_checks=registry, check_timeout=check_timeout,
                                  generic=generic)
        except Exception as error:  # a grader bug must not lose the other exercises
            result = {"id": exercise_id, "status": "error", "score": 0.0, "checks": [],
                      "message": f"grader error: {type(error).__name__}: {error}"}
        result["function"] = name
        result["message"] = _short(result.get("message", ""))
        for check in result.get("checks", []):
            check["message"] = _short(check.get("message", ""))
        results.append(result)
    print(MARKER + json.dumps({"variant": _jsonable(variant()), "exercises": results}))


def _short(text: str, limit: int = MAX_MESSAGE) -> str:
    text = str(text)
    return text if len(text) <= limit else text[: limit - 40] + f" ... [{len(text) - limit + 40} characters cut]"


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


# ---- stored output: capped per cell and per notebook --------------------------------------------------------


def human_size(chars: int) -> str:
    for unit, size in (("MB", 1_000_000), ("KB", 1_000)):
        if chars >= size:
            return f"{chars / size:.3g} {unit}"
    return f"{chars} characters"


def _output_size(out) -> int:
    kind = out.get("output_type")
    if kind == "stream":
        return len(out.get("text", ""))
    if kind == "error":
        return (len(out.get("ename") or "") + len(out.get("evalue") or "")
                + sum(len(line) for line in out.get("traceback") or []))
    return sum(len(v) if isinstance(v, str) else len(json.dumps(v)) for v in (out.get("data") or {}).values())


def _fit(out, room: int):
    """``out`` cut to at most ``room`` characters, or None when nothing of it fits."""
    if room <= 0:
        return None
    kind = out.get("output_type")
    if kind == "stream":
        out["text"] = out.get("text", "")[:room]
        return out
    if kind == "error":
        out["evalue"] = (out.get("evalue") or "")[: max(0, room - len(out.get("ename") or ""))]
        kept, used = [], _output_size({"output_type": "error", "ename": out.get("ename"), "evalue": out["evalue"]})
        for line in out.get("traceback") or []:
            if used + len(line) > room:
                break
            kept.append(line)
            used += len(line)
        out["traceback"] = kept
        return out
    text = (out.get("data") or {}).get("text/plain")
    if isinstance(text, str):  # keep the plain-text form only, cut
        out["data"] = {"text/plain": text[:room]}
        out["metadata"] = {}
        return out
    return None


class OutputCaps:
    """Keeps the stored output of a notebook within ``per_cell`` characters a cell and ``per_notebook`` in all;
    ``exempt`` cells (the grader's) get ``MAX_GRADING_OUTPUT`` and do not count. ``on_cap(cell_index, record)``
    is told the first time a cell is cut."""

    def __init__(self, per_cell: int, per_notebook: int, exempt: set[int] = frozenset(), on_cap=None):
        self.per_cell, self.per_notebook, self.exempt, self.on_cap = per_cell, per_notebook, set(exempt), on_cap
        self.stored: dict[int, int] = {}
        self.produced: dict[int, int] = {}
        self.hit: dict[int, str] = {}

    def _room(self, cell_index: int) -> tuple[int, str]:
        if cell_index in self.exempt:
            return MAX_GRADING_OUTPUT - self.stored.get(cell_index, 0), "grader"
        cell = self.per_cell - self.stored.get(cell_index, 0)
        others = sum(v for k, v in self.stored.items() if k not in self.exempt)
        notebook = self.per_notebook - others
        return (cell, "per-cell") if cell <= notebook else (notebook, "per-notebook")

    def _cut(self, cell_index: int, which: str) -> None:
        if cell_index not in self.hit:
            self.hit[cell_index] = which
            if self.on_cap:
                self.on_cap(cell_index, self.record(cell_index))

    def admit(self, outs: list, cell_index: int) -> None:
        """The output just appended to ``outs``: stored as it is, cut, or replaced by an empty placeholder."""
        out = outs[-1]
        size = _output_size(out)
        self.produced[cell_index] = self.produced.get(cell_index, 0) + size
        room, which = self._room(cell_index)
        if size > room:
            out = _fit(out, room)
            if out is None:
                import nbformat

                out = nbformat.v4.new_output("stream", name="stdout", text="")
            outs[-1] = out
            self._cut(cell_index, which)
            size = _output_size(out)
        self.stored[cell_index] = self.stored.get(cell_index, 0) + size

    def cleared(self, outs: list, cell_index: int) -> None:
        self.stored[cell_index] = sum(_output_size(o) for o in outs)

    def finish(self, cell, cell_index: int) -> None:
        """Enforce the caps on a cell's outputs as they stand (outputs updated in place included), drop the
        placeholders and add one note to a cell that was cut."""
        import nbformat

        self.stored[cell_index] = 0
        kept = []
        for out in cell.get("outputs", []):
            if (out.get("metadata") or {}).get("mhc_lab") == "output capped":
                continue  # the note, added again below
            size = _output_size(out)
            room, which = self._room(cell_index)
            if size > room:
                out = _fit(out, room)
                self._cut(cell_index, which)
            if out is None or (out.get("output_type") == "stream" and not out.get("text")):
                continue
            self.stored[cell_index] += _output_size(out)
            kept.append(out)
        if cell_index in self.hit and cell_index not in self.exempt:
            kept.append(nbformat.v4.new_output("display_data", data={"text/plain": self.note(cell_index)},
                                               metadata={"mhc_lab": "output capped"}))
        cell["outputs"] = kept

    def record(self, cell_index: int) -> dict:
        which = self.hit.get(cell_index)
        cap = self.per_cell if which == "per-cell" else self.per_notebook
        return {"cap": which, "cap_chars": cap, "produced_chars": self.produced.get(cell_index, 0)}

    def note(self, cell_index: int) -> str:
        record = self.record(cell_index)
        return (f"[output capped by the grader: this cell's output came to at least "
                f"{human_size(record['produced_chars'])}; only what fits the {record['cap']} cap of "
                f"{human_size(record['cap_chars'])} is stored]")


def _capped_client_class():
    from nbclient import NotebookClient

    class CappedClient(NotebookClient):
        """nbclient's client, each output admitted through an OutputCaps as it arrives (no unbounded growth)."""

        caps: OutputCaps | None = None

        def output(self, outs, msg, display_id, cell_index):
            out = super().output(outs, msg, display_id, cell_index)
            if out is not None and self.caps is not None and outs and outs[-1] is out:
                self.caps.admit(outs, cell_index)
            return out

        def clear_output(self, outs, msg, cell_index):
            super().clear_output(outs, msg, cell_index)
            if self.caps is not None:
                self.caps.cleared(outs, cell_index)

    return CappedClient


# ---- the worker: one submission, one kernel -----------------------------------------------------------------


def _first_line(source: str) -> str:
    """A cell's first line of code (comments skipped), to name the cell in a report."""
    lines = [line for line in source.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    if not lines:
        lines = source.strip().splitlines() or [""]
    return lines[0].strip()[:80]


GRADING_CELL_STORED = "# The grader's cell ran here: the visible and hidden checks (their results are in the report)."


def _write_notebook(nb, path: Path, grading_index: int | None, grading_started: bool = True) -> None:
    """Write ``nb`` atomically, the grader's cell reduced to a note (its code carries the hidden checks), or left
    out when it has not started."""
    cells = list(nb.cells)
    if grading_index is not None and grading_index < len(cells):
        if grading_started:
            cells[grading_index] = {**cells[grading_index], "source": GRADING_CELL_STORED, "outputs": []}
        else:
            del cells[grading_index]
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.partial")
    partial.write_text(json.dumps({**nb, "cells": cells}, ensure_ascii=False) + "\n")
    os.replace(partial, path)


def _worker(job: dict, send: Callable[[str, dict], None]) -> dict:
    """Execute one submission and grade it; returns the submission's result (without its path fields).
    ``send(kind, data)`` tells the parent how far it got."""
    import nbformat
    from nbclient.exceptions import DeadKernelError
    from papermill.iorw import load_notebook_node
    from papermill.parameterize import parameterize_notebook

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
    # The hidden checks travel as text inside this cell (no path to them anywhere the kernel can see); the cell
    # is stored as a note only.
    code = (f"from mhc_lab.classroom.grading_worker import grade_in_kernel as _mhc_grade\n"
            f"_mhc_grade({json.dumps(job['exercises'])}, {job['hidden']!r}, {job['check_timeout']!r}, "
            f"{bool(job['generic'])!r})")
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
    executed = Path(job["executed"])
    started: dict[int, float] = {}
    durations: dict[int, float] = {}
    state: dict[str, Any] = {"cell": None}

    def capped(cell_index, record):
        send("capped", {"cell": ordinal.get(cell_index), **record})

    caps = OutputCaps(job["max_cell_output"], job["max_output"], exempt={grading_index}, on_cap=capped)

    def snapshot():
        for index, cell in enumerate(nb.cells):
            if cell.cell_type == "code" and cell.get("outputs"):
                caps.finish(cell, index)
        _write_notebook(nb, executed, grading_index, grading_index in started)

    def on_stop(signum, frame):
        # Stopped by the parent (time limit): keep the notebook as far as it got, then die of the signal.
        try:
            snapshot()
        finally:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)

    signal.signal(signal.SIGTERM, on_stop)

    def on_start(**_):
        pid = getattr(getattr(client.km, "provisioner", None), "pid", None)
        send("progress", {"kernel_pid": pid, "cell": None})

    def on_execute(cell, cell_index, **_):
        started[cell_index] = time.monotonic()
        state.update(cell=ordinal.get(cell_index), source=_first_line(cell.source),
                     grading=cell_index == grading_index)
        send("progress", state)
        snapshot()  # the notebook as far as it got, should the worker die in this cell

    def on_executed(cell, cell_index, **_):
        durations[cell_index] = time.monotonic() - started.get(cell_index, time.monotonic())
        caps.finish(cell, cell_index)

    client = _capped_client_class()(
        nb, timeout=job["cell_timeout"], interrupt_on_timeout=True, allow_errors=True, kernel_name="python3",
        record_timing=True, resources={"metadata": {"path": os.getcwd()}}, on_notebook_start=on_start,
        on_cell_execute=on_execute, on_cell_executed=on_executed,
    )
    client.caps = caps
    result: dict[str, Any] = {"parameters": parameters}
    try:
        client.execute()
    except DeadKernelError:
        what = ("while grading" if state.get("grading") else
                f"in cell {state.get('cell')} (`{state.get('source', '')}`)")
        result.update(status="crashed", detail=f"the kernel died {what}")
    except Exception as error:
        result.update(status="crashed", detail=f"{type(error).__name__}: {error}")
    grading_outputs = list(nb.cells[grading_index].get("outputs", []))
    snapshot()
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
    result["output_capped"] = [{"cell": ordinal.get(i), **caps.record(i)} for i in sorted(caps.hit)
                               if i != grading_index]
    if result.get("status") != "crashed":
        payload = None
        for output in grading_outputs:
            if output.get("output_type") == "stream" and MARKER in output.get("text", ""):
                payload = output["text"].split(MARKER, 1)[1].strip().splitlines()[0]
        if payload is None:
            failure = next((o for o in grading_outputs if o.get("output_type") == "error"), None)
            detail = f"{failure.get('ename')}: {failure.get('evalue')}" if failure else "no result"
            result.update(status="crashed", detail=f"grading did not complete: {_short(detail, 300)}")
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


def make_not_dumpable() -> None:
    """Linux: keep processes of the same user (the kernel) from reading this one's memory and descriptors."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE, 0
    except Exception:
        pass


def _worker_main() -> int:
    """The worker: reads {"token", "job"} from stdin, answers on its stdout with lines led by the token."""
    sys.path[:] = [p for p in sys.path if p not in ("", os.getcwd())]  # nothing imported from the work folder
    message = json.loads(sys.stdin.buffer.read())
    token, job = message["token"], message["job"]
    make_not_dumpable()
    # The kernel (a child) inherits descriptors 0-2: point them at /dev/null and keep the channel to the parent,
    # and the log, on descriptors of our own that are closed on exec.
    channel = os.fdopen(os.dup(1), "w", buffering=1)
    sys.stderr = os.fdopen(os.dup(2), "w", buffering=1)
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    os.close(devnull)
    sys.stdin = open(os.devnull)
    sys.stdout = open(os.devnull, "w")
    lock = threading.Lock()

    def send(kind: str, data: dict) -> None:
        with lock:
            channel.write(f"{token} {kind} {json.dumps(data)}\n")
            channel.flush()

    try:
        result = _worker(job, send)
    except Exception as error:
        result = {"status": "crashed", "detail": f"{type(error).__name__}: {error}",
                  "traceback": traceback.format_exc()[-2000:]}
    send("result", result)
    channel.close()
    return 0

if __name__ == "__main__":
    if sys.argv[1:] != ["--worker"]:
        sys.exit("usage: python -m mhc_lab.classroom.grading_worker --worker, with the job on stdin (graders run "
                 "`mhc-lab grade`)")
    sys.exit(_worker_main())
