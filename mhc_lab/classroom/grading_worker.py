"""The grading worker: one submission, executed in a kernel of its own, graded from outside that kernel.

``mhc_lab.classroom.grading`` starts one worker per submission (``python -m mhc_lab.classroom.grading_worker
--worker``) with the job and a per-job token on its stdin. The worker executes the notebook in an empty folder of
its own, writing the executed notebook after every cell with its outputs capped (OutputCaps). Then it grades in
its own process: the checks (visible, hidden, generic) run here and call the learner's functions across the
grading channel (grading_channel.KernelSession: arguments in, plain data out), so that nothing the notebook
did to its own kernel reaches a verdict. It sends its progress and its result on a private descriptor, each
line led by the token. grade_answer grades one answer, local or remote (the tests use it directly).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Callable

from mhc_lab.classroom.notebook_build import (
    CHECK_CALL,
    notebook_parameters,
)
from mhc_lab.classroom import sandbox
from mhc_lab.classroom.grading_channel import CheckTimeout, GraderError, KernelDied, KernelSession, is_remote
from mhc_lab.classroom.hidden_checks import (
    HIDDEN_DIR,
    generic_checks,
    load_hidden,
    recorder,
    registry_from_sources,
)

GRADING_TAG = "mhc-lab-grading"
DEFAULT_PARAMETERS = {"SIZE": "small", "DEVICE": "cpu"}  # grading is about answers: small and on the CPU
MAX_CELL_OUTPUT = 100_000  # characters of output stored per cell of an executed notebook
MAX_OUTPUT = 2_000_000  # ... and per notebook
MAX_GRADING_OUTPUT = 20_000_000  # one answer of the grading channel; a larger one is not an answer
MAX_MESSAGE = 2_000  # characters kept of one check's message


# ---- running one check with a time limit --------------------------------------------------------------------


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


def _attempt(fn: Callable[[], object], seconds: float | None, limit=None) -> tuple[bool, str]:
    try:
        with (limit or _time_limit)(seconds):
            result = fn()
    except CheckTimeout as error:
        return False, str(error)
    except (KernelDied, GraderError):
        raise
    except BaseException as error:  # anything else fails this check only: SystemExit, KeyboardInterrupt included
        return False, _message(error)
    return True, (f"passed {len(result)} cases" if isinstance(result, (list, tuple)) else "passed")


# ---- grading one answer ------------------------------------------------------------------------------------


def exercise_score(visible_passed: bool, hidden_passed: int, hidden_total: int) -> float:
    """The score rule: 0 unless the visible check passes; then 0.5 plus 0.5 times the fraction of the hidden
    checks passed (1 with no hidden checks). A wrong answer earns nothing from side checks, and the size of a
    step does not depend on how many checks an exercise has."""
    if not visible_passed:
        return 0.0
    return 1.0 if hidden_total == 0 else round(0.5 + 0.5 * hidden_passed / hidden_total, 3)


def grade_answer(exercise_id: str, answer: Any, *, hidden_dir: Path | str | None = HIDDEN_DIR,
                 check_timeout: float | None = 60.0, generic: bool = True,
                 hidden_checks: dict[str, list] | None = None, session: KernelSession | None = None) -> dict:
    """Visible and hidden checks of one exercise on ``answer``; returns the exercise's result (see module doc).
    ``answer`` is a function here, or a Remote of the learner's kernel (``session``: the channel to it). The
    hidden checks come from ``hidden_checks`` (a registry by exercise id) when given, else from the files in
    ``hidden_dir`` (``None``: none). An answer that calls the exercise's own library function scores 0."""
    from mhc_lab.course.checks import ExerciseIncomplete, get_exercise, library_calls, library_use_message, run_check

    exercise = get_exercise(exercise_id)
    result = {"id": exercise.id, "title": exercise.title, "checks": []}
    limit = session.time_limit if session is not None else _time_limit
    watch = library_calls([exercise.library])
    if session is not None:
        from mhc_lab.classroom.withheld import withheld_names

        session.library, session.library_seen = (exercise.library,), set()
        session.exercise, session.withheld = exercise.id, withheld_names(exercise.id, exercise.library)
    elif callable(answer) and not is_remote(answer):
        answer = watch.wrap(answer)
    learner, learner_calls = recorder(answer) if callable(answer) else (answer, None)

    def used_library() -> set[str]:
        return set(watch.seen) | (session.library_seen if session is not None else set())

    try:
        with limit(check_timeout):
            cases = run_check(exercise.id, learner)
        visible = {"name": "visible check", "kind": "visible", "passed": True,
                   "message": f"passed {len(cases)} cases"}
    except ExerciseIncomplete as error:
        result.update(status="not done", score=0.0, message=str(error),
                      checks=[{"name": "visible check", "kind": "visible", "passed": False, "message": str(error)}])
        return result
    except CheckTimeout as error:
        visible = {"name": "visible check", "kind": "visible", "passed": False, "message": str(error)}
    except (KernelDied, GraderError):
        raise
    except BaseException as error:
        if isinstance(error, NotImplementedError) and str(error).startswith("Exercise"):
            message = f"{error} -- not done yet: replace the `raise NotImplementedError` line"
            result.update(status="not done", score=0.0, message=message,
                          checks=[{"name": "visible check", "kind": "visible", "passed": False, "message": message}])
            return result
        visible = {"name": "visible check", "kind": "visible", "passed": False, "message": _message(error)}
    checks = [visible]
    if "timed out" in visible["message"] and not visible["passed"]:  # the hidden checks would only time out again
        result.update(status="timed out", score=0.0, checks=checks, message=f"visible check: {visible['message']}")
        return result
    registry = hidden_checks if hidden_checks is not None else load_hidden(hidden_dir) if hidden_dir else {}
    candidates = list(registry.get(exercise.id, []))
    if generic:
        candidates += generic_checks(exercise, answer, learner_calls)
    for check in candidates:
        passed, message = _attempt(functools.partial(check.run, answer), check_timeout, limit)
        checks.append({"name": check.name, "kind": "hidden", "passed": passed, "message": message})
    if used_library():
        message = library_use_message(exercise.id, used_library())
        result.update(status="uses the library", score=0.0, checks=checks, message=message)
        return result
    hidden = checks[1:]
    passed = sum(c["passed"] for c in hidden)
    score = exercise_score(visible["passed"], passed, len(hidden))
    timed_out = any("timed out" in c["message"] for c in checks if not c["passed"])
    status = ("passed" if visible["passed"] and passed == len(hidden) else
              "timed out" if timed_out and score == 0 else "partial" if score else "failed")
    failures = [f"{c['name']}: {c['message']}" for c in checks if not c["passed"]]
    result.update(status=status, score=score, checks=checks, message=failures[0] if failures else "")
    return result


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


