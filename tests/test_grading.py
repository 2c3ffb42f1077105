"""Grading: a solution scores full marks, a lab (stubs) scores zero with the stubs' messages, an endless loop or a
crash in one submission is reported while the others are graded; hidden checks pass every reference solution and
catch what the visible checks miss; value answers depend on the variant.

The end-to-end test grades, in one `grade` run over a folder, the solution and the lab notebook of every lab
present, plus broken copies of lab 00 (an endless loop in an exercise, an unstoppable loop, a dead kernel).
"""

from __future__ import annotations

import csv
import json
import shutil
from pathlib import Path

import nbformat
import pytest
import torch

from mhc_lab.course import checks
from mhc_lab.course.checks import all_exercises, expect_number, register
from mhc_lab.classroom.grading import format_report, grade_paths
from mhc_lab.classroom.grading_worker import grade_answer, lab_exercises
from mhc_lab.classroom.hidden_checks import HIDDEN_DIR, load_hidden
from mhc_lab.classroom.notebook_build import (
    LABS_DIR,
    ROOT,
    SOLUTIONS_DIR,
    exercise_regions,
    identify_lab,
    notebook_parameters,
    solution_notebooks,
)
from mhc_lab.course.setup import setup
from test_checks import own_copy

EXERCISES = all_exercises()
SOLUTIONS = solution_notebooks(SOLUTIONS_DIR)
# Time limits: generous for a healthy lab (6 to 16 s each up to its last check here, under load), short for the
# broken submissions (the unstoppable loop costs NOTEBOOK_TIMEOUT, the endless exercise CELL_TIMEOUT + CHECK_TIMEOUT).
NOTEBOOK_TIMEOUT, CELL_TIMEOUT, CHECK_TIMEOUT = 90, 30, 5


# ---- in-process: the checks themselves (no kernels) ---------------------------------------------------------


@pytest.mark.parametrize("exercise", EXERCISES, ids=lambda e: e.id)
def test_the_library_equation_passes_every_hidden_check(exercise):
    result = grade_answer(exercise.id, own_copy(exercise.library_function()), hidden_dir=HIDDEN_DIR)
    failed = [c for c in result["checks"] if not c["passed"]]
    assert result["score"] == 1.0 and not failed, failed


@pytest.mark.parametrize("exercise", EXERCISES, ids=lambda e: e.id)
def test_stub_scores_zero_with_its_message(exercise):
    def stub(*args, **kwargs):
        raise NotImplementedError(f"Exercise {exercise.id}: {exercise.title}")

    result = grade_answer(exercise.id, stub, hidden_dir=HIDDEN_DIR)
    assert result["status"] == "not done" and result["score"] == 0.0
    assert result["message"].startswith(f"Exercise {exercise.id}: {exercise.title} -- not done yet")


def test_hidden_checks_catch_what_the_visible_check_misses():
    def bytes_for_float_dtypes_only(numel, dtype):  # right for the four dtypes the visible check tries
        size = {torch.float32: 4, torch.float64: 8, torch.bfloat16: 2, torch.float16: 2}.get(dtype, 4)
        return 2 * numel * size

    result = grade_answer("0.1", bytes_for_float_dtypes_only, hidden_dir=HIDDEN_DIR)
    assert result["checks"][0]["passed"], "the visible check should pass this answer"
    assert result["status"] == "partial" and 0 < result["score"] < 1
    assert "torch.int8 has 1 bytes per element" in result["message"]


def test_generic_hidden_checks_catch_detached_and_in_place_answers():
    exercise = next((e for e in EXERCISES if e.id.startswith(("1.", "2.", "3."))
                     and any(c["name"].startswith("gradients") for c in
                             grade_answer(e.id, own_copy(e.library_function()), hidden_dir=None)["checks"])), None)
    if exercise is None:
        pytest.skip("no exercise with tensor inputs and gradients is registered yet")

    def detached(*args, **kwargs):
        return own_copy(exercise.library_function())(*args, **kwargs).detach()

    result = grade_answer(exercise.id, detached, hidden_dir=None)
    assert result["checks"][0]["passed"] and result["status"] == "partial"
    assert "carries no gradient" in result["message"]


def test_a_check_that_never_returns_is_stopped():
    def endless(nbytes, seconds):
        while True:
            pass

    result = grade_answer("0.2", endless, hidden_dir=HIDDEN_DIR, check_timeout=1)
    assert result["status"] == "timed out" and result["score"] == 0.0
    assert "timed out after 1 s" in result["message"]


def test_hidden_checks_are_kept_out_of_the_labs():
    registry = load_hidden(HIDDEN_DIR)
    known = {e.id for e in EXERCISES}
    assert registry, "no hidden checks found in tests/hidden"
    assert set(registry) <= known, f"hidden checks for unknown exercises: {set(registry) - known}"
    for path in [*SOLUTIONS, *LABS_DIR.glob("[0-9][0-9]_*.ipynb")]:
        text = path.read_text()
        assert "tests/hidden" not in text and "grading import hidden" not in text, path
    for path in (ROOT / "mhc_lab").rglob("*.py"):
        assert "tests.hidden" not in path.read_text(), path


