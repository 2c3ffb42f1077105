"""The grading report: the score table an instructor reads, report.json and report.csv, and the feedback file
each student gets.

``grading.grade_paths`` builds the report (one row per submission); this module writes and formats it.
"""

from __future__ import annotations

import csv
import os
import re
import sys
import textwrap
from pathlib import Path

WIDTH = 110  # the console report's lines are wrapped here (a failure message is shown whole)
MAX_NOTE = 4000  # a longer message is cut from the middle in the console report, keeping its start and its end


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def _middle(text: str, limit: int) -> str:
    """``text`` at most ``limit`` characters: its start and its end, the middle cut and counted."""
    if len(text) <= limit:
        return text
    keep = (limit - 40) // 2
    return f"{text[:keep]} [... {len(text) - 2 * keep} characters cut ...] {text[-keep:]}"


def reasons(row: dict) -> str:
    """Why a submission lost points, in one line: the first failure of each exercise that did not score full
    marks, or why it was not graded."""
    if row.get("status") != "graded":
        return _one_line(f"{row.get('status')}: {row.get('detail', '')}")
    parts = []
    for e in row.get("exercises") or []:
        if e.get("score", 0) >= 1:
            continue
        message = e.get("message") or next((f"{c.get('name')}: {c.get('message')}" for c in e.get("checks") or []
                                            if not c.get("passed")), "") or e.get("status", "")
        parts.append(f"{e['id']}: {_one_line(message)}")
    return "; ".join(parts)


