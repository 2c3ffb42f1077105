"""The single-source gates: labs/ is exactly a fresh build of solutions/, and no answer leaks into it."""

import re

import nbformat
import pytest

from mhc_lab.classroom.notebook_build import (
    LABS_DIR,
    SOLUTIONS_DIR,
    MarkerError,
    build_lab,
    notebook_text,
    solution_notebooks,
    split_regions,
)

SOLUTIONS = solution_notebooks(SOLUTIONS_DIR)


def _read(path):
    return nbformat.read(path, as_version=4)


def test_labs_and_solutions_pair_up():
    assert SOLUTIONS, "no solution notebooks found"
    labs = sorted(p.name for p in LABS_DIR.glob("[0-9][0-9]_*.ipynb"))
    assert labs == [p.name for p in SOLUTIONS]


@pytest.mark.parametrize("path", SOLUTIONS, ids=lambda p: p.name)
def test_lab_equals_fresh_build(path):
    lab, _ = build_lab(_read(path), name=path.name)
    committed = (LABS_DIR / path.name).read_text()
    assert committed == notebook_text(lab), f"labs/{path.name} is stale: run `make labs`"


@pytest.mark.parametrize("path", SOLUTIONS, ids=lambda p: p.name)
def test_no_solution_text_in_lab(path):
    solution = _read(path)
    lab, regions = build_lab(solution, name=path.name)
    lab_text = (LABS_DIR / path.name).read_text()
    assert not re.search(r"###\s*(BEGIN|END)\s+SOLUTION", lab_text)
    assert regions, f"{path.name} has no exercises"
    outside = "\n".join(c.source for c in lab.cells)  # the solution notebook with every region removed
    distinctive = [
        line.strip()
        for region in regions
        for line in region.text.splitlines()
        if len(line.strip()) >= 16 and line.strip() not in outside
    ]
    assert distinctive, f"{path.name}: no distinctive solution line to look for"
    raw_lab = "\n".join(c.source for c in _read(LABS_DIR / path.name).cells)
    leaked = [line for line in distinctive if line in raw_lab]
    assert not leaked, f"solution lines found in labs/{path.name}: {leaked[:3]}"


@pytest.mark.parametrize("path", SOLUTIONS, ids=lambda p: p.name)
def test_lab_shape(path):
    """3 to 8 exercises, numbered after the lab; the first code cell is the tagged parameters cell."""
    nb = _read(path)
    lab_number = int(path.name[:2])
    _, regions = build_lab(nb, name=path.name)
    ids = sorted({r.exercise for r in regions}, key=lambda s: tuple(map(int, s.split("."))))
    assert 3 <= len(ids) <= 8, f"{path.name}: {len(ids)} exercises {ids}"
    assert all(int(i.split(".")[0]) == lab_number for i in ids), ids
    first_code = next(c for c in nb.cells if c.cell_type == "code")
    assert "parameters" in first_code.metadata.get("tags", [])
    for name in ("SIZE", "DEVICE", "SEED"):
        assert re.search(rf"^{name}\s*=", first_code.source, re.M), f"{path.name}: parameters cell lacks {name}"
    for ex in ids:
        assert re.search(rf"check\(\"{re.escape(ex)}\"", "\n".join(c.source for c in nb.cells)), \
            f"{path.name}: exercise {ex} has no check(...) call"


def test_build_replaces_region_with_stub_at_its_indentation():
    source = 'def f(x):\n    """Doc."""\n    ### BEGIN SOLUTION (Exercise 9.1: add one)\n    return x + 1\n    ### END SOLUTION\n'
    stubbed, regions = split_regions(source)
    assert stubbed == 'def f(x):\n    """Doc."""\n    raise NotImplementedError("Exercise 9.1: add one")\n'
    assert regions == [("9.1", "Exercise 9.1: add one", "    return x + 1\n")]


@pytest.mark.parametrize(
    "source, message",
    [
        ("### BEGIN SOLUTION (Exercise 9.1: a)\nx = 1\n", "has no '### END SOLUTION'"),
        ("### BEGIN SOLUTION\nx = 1\n### END SOLUTION\n", "expected '### BEGIN SOLUTION (Exercise k.m: title)'"),
        ("### BEGIN SOLUTION (Exercise 9.1: a)\n### BEGIN SOLUTION (Exercise 9.2: b)\n### END SOLUTION\n",
         "cannot nest"),
        ("x = 1\n### END SOLUTION\n", "expected '### BEGIN SOLUTION"),
    ],
)
def test_malformed_markers_are_clear_errors(source, message):
    with pytest.raises(MarkerError, match=re.escape(message)):
        split_regions(source)
