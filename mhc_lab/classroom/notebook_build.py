"""Single source: write the student notebooks in labs/ from the solution notebooks in solutions/.

A solution region in a code cell is marked by two lines:

    ### BEGIN SOLUTION (Exercise 3.2: normalise the columns)
    ...the answer...
    ### END SOLUTION

The build replaces each region by ``raise NotImplementedError("Exercise 3.2: normalise the columns")`` at the
marker's indentation, keeps every other line of every cell as it is, and strips outputs and execution counts.
"""

from __future__ import annotations

import ast
import copy
import re
from dataclasses import dataclass
from pathlib import Path

import nbformat

BEGIN = re.compile(r"^(?P<indent>[ \t]*)### BEGIN SOLUTION \((?P<label>Exercise (?P<id>\d+\.\d+): [^)\n]+)\)[ \t]*$")
END = re.compile(r"^[ \t]*### END SOLUTION[ \t]*$")
ANY_MARKER = re.compile(r"###\s*(BEGIN|END)\s+SOLUTION")

ROOT = Path(__file__).resolve().parents[2]
SOLUTIONS_DIR = ROOT / "solutions"
LABS_DIR = ROOT / "labs"


class MarkerError(ValueError):
    """A solution marker is malformed, unbalanced or nested; the message names the notebook and cell."""


@dataclass(frozen=True)
class SolutionRegion:
    exercise: str  # "3.2"
    label: str  # "Exercise 3.2: normalise the columns"
    cell_index: int
    text: str  # the lines between the markers


def split_regions(source: str, where: str = "cell") -> tuple[str, list[tuple[str, str, str]]]:
    """Return (stubbed source, [(exercise id, label, solution text), ...]) for one cell's source."""
    out, regions = [], []
    lines = source.splitlines(keepends=True)
    i = 0
    while i < len(lines):
        line = lines[i]
        begin = BEGIN.match(line.rstrip("\n"))
        if begin is None:
            if ANY_MARKER.search(line):
                raise MarkerError(
                    f"{where}, line {i + 1}: expected '### BEGIN SOLUTION (Exercise k.m: title)' or a matching "
                    f"'### END SOLUTION', got {line.strip()!r}"
                )
            out.append(line)
            i += 1
            continue
        j = i + 1
        while j < len(lines) and not END.match(lines[j].rstrip("\n")):
            if ANY_MARKER.search(lines[j]):
                raise MarkerError(f"{where}, line {j + 1}: solution regions cannot nest ({lines[j].strip()!r})")
            j += 1
        if j == len(lines):
            raise MarkerError(f"{where}, line {i + 1}: '### BEGIN SOLUTION' has no '### END SOLUTION'")
        indent, label = begin.group("indent"), begin.group("label")
        newline = "\n" if lines[j].endswith("\n") else ""
        out.append(f'{indent}raise NotImplementedError("{label}"){newline}')
        regions.append((begin.group("id"), label, "".join(lines[i + 1 : j])))
        i = j + 1
    return "".join(out), regions


def build_lab(solution: nbformat.NotebookNode, name: str = "notebook"):
    """Return (lab notebook, solution regions) for one solution notebook."""
    lab = copy.deepcopy(solution)
    regions: list[SolutionRegion] = []
    for index, cell in enumerate(lab.cells):
        if cell.cell_type == "code":
            source, found = split_regions(cell.source, where=f"{name}, cell {index}")
            cell.source = source
            cell.outputs = []
            cell.execution_count = None
            regions += [SolutionRegion(ex, label, index, text) for ex, label, text in found]
        elif ANY_MARKER.search(cell.source):
            raise MarkerError(f"{name}, cell {index}: solution markers belong in code cells only")
        for key in ("execution", "papermill", "collapsed", "scrolled"):
            cell.metadata.pop(key, None)
    # Notebook-level run state: papermill's record and the widgets' saved state (fresh ids every run).
    lab.metadata.pop("papermill", None)
    lab.metadata.pop("widgets", None)
    return lab, regions


def notebook_text(nb: nbformat.NotebookNode) -> str:
    return nbformat.writes(nb, version=4) + "\n"


def solution_notebooks(directory: Path = SOLUTIONS_DIR) -> list[Path]:
    return sorted(Path(directory).glob("[0-9][0-9]_*.ipynb"))


def build_all(solutions_dir: Path = SOLUTIONS_DIR, labs_dir: Path = LABS_DIR,
              names: list[str] | None = None) -> list[Path]:
    """Write labs/ afresh from solutions/ (only the notebooks whose names start with one of ``names``, if
    given); returns the written paths. With no names, lab notebooks without a solution are removed."""
    labs_dir = Path(labs_dir)
    labs_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for path in solution_notebooks(solutions_dir):
        if names and not any(path.name.startswith(n) for n in names):
            continue
        lab, _ = build_lab(nbformat.read(path, as_version=4), name=path.name)
        target = labs_dir / path.name
        target.write_text(notebook_text(lab))
        written.append(target)
    if not names:
        keep = {p.name for p in written}
        for stale in labs_dir.glob("[0-9][0-9]_*.ipynb"):
            if stale.name not in keep:
                stale.unlink()
    return written


def exercise_regions(path: Path) -> list[SolutionRegion]:
    return build_lab(nbformat.read(path, as_version=4), name=Path(path).name)[1]


# a check cell's call: check("k.m", function_name)
CHECK_CALL = re.compile(r"""^[ \t]*check\(\s*["'](\d+\.\d+)["']\s*,\s*([A-Za-z_]\w*)\s*\)""", re.M)


def identify_lab(nb, path: Path, solutions_dir: Path = SOLUTIONS_DIR) -> Path | None:
    """The solution notebook a submission belongs to: by its check cells' exercise numbers, else its metadata,
    else a ``NN_`` in its file name."""
    labs = {int(p.name[:2]): p for p in solution_notebooks(solutions_dir)}
    numbers = [int(exercise_id.split(".")[0]) for cell in nb.cells if cell.cell_type == "code"
               for exercise_id, _ in CHECK_CALL.findall(cell.source)]
    if numbers:
        number = max(set(numbers), key=numbers.count)
        if number in labs:
            return labs[number]
    name = (nb.metadata.get("mhc_lab") or {}).get("lab")
    if name and (Path(solutions_dir) / name).exists():
        return Path(solutions_dir) / name
    match = re.search(r"(?:^|[^0-9])(\d\d)_", path.name)
    if match and int(match.group(1)) in labs:
        return labs[int(match.group(1))]
    return None


def notebook_parameters(nb, tags=("parameters", "injected-parameters")) -> dict:
    """Literal values assigned in a notebook's parameters cell, overridden by a papermill-injected cell."""
    values = {}
    for tag in tags:
        for cell in nb.cells:
            if cell.cell_type == "code" and tag in cell.metadata.get("tags", []):
                try:
                    tree = ast.parse(cell.source)
                except SyntaxError:
                    continue
                for node in tree.body:
                    if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
                        try:
                            values[node.targets[0].id] = ast.literal_eval(node.value)
                        except ValueError:
                            pass
    return values
