"""Gate: each student notebook, executed top to bottom with errors allowed, fails at every exercise with that
exercise's stub and nowhere else. (The solution notebooks are executed and output-checked by nbval.)"""

import re

import pytest

from mhc_lab.classroom.notebook_build import LABS_DIR, SOLUTIONS_DIR, exercise_regions, solution_notebooks
from mhc_lab.classroom.runner import execute_allowing_errors

SOLUTIONS = solution_notebooks(SOLUTIONS_DIR)
STUB_ERRORS = ("NotImplementedError", "ExerciseIncomplete")


@pytest.mark.notebooks
@pytest.mark.parametrize("path", SOLUTIONS, ids=lambda p: p.name)
def test_lab_fails_only_at_its_exercises(path):
    expected = {r.exercise for r in exercise_regions(path)}
    _, errors = execute_allowing_errors(LABS_DIR / path.name, {"SIZE": "small", "DEVICE": "cpu", "SEED": 0})
    failed, unexpected = set(), []
    for error in errors:
        found = re.search(r"Exercise (\d+\.\d+)", error["evalue"] or "")
        if error["ename"] in STUB_ERRORS and found and found.group(1) in expected:
            failed.add(found.group(1))
        else:
            unexpected.append(error)
    assert not unexpected, f"labs/{path.name}: errors that are not exercise stubs: {unexpected}"
    assert failed == expected, f"labs/{path.name}: exercises whose stub did not fail: {sorted(expected - failed)}"
