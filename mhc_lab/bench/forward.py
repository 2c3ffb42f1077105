"""Benchmark of one mHC site's forward (pre + post, layer F = identity) on a CUDA GPU.

    python -m mhc_lab.bench forward                              # both parts, the three shapes, records JSON
    python -m mhc_lab.bench forward --parts sites --shapes 16384x4096 --no-save

n = 4, bf16 lanes, float32 coefficients, 20 Sinkhorn rounds; medians of triton.testing.do_bench with the L2
flushed between runs, and the device-to-device copy bandwidth (bytes read + written) of the same run. Two parts,
each a section of mhc_lab/recorded/forward_h200.json:

- sites: DeepSeek's TileKernels (tile-kernels 1.0.0, its inference path) and ours, a site whose pre projects for
  itself (phi split, projection pass, apply pass, then the post) and a site inside a stack (ours_chained: the
  apply pass on the projection the previous post made, then the post fused with the next site's projection);
  then each of our kernels alone; every output against the float32 reference.
- reference: the reference code eager and under torch.compile. A part of its own: torch.compile takes minutes
  per shape, and neither changes when our kernels do.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from mhc_lab.bench.common import (
    N,
    SHAPES,
    copy_bandwidth,
    gpu_timer,
    l2_read_bandwidth,
    parse_shapes,
    reference_site,
    rel,
    section_saver,
    site_inputs,
    tilekernels_site,
)
from mhc_lab.reference import mhc_coefficients, mhc_post, mhc_pre

PARTS = ("sites", "reference")
RECORDING = "forward_h200"


def site_bytes(tokens: int, C: int, n: int = N, itemsize: int = 2) -> int:
    """Least bytes one site's forward moves: pre reads nC, writes C; post reads (n+1)C, writes nC."""
    return tokens * (2 * n + 1 + n + 1) * C * itemsize  # 14 C elements at n = 4


def _setup(bench_name: str, copy_gbps: float) -> dict:
    return {"timer": bench_name, "n": N, "dtype": "bfloat16", "sinkhorn_iterations": 20, "post_mult": 2.0,
            "copy_gbps": copy_gbps}


def _ours(x, phi, bias, alpha):
    from mhc_lab.ops import mhc_post_fused, mhc_pre_fused

    o = mhc_pre_fused(x, phi, bias, alpha)
    return mhc_post_fused(x, o.layer_input, o.post, o.res)


def chained_site(x, phi, bias, alpha):
    """A site inside a stack, in its steady state: the previous site's post already projected these lanes
    (made here once, untimed), so the pre runs only its apply pass; this site's post projects the lanes it
    writes for the next site (here with the same phi: the cost does not depend on its values). 14 C elements
    per token at n = 4, the least a site must move. Returns (site, apply, post_project, outputs): the whole
    site and its two kernels as calls, and the tensors they write."""
    from mhc_lab.kernels._coefficients import mixes_width
    from mhc_lab.kernels.post_project import post_project_kernel
    from mhc_lab.kernels.pre_cuda import run_pre_cuda
    from mhc_lab.kernels.pre_split import phi_rows, phi_split_kernel, project_kernel
    from mhc_lab.ops.dispatch import CHAIN_SPLITS

    tokens, n, C = x.shape
    phi_hl = torch.empty((phi_rows(n), n * C), dtype=torch.bfloat16, device=x.device)
    phi_split_kernel(n, C, "cuda")(phi, phi_hl)
    handed, partial_out = (torch.empty((CHAIN_SPLITS, tokens, mixes_width(n) + 1), device=x.device)
                           for _ in range(2))
    project_kernel(n, C, "bfloat16", "cuda", splits=CHAIN_SPLITS)(x.view(tokens, n * C), phi_hl, handed)
    y = torch.empty((tokens, C), dtype=x.dtype, device=x.device)
    pre, post = (torch.empty((tokens, n), device=x.device) for _ in range(2))
    res = torch.empty((tokens, n, n), device=x.device)
    new = torch.full_like(x, float("nan"))
    fused = post_project_kernel(n, C, "bfloat16", "cuda", splits=CHAIN_SPLITS)

    def apply():
        run_pre_cuda(x, phi, bias, alpha, y, pre, post, res, splits=CHAIN_SPLITS, partial=handed, projected=True)

    def post_project():
        fused(x, y, post, res, phi_hl, new, partial_out)

    def site():
        apply()
        post_project()

    return site, apply, post_project, {"new": new, "partial": partial_out}


