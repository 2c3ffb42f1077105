"""Benchmark of mHC training on a CUDA GPU: one site's forward + backward, and a transformer block.

    python -m mhc_lab.bench training                       # the default parts, records JSON
    python -m mhc_lab.bench training --parts site --shapes 16384x4096 --no-save
    python -m mhc_lab.bench training --parts stack                 # the MLP stack at 4096x768 and 8192x2048
    python -m mhc_lab.bench training --parts stack --stack-shapes 16384x2560,16384x4096   # at the block widths
    python -m mhc_lab.bench training --parts deepseek_v4           # transformers' DeepSeek-V4, patched and not

Parts, each a section of mhc_lab/recorded/training_h200.json (a run of some parts replaces those sections):

- site (mhc_lab.bench.site): one site (F = identity) per shape, ours as separate ops, as a linked site and as a
  chained site, TileKernels, torch.compile and eager; launched and as CUDA graphs, the graphs again in
  --graph-rounds interleaved rounds.
- block (mhc_lab.bench.block): a transformer block per width, plain, with the copy floor, with our chained
  sites (also with the mHC ops recomputed in backward), TileKernels and torch.compile; launched and as CUDA
  graphs, each in --block-rounds interleaved rounds, with peak memory and the graphs' correctness check.
- block_kernels (mhc_lab.bench.kernels): the plain block beside each of --block-kernels-kinds, profiled kernel
  by kernel, and that kind's connections alone.
- host (mhc_lab.bench.host, not a default part): what the host costs per chained site at a small shape.
- portable (mhc_lab.bench.portable, not a default part): one site per shape run with the Hopper programs and with
  the portable ones (those of sm_80 to sm_89 and Blackwell), as CUDA graphs in --graph-rounds interleaved rounds.
- stack (mhc_lab.bench.stack, not a default part): a stack of --stack-layers pre-norm MLP layers per
  --stack-shapes, trained one step at a time as a user's loop does, joined by the plain residual, the fused
  stream (MHCResidualStream, kernels), the reference stream and TileKernels: launched (wall clock) and as CUDA
  graphs in --stack-rounds interleaved rounds, the kernels' GPU time and count, the ratios to the plain residual,
  and where the fused stream's host time goes (cProfile). A run replaces the shapes it measures in the section
  and keeps the others; each shape carries the environment and command that made it.
- peers (mhc_lab.bench.peers, not a default part): one site per shape beside the fused implementations of
  TileKernels (2.x kernels), Liger-Kernel and TransformerEngine, each in its own layout on the same numbers:
  errors against a float64 site, forward and forward + backward launched and as CUDA graphs (the graphs again
  in --graph-rounds interleaved rounds), the share of the copy floor each reaches, and each peer's version.
- deepseek_v4 (mhc_lab.bench.deepseek_v4, not a default part): one training step of a small random DeepSeek-V4
  from transformers (--deepseek-v4-shapes TOKENSxHIDDEN, --deepseek-v4-layers), as transformers runs it and with
  its mHC sites run by mhc_lab.ops (use_mhc_lab), on the same weights and tokens: the step, the forward with
  autograd recording and the forward under torch.no_grad, each timed launched in --deepseek-v4-rounds
  interleaved rounds, with its peak memory; the two losses and gradients. Needs transformers (pip install
  'mhc-lab[transformers]'); the one part that also runs on a CPU (--device cpu, or without CUDA: a tiny model in
  float32, seconds).
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from mhc_lab.bench.block import BLOCK_KINDS, bench_block
from mhc_lab.bench.common import N, SHAPES, copy_bandwidth, gpu_timer, parse_shapes, section_saver
from mhc_lab.bench import deepseek_v4
from mhc_lab.bench.host import bench_host
from mhc_lab.bench.kernels import bench_block_kernels
from mhc_lab.bench.portable import bench_portable
from mhc_lab.bench.site import bench_site
from mhc_lab.bench.stack import ALL_KINDS, LAUNCHED_TIMER, LOSS, STACK_KINDS, STACK_SHAPES, bench_stack
from mhc_lab.measure import bench_command, environment_tags, recorded_or_none

RECORDING = "training_h200"
PARTS = ("site", "block", "block_kernels", "host", "portable", "stack", "peers", "deepseek_v4")
DEFAULT_PARTS = ("site", "block", "block_kernels")
CPU_PARTS = ("deepseek_v4",)  # the parts that also run on a CPU
BLOCK_WIDTHS = (2560, 4096)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m mhc_lab.bench training", description=__doc__.splitlines()[0])
    parser.add_argument("--parts", default=",".join(DEFAULT_PARTS), help=f"comma-separated, among {', '.join(PARTS)}")
    parser.add_argument("--shapes", default=",".join(f"{t}x{c}" for t, c in SHAPES), help="site shapes TOKENSxC")
    parser.add_argument("--widths", default=",".join(str(c) for c in BLOCK_WIDTHS), help="block widths C")
    parser.add_argument("--skip", default="", help="comma-separated baselines to skip: eager,compile,tilekernels")
    parser.add_argument("--graph-rounds", type=int, default=3, help="part 'site': interleaved rounds of the sites' "
                        "CUDA graphs")
    parser.add_argument("--block-rounds", type=int, default=5, help="part 'block': interleaved rounds of the "
                        "blocks, launched and as CUDA graphs")
    parser.add_argument("--block-kernels-kinds", default="mhc_ours,copy_floor", help="part 'block_kernels': the "
                        "kinds each profiled beside the plain block, comma-separated")
    parser.add_argument("--stack-shapes", default=",".join(f"{t}x{c}" for t, c in STACK_SHAPES),
                        help="part 'stack': shapes TOKENSxC of the stack (the block widths: 16384x2560,16384x4096)")
    parser.add_argument("--stack-layers", type=int, default=8, help="part 'stack': MLP layers in the stack")
    parser.add_argument("--stack-rounds", type=int, default=3, help="part 'stack': interleaved rounds of the "
                        "stacks, launched and as CUDA graphs")
    parser.add_argument("--stack-kinds", default=",".join(STACK_KINDS), help="part 'stack': the kinds, "
                        "comma-separated, the plain residual among them (--skip tilekernels leaves TileKernels out); "
                        "add <kind>_compiled or <kind>_reduce_overhead for the step under torch.compile")
    parser.add_argument("--deepseek-v4-shapes", default=None, help="part 'deepseek_v4': shapes TOKENSxHIDDEN, "
                        f"one sequence of TOKENS at width HIDDEN (default: "
                        f"{','.join(f'{t}x{c}' for t, c in deepseek_v4.CUDA_SHAPES)} on CUDA, "
                        f"{','.join(f'{t}x{c}' for t, c in deepseek_v4.CPU_SHAPES)} on a CPU)")
    parser.add_argument("--deepseek-v4-layers", type=int, default=deepseek_v4.LAYERS, help="part 'deepseek_v4': "
                        "decoder layers")
    parser.add_argument("--deepseek-v4-rounds", type=int, default=deepseek_v4.ROUNDS, help="part 'deepseek_v4': "
                        "interleaved rounds of the timings")
    parser.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto", help="part 'deepseek_v4': "
                        "where it runs (auto: CUDA where present); the other parts need CUDA")
    parser.add_argument("--name", default=RECORDING, help="recording name (mhc_lab/recorded/NAME.json)")
    parser.add_argument("--out", "--out-dir", dest="out_dir", default=None, help="write the JSON here instead")
    parser.add_argument("--no-save", action="store_true", help="print only")
    return parser


def _check(parser, args) -> list[str]:
    parts = [p for p in args.parts.split(",") if p]
    if not parts or set(parts) - set(PARTS):
        parser.error(f"--parts: expected parts among {', '.join(PARTS)}, got {args.parts!r}")
    for flag in ("graph_rounds", "block_rounds", "stack_rounds", "stack_layers", "deepseek_v4_layers",
                 "deepseek_v4_rounds"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')}: expected an integer >= 1, got {getattr(args, flag)}")
    kinds = [k for k in args.block_kernels_kinds.split(",") if k]
    if not kinds or set(kinds) - set(BLOCK_KINDS[1:]):
        parser.error(f"--block-kernels-kinds: expected kinds among {', '.join(BLOCK_KINDS[1:])}, got "
                     f"{args.block_kernels_kinds!r}")
    try:
        parse_shapes(args.stack_shapes)
    except ValueError as e:
        parser.error(f"--stack-shapes: {e}")
    if args.deepseek_v4_shapes is not None:
        try:
            shapes = parse_shapes(args.deepseek_v4_shapes)
        except ValueError as e:
            parser.error(f"--deepseek-v4-shapes: {e}")
        if any(hidden % 16 or tokens < 8 for tokens, hidden in shapes):
            parser.error(f"--deepseek-v4-shapes: expected at least 8 tokens and a width that is a multiple of 16, "
                         f"got {args.deepseek_v4_shapes!r}")
    kinds = [k for k in args.stack_kinds.split(",") if k]
    if "residual" not in kinds or set(kinds) - set(ALL_KINDS):
        parser.error(f"--stack-kinds: expected kinds among {', '.join(ALL_KINDS)}, the plain residual among them, "
                     f"got {args.stack_kinds!r}")
    return [p for p in PARTS if p in parts]


def recorded_stack_shapes(args, measured: set) -> list[dict]:
    """The shapes of the recording's stack section that this run does not measure (a run of part 'stack' replaces
    the shapes it measures and keeps the others: a stack of every kind at 8192 x 2048 takes most of a device
    call alone), each with the environment and command that made it; none with --no-save."""
    if args.no_save:
        return []
    recording = recorded_or_none(args.name, directory=args.out_dir) or {}
    section = recording.get("results", {}).get("stack") or {}
    made = {"environment": section.get("environment"), "command": section.get("command")}
    return [{**made, **shape} for shape in section.get("shapes", [])
            if (shape["tokens"], shape["C"], shape["layers"]) not in measured]


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    parts = _check(parser, args)
    cuda = torch.cuda.is_available()
    device = ("cuda" if cuda else "cpu") if args.device == "auto" else args.device
    gpu_parts = [p for p in parts if p not in CPU_PARTS]
    if (gpu_parts or device == "cuda") and not cuda:
        print("bench training needs a CUDA GPU" + (f" for parts {', '.join(gpu_parts)}" if gpu_parts else "")
              + "; recorded H200 results: mhc_lab/recorded/training_h200.json")
        return 1
    if gpu_parts and device != "cuda":
        parser.error(f"--device {args.device}: only part {', '.join(CPU_PARTS)} runs on a CPU, got parts "
                     f"{', '.join(parts)}")
    if device == "cpu" and not args.no_save and args.out_dir is None and args.name == RECORDING:
        parser.error(f"a run on the CPU is not recorded in mhc_lab/recorded/{RECORDING}.json (the H200's): give "
                     "--out DIR (or --name NAME) to record it elsewhere, or --no-save")
    if "deepseek_v4" in parts:
        try:
            transformers_version = deepseek_v4.require_transformers()
        except ImportError as e:
            print(f"part deepseek_v4: {e}")
            return 1
    skip = {s for s in args.skip.split(",") if s}
    if gpu_parts:
        bench, timer_name = gpu_timer()
        copy = copy_bandwidth(bench)
        print(f"copy {copy:.0f} GB/s")
        setup = {"timer": timer_name, "n": N, "dtype": "bfloat16", "copy_gbps": copy}
    sections = {}
    save = section_saver("training", args, argv, recording=RECORDING, order=PARTS, sections=sections)

    t0 = time.time()
    if "site" in parts:
        sections["site"] = {**setup, "sinkhorn_iterations": 20, "post_mult": 2.0, "shapes": []}
        for tokens, C in parse_shapes(args.shapes):
            sections["site"]["shapes"].append(bench_site(tokens, C, bench, skip=skip, graph_rounds=args.graph_rounds))
            save(final=False)
            torch.cuda.empty_cache()
    if "block" in parts:
        sections["block"] = {**setup, "widths": []}
        for width in (int(w) for w in args.widths.split(",") if w):
            sections["block"]["widths"].append(bench_block(width, bench, skip=skip, rounds=args.block_rounds))
            save(final=False)
    if "block_kernels" in parts:
        sections["block_kernels"] = {"copy_gbps": copy, "widths": []}
        for width in (int(w) for w in args.widths.split(",") if w):
            for kind in (k for k in args.block_kernels_kinds.split(",") if k):
                sections["block_kernels"]["widths"].append(bench_block_kernels(width, bench, kind=kind))
                save(final=False)
    if "host" in parts:
        sections["host"] = bench_host()
    if "portable" in parts:
        sections["portable"] = {**setup, "shapes": []}
        for tokens, C in parse_shapes(args.shapes):
            sections["portable"]["shapes"].append(bench_portable(tokens, C, bench, rounds=args.graph_rounds))
            save(final=False)
            torch.cuda.empty_cache()
    if "stack" in parts:
        kinds = [k for k in args.stack_kinds.split(",")
                 if k and not (k == "mhc_tilekernels" and "tilekernels" in skip)]
        measured = parse_shapes(args.stack_shapes)
        sections["stack"] = {**setup, "launched_timer": LAUNCHED_TIMER, "loss": LOSS,
                             "shapes": recorded_stack_shapes(args, {(t, c, args.stack_layers) for t, c in measured})}
        made = {"environment": environment_tags(), "command": bench_command("training", argv)}
        for tokens, C in measured:
            shape = bench_stack(C, tokens, bench, layers=args.stack_layers, kinds=kinds, rounds=args.stack_rounds)
            sections["stack"]["shapes"] = sorted(sections["stack"]["shapes"] + [{**shape, **made}],
                                                 key=lambda s: (s["C"], s["tokens"]))
            save(final=False)
            torch.cuda.empty_cache()
    if "peers" in parts:
        from mhc_lab.bench.peers import bench_peers, peer_versions

        sections["peers"] = {**setup, "sinkhorn_iterations": 20, "versions": peer_versions(), "shapes": []}
        for tokens, C in parse_shapes(args.shapes):
            sections["peers"]["shapes"].append(bench_peers(tokens, C, bench, copy, rounds=args.graph_rounds))
            save(final=False)
            torch.cuda.empty_cache()
    if "deepseek_v4" in parts:
        shapes = deepseek_v4.CUDA_SHAPES if device == "cuda" else deepseek_v4.CPU_SHAPES
        if args.deepseek_v4_shapes is not None:
            shapes = parse_shapes(args.deepseek_v4_shapes)
        sections["deepseek_v4"] = {"timer": deepseek_v4.TIMER, "loss": deepseek_v4.LOSS, "device": device,
                                   "backend": "auto", "transformers": transformers_version, "shapes": []}
        for tokens, hidden in shapes:
            sections["deepseek_v4"]["shapes"].append(deepseek_v4.bench_deepseek_v4(
                tokens, hidden, layers=args.deepseek_v4_layers, device=device, rounds=args.deepseek_v4_rounds))
            save(final=False)
            if device == "cuda":
                torch.cuda.empty_cache()
    path = save(final=True)
    print(f"done in {time.time() - t0:.0f} s" + (f"; saved {path}" if path else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
