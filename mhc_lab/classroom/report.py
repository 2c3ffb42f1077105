"""The grading report: the score table an instructor reads, report.json and report.csv.

``grading.grade_paths`` builds the report (one row per submission); this module writes and formats it.
"""

from __future__ import annotations

import csv
import os
from pathlib import Path


def write_csv(report: dict, path: Path) -> None:
    ids = sorted({e["id"] for r in report["submissions"] for e in r["exercises"]},
                 key=lambda i: tuple(int(p) for p in i.split(".")))
    with open(path, "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["submission", "student", "lab", "status", "score", "max_score", *ids])
        for r in report["submissions"]:
            scores = {e["id"]: e["score"] for e in r["exercises"]}
            writer.writerow([r["submission"], r.get("student") or "", r["lab"] or "", r["status"], r["score"],
                             r["max_score"], *[scores.get(i, "") for i in ids]])


def _shown(path: str) -> str:
    """A submission's path as the table shows it: relative to the current folder when below it."""
    try:
        relative = os.path.relpath(path)
    except ValueError:
        return path
    return path if relative.startswith("..") else relative


def format_report(report: dict, details: bool = True) -> str:
    """The score table, one block per lab, then what each non-perfect exercise failed on."""
    lines = []
    settings = report.get("settings") or {}
    if settings.get("checks", "").startswith("visible only"):
        lines += ["visible checks only: no hidden checks were run (--no-hidden)", ""]
    for warning in report.get("warnings") or []:
        lines += [f"warning: {warning}", ""]
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
                notes.append(f"  {r['status']}: {r.get('detail', '')}")
            for warning in r.get("warnings", []):
                notes.append(f"  warning: {warning}")
            if r.get("variant") and (r.get("student") or r["variant"] != {"SEED": 0}):
                notes.append(f"  variant: {', '.join(f'{k}={v}' for k, v in r['variant'].items())}")
            for e in r["exercises"]:
                if r["status"] == "graded" and e["score"] < 1:
                    notes.append(f"  {e['id']} {e.get('title', '')}: {e['status']}, {e['score']:g}: {e['message']}")
            for error in r.get("cell_errors", []):
                notes.append(f"  cell {error['cell']} (`{error['source']}`): {error['ename']}: {error['evalue']}")
            if notes:
                lines.append(r["submission"])
                lines += [n if len(n) <= 220 else n[:217] + "..." for n in notes]
                lines.append("")
    return "\n".join(lines).rstrip() + "\n"
