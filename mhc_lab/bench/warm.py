"""Compile the benchmarks' kernels in parallel before timing them, on a CUDA GPU.

    python -m mhc_lab.bench warm                       # the three issue widths, every benchmark that uses them
    python -m mhc_lab.bench warm --widths 4096 --jobs 8
    python -m mhc_lab.bench warm --tests "cuda and post_project"   # and those CUDA tests, one process each

TileLang compiles each kernel on first use (10-15 s each with nvcc) and keeps it in its on-disk cache. A
benchmark run compiles its kernels one after another; this command runs every benchmark of the given widths
at 64 tokens, in parallel processes, without saving anything, so that the kernels (which do not depend on the
token count) are compiled side by side on the machine's cores and the timed runs that follow load them from
the cache. On the course's 16-core H200 machine the compile phase takes about 80 s this way instead of about
5 minutes. Each process's output goes to --logs; the command prints one line per
process (with the end of the log of any that failed), last the failed ones again, and fails if one did.

--tests EXPR adds the tests that pytest's -k EXPR selects, each in a process of its own in the same pool: a
CUDA test compiles the kernels of its own shapes, so a pytest process that runs them one after another spends
minutes compiling (one such process took 522 s on the H200 machine; the same tests side by side took under
2 minutes).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

WIDTHS = (2560, 4096, 7168)
SMALL_TOKENS = 64


def commands(widths=WIDTHS) -> list[list[str]]:
    """The benchmark command lines that compile every kernel the timed runs of these widths use."""
    out = []
    for C in widths:
        shape = f"{SMALL_TOKENS}x{C}"
        out.append(["training", "--parts", "site", "--shapes", shape, "--skip", "eager,compile,tilekernels",
                    "--no-save"])
        out.append(["forward", "--parts", "sites", "--shapes", shape, "--skip", "tilekernels", "--no-save"])
    return out


def selected_test_commands(expression: str, paths=("tests",)) -> list[list[str]]:
    """One pytest command line per test that ``-k expression`` selects under paths (collected here, whether
    or not it would be skipped)."""
    found = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-o", "addopts=", "-p",
                            "no:cacheprovider", "-k", expression, *paths], capture_output=True, text=True)
    ids = [line.strip() for line in found.stdout.splitlines() if "::" in line]
    return [["-m", "pytest", "-o", "addopts=", "-q", "-p", "no:cacheprovider", test_id] for test_id in ids]


def failure_report(path: str, lines: int = 40) -> str:
    """The last lines of a failed process's log, indented, for the command's own output: on a machine whose
    files may not all come back, the reason for a failure travels with the line that reports it."""
    with open(path, errors="replace") as f:
        tail = f.read().splitlines()[-lines:]
    return "\n".join(f"    | {line}" for line in tail) or "    | (empty log)"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mhc_lab.bench warm", description=__doc__.splitlines()[0])
    parser.add_argument("--widths", default=",".join(str(c) for c in WIDTHS), help="comma-separated widths C")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="processes at once")
    parser.add_argument("--logs", default="warm-logs", help="folder for each process's output")
    parser.add_argument("--tests", default="", help="pytest -k expression: also run these tests, one process each")
    args = parser.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("bench warm compiles CUDA kernels by running the benchmarks: it needs a CUDA GPU")
        return 1
    os.makedirs(args.logs, exist_ok=True)
    todo = [(line[0], ["-m", "mhc_lab.bench", *line], " ".join(line))
            for line in commands(int(c) for c in args.widths.split(",") if c)]
    if args.tests:
        todo += [("test", line, line[-1]) for line in selected_test_commands(args.tests)]
    failed = run_processes(todo, args.jobs, args.logs)
    return int(bool(failed))


def run_processes(todo, jobs: int, logs: str) -> list[str]:
    """Run each (label, python arguments, shown) of todo as a python process, ``jobs`` at once, its output in a
    log of its own under logs; print a line per process as it ends (a failed one with the end of its log), and
    last the failed ones again, which a truncated output keeps. Returns the failed ones' shown names."""
    running, failed, t0 = [], [], time.time()

    def finish(job):
        proc, shown, log = job
        code = proc.wait()
        log.close()
        print(f"{'ok' if code == 0 else f'FAILED ({code})'}: {shown}  ({time.time() - t0:.0f} s)")
        if code != 0:
            failed.append(shown)
            print(failure_report(log.name), flush=True)

    for k, (label, line, shown) in enumerate(todo):
        while len(running) >= max(1, jobs):
            finish(running.pop(0))
        log = open(os.path.join(logs, f"{k:02d}-{label}.log"), "w")
        proc = subprocess.Popen([sys.executable, *line], stdout=log, stderr=subprocess.STDOUT)
        running.append((proc, shown, log))
    for job in running:
        finish(job)
    print(f"done in {time.time() - t0:.0f} s: {len(todo) - len(failed)} passed, {len(failed)} failed")
    for shown in failed:
        print(f"  failed: {shown}")
    return failed


if __name__ == "__main__":
    sys.exit(main())
