"""Variants: every student (or section) gets the lab with parameters of their own (SEED, and any parameter the
lab declares), so each sees numbers of their own.

    mhc-lab variants labs/03_mhc.ipynb --roster roster.csv --out handout/ [--param NAME=V1,V2] [--secret WORD]

writes ``handout/<student>/03_mhc.ipynb`` for each student, with papermill's ``injected-parameters`` cell
(``SEED = 48213`` and any ``--param`` values; nothing is executed), and ``handout/variants.json``, the manifest
that ``mhc-lab grade --variants handout/variants.json`` uses to re-run each submission with the parameters its
author was given (a student who edits SEED is graded on their own variant all the same).

The parameters are a deterministic function of (secret, lab, student): the same roster and secret give the same
handout. How the checks use them: ``setup(SIZE, DEVICE, SEED, **lab_parameters)`` records SEED and the lab's
parameters; a checker of a value answer computes its expected value from ``checks.variant()`` (see
docs/instructor-guide.md), so a number copied from another variant fails. The labs' exercises are functions,
which are right for every variant: a function copied from a classmate passes, so variants do not tell copying
apart.

Identity: the roster (or the manifest's students) says who may hand in; a submission is credited to the student its
path names (``identify``), never to the id recorded in the notebook, which is only compared with it.
"""

from __future__ import annotations

import ast
import hashlib
import json
import re
from pathlib import Path
from typing import Any

SEED_RANGE = 100_000
STUDENT_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.@+-]*$")


def _hash(*parts: str) -> int:
    return int(hashlib.sha256("|".join(parts).encode()).hexdigest()[:12], 16)


def assign(student: str, lab: str, *, secret: str = "", choices: dict[str, list] | None = None) -> dict[str, Any]:
    """One student's parameters: SEED from a hash of (secret, lab, student), and one value of each choice."""
    parameters: dict[str, Any] = {"SEED": _hash(secret, lab, student, "SEED") % SEED_RANGE}
    for name, values in (choices or {}).items():
        values = list(values)
        if not values:
            raise ValueError(f"--param {name}: no values to choose from")
        parameters[name] = values[_hash(secret, lab, student, name) % len(values)]
    return parameters


def parse_choices(items: list[str]) -> dict[str, list]:
    """``["n=2,4,8", "C=64"]`` -> {"n": [2, 4, 8], "C": [64]} (values as Python literals, else strings)."""
    choices = {}
    for item in items or []:
        if "=" not in item:
            raise ValueError(f"--param: expected NAME=VALUE[,VALUE...], got {item!r}")
        name, values = item.split("=", 1)
        choices[name.strip()] = [_literal(v.strip()) for v in values.split(",") if v.strip()]
    return choices


def parse_parameters(items: list[str]) -> dict[str, Any]:
    """``["SIZE=full", "SEED=3"]`` -> {"SIZE": "full", "SEED": 3}."""
    return {name: values[0] if len(values) == 1 else values for name, values in parse_choices(items).items()}


def _literal(text: str):
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text


class RosterError(ValueError):
    """A roster that cannot be used as it is; the message names the file, the line and what was expected."""


# A roster's first row is a header, not a student, when its first cell is one of these column names.
HEADER_NAMES = {"id", "ids", "student", "students", "student id", "student ids", "studentid", "student number",
                "name", "names", "full name", "first name", "last name", "surname", "given name", "email",
                "e mail", "mail", "email address", "login", "username", "user name", "user", "user id", "userid",
                "uid", "netid", "sis id", "sis user id", "section", "group", "team", "learner", "number", "no"}


def _header_like(cell: str) -> bool:
    return re.sub(r"[\s_.-]+", " ", cell.strip().strip("#").lower()).strip() in HEADER_NAMES


