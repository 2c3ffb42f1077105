"""Compile the benchmarks' kernels in parallel before timing them, on a CUDA GPU.

    python -m mhc_lab.bench warm                       # the three issue widths, every benchmark that uses them
    python -m mhc_lab.bench warm --widths 4096 --jobs 8

TileLang compiles each kernel on first use (10-15 s each with nvcc) and keeps it in its on-disk cache. A
benchmark run compiles its kernels one after another; this command runs every benchmark of the given widths
at 64 tokens, in parallel processes, without saving anything, so that the kernels (which do not depend on the
token count) are compiled side by side on the machine's cores and the timed runs that follow load them from
the cache. Done this way by hand on the course's H200 machine (16 cores, 2026-11-30), the compile phase took
about 80 s instead of about 5 minutes. Each process's output goes to --logs; the command prints one line per
process and fails if one did.
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
        out.append(["forward", "--shapes", shape, "--skip", "eager,compile,tilekernels", "--plans", "split",
                    "--no-save"])
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mhc_lab.bench warm", description=__doc__.splitlines()[0])
    parser.add_argument("--widths", default=",".join(str(c) for c in WIDTHS), help="comma-separated widths C")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="processes at once")
    parser.add_argument("--logs", default="warm-logs", help="folder for each process's output")
    args = parser.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("bench warm compiles CUDA kernels by running the benchmarks: it needs a CUDA GPU")
        return 1
    os.makedirs(args.logs, exist_ok=True)
    todo = commands(int(c) for c in args.widths.split(",") if c)
    running, status, t0 = [], 0, time.time()

    def finish(job):
        nonlocal status
        proc, line, log = job
        code = proc.wait()
        log.close()
        status |= int(code != 0)
        print(f"{'ok' if code == 0 else f'FAILED ({code})'}: {' '.join(line)}  ({time.time() - t0:.0f} s)")

    for k, line in enumerate(todo):
        while len(running) >= max(1, args.jobs):
            finish(running.pop(0))
        log = open(os.path.join(args.logs, f"{k:02d}-{line[0]}.log"), "w")
        proc = subprocess.Popen([sys.executable, "-m", "mhc_lab.bench", *line], stdout=log, stderr=subprocess.STDOUT)
        running.append((proc, line, log))
    for job in running:
        finish(job)
    print(f"compiled in {time.time() - t0:.0f} s")
    return status


if __name__ == "__main__":
    sys.exit(main())