def write_csv(report: dict, path: Path) -> None:
    """One row per submission: who, the lab, status, total, one column per exercise, then ``reasons`` (see
    ``reasons``) and ``warnings`` (identity, output caps), each in one line."""
    ids = sorted({e["id"] for r in report["submissions"] for e in r["exercises"]},
                 key=lambda i: tuple(int(p) for p in i.split(".")))
    with open(path, "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["submission", "student", "lab", "status", "score", "max_score", *ids, "reasons", "warnings"])
        for r in report["submissions"]:
            scores = {e["id"]: e["score"] for e in r["exercises"]}
            writer.writerow([r["submission"], r.get("student") or "", r["lab"] or "", r["status"], r["score"],
                             r["max_score"], *[scores.get(i, "") for i in ids], reasons(r),
                             " | ".join(_one_line(w) for w in r.get("warnings") or [])])


def _shown(path: str) -> str:
    """A submission's path as the table shows it: relative to the current folder when below it."""
    try:
        relative = os.path.relpath(path)
    except ValueError:
        return path
    return path if relative.startswith("..") else relative


def _wrapped(note: str) -> list[str]:
    """One note of the details, whole (but for a very long one, cut from the middle), wrapped at WIDTH; its
    continuation lines indented under it."""
    lines = []
    for number, line in enumerate(_middle(note, MAX_NOTE).splitlines() or [""]):
        indent = "  " if number == 0 else "      "
        lines += textwrap.wrap(line.strip() if number else line.lstrip(), WIDTH, initial_indent=indent,
                               subsequent_indent="      ", break_long_words=False, break_on_hyphens=False) or [""]
    return lines


def format_report(report: dict, details: bool = True) -> str:
    """The score table, one block per lab, then what each non-perfect exercise failed on (messages whole,
    wrapped)."""
    lines = []
    settings = report.get("settings") or {}
    if settings.get("checks", "").startswith("visible only"):
        lines += ["visible checks only: no hidden checks were run (--no-hidden)", ""]
    for warning in report.get("warnings") or []:
        lines += [*textwrap.wrap(f"warning: {warning}", WIDTH, subsequent_indent="  ", break_long_words=False,
                                 break_on_hyphens=False), ""]
    rows = [{**r, "submission": _shown(r["submission"])} for r in report["submissions"]]
    labs = sorted({r["lab"] or "-" for r in rows})
    for lab in labs:
        group = [r for r in rows if (r["lab"] or "-") == lab]
        ids = [e["id"] for e in group[0]["exercises"]] if group[0]["exercises"] else []
        width = max([len("submission")] + [len(r["submission"]) for r in group])
        lines.append(f"lab {lab}")
        lines.append(f"  {'submission':<{width}}  {'status':<11}" + "".join(f"{i:>6}" for i in ids) + "   total")
        for r in group:
            scores = {e["id"]: e for e in r["exercises"]}
            cells = "".join(f"{scores[i]['score']:>6.2f}" if r["status"] == "graded" else f"{'-':>6}" for i in ids)
            lines.append(f"  {r['submission']:<{width}}  {r['status']:<11}{cells}   {r['score']:g}/{r['max_score']}")
        lines.append("")
    if details:
        for r in rows:
            notes = []
            if r["status"] != "graded":
                notes.append(f"{r['status']}: {r.get('detail', '')}")
            for warning in r.get("warnings", []):
                notes.append(f"warning: {warning}")
            if r.get("variant") and (r.get("student") or r["variant"] != {"SEED": 0}):
                notes.append(f"variant: {', '.join(f'{k}={v}' for k, v in r['variant'].items())}")
            for e in r["exercises"]:
                if r["status"] == "graded" and e["score"] < 1:
                    notes.append(f"{e['id']} {e.get('title', '')}: {e['status']}, {e['score']:g}: {e['message']}")
            for error in r.get("cell_errors", []):
                notes.append(f"cell {error['cell']} (`{error['source']}`): {error['ename']}: {error['evalue']}")
            if notes:
                lines.append(r["submission"] + (f" ({r['student']})" if r.get("student") else ""))
                for note in notes:
                    lines += _wrapped(note)
                lines.append("")
    return "\n".join(lines).rstrip() + "\n"


# ---- the feedback file each student gets ---------------------------------------------------------------------

# An absolute path (two parts or more) that is still in a message once the known folders are replaced.
ABSOLUTE_PATH = re.compile(r"(?<![\w.~/])(?:[A-Za-z]:)?[/\\](?:[\w.@+-]+[/\\])+([\w.@+-]*)")


def _private_folders(private) -> list[str]:
    folders = {str(p) for p in private if p}
    folders |= {str(Path(p).resolve()) for p in private if p}
    folders |= {sys.prefix, sys.base_prefix, str(Path.home())}
    from mhc_lab.classroom.notebook_build import ROOT

    folders.add(str(ROOT))
    return sorted((f.rstrip("/") for f in folders if len(f.rstrip("/")) > 1), key=len, reverse=True)


def _clean(text, folders: list[str]) -> str:
    """A message as a student may read it: no folder of the grader's machine in it (a path is cut to its file
    name), and nothing of the grader's own output."""
    text = str(text or "")
    for folder in folders:
        text = re.sub(re.escape(folder) + r"(?:[/\\]|(?![\w.@+-]))", lambda m: "" if m.group(0) != folder else "…",
                      text)
    text = ABSOLUTE_PATH.sub(lambda m: m.group(1) or "…", text)
    return text.replace("<<mhc-lab-grade>>", "")


SHINGLE = 24  # characters of code (whitespace left out) that a feedback message may not share with a secret
REDACTED = "[left out: this text repeats the grader's hidden checks]"


class SecretFilter:
    """Tells whether a text repeats code of the hidden checks: any run of ``SHINGLE`` characters of their code
    (whitespace, comments and string literals left out: those are the checks' names and messages, which the
    feedback shows on purpose) found in the text, whitespace left out too."""

    def __init__(self, sources=()):
        self.shingles: set[str] = set()
        for source in sources:
            for piece in _code_pieces(str(source)):
                self.shingles.update(piece[i:i + SHINGLE] for i in range(len(piece) - SHINGLE + 1))

    def leaks(self, text) -> bool:
        if not self.shingles:
            return False
        flat = re.sub(r"\s+", "", str(text or ""))
        return any(flat[i:i + SHINGLE] in self.shingles for i in range(len(flat) - SHINGLE + 1))


def _code_pieces(source: str) -> list[str]:
    """The runs of code of a Python source between its string literals and comments, whitespace removed."""
    import io
    import tokenize

    pieces, current = [], []
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
    except (tokenize.TokenError, SyntaxError, IndentationError):
        return [re.sub(r"\s+", "", source)]
    for token in tokens:
        if token.type in (tokenize.STRING, tokenize.COMMENT):
            pieces.append("".join(current))
            current = []
        elif token.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT,
                                tokenize.ENDMARKER):
            current.append(token.string)
    pieces.append("".join(current))
    return [p for p in pieces if len(p) >= SHINGLE]


