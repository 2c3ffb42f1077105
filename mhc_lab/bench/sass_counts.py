"""Static SASS of the two kernels that set the block's extra time, counted by instruction class, without a GPU.

    python -m mhc_lab.bench sass-counts                      # kernel 2 and the post + projection at n = 4, C = 4096
    python -m mhc_lab.bench sass-counts --kernels lanes --json counts.json
    python -m mhc_lab.bench sass-counts --uniform-branches   # the role branches made warp-uniform first

Each kernel is built by TileLang for sm_90 (its CUDA source; needs nvcc), compiled by nvcc to a cubin for
sm_90a and disassembled by cuobjdump (which calls nvdisasm). The two come with the CUDA toolkit, or from PyPI as
nvidia-cuda-cuobjdump and nvidia-cuda-nvdisasm (the test extras install them). Counted over the whole kernel,
every warp role's code together: the instruction total, wgmma (HGMMA), the moves into uniform registers that
feed wgmma's descriptors (R2UR), and the classes of ncu-summary (mhc_lab.bench.ncu_summary.SASS_CLASSES). Nsight
Compute counts what runs per tile; these count what the compiler emitted, so a change to how a kernel is
written can be weighed before it meets a GPU.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from mhc_lab.bench.ncu_summary import SASS_CLASSES, sass_class

KERNELS = ("lanes", "post_project")
N, C = 4, 4096
# a SASS line of cuobjdump: /*0a30*/  [@P0] OPCODE operands ;  /* encoding */
_SASS_LINE = re.compile(r"^\s*/\*[0-9a-f]{4,}\*/\s+(.*?)\s*;")


def kernel_source(name: str, n: int = N, width: int = C) -> str:
    """The CUDA source TileLang builds for sm_90 of one of KERNELS, with the defaults the chained site runs:
    "lanes", kernel 2 of the pre backward with the post's gradient; "post_project", the post + next projection
    with one column split (as a chain runs it). Built by compile_program, so under its settings
    (uniform_warp_branches)."""
    from mhc_lab.kernels._target import compile_program

    if name == "lanes":
        from mhc_lab.kernels.pre_backward import pre_backward_lanes_program
        from mhc_lab.ops.training import lane_program_tuning

        program = pre_backward_lanes_program(n, width, "bfloat16", "sm_90", post_grad=True, splits=2,
                                             **lane_program_tuning())
    elif name == "post_project":
        from mhc_lab.kernels.post_project import post_project_program

        program = post_project_program(n, width, "bfloat16", "sm_90", splits=1)
    else:
        raise ValueError(f"sass-counts: expected a kernel among {', '.join(KERNELS)}, got {name!r}")
    return compile_program(program, "sm_90").get_kernel_source()


def _tool(name: str) -> str | None:
    """A CUDA binary tool where kernels._target.cuda_tool finds it, or in the nvidia-cuda-* wheels' folder."""
    from mhc_lab.kernels._target import cuda_tool

    found = cuda_tool(name)
    if found:
        return found
    try:
        import nvidia

        for root in nvidia.__path__:
            for candidate in Path(root).glob(f"cu*/bin/{name}"):
                return str(candidate)
    except ImportError:
        pass
    return None


def tools() -> dict[str, str]:
    """nvcc, cuobjdump and nvdisasm, or a clear error naming what is missing and where to get it."""
    found = {name: _tool(name) for name in ("nvcc", "cuobjdump", "nvdisasm")}
    missing = [name for name, path in found.items() if path is None]
    if missing:
        raise RuntimeError(f"sass-counts needs nvcc, cuobjdump and nvdisasm; not found: {', '.join(missing)} (the "
                           "CUDA toolkit has them; pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm gives the "
                           "last two)")
    return found