def bench_sites(tokens: int, C: int, bench, *, skip=(), log=print) -> dict:
    """TileKernels' site and ours, then our kernels alone, at one shape, with their errors."""
    from mhc_lab.kernels._coefficients import mixes_width
    from mhc_lab.kernels.pre_split import PROJECTION_SPLITS, apply_kernel, phi_rows, phi_split_kernel, project_kernel
    from mhc_lab.ops import mhc_post_fused, mhc_pre_fused

    x, phi, bias, alpha = site_inputs(tokens, C)
    out = {"tokens": tokens, "C": C, "n": N, "min_bytes": site_bytes(tokens, C), "time_ms": {}, "rel_err": {},
           "kernel_ms": {}, "kernel_rel_err": {}, "errors": {}}
    want = reference_site(x, phi, bias, alpha)  # float32 coefficients from the bf16 lanes
    impls = {"ours": _ours}
    if "tilekernels" not in skip:
        impls["tilekernels"] = lambda *a: tilekernels_site(*a)
    for name, fn in impls.items():
        try:
            with torch.no_grad():
                got = fn(x, phi, bias, alpha)
                torch.cuda.synchronize()
                out["rel_err"][name] = rel(got, want)
                out["time_ms"][name] = bench(lambda: fn(x, phi, bias, alpha)) * 1e3
            log(f"  {name:14s} {out['time_ms'][name]:8.3f} ms  rel err {out['rel_err'][name]:.2e}")
        except Exception as e:  # noqa: BLE001 - record why, and time the rest
            out["errors"][name] = repr(e)[:500]
            log(f"  {name:14s} FAILED {repr(e)[:200]}")
    try:
        site, apply, post_project, written = chained_site(x, phi, bias, alpha)
        site()
        torch.cuda.synchronize()
        flat = written["new"].float().view(tokens, N * C)
        projection = torch.cat([flat @ phi.t(), flat.pow(2).sum(-1, keepdim=True)], dim=-1)
        got, M = written["partial"].sum(0), mixes_width(N)
        out["rel_err"]["ours_chained"] = rel(written["new"], want)
        # the projection and the squared norm apart: the norm's column is far larger and would hide the other
        out["kernel_rel_err"]["chained.partial"] = max(rel(got[:, :M], projection[:, :M]),
                                                       rel(got[:, M], projection[:, M]))
        out["time_ms"]["ours_chained"] = bench(site) * 1e3
        out["kernel_ms"]["chained.apply"] = bench(apply) * 1e3
        out["kernel_ms"]["chained.post_project"] = bench(post_project) * 1e3
        log(f"  {'ours_chained':14s} {out['time_ms']['ours_chained']:8.3f} ms  rel err "
            f"{out['rel_err']['ours_chained']:.2e} (apply {out['kernel_ms']['chained.apply']:.3f}, post + next "
            f"projection {out['kernel_ms']['chained.post_project']:.3f})")
    except Exception as e:  # noqa: BLE001
        out["errors"]["ours_chained"] = repr(e)[:500]
        log(f"  {'ours_chained':14s} FAILED {repr(e)[:200]}")
    # our kernels alone
    pre, post, res = mhc_coefficients(x, phi, bias, alpha)
    o = mhc_pre_fused(x, phi, bias, alpha)
    torch.cuda.synchronize()
    out["kernel_rel_err"]["pre"] = {"layer_input": rel(o.layer_input, mhc_pre(x, pre)), "pre": rel(o.pre, pre),
                                    "post": rel(o.post, post), "res": rel(o.res, res)}
    out["kernel_ms"]["pre"] = bench(lambda: mhc_pre_fused(x, phi, bias, alpha, out=o)) * 1e3
    post_out = torch.empty_like(x)
    out["kernel_ms"]["post"] = bench(lambda: mhc_post_fused(x, o.layer_input, o.post, o.res, out=post_out)) * 1e3
    out["kernel_rel_err"]["post"] = rel(post_out, mhc_post(x, o.layer_input, o.post, o.res))
    n = N
    phi_hl = torch.empty((phi_rows(n), n * C), dtype=torch.bfloat16, device="cuda")
    partial = torch.empty((PROJECTION_SPLITS, tokens, mixes_width(n) + 1), device="cuda")
    split, project = phi_split_kernel(n, C, "cuda"), project_kernel(n, C, "bfloat16", "cuda")
    apply_pass = apply_kernel(n, C, "bfloat16", "cuda")
    y, p, q, r = o.layer_input, o.pre, o.post, o.res
    out["kernel_ms"]["pre.phi_split"] = bench(lambda: split(phi, phi_hl)) * 1e3
    out["kernel_ms"]["pre.project"] = bench(lambda: project(x.view(tokens, n * C), phi_hl, partial)) * 1e3
    out["kernel_ms"]["pre.apply"] = bench(lambda: apply_pass(x, partial, bias, alpha, y, p, q, r)) * 1e3
    log("  kernels alone: " + ", ".join(f"{k} {v:.3f}" for k, v in out["kernel_ms"].items()) + " ms")
    return out


