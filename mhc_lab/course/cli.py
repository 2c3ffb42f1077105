"""The ``mhc-lab`` command line: build the labs, run the course, refresh the solutions' stored outputs."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="mhc-lab", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    commands.add_parser("build", help="write labs/ from solutions/ (solution regions replaced by stubs)")

    run = commands.add_parser("run", help="execute every lab's solution headless with papermill")
    run.add_argument("--size", choices=("small", "full"), default="small")
    run.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    run.add_argument("--out", type=Path, default=Path("build/course"))
    run.add_argument("names", nargs="*", help="notebook name prefixes, e.g. 03 (default: all)")

    refresh = commands.add_parser("refresh-solutions", help="execute solution notebooks in place (stored outputs)")
    refresh.add_argument("names", nargs="*", help="notebook name prefixes (default: all)")

    args = parser.parse_args(argv)
    if args.command == "build":
        from mhc_lab.course.notebook_build import build_all

        for path in build_all():
            print(f"wrote {path}")
        return 0
    if args.command == "run":
        from mhc_lab.course.runner import run_course

        return 1 if run_course(args.out, size=args.size, device=args.device, names=args.names) else 0
    if args.command == "refresh-solutions":
        from mhc_lab.course.runner import refresh_solutions

        refresh_solutions(args.names)
        from mhc_lab.course.notebook_build import build_all

        build_all(names=args.names)
        return 0
    return 2


if __name__ == "__main__":
    sys.exit(main())