def test_value_answers_depend_on_the_variant(capsys):
    """A value exercise's checker computes its expected value from checks.variant(): a number copied from
    another variant fails."""

    @register("99.1", "predict the sum of your seeded numbers", hints=["Add them up."], library=None)
    def _check(answer):
        expected = float(checks.randn(16, seed=checks.variant_seed(7)).sum())
        expect_number(answer, expected, case=f"SEED={checks.variant_value('SEED')}", name="the sum",
                      explain="Your number belongs to another variant: compute it in your own notebook.")
        return ["the sum"]

    try:
        setup("small", "cpu", 11, quiet=True)
        mine = float(checks.randn(16, seed=checks.variant_seed(7)).sum())
        checks.check("99.1", mine)
        setup("small", "cpu", 12, quiet=True, n=4)
        assert checks.variant() == {"SEED": 12, "n": 4}
        with pytest.raises(checks.CheckFailed, match="another variant"):
            checks.check("99.1", mine)
        assert grade_answer("99.1", mine, hidden_dir=None)["score"] == 0.0
    finally:
        checks.REGISTRY.pop("99.1", None)
        setup("small", "cpu", 0, quiet=True)


@pytest.mark.parametrize("path", SOLUTIONS, ids=lambda p: p.name)
def test_grader_finds_each_labs_exercises(path):
    names = lab_exercises(path)
    assert [i for i, _ in names] == sorted({r.exercise for r in exercise_regions(path)},
                                           key=lambda i: tuple(map(int, i.split("."))))
    lab = nbformat.read(LABS_DIR / path.name, as_version=4)
    assert identify_lab(lab, LABS_DIR / "renamed_by_a_student.ipynb") == path
    assert {"SIZE", "DEVICE", "SEED"} <= set(notebook_parameters(lab))


# ---- end to end: one `grade` run over a folder --------------------------------------------------------------


def _edit(nb, old: str, new: str):
    for cell in nb.cells:
        if cell.cell_type == "code" and old in cell.source:
            cell.source = cell.source.replace(old, new)
            return nb
    raise AssertionError(f"no cell contains {old!r}")


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    folder = tmp_path_factory.mktemp("submissions")
    for path in SOLUTIONS:
        (folder / "solution").mkdir(exist_ok=True)
        (folder / "lab").mkdir(exist_ok=True)
        shutil.copy(path, folder / "solution" / path.name)
        shutil.copy(LABS_DIR / path.name, folder / "lab" / path.name)
    broken = folder / "broken"
    broken.mkdir()
    lab00 = SOLUTIONS_DIR / "00_setup.ipynb"
    loop = _edit(nbformat.read(lab00, as_version=4), "return nbytes / seconds / 1e9", "while True:\n        pass")
    nbformat.write(loop, broken / "loop_00_setup.ipynb")
    stuck = _edit(nbformat.read(lab00, as_version=4), "cfg = setup(SIZE, DEVICE, SEED)",
                  "cfg = setup(SIZE, DEVICE, SEED)\nimport signal\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\n"
                  "while True:\n    pass")
    nbformat.write(stuck, broken / "stuck_00_setup.ipynb")
    crash = _edit(nbformat.read(lab00, as_version=4), "cfg = setup(SIZE, DEVICE, SEED)",
                  "cfg = setup(SIZE, DEVICE, SEED)\nimport os\nos._exit(1)")
    nbformat.write(crash, broken / "crash_00_setup.ipynb")
    out = tmp_path_factory.mktemp("grading")
    report = grade_paths([folder], allow_root=True, out_dir=out, timeout=NOTEBOOK_TIMEOUT, cell_timeout=CELL_TIMEOUT,
                         check_timeout=CHECK_TIMEOUT, jobs=2, log=None)
    by_path = {str(Path(r["submission"]).relative_to(folder)): r for r in report["submissions"]}
    return {"report": report, "rows": by_path, "out": out}


def _row(graded, name):
    assert name in graded["rows"], f"{name} was not graded; graded: {sorted(graded['rows'])}"
    return graded["rows"][name]


@pytest.mark.notebooks
@pytest.mark.parametrize("path", SOLUTIONS, ids=lambda p: p.name)
def test_solution_notebook_scores_full_marks(graded, path):
    row = _row(graded, f"solution/{path.name}")
    assert row["status"] == "graded", row.get("detail")
    assert row["score"] == row["max_score"] == len(lab_exercises(path)), format_report({"submissions": [row]})
    assert all(e["status"] == "passed" for e in row["exercises"])