def disassemble(source: str) -> str:
    """cuobjdump -sass of the source compiled by nvcc for sm_90a, with TileLang's headers."""
    import tilelang

    paths = tools()
    root = Path(tilelang.__file__).parent
    includes = [root / "src", root / "3rdparty" / "cutlass" / "include"]
    with tempfile.TemporaryDirectory() as folder:
        cu, cubin = Path(folder) / "kernel.cu", Path(folder) / "kernel.cubin"
        cu.write_text(source)
        subprocess.run([paths["nvcc"], "-std=c++17", "-O3", "-cubin", "-arch=sm_90a", "-w", "-DENABLE_BF16",
                        "--use_fast_math", *(f"-I{p}" for p in includes), "-o", str(cubin), str(cu)],
                       check=True, capture_output=True, text=True)
        env = {**os.environ, "PATH": os.path.dirname(paths["nvdisasm"]) + os.pathsep + os.environ.get("PATH", "")}
        return subprocess.run([paths["cuobjdump"], "-sass", str(cubin)], check=True, capture_output=True,
                              text=True, env=env).stdout


def count(sass: str) -> dict:
    """Instruction counts of cuobjdump's SASS listing: total, HGMMA, R2UR, by opcode and by SASS_CLASSES."""
    lines = [m.group(1) for m in map(_SASS_LINE.match, sass.splitlines()) if m]
    if not lines:
        raise ValueError("sass-counts: expected cuobjdump -sass output (lines like '/*0010*/  MOV R1, c[0x0][0x28] ;'),"
                         " found no instruction")
    opcodes = collections.Counter(
        (words[1] if words[0].startswith("@") else words[0]).split(".")[0]
        for words in (line.split() for line in lines))
    classes = collections.Counter(sass_class(line) for line in lines)
    return {"instructions": len(lines), "HGMMA": opcodes["HGMMA"], "R2UR": opcodes["R2UR"],
            "classes": {c: classes[c] for c in SASS_CLASSES},
            "opcodes": dict(opcodes.most_common())}


def table(counts: dict[str, dict]) -> str:
    """The counts of each kernel side by side, one row per figure."""
    names = list(counts)
    rows = [("instructions", "instructions"), ("wgmma (HGMMA)", "HGMMA"), ("moves to uniform registers (R2UR)",
                                                                          "R2UR")]
    lines = [f"{'static SASS, sm_90a':<40}" + "".join(f"{n:>14}" for n in names)]
    for label, key in rows:
        lines.append(f"{label:<40}" + "".join(f"{counts[n][key]:>14}" for n in names))
    for c in SASS_CLASSES:
        lines.append(f"  {c:<38}" + "".join(f"{counts[n]['classes'][c]:>14}" for n in names))
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mhc_lab.bench sass-counts", description=__doc__.splitlines()[0])
    parser.add_argument("--kernels", default=",".join(KERNELS), help=f"comma-separated, among {', '.join(KERNELS)}")
    parser.add_argument("--json", default=None, help="also write the counts (with every opcode's) to this file")
    parser.add_argument("--uniform-branches", action="store_true", help="build the kernels with their role "
                        "branches made warp-uniform (mhc_lab.kernels._target.uniform_warp_branches)")
    args = parser.parse_args(argv)
    names = [k for k in args.kernels.split(",") if k]
    unknown = [k for k in names if k not in KERNELS]
    if unknown or not names:
        parser.error(f"--kernels: expected names among {', '.join(KERNELS)}, got {args.kernels!r}")
    try:
        tools()
    except RuntimeError as e:
        print(e, file=sys.stderr)
        return 1
    from mhc_lab.kernels._target import warp_uniform_branches

    with warp_uniform_branches(args.uniform_branches):
        counts = {name: count(disassemble(kernel_source(name))) for name in names}
    print(f"n = {N}, C = {C}" + (", role branches warp-uniform" if args.uniform_branches else "") + "\n"
          + table(counts))
    if args.json:
        Path(args.json).write_text(json.dumps({"n": N, "C": C, "uniform_warp_branches": args.uniform_branches,
                                               "counts": counts}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