def bench_reference(tokens: int, C: int, bench, *, skip=(), log=print) -> dict:
    """The reference site eager and under torch.compile at one shape."""
    x, phi, bias, alpha = site_inputs(tokens, C)
    out = {"tokens": tokens, "C": C, "n": N, "min_bytes": site_bytes(tokens, C), "time_ms": {}, "rel_err": {},
           "errors": {}}
    want = reference_site(x, phi, bias, alpha)
    impls = {}
    if "eager" not in skip:
        impls["eager"] = reference_site
    if "compile" not in skip:
        impls["compile"] = torch.compile(reference_site, dynamic=True)
    for name, fn in impls.items():
        try:
            got = fn(x, phi, bias, alpha)
            torch.cuda.synchronize()
            out["rel_err"][name] = rel(got, want)
            out["time_ms"][name] = bench(lambda: fn(x, phi, bias, alpha)) * 1e3
            log(f"  {name:14s} {out['time_ms'][name]:8.3f} ms  rel err {out['rel_err'][name]:.2e}")
        except Exception as e:  # noqa: BLE001
            out["errors"][name] = repr(e)[:500]
            log(f"  {name:14s} FAILED {repr(e)[:200]}")
    return out


def summarize(sections: dict) -> str:
    """Every site's time, GB/s on the least bytes (14C) and share of the copy bandwidth, one line each."""
    lines = [f"{'shape':>12s} {'impl':>14s} {'ms':>8s} {'GB/s(14C)':>10s} {'%copy':>6s} {'rel err':>8s}"]
    for section in sections.values():
        copy = section["copy_gbps"]
        for r in section["shapes"]:
            for name, ms in r["time_ms"].items():
                gbps = r["min_bytes"] / (ms * 1e-3) / 1e9
                err = r["rel_err"].get(name)
                lines.append(f"{r['tokens']:>6d}x{r['C']:<5d} {name:>14s} {ms:8.3f} {gbps:10.0f} "
                             f"{100 * gbps / copy:6.1f} " + (f"{err:8.1e}" if err is not None else ""))
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m mhc_lab.bench forward", description=__doc__.splitlines()[0])
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, among {', '.join(PARTS)}")
    parser.add_argument("--shapes", default=",".join(f"{t}x{c}" for t, c in SHAPES),
                        help="comma-separated TOKENSxC (default: the three issue shapes)")
    parser.add_argument("--skip", default="", help="comma-separated baselines to skip: tilekernels,eager,compile")
    parser.add_argument("--name", default=RECORDING, help="recording name (mhc_lab/recorded/NAME.json)")
    parser.add_argument("--out", "--out-dir", dest="out_dir", default=None,
                        help="write the JSON here instead of mhc_lab/recorded")
    parser.add_argument("--no-save", action="store_true", help="print only")
    return parser


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    parts = [p for p in PARTS if p in args.parts.split(",")]
    unknown = set(args.parts.split(",")) - set(PARTS) - {""}
    if unknown or not parts:
        parser.error(f"--parts: expected parts among {', '.join(PARTS)}, got {args.parts!r}")
    if not torch.cuda.is_available():
        print("bench forward needs a CUDA GPU; recorded H200 results: mhc_lab/recorded/forward_h200.json")
        return 1
    shapes, skip = parse_shapes(args.shapes), {s for s in args.skip.split(",") if s}
    bench, timer_name = gpu_timer()
    copy = copy_bandwidth(bench)
    print(f"copy {copy:.0f} GB/s")
    sections = {}
    if "sites" in parts:
        sections["sites"] = {**_setup(timer_name, copy), "l2_read_gbps": l2_read_bandwidth(), "shapes": []}
    if "reference" in parts:
        sections["reference"] = {**_setup(timer_name, copy), "shapes": []}
    save = section_saver("forward", args, argv, recording=RECORDING, order=PARTS, sections=sections)

    t0 = time.time()
    for tokens, C in shapes:
        print(f"shape {tokens} x {C}")
        if "sites" in sections:
            sections["sites"]["shapes"].append(bench_sites(tokens, C, bench, skip=skip))
        if "reference" in sections:
            sections["reference"]["shapes"].append(bench_reference(tokens, C, bench, skip=skip))
        save(final=False)  # keep what is measured so far, should a later shape not finish
        torch.cuda.empty_cache()
    print(summarize(sections))
    path = save(final=True)
    print(f"done in {time.time() - t0:.0f} s" + (f"; saved {path}" if path else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