@pytest.mark.notebooks
@pytest.mark.parametrize("path", SOLUTIONS, ids=lambda p: p.name)
def test_lab_notebook_scores_zero_with_the_stubs_messages(graded, path):
    row = _row(graded, f"lab/{path.name}")
    assert row["status"] == "graded", row.get("detail")
    assert row["score"] == 0
    for exercise in row["exercises"]:
        assert exercise["status"] == "not done", exercise
        assert exercise["message"].startswith(f"Exercise {exercise['id']}: ")
        assert "not done yet: replace the `raise NotImplementedError` line" in exercise["message"]


@pytest.mark.notebooks
def test_endless_loop_in_an_exercise_is_reported_and_the_rest_graded(graded):
    row = _row(graded, "broken/loop_00_setup.ipynb")
    assert row["status"] == "graded"
    scores = {e["id"]: e for e in row["exercises"]}
    assert scores["0.2"]["status"] == "timed out" and scores["0.2"]["score"] == 0
    assert scores["0.1"]["score"] == scores["0.3"]["score"] == 1.0
    assert any(e["ename"] == "timed out" for e in row["cell_errors"]), row["cell_errors"]


@pytest.mark.notebooks
def test_unstoppable_notebook_is_timed_out_and_a_dead_kernel_is_reported(graded):
    stuck = _row(graded, "broken/stuck_00_setup.ipynb")
    assert stuck["status"] == "timed out" and stuck["score"] == 0
    assert "still running after" in stuck["detail"] and "in cell 3 (`import torch`)" in stuck["detail"]
    crash = _row(graded, "broken/crash_00_setup.ipynb")
    assert crash["status"] == "crashed" and "kernel died" in crash["detail"]
    # ... and the other submissions were graded all the same
    assert _row(graded, "solution/00_setup.ipynb")["score"] == 3


@pytest.mark.notebooks
def test_report_is_machine_readable_and_printable(graded):
    out = graded["out"]
    report = json.loads((out / "report.json").read_text())
    assert len(report["submissions"]) == 2 * len(SOLUTIONS) + 3
    for row in report["submissions"]:
        assert {"submission", "lab", "status", "score", "max_score", "exercises"} <= set(row)
    with open(out / "report.csv") as handle:
        rows = list(csv.DictReader(handle))
    assert len(rows) == len(report["submissions"]) and "0.1" in rows[0]
    text = format_report(report)
    assert "lab 00_setup.ipynb" in text and "timed out" in text and "crashed" in text
    assert (out / "executed").is_dir()


@pytest.mark.notebooks
def test_every_submission_keeps_its_executed_notebook_without_the_hidden_checks(graded):
    """Timed out and crashed ones too (as far as they got); the grader's cell is stored as a note only."""
    hidden_text = [line for path in HIDDEN_DIR.glob("lab*.py") for line in path.read_text().splitlines()
                   if line.startswith("@hidden(")]
    for row in graded["report"]["submissions"]:
        assert row["executed"] and Path(row["executed"]).exists(), row["submission"]
        nb = nbformat.read(row["executed"], as_version=4)
        text = Path(row["executed"]).read_text()
        assert not any(line in text for line in hidden_text), row["submission"]
        assert "grading_kernel" not in text and str(HIDDEN_DIR) not in text, row["submission"]
        assert nb.cells, row["submission"]



@pytest.mark.notebooks
def test_cell_numbers_in_a_variant_handout_match_jupyterlab(tmp_path):
    """A handout made by `mhc-lab variants` has a parameters cell of its own, which JupyterLab shows and counts:
    the report names a failing cell by the number JupyterLab gives it."""
    from mhc_lab.classroom.variants import make_handout

    make_handout(LABS_DIR / "00_setup.ipynb", ["ada"], tmp_path / "handout", secret="s")
    handout = tmp_path / "handout" / "ada" / "00_setup.ipynb"
    nb = nbformat.read(handout, as_version=4)
    assert any("injected-parameters" in c.metadata.get("tags", []) for c in nb.cells)
    nb = _edit(nb, 'check("0.2", gigabytes_per_second)', 'raise ValueError("here")\ncheck("0.2", gigabytes_per_second)')
    jupyterlab_number = next(i for i, c in enumerate(nb.cells, start=1) if 'raise ValueError("here")' in c.source)
    nbformat.write(nb, handout)
    report = grade_paths([handout], allow_root=True, out_dir=tmp_path / "out", timeout=NOTEBOOK_TIMEOUT, cell_timeout=CELL_TIMEOUT,
                         check_timeout=CHECK_TIMEOUT, hidden_dir=None, log=None)
    errors = [e for e in report["submissions"][0]["cell_errors"] if e["ename"] == "ValueError"]
    assert [e["cell"] for e in errors] == [jupyterlab_number], report["submissions"][0]["cell_errors"]