MAX_LEARNER_TEXT = 600  # characters of one message shown in feedback (a learner's exception text included)


def _not_graded(row: dict) -> str:
    """Why a submission was not graded, in words meant for its author (no log of the grader's)."""
    status, detail = row.get("status"), str(row.get("detail") or "")
    if status == "crashed" and "kernel died" not in detail:
        detail = ("the grader could not run your notebook to its end; your instructor has the details. Check "
                  "that it runs from top to bottom with Run All")
    return f"Not graded ({status}): {detail}"


def feedback_text(row: dict, private=(), secrets=(), visible_only: bool = False) -> str:
    """One submission's feedback, in Markdown: the lab, the total, then every exercise with its score, status and
    each check (passed or failed, with its message), then the cells that raised. Paths of the grader's machine
    (``private`` folders, the course, the Python installation, home) are left out; each message is cut to
    MAX_LEARNER_TEXT characters, and one that repeats code of the hidden checks (``secrets``: their sources, or a
    SecretFilter) is replaced by a note (a notebook that read them and raised their text gets nothing back)."""
    folders = _private_folders(private)
    secret = secrets if isinstance(secrets, SecretFilter) else SecretFilter(secrets)

    def clean(text):
        text = _middle(_clean(text, folders), MAX_LEARNER_TEXT)
        return REDACTED if secret.leaks(text) else text

    lines = [f"# Feedback: {row.get('lab') or 'unknown lab'}", ""]
    if row.get("student"):
        lines.append(f"- student: {row['student']}")
    lines.append(f"- notebook: {Path(row['submission']).name}")
    if row.get("graded_at"):
        lines.append(f"- graded: {row['graded_at']}")
    if row.get("variant"):
        lines.append(f"- variant: {', '.join(f'{k}={v}' for k, v in row['variant'].items())}")
    lines.append(f"- total: **{row.get('score', 0):g} / {row.get('max_score', 0)}**")
    if visible_only:
        lines.append("- checks: the visible checks only (your notebook's own); the hidden checks were not run")
    lines.append("")
    if row.get("status") != "graded":
        lines += [clean(_not_graded(row)), "", "Every exercise scores 0.", ""]
    for e in row.get("exercises") or []:
        lines.append(f"## Exercise {e['id']}: {e.get('title', '')}")
        lines.append("")
        lines.append(f"score {e.get('score', 0):g} / 1, {e.get('status', '')}")
        lines.append("")
        checks = e.get("checks") or []
        for c in checks:
            mark = "passed" if c.get("passed") else "FAILED"
            lines.append(f"- {mark}: {clean(c.get('name', 'check'))}: {clean(c.get('message', ''))}")
        if not checks and e.get("message"):
            lines.append(f"- {clean(e['message'])}")
        lines.append("")
    if row.get("cell_errors"):
        lines += ["## Cells that raised an error", "",
                  "Cells are numbered from 1 over all cells, as JupyterLab's status bar counts them.", ""]
        for error in row["cell_errors"]:
            lines.append(f"- cell {error.get('cell')} (`{clean(error.get('source', ''))}`): "
                         f"{clean(error.get('ename'))}: {clean(error.get('evalue'))}")
        lines.append("")
    if row.get("output_capped"):
        cells = ", ".join(str(c.get("cell")) for c in row["output_capped"])
        lines += [f"Output of cell {cells} was cut: the grader stores a limited amount of output per cell and per "
                  "notebook.", ""]
    return "\n".join(lines).rstrip() + "\n"


def write_feedback(report: dict, private=(), secrets=()) -> list[Path]:
    """Write each row's feedback file (the path in its ``feedback`` key); returns the paths written. ``secrets``:
    the hidden checks' sources, which no feedback repeats (see feedback_text)."""
    secrets = secrets if isinstance(secrets, SecretFilter) else SecretFilter(secrets)
    written = []
    for row in report["submissions"]:
        if not row.get("feedback"):
            continue
        path = Path(row["feedback"])
        path.parent.mkdir(parents=True, exist_ok=True)
        visible_only = str(row.get("checks") or (report.get("settings") or {}).get("checks", "")).startswith(
            "visible only")
        path.write_text(feedback_text(row, private, secrets, visible_only))
        written.append(path)
    return written
