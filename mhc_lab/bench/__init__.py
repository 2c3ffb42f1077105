"""Benchmarks that record GPU figures as JSON in mhc_lab/recorded/ (tagged with GPU, versions, date and the
command that made them; mhc_lab.measure.schemas documents every key).

    python -m mhc_lab.bench memory-wall [--out DIR]   lab 04: copy bandwidth, naive layers, launches
    python -m mhc_lab.bench tilelang [--out DIR]      lab 05: TileLang RMSNorm, residual add and copy vs eager
    python -m mhc_lab.bench forward [--parts ...]     labs 06, 08: fused mHC forward vs eager, compile, TileKernels
    python -m mhc_lab.bench training [--parts ...]    labs 07, 08: site forward + backward, transformer block,
                                                      transformers' DeepSeek-V4 with and without our ops
    python -m mhc_lab.bench all [--out DIR]
    python -m mhc_lab.bench warm [--widths ...]       compile the kernels of the runs above in parallel first
    python -m mhc_lab.bench results [--check]         docs/results.md and the README's table from the recordings

Modules: common.py (timer, copy bandwidth, inputs, graphs, rounds), memory_wall.py, tilelang.py, forward.py,
training.py with site.py, block.py, copy_floor.py, kernels.py, host.py, portable.py, stack.py and deepseek_v4.py,
warm.py, results.py.
"""

from __future__ import annotations

import importlib
import sys

SUITES = {
    "memory-wall": "mhc_lab.bench.memory_wall",
    "tilelang": "mhc_lab.bench.tilelang",
    "forward": "mhc_lab.bench.forward",
    "training": "mhc_lab.bench.training",
    "warm": "mhc_lab.bench.warm",
    "results": "mhc_lab.bench.results",
}
MEASURING = ("memory-wall", "tilelang", "forward", "training")  # what "all" runs


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in (*SUITES, "all"):
        print(__doc__)
        print(f"expected a suite: one of {', '.join(SUITES)} or all; got {argv[:1] or 'nothing'}")
        return 2
    suite, rest = argv[0], argv[1:]
    names = list(MEASURING) if suite == "all" else [suite]
    status = 0
    for name in names:
        module = importlib.import_module(SUITES[name])
        status |= int(module.main(rest) or 0)
    return status

