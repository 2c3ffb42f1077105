"""Variants: every student (or section) gets the lab with parameters of their own, so answers cannot be copied.

    mhc-lab variants labs/03_mhc.ipynb --roster roster.txt --out handout/ [--param n=2,4,8] [--secret WORD]

writes ``handout/<student>/03_mhc.ipynb`` for each student, with papermill's ``injected-parameters`` cell
(``SEED = 48213`` and any ``--param`` values; nothing is executed), and ``handout/variants.json``, the manifest
that ``mhc-lab grade --variants handout/variants.json`` uses to re-run each submission with the parameters its
author was given (a student who edits SEED is graded on their own variant all the same).

The parameters are a deterministic function of (secret, lab, student): the same roster and secret give the same
handout. How the checks use them: ``setup(SIZE, DEVICE, SEED, **lab_parameters)`` records SEED and the lab's
parameters; a checker of a value answer computes its expected value from ``checks.variant()`` (see
docs/instructor-guide.md), so a number copied from another variant fails.
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


def read_roster(path: Path | str) -> list[str]:
    """Student ids, one a line (a CSV's first column; blank lines and # comments skipped)."""
    students = []
    for line in Path(path).read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        students.append(line.split(",", 1)[0].strip())
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
        raise ValueError(f"{notebook.name} has no parameter {', '.join(unknown)} (its parameters cell sets "
                         f"{', '.join(sorted(known))})")
    bad = [s for s in students if not STUDENT_ID.match(s)]
    if bad:
        raise ValueError(f"student ids must be letters, digits and _.@+- (they name folders): {bad[:5]}")
    if len(set(students)) != len(students):
        raise ValueError("the roster names a student twice")
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
    data = json.loads(Path(path).read_text())
    if "labs" not in data:
        raise ValueError(f"{path}: not a variants manifest (no 'labs')")
    return data


def student_of(submission: Path, students: list[str]) -> str | None:
    """The roster id a submission's path names: a folder of that name, or a file name starting with it
    (``alice_03_mhc.ipynb``, ``alice-03_mhc.ipynb``); the longest such id wins."""
    parts = set(Path(submission).parts[:-1])
    name = Path(submission).name
    found = [s for s in students if s in parts or re.match(rf"{re.escape(s)}[_.\- ]", name)]
    return max(found, key=len) if found else None


def assigned_variant(manifest: dict, submission: Path) -> dict | None:
    """{"student", "parameters"} the manifest assigned to this submission's author for its lab, or None."""
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
    students = list(lab["students"])
    student = student_of(Path(submission), students)
    if student is None:  # fall back on the notebook's own record of whom it was made for
        student = (nb.metadata.get("mhc_lab") or {}).get("student")
    if student not in lab["students"]:
        return None
    return {"student": student, "parameters": lab["students"][student]["parameters"]}