def read_roster(path: Path | str, header: bool | None = None, notes: list[str] | None = None) -> list[str]:
    """Student ids, one a row: a text file with one id a line, or a comma-separated file whose first column is
    the id (blank lines and # comments skipped). ``header``: True skips the first row, False reads it as a
    student, None (default) skips it when it is a header: its first cell a column name such as id, student,
    name or email, or not an id at all (a space in it, say); ``notes`` is told when a row is skipped so.
    An id that is not letters, digits and _.@+- or an id named twice is an error naming both lines."""
    import csv

    path = Path(path)
    if not path.is_file():
        raise RosterError(f"roster {path}: expected a file of student ids, one a line, "
                          f"{'got a folder' if path.exists() else 'found nothing there'}")
    rows = []
    for number, line in enumerate(path.read_text(encoding="utf-8-sig").splitlines(), start=1):
        line = line.split("#", 1)[0].strip()
        if line:
            cells = next(csv.reader([line]), [""])
            rows.append((number, [c.strip() for c in cells] or [""]))
    if rows and (header or (header is None and (_header_like(rows[0][1][0]) or not STUDENT_ID.match(rows[0][1][0])))):
        number, cells = rows.pop(0)
        if notes is not None:
            notes.append(f"roster {path}, line {number}: {','.join(cells)!r} read as a header row, not a student"
                         + ("" if header else " (--roster-header no reads it as a student)"))
    students, seen = [], {}
    for number, cells in rows:
        student = cells[0]
        if not STUDENT_ID.match(student):
            raise RosterError(f"roster {path}, line {number}: expected a student id of letters, digits and _.@+- "
                              f"in the first column (it names the student's folder), got {student!r}")
        if student in seen:
            raise RosterError(f"roster {path}: student {student!r} is named twice (lines {seen[student]} and "
                              f"{number}); expected each id once")
        seen[student] = number
        students.append(student)
    if not students:
        raise RosterError(f"roster {path}: expected one student id a line, found none")
    return students


def _parameter_names(nb) -> set[str]:
    from mhc_lab.classroom.notebook_build import notebook_parameters

    return set(notebook_parameters(nb, tags=("parameters",)))


def make_handout(notebook: Path | str, students: list[str], out: Path | str, *, secret: str = "",
                 choices: dict[str, list] | None = None) -> Path:
    """Write one parameterised copy of ``notebook`` per student under ``out`` and update ``out/variants.json``;
    returns the manifest's path."""
    import nbformat
    from papermill.iorw import load_notebook_node
    from papermill.parameterize import parameterize_notebook

    notebook, out = Path(notebook), Path(out)
    source = nbformat.read(notebook, as_version=4)
    known = _parameter_names(source)
    unknown = sorted(set(choices or {}) - known)
    if unknown:
        raise ValueError(f"--param {', '.join(unknown)}: {notebook.name} has no parameter {', '.join(unknown)}; "
                         f"expected one the lab declares in its parameters cell: {', '.join(sorted(known))} "
                         "(SEED varies on its own)")
    bad = [s for s in students if not STUDENT_ID.match(s)]
    if bad:
        raise ValueError(f"student ids must be letters, digits and _.@+- (they name folders): {bad[:5]}")
    twice = sorted({s for s in students if students.count(s) > 1})
    if twice:
        raise ValueError(f"student ids must be distinct (each names a folder), got {', '.join(twice)} twice")
    manifest_path = out / "variants.json"
    manifest = read_manifest(manifest_path) if manifest_path.exists() else {"labs": {}}
    entry = {"students": {}, "choices": choices or {}, "secret": bool(secret)}
    for student in students:
        parameters = assign(student, notebook.name, secret=secret, choices=choices)
        nb = parameterize_notebook(load_notebook_node(str(notebook)), parameters, report_mode=False)
        nb.metadata["mhc_lab"] = {"lab": notebook.name, "student": student, "variant": parameters}
        nb.metadata.pop("papermill", None)
        target = out / student / notebook.name
        target.parent.mkdir(parents=True, exist_ok=True)
        nbformat.write(nb, target)
        entry["students"][student] = {"file": str(target.relative_to(out)), "parameters": parameters}
    manifest["labs"][notebook.name] = entry
    out.mkdir(parents=True, exist_ok=True)
    manifest_path.write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest_path