def _write_notebook(nb, path: Path, cells: int) -> None:
    """Write ``nb``'s first ``cells`` cells atomically (the grading channel's slot after them is never stored)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.partial")
    partial.write_text(json.dumps({**nb, "cells": nb.cells[:cells]}, ensure_ascii=False) + "\n")
    os.replace(partial, path)


def _worker(job: dict, send: Callable[[str, dict], None]) -> dict:
    """Execute one submission, then grade it from this process; returns the submission's result (without its
    path fields). ``send(kind, data)`` tells the parent how far it got."""
    import nbformat
    from papermill.iorw import load_notebook_node
    from papermill.parameterize import parameterize_notebook

    nb = load_notebook_node(job["submission"])  # papermill's reader: every cell gets metadata.tags
    nb.cells = [c for c in nb.cells if GRADING_TAG not in c.metadata.get("tags", [])]
    handed_out = any("injected-parameters" in c.metadata.get("tags", []) for c in nb.cells)
    # Keep what papermill injected when the notebook was handed out (its variant), then apply the grader's.
    parameters = {**notebook_parameters(nb, tags=("injected-parameters",)), **job["parameters"]}
    nb = parameterize_notebook(nb, parameters, report_mode=False)
    variant = {k: v for k, v in {**notebook_parameters(nb), **parameters}.items() if k not in DEFAULT_PARAMETERS}
    if not job.get("whole_notebook"):
        # The cells after the last exercise check only measure and reflect (a lab never uses the learner's
        # functions after their check), so grading stops there: much faster, same scores.
        ids = {exercise_id for exercise_id, _ in job["exercises"]}
        last = max((i for i, c in enumerate(nb.cells) if c.cell_type == "code"
                    and any(found in ids for found, _ in CHECK_CALL.findall(c.source))), default=None)
        if last is not None:
            nb.cells = nb.cells[: last + 1]
    # Cells are named by their place in the submission, counted from 1 over all its cells as JupyterLab's status
    # bar does ("Cell 3/26"): a handout's parameters cell counts (the learner sees it), the one the grader
    # injects into a notebook that had none does not.
    ordinal, number = {}, 0
    for index, cell in enumerate(nb.cells):
        if handed_out or "injected-parameters" not in cell.metadata.get("tags", []):
            number += 1
            ordinal[index] = number
    grading_index = len(nb.cells)  # the requests of the grading channel: never part of the stored notebook
    executed = Path(job["executed"])
    started: dict[int, float] = {}
    durations: dict[int, float] = {}
    state: dict[str, Any] = {"cell": None}

    def capped(cell_index, record):
        send("capped", {"cell": ordinal.get(cell_index), **record})

    caps = OutputCaps(job["max_cell_output"], job["max_output"], exempt={grading_index}, on_cap=capped)

    def snapshot():
        for index, cell in enumerate(nb.cells[:grading_index]):
            if cell.cell_type == "code" and cell.get("outputs"):
                caps.finish(cell, index)
        _write_notebook(nb, executed, grading_index)

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
        if cell_index == grading_index or state.get("replaying"):
            return
        started[cell_index] = time.monotonic()
        state.update(cell=ordinal.get(cell_index), source=_first_line(cell.source), grading=False)
        send("progress", state)
        snapshot()  # the notebook as far as it got, should the worker die in this cell

    def on_executed(cell, cell_index, **_):
        if cell_index == grading_index or state.get("replaying"):
            return
        durations[cell_index] = time.monotonic() - started.get(cell_index, time.monotonic())
        caps.finish(cell, cell_index)

    # Every kernel starts boxed (sandbox): resource limits, and as a user of its own when the grader is root.
    box = job.get("sandbox") or {}
    kernels = Path(tempfile.mkdtemp(prefix="mhc-kernels-"))
    os.environ.update(JUPYTER_PATH=str(kernels), JUPYTER_RUNTIME_DIR=str(kernels / "runtime"),
                      JUPYTER_DATA_DIR=str(kernels / "data"))
    (kernels / "runtime").mkdir()
    uids: list[int] = []
    if box.get("drop"):
        for folder in (kernels, kernels / "runtime", Path(os.getcwd())):
            os.chmod(folder, 0o711)  # the kernel's user may pass through, not list

    def box_next_kernel():
        uid = sandbox.kernel_uid() if box.get("drop") else None
        if uid is not None:
            uids.append(uid)
        sandbox.write_kernel_spec(kernels, memory=box.get("memory"), uid=uid)

    def record_withheld():
        """Before any of the notebook's code: the kernel records the code of the library's answers to this lab's
        exercises, to withhold each while its exercise is graded (withheld)."""
        from mhc_lab.classroom.withheld import withheld_names
        from mhc_lab.course.checks import get_exercise

        names = sorted({n for i, _ in job["exercises"] for n in withheld_names(i, get_exercise(i).library)})
        source = f"__import__('mhc_lab.classroom.withheld', fromlist=['record']).record({names!r})"
        client.execute_cell(nbformat.v4.new_code_cell(source), grading_index, store_history=False)
        caps.cleared([], grading_index)

    box_next_kernel()
    client = _capped_client_class()(
        nb, timeout=job["cell_timeout"], interrupt_on_timeout=True, allow_errors=True,
        kernel_name=sandbox.KERNEL_NAME,
        record_timing=True, resources={"metadata": {"path": os.getcwd()}}, on_notebook_start=on_start,
        on_cell_execute=on_execute, on_cell_executed=on_executed,
    )
    client.caps = caps
    result: dict[str, Any] = {"parameters": parameters}
    graded: list[dict] | None = None
    try:
        client.reset_execution_trackers()
        nb.cells.append(nbformat.v4.new_code_cell(""))  # the slot the grader's own cells run in (never stored)
        with client.setup_kernel():
            record_withheld()
            for index, cell in enumerate(nb.cells[:grading_index]):
                client.execute_cell(cell, index, execution_count=client.code_cells_executed + 1)
            state.update(cell=None, source="", grading=True)
            send("progress", state)
            snapshot()
            graded = []
            try:
                _grade_in_worker(KernelSession(client, grading_index, caps), {**job, "variant": variant}, graded)
            except KernelDied:
                pass  # graded again below, in a fresh kernel, from the exercise after the one that killed it
        # A learner's function that ends its kernel (exit, os._exit, a crash) costs its own exercise only: the
        # notebook runs again in a fresh kernel (its outputs not stored) and grading goes on with the next one.
        while len(graded) < len(job["exercises"]):
            box_next_kernel()
            state.update(replaying=True)
            replay_caps = OutputCaps(job["max_cell_output"], job["max_output"], exempt={grading_index})
            client.caps = replay_caps
            with client.setup_kernel():
                send("progress", {"kernel_pid": getattr(getattr(client.km, "provisioner", None), "pid", None)})
                record_withheld()
                for index, cell in enumerate(nb.cells[:grading_index]):
                    client.execute_cell(nbformat.from_dict(json.loads(json.dumps(cell))), index,
                                        execution_count=client.code_cells_executed + 1)
                client.caps = caps
                state.update(replaying=False)
                try:
                    _grade_in_worker(KernelSession(client, grading_index, caps), {**job, "variant": variant},
                                     graded)
                except KernelDied:
                    continue
    except (KernelDied, Exception) as error:
        if type(error).__name__ in ("DeadKernelError", "KernelDied"):
            what = ("while grading" if state.get("grading") else
                    f"in cell {state.get('cell')} (`{state.get('source', '')}`)")
            result.update(status="crashed", detail=f"the kernel died {what}")
        else:
            result.update(status="crashed", detail=f"{type(error).__name__}: {error}")
    for uid in uids:
        sandbox.end_processes_of(uid)
    shutil.rmtree(kernels, ignore_errors=True)
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
    if result.get("status") != "crashed" and graded is not None:
        for exercise in graded:
            # A value exercise's stub raises where the value is computed, so the name is never defined.
            stub = next((e for e in errors if e["ename"] in ("NotImplementedError", "ExerciseIncomplete")
                         and re.match(rf"Exercise {re.escape(exercise['id'])}\b", e["evalue"])), None)
            if exercise["status"] == "missing" and stub is not None:
                exercise.update(status="not done", message=stub["evalue"].split(" -- ")[0]
                                + " -- not done yet: replace the `raise NotImplementedError` line")
        result.update(status="graded", variant=_jsonable(variant), exercises=graded)
    return result


def _grade_in_worker(session: KernelSession, job: dict, results: list[dict]) -> list[dict]:
    """Each exercise of the job not yet in ``results`` graded here, its answer the learner's function called
    across ``session``, its result appended to ``results``. When the kernel dies while an exercise is graded,
    that exercise is recorded as crashed and KernelDied is raised (the caller starts a fresh kernel)."""
    from mhc_lab.course.checks import get_exercise, set_variant

    set_variant(**job["variant"])  # what the notebook's setup() records, read from its parameters here
    registry = registry_from_sources(job["hidden"]) if job.get("hidden") else {}
    done = {r["id"] for r in results}
    for exercise_id, name in job["exercises"]:
        if exercise_id in done:
            continue
        exercise = get_exercise(exercise_id)
        answer = missing = None
        try:
            with session.time_limit(job["check_timeout"]):
                answer = session.answer(name)
            result = grade_answer(exercise_id, answer, hidden_checks=registry, check_timeout=job["check_timeout"],
                                  generic=bool(job["generic"]), session=session)
        except KernelDied:
            results.append({"id": exercise_id, "title": exercise.title, "status": "crashed", "score": 0.0,
                            "checks": [], "function": name,
                            "message": f"the kernel died while `{name}` was being checked (an exit, os._exit, a "
                                       "crash or a memory limit in your function): this exercise scores 0, the "
                                       "others were graded in a fresh kernel"})
            raise
        except CheckTimeout as error:
            if answer is None:
                missing = f"reading `{name}` from the notebook timed out"
            else:
                result = {"id": exercise_id, "title": exercise.title, "status": "timed out", "score": 0.0,
                          "checks": [], "message": str(error)}
        except (Exception, GraderError) as error:
            if answer is None:
                missing = (f"no `{name}` defined in the notebook (the lab's check cell uses that name)"
                           if type(error).__name__ == "NameError" else
                           f"`{name}` could not be read: {_message(error)}")
            else:  # a grader bug must not lose the other exercises
                result = {"id": exercise_id, "title": exercise.title, "status": "error", "score": 0.0, "checks": [],
                          "message": f"grader error: {type(error).__name__}: {error}"}
        except BaseException as error:  # an exit or an interrupt raised in a check: this exercise only
            result = {"id": exercise_id, "title": exercise.title, "status": "error", "score": 0.0, "checks": [],
                      "message": f"the check stopped with {type(error).__name__}: this exercise scores 0"}
        if missing is not None:
            results.append({"id": exercise_id, "title": exercise.title, "status": "missing", "score": 0.0,
                            "message": missing, "checks": [], "function": name})
            continue
        result["function"] = name
        result["message"] = _short(result.get("message", ""))
        for check in result.get("checks", []):
            check["message"] = _short(check.get("message", ""))
        results.append(result)
    return results


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
