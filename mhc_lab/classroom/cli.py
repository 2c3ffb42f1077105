"""The ``mhc-lab`` command line.

    mhc-lab doctor                      versions, device, TileLang known answers, which labs run live or replay
    mhc-lab run [--size full] [03]      execute the labs' solutions headless with papermill
    mhc-lab build                       write labs/ from solutions/
    mhc-lab refresh-solutions [03]      re-execute solution notebooks in place (their stored outputs)
    mhc-lab grade PATH...               grade submitted notebooks (files or folders): score table, report, feedback
    mhc-lab variants LAB --roster F     one parameterised copy of a lab per student, and its manifest
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mhc-lab", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    doctor = commands.add_parser(
        "doctor", help="what this machine runs: versions, device, TileLang, live or replay",
        description="Check this machine for the labs: the packages they import, a C++ compiler (TileLang's C "
                    "target builds with it), TileLang known-answer runs, the device, and lab by lab what runs live "
                    "and what replays recorded GPU results.",
        epilog="exit status: 0 ready (every lab runs here); 1 something a lab needs is missing or broken (listed "
               "under 'not ready', each with its fix); 2 bad options. Scripts checking many machines can read "
               "the status, or `--json` (keys 'ready' and 'problems').")
    doctor.add_argument("--json", action="store_true", help="print the report as JSON")
    doctor.add_argument("--cells", action="store_true", help="list every cell that does not simply run live")
    doctor.add_argument("--no-tilelang", action="store_true", help="skip the TileLang known-answer compiles")
    doctor.add_argument("--labs", type=Path, default=None, metavar="FOLDER",
                        help="the lab notebooks to read (default: the course's solutions/; a learner gives the "
                             "folder of the handout)")

    commands.add_parser("build", help="write labs/ from solutions/ (solution regions replaced by stubs)")

    run = commands.add_parser("run", help="execute every lab's solution headless with papermill")
    run.add_argument("--size", choices=("small", "full"), default="small")
    run.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    run.add_argument("--out", type=Path, default=Path("build/course"))
    run.add_argument("names", nargs="*", help="notebook name prefixes, e.g. 03 (default: all)")

    refresh = commands.add_parser("refresh-solutions", help="execute solution notebooks in place (stored outputs)")
    refresh.add_argument("names", nargs="*", help="notebook name prefixes (default: all)")

    grade = commands.add_parser(
        "grade", help="grade submitted notebooks: visible and hidden checks, score table, JSON report",
        description="Execute each submission headless in its own kernel, then run the visible and the hidden "
                    "checks on the learner's functions. Prints a score table; writes report.json, report.csv, "
                    "the executed notebooks and one feedback file a submission under --out. When --out already "
                    "holds a class report, the submissions graded now replace their rows in it and the others "
                    "are kept (--fresh starts a new report).",
        epilog="exit status: 0 every submission was graded (whatever its score); 1 some submission could not be "
               "graded (crashed, timed out, killed, unreadable, unknown lab: listed in the report, scored 0); 2 "
               "the grader could not do its job and graded nothing (bad options, no submissions, a hidden-checks "
               "folder that is missing, empty or without checks for a lab, an unusable roster, manifest, "
               "--param or earlier report).")
    grade.add_argument("paths", nargs="+", type=Path, help="notebooks, or folders searched for *.ipynb")
    grade.add_argument("--out", type=Path, default=Path("build/grading"), help="report and executed notebooks")
    grade.add_argument("--json", type=Path, default=None, help="also write the JSON report here ('-': stdout)")
    grade.add_argument("--timeout", type=float, default=900, help="seconds per notebook before it is stopped")
    grade.add_argument("--cell-timeout", type=float, default=300,
                       help="seconds per cell before it is interrupted (the notebook goes on)")
    grade.add_argument("--check-timeout", type=float, default=60, help="seconds per check of one exercise")
    grade.add_argument("--param", action="append", default=[], metavar="NAME=VALUE",
                       help="papermill parameter for every submission (default SIZE=small DEVICE=cpu)")
    grade.add_argument("--variants", type=Path, default=None,
                       help="variants.json from `mhc-lab variants`: re-run each with its author's parameters; its "
                            "students are the roster (a submission is credited to the student its path names)")
    grade.add_argument("--roster", type=Path, default=None,
                       help="file of student ids (as for `mhc-lab variants`): name each submission's student, warn "
                            "about unknown, mismatched and duplicate ids and list who handed in nothing")
    grade.add_argument("--roster-header", choices=("auto", "yes", "no"), default="auto",
                       help="whether the roster's first row is a header (auto: when it looks like one)")
    grade.add_argument("--fresh", action="store_true",
                       help="start a new report in --out instead of merging into the one there")
    grade.add_argument("--hidden", type=Path, default=None,
                       help="folder of hidden checks, lab*.py (default tests/hidden); it must have checks for "
                            "every lab graded")
    grade.add_argument("--no-hidden", action="store_true",
                       help="run the visible checks only (no hidden or generic checks); the report says so")
    grade.add_argument("--max-cell-output", type=int, default=100, metavar="KB",
                       help="output stored per cell of an executed notebook, in thousands of characters")
    grade.add_argument("--max-output", type=int, default=2000, metavar="KB",
                       help="output stored per executed notebook, in thousands of characters")
    grade.add_argument("--jobs", type=int, default=1, help="submissions graded at the same time")
    grade.add_argument("--memory-limit", type=float, default=8, metavar="GB",
                       help="address space each notebook's kernel may map, in GiB (0: no limit; a GPU kernel "
                            "maps far more than it uses: pass 0 with --param DEVICE=cuda)")
    grade.add_argument("--allow-root", action="store_true",
                       help="running as root where no unprivileged user can run this Python: let the notebooks "
                            "run as root (a notebook can then forge its result and a classmate's)")
    grade.add_argument("--whole-notebook", action="store_true",
                       help="execute every cell (default: stop after the last exercise check cell)")
    grade.add_argument("--brief", action="store_true", help="the score table only, without the details")

    variants = commands.add_parser("variants", help="one parameterised copy of a lab per student or section")
    variants.add_argument("notebook", type=Path, help="the lab to hand out, e.g. labs/03_mhc.ipynb")
    who = variants.add_mutually_exclusive_group(required=True)
    who.add_argument("--roster", type=Path, help="file with one student (or section) id a line, or a CSV whose "
                                                 "first column is the id")
    who.add_argument("--students", nargs="+", help="student (or section) ids")
    variants.add_argument("--out", type=Path, default=Path("build/handout"))
    variants.add_argument("--param", action="append", default=[], metavar="NAME=V1,V2,...",
                          help="a lab parameter and the values to choose from per student (SEED always varies)")
    variants.add_argument("--secret", default="", help="mixed into the choice, so ids alone do not reveal it")
    variants.add_argument("--roster-header", choices=("auto", "yes", "no"), default="auto",
                          help="whether the roster's first row is a header (auto: when its first cell is a column "
                               "name such as id, student, name or email, or not an id)")
    return parser


def _absolute(path: Path | None) -> Path | None:
    """A path from the command line made absolute against the current folder, before anything runs."""
    if path is None or str(path) == "-":
        return path
    return Path(os.path.abspath(os.path.expanduser(str(path))))


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command in ("grade", "variants"):
        for name in ("out", "json", "variants", "hidden", "roster", "notebook"):
            if isinstance(getattr(args, name, None), Path):
                setattr(args, name, _absolute(getattr(args, name)))
    if args.command == "grade":
        args.paths = [_absolute(p) for p in args.paths]
    if args.command == "doctor":
        from mhc_lab.classroom import doctor

        info = doctor.report(run_tilelang=not args.no_tilelang, labs_dir=_absolute(args.labs))
        print(json.dumps(info, indent=2) if args.json else doctor.format_report(info, cells=args.cells), end="")
        return 0 if info["ready"] else 1
    if args.command == "build":
        from mhc_lab.classroom.notebook_build import build_all

        for path in build_all():
            print(f"wrote {path}")
        return 0
    if args.command == "run":
        from mhc_lab.classroom.runner import run_course

        return 1 if run_course(args.out, size=args.size, device=args.device, names=args.names) else 0
    if args.command == "refresh-solutions":
        from mhc_lab.classroom.runner import refresh_solutions

        refresh_solutions(args.names)
        from mhc_lab.classroom.notebook_build import build_all

        build_all()
        return 0
    if args.command == "grade":
        return _grade(args)
    if args.command == "variants":
        from mhc_lab.classroom.variants import make_handout, parse_choices, read_roster

        notes: list[str] = []
        try:
            students = (read_roster(args.roster, header=_HEADER[args.roster_header], notes=notes) if args.roster
                        else args.students)
            for note in notes:
                print(f"note: {note}", file=sys.stderr)
            manifest = make_handout(args.notebook, students, args.out, secret=args.secret,
                                    choices=parse_choices(args.param))
        except (ValueError, OSError) as error:
            print(f"error: {error}", file=sys.stderr)
            return 2
        data = json.loads(manifest.read_text())["labs"][args.notebook.name]
        for student, entry in data["students"].items():
            values = ", ".join(f"{k}={v!r}" for k, v in entry["parameters"].items())
            print(f"{args.out / entry['file']}: {values}")
        print(f"manifest: {manifest} (grade with --variants {manifest})")
        return 0
    return 2


_HEADER = {"auto": None, "yes": True, "no": False}


def _grade(args) -> int:
    """Exit status: 0 every submission graded, 1 some could not be graded, 2 nothing graded (see the epilog)."""
    from mhc_lab.classroom.grading import GradingInputError, format_report, grade_paths
    from mhc_lab.classroom.grading_worker import make_not_dumpable
    from mhc_lab.classroom.hidden_checks import HIDDEN_DIR, HiddenChecksError
    from mhc_lab.classroom.variants import parse_parameters

    if args.no_hidden and args.hidden is not None:
        print(f"error: --no-hidden and --hidden {args.hidden}: expected one of them, got both", file=sys.stderr)
        return 2
    for name, value in (("--max-cell-output", args.max_cell_output), ("--max-output", args.max_output),
                        ("--jobs", args.jobs), ("--timeout", args.timeout), ("--cell-timeout", args.cell_timeout),
                        ("--check-timeout", args.check_timeout)):
        if not value > 0:
            print(f"error: {name}: expected a positive number, got {value:g}", file=sys.stderr)
            return 2
    if args.memory_limit < 0:
        print(f"error: --memory-limit: expected 0 (no limit) or more GiB, got {args.memory_limit:g}", file=sys.stderr)
        return 2
    hidden = None if args.no_hidden else (args.hidden or HIDDEN_DIR)
    quiet = args.json == Path("-")
    try:
        parameters = parse_parameters(args.param)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    make_not_dumpable()  # the learners' kernels (same user) cannot read the workers' tokens from this process
    if hidden is None and not quiet:
        print("note: --no-hidden: grading with the visible checks only (no hidden or generic checks)",
              file=sys.stderr)
    try:
        report = grade_paths(args.paths, out_dir=args.out, timeout=args.timeout, cell_timeout=args.cell_timeout,
                             check_timeout=args.check_timeout, parameters=parameters,
                             variants=args.variants, hidden_dir=hidden, jobs=args.jobs,
                             whole_notebook=args.whole_notebook, max_cell_output=args.max_cell_output * 1000,
                             max_output=args.max_output * 1000, roster=args.roster,
                             roster_header=_HEADER[args.roster_header], fresh=args.fresh,
                             memory_limit=int(args.memory_limit * 2**30) or None, allow_root=args.allow_root,
                             log=None if quiet else (lambda line: print(line, file=sys.stderr, flush=True)))
    except (HiddenChecksError, GradingInputError, FileNotFoundError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    this_run = set(report["runs"][-1]["submissions"])
    failed = [r for r in report["submissions"] if r["submission"] in this_run and r["status"] != "graded"]
    status = 1 if failed else 0
    text = json.dumps(report, indent=2) + "\n"
    if quiet:
        print(text, end="")
        return status
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(text)
    shown = {**report, "submissions": [r for r in report["submissions"] if r["submission"] in this_run]}
    print(format_report(shown, details=not args.brief), end="")
    kept = len(report["submissions"]) - len(this_run)
    if len(report["runs"]) > 1:
        replaced = len(report["runs"][-1].get("replaced") or [])
        print(f"\nmerged into the class report in {args.out}: {replaced} regraded, {len(this_run) - replaced} "
              f"added, {kept} kept from earlier runs ({len(report['submissions'])} in all; --fresh starts a new "
              "report)")
    print(f"\nreport: {args.out / 'report.json'}, {args.out / 'report.csv'}; feedback for each student: "
          f"{args.out / 'feedback'}/; executed notebooks: {args.out / 'executed'}/")
    if failed:
        print(f"not graded: {len(failed)} submission{'s' if len(failed) > 1 else ''} (exit status 1): "
              + ", ".join(f"{r['submission']} ({r['status']})" for r in failed), file=sys.stderr)
    return status

if __name__ == "__main__":
    sys.exit(main())