def read_manifest(path: Path | str) -> dict:
    """The manifest `mhc-lab variants` wrote; anything else is an error naming the file."""
    expected = "expected the variants.json that `mhc-lab variants` wrote"
    try:
        data = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ValueError(f"variants manifest {path}: {expected}, found nothing there") from None
    except (OSError, ValueError) as error:
        raise ValueError(f"variants manifest {path}: {expected}, got {type(error).__name__}: {error}") from None
    if not isinstance(data, dict) or not isinstance(data.get("labs"), dict):
        raise ValueError(f"variants manifest {path}: {expected}, got JSON without its 'labs'")
    return data


def student_of(submission: Path, students: list[str], root: Path | None = None) -> str | None:
    """The roster id a submission's path names: its file name starting with the id (``alice_03_mhc.ipynb``,
    ``alice-03_mhc.ipynb``; the longest such id wins), else the nearest folder of that name
    (``alice/03_mhc.ipynb``). With ``root``, only the folders below it are read, so the folders above the
    submissions (the instructor's own) never name a student."""
    path = Path(submission)
    folders = path.parts[:-1]
    if root is not None:
        try:
            folders = path.relative_to(root).parts[:-1]
        except ValueError:
            pass
    by_name = [s for s in students if re.match(rf"{re.escape(s)}[_.\- ]", path.name)]
    if by_name:
        return max(by_name, key=len)
    return next((folder for folder in reversed(folders) if folder in students), None)


def made_for(nb) -> str | None:
    """The student id a handout recorded in the notebook when `mhc-lab variants` wrote it, or None."""
    student = (nb.metadata.get("mhc_lab") or {}).get("student")
    return student if isinstance(student, str) and student else None


def identify(submission: Path, students: list[str], nb=None, root: Path | None = None) -> dict:
    """Who a submission belongs to, for a roster of ``students``: {"student": the id its path names, or None,
    "made_for": the id its handout recorded in the notebook, or None, "warnings": [...]}. Only the path credits
    a submission: a notebook found where the path names no student on the roster is credited to no one, and
    one whose recorded id differs from its path's is flagged."""
    student = student_of(Path(submission), students, root)
    recorded = made_for(nb) if nb is not None else None
    warnings = []
    where = "a folder named by the id, or a file name starting with it"
    if student is None:
        text = f"not on the roster: its path names no student on the roster (expected {where}); credited to no one"
        if recorded in students:
            text += (f". The notebook was handed out to {recorded}: if it is theirs, put it in {recorded}'s folder "
                     "and grade it again")
        elif recorded:
            text += f". The notebook was handed out to {recorded!r}, who is not on the roster either"
        warnings.append(text)
    elif recorded and recorded != student:
        warnings.append(f"mismatched id: found in {student}'s place but handed out to {recorded} (the id recorded in "
                        f"the notebook); graded as {student}'s. Check whether {student} handed in {recorded}'s "
                        "notebook")
    return {"student": student, "made_for": recorded, "warnings": warnings}


def assigned_variant(manifest: dict, submission: Path, root: Path | None = None) -> dict | None:
    """{"student", "parameters"} the manifest assigned, for this submission's lab, to the student its path names
    (see student_of), or None. The id recorded in the notebook does not credit it to anyone (see identify)."""
    import nbformat

    from mhc_lab.classroom.notebook_build import identify_lab

    try:
        nb = nbformat.read(submission, as_version=4)
    except Exception:
        return None
    solution = identify_lab(nb, Path(submission))
    lab = manifest["labs"].get(solution.name) if solution is not None else None
    if lab is None:
        return None
    student = student_of(Path(submission), list(lab["students"]), root)
    if student is None:
        return None
    return {"student": student, "parameters": lab["students"][student]["parameters"]}
