"""Benchmark of one mHC site's forward (pre + post, layer F = identity) on a CUDA GPU.

    python -m mhc_lab.bench.forward                  # all three shapes, all baselines, records JSON
    python -m mhc_lab.bench.forward --shapes 16384x4096 --skip eager,compile --no-save

For each shape (tokens x C, n = 4, bf16 lanes, float32 coefficients) it times, as medians of CUDA-event
timings: the eager reference (mhc_lab.reference), torch.compile of it, DeepSeek's TileKernels forward
(tile-kernels 1.0.0, inference path, 20 Sinkhorn rounds and post multiplier 2 passed explicitly), and ours
(each plan of the pre kernel, plus every kernel alone, plus a site inside a stack of sites, where the previous
post already projected the lanes: 'ours_stream'); the device-to-device copy bandwidth (bytes read +
written); our GB/s on the least bytes a site must move (14 C elements of 2 bytes per token) and its
fraction of the copy bandwidth; and the relative error of every implementation against the reference.
Results go to mhc_lab/recorded/forward_h200.json (tagged with GPU, driver, versions, date) unless --no-save.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time

import torch

from mhc_lab.measure import save_recording
from mhc_lab.reference import mhc_coefficients, mhc_post, mhc_pre

SHAPES = ((16384, 2560), (16384, 4096), (8192, 7168))
N = 4
BASELINES = ("eager", "compile", "tilekernels")
PLANS = ("split", "lookback", "cluster")


def site_bytes(tokens: int, C: int, n: int = N, itemsize: int = 2) -> int:
    """Least bytes one site's forward moves: pre reads nC, writes C; post reads (n+1)C, writes nC."""
    return tokens * (2 * n + 1 + n + 1) * C * itemsize  # 14 C elements at n = 4


def _timer():
    try:
        from triton.testing import do_bench

        def bench(fn, warmup_ms=25, rep_ms=100):
            return do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median") * 1e-3

        return bench, "triton.testing.do_bench (median, L2 flushed between runs)"
    except Exception:  # noqa: BLE001 - no triton: CUDA events through measure.time_fn
        from mhc_lab.measure import time_fn

        def bench(fn, warmup_ms=25, rep_ms=100):
            return time_fn(fn, warmup=3, repeat=20)["median_s"]

        return bench, "mhc_lab.measure.time_fn (median of CUDA events)"


def copy_bandwidth(bench, nbytes: int = 2 << 30) -> float:
    """Device-to-device copy of nbytes, counting bytes read + written, in GB/s."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda").normal_()
    dst = torch.empty_like(src)
    seconds = bench(lambda: dst.copy_(src))
    del src, dst
    return 2 * nbytes / seconds / 1e9


def l2_read_bandwidth(mbytes: int = 24, loops: int = 200) -> float:
    """Repeated reads of a buffer that fits in L2 (a sum over it), GB/s: the ceiling of on-chip re-reads."""
    a = torch.randn(mbytes * 2**20 // 4, device="cuda")
    for _ in range(3):
        a.sum()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(loops):
        a.sum()
    end.record()
    end.synchronize()
    return loops * a.numel() * 4 / (start.elapsed_time(end) * 1e-3) / 1e9


def _inputs(tokens, C, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    m = N * N + 2 * N
    x = torch.randn(tokens, N, C, device="cuda", generator=g).bfloat16()
    phi = torch.randn(m, N * C, device="cuda", generator=g) / math.sqrt(N * C)
    bias = torch.randn(m, device="cuda", generator=g) * 0.5
    alpha = torch.rand(3, device="cuda", generator=g) + 0.5
    return x, phi, bias, alpha


def reference_site(x, phi, bias, alpha):
    pre, post, res = mhc_coefficients(x, phi, bias, alpha)
    y = mhc_pre(x, pre)
    return mhc_post(x, y, post, res)


def _tilekernels():
    try:
        import tile_kernels  # noqa: F401  (1.0.0 imports a module tilelang removed; the mhc modules load after)
    except ModuleNotFoundError:
        pass
    from tile_kernels.modeling.mhc import mhc_pre as tk_pre
    from tile_kernels.modeling.mhc.ops.post import mhc_post as tk_post

    def site(x, phi, bias, alpha):  # TileKernels wants [sequences, tokens, n, C]
        with torch.no_grad():
            r = x.unsqueeze(0)
            y, (post_mix, comb_mix) = tk_pre(r, phi, alpha, bias, post_mult_value=2.0, sinkhorn_repeat=20)
            return tk_post(y, r, post_mix, comb_mix).squeeze(0)

    return site


def _ours(plan, tuning=None):
    from mhc_lab.ops import mhc_post_fused, mhc_pre_fused

    def site(x, phi, bias, alpha):
        o = mhc_pre_fused(x, phi, bias, alpha, plan=plan, tuning=tuning)
        return mhc_post_fused(x, o.layer_input, o.post, o.res)

    return site


def _rel(a, b) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm())


def bench_shape(tokens, C, bench, *, skip=(), plans=PLANS, variants=(), stream_variants=(), log=print) -> dict:
    """Times and errors of every implementation on one shape; variants: ours with other tunings,
    [{"name": ..., "plan": ..., "tuning": {...}}], timed as whole sites too; stream_variants: tunings of the
    fused post + next projection, [{...}], each timed as a site inside a stack."""
    from mhc_lab.ops import mhc_post_fused, mhc_pre_fused

    x, phi, bias, alpha = _inputs(tokens, C)
    nbytes = site_bytes(tokens, C)
    out = {"tokens": tokens, "C": C, "n": N, "min_bytes": nbytes, "time_ms": {}, "rel_err": {}, "errors": {}}
    # reference in float32 on the GPU (coefficients in float32 from the bf16 lanes), checked once
    ref_out = reference_site(x, phi, bias, alpha)
    ref_pre, ref_post, ref_res = mhc_coefficients(x, phi, bias, alpha)
    ref_y = mhc_pre(x, ref_pre)
    impls = {}
    if "eager" not in skip:
        impls["eager"] = reference_site
    if "compile" not in skip:
        impls["compile"] = torch.compile(reference_site, dynamic=True)
    if "tilekernels" not in skip:
        try:
            impls["tilekernels"] = _tilekernels()
        except Exception as e:  # noqa: BLE001 - record why the baseline is missing
            out["errors"]["tilekernels"] = repr(e)
    for plan in plans:
        impls[f"ours_{plan}"] = _ours(plan)
    for v in variants:
        impls[v["name"]] = _ours(v["plan"], v.get("tuning"))
    for name, fn in impls.items():
        try:
            got = fn(x, phi, bias, alpha)
            torch.cuda.synchronize()
            out["rel_err"][name] = _rel(got, ref_out)
            out["time_ms"][name] = bench(lambda: fn(x, phi, bias, alpha)) * 1e3
            log(f"  {name:22s} {out['time_ms'][name]:8.3f} ms  rel err {out['rel_err'][name]:.2e}")
        except Exception as e:  # noqa: BLE001
            out["errors"][name] = repr(e)[:500]
            log(f"  {name:22s} FAILED {repr(e)[:200]}")
    # our kernels alone, with the per-output errors of pre
    for plan in plans:
        try:
            o = mhc_pre_fused(x, phi, bias, alpha, plan=plan)
            torch.cuda.synchronize()
            out["rel_err"][f"pre_{plan}"] = {"layer_input": _rel(o.layer_input, ref_y), "pre": _rel(o.pre, ref_pre),
                                             "post": _rel(o.post, ref_post), "res": _rel(o.res, ref_res)}
            out["time_ms"][f"pre_{plan}"] = bench(lambda: mhc_pre_fused(x, phi, bias, alpha, plan=plan)) * 1e3
        except Exception as e:  # noqa: BLE001
            out["errors"][f"pre_{plan}"] = repr(e)[:500]
    o = mhc_pre_fused(x, phi, bias, alpha, plan="split")
    post_out = torch.empty_like(x)
    out["time_ms"]["post"] = bench(lambda: mhc_post_fused(x, o.layer_input, o.post, o.res, out=post_out)) * 1e3
    out["rel_err"]["post"] = _rel(post_out, mhc_post(x, o.layer_input, o.post, o.res))
    out["time_ms"].update(_split_components(x, phi, bias, alpha, bench))
    if "stream" not in skip:
        try:
            times, errors = _stream_site(x, phi, bias, alpha, bench, ref_out)
            out["time_ms"].update(times)
            out["rel_err"].update(errors)
            log(f"  {'ours_stream':22s} {times['ours_stream']:8.3f} ms  rel err {errors['ours_stream']:.2e} "
                f"(apply {times['stream.apply']:.3f}, post + next projection {times['stream.post_project']:.3f})")
        except Exception as e:  # noqa: BLE001
            out["errors"]["ours_stream"] = repr(e)[:500]
            log(f"  {'ours_stream':22s} FAILED {repr(e)[:200]}")
        out["stream_variants"] = []
        for tuning in stream_variants:
            row = {"tuning": tuning}
            try:
                row["time_ms"], row["rel_err"] = _stream_site(x, phi, bias, alpha, bench, ref_out, tuning)
                log(f"  stream {tuning}: site {row['time_ms']['ours_stream']:.3f} ms, post + next projection "
                    f"{row['time_ms']['stream.post_project']:.3f} ms, partial rel err "
                    f"{row['rel_err']['stream.partial']:.1e}")
            except Exception as e:  # noqa: BLE001
                row["error"] = repr(e)[:500]
                log(f"  stream {tuning}: FAILED {repr(e)[:200]}")
            out["stream_variants"].append(row)
    return out


def _stream_site(x, phi, bias, alpha, bench, ref_out, tuning=None) -> tuple[dict, dict]:
    """A site inside a stack of sites, in its steady state: the previous site's post already projected these
    lanes (kernels/post_project.py), so the pre runs only its apply pass, and this site's post projects the
    lanes it writes for the next site (here with the same phi: the cost does not depend on its values).
    Moves 14 C elements per token at n = 4, the least a site must. tuning: post_project_program's keywords
    (its "splits", by default what the library chains with, mhc_lab.ops.training.CHAIN_SPLITS, also sets the
    apply pass's), and "apply_phases" and "spread_coefficients" of the apply pass (split_kernels)."""
    from mhc_lab.kernels._coefficients import mixes_width
    from mhc_lab.kernels.post_project import post_project_kernel
    from mhc_lab.kernels.pre_cuda import SPLIT_DEFAULTS
    from mhc_lab.kernels.pre_split import phi_rows, split_kernels
    from mhc_lab.ops.training import CHAIN_SPLITS

    tokens, n, C = x.shape
    tuning = {"splits": CHAIN_SPLITS, **hashable_tuning(tuning or {})}
    S = tuning["splits"]
    apply_tuning = {key: tuning.pop(key, SPLIT_DEFAULTS[key]) for key in ("apply_phases", "spread_coefficients")}
    phi_split, project, apply = split_kernels(n, C, "bfloat16", "cuda",
                                              **{**SPLIT_DEFAULTS, "splits": S, **apply_tuning})
    fused = post_project_kernel(n, C, "bfloat16", "cuda", **tuning)
    phi_hl = torch.empty((phi_rows(n), n * C), dtype=torch.bfloat16, device="cuda")
    phi_split(phi, phi_hl)
    partial_in, partial_out = (torch.empty((S, tokens, mixes_width(n) + 1), device="cuda") for _ in range(2))
    project(x.view(tokens, n * C), phi_hl, partial_in)  # what the previous site's post would have written
    y = torch.empty((tokens, C), dtype=x.dtype, device="cuda")
    pre, post = (torch.empty((tokens, n), device="cuda") for _ in range(2))
    res = torch.empty((tokens, n, n), device="cuda")
    new = torch.full_like(x, float("nan"))
    partial_out.fill_(float("nan"))

    def site():
        apply(x, partial_in, bias, alpha, y, pre, post, res)
        fused(x, y, post, res, phi_hl, new, partial_out)

    site()
    torch.cuda.synchronize()
    flat = new.float().view(tokens, n * C)
    want = torch.cat([flat @ phi.t(), flat.pow(2).sum(-1, keepdim=True)], dim=-1)
    got, M = partial_out.sum(0), mixes_width(n)
    # the projection and the squared norm apart: the norm's column is far larger and would hide the projection's
    errors = {"ours_stream": _rel(new, ref_out),
              "stream.partial": max(_rel(got[:, :M], want[:, :M]), _rel(got[:, M], want[:, M]))}
    times = {"ours_stream": bench(site) * 1e3,
             "stream.apply": bench(lambda: apply(x, partial_in, bias, alpha, y, pre, post, res)) * 1e3,
             "stream.post_project": bench(lambda: fused(x, y, post, res, phi_hl, new, partial_out)) * 1e3}
    return times, errors


def hashable_tuning(tuning: dict) -> dict:
    """A kernel tuning read from JSON with its lists made tuples: the kernel factories' caches need hashable
    keywords."""
    return {k: tuple(v) if isinstance(v, list) else v for k, v in tuning.items()}


def _split_components(x, phi, bias, alpha, bench) -> dict:
    from mhc_lab.kernels._coefficients import mixes_width
    from mhc_lab.kernels.pre_cuda import SPLIT_DEFAULTS
    from mhc_lab.kernels.pre_split import phi_rows, split_kernels

    tokens, n, C = x.shape
    phi_split, project, apply = split_kernels(n, C, "bfloat16", "cuda", **SPLIT_DEFAULTS)
    phi_hl = torch.empty((phi_rows(n), n * C), dtype=torch.bfloat16, device="cuda")
    partial = torch.empty((SPLIT_DEFAULTS["splits"], tokens, mixes_width(n) + 1), device="cuda")
    y = torch.empty((tokens, C), dtype=x.dtype, device="cuda")
    pre, post = (torch.empty((tokens, n), device="cuda") for _ in range(2))
    res = torch.empty((tokens, n, n), device="cuda")
    return {
        "split.phi_split": bench(lambda: phi_split(phi, phi_hl)) * 1e3,
        "split.project": bench(lambda: project(x.view(tokens, n * C), phi_hl, partial)) * 1e3,
        "split.apply": bench(lambda: apply(x, partial, bias, alpha, y, pre, post, res)) * 1e3,
    }


def sweep_pre(tokens, C, bench, plan, variants, log=print) -> list:
    """Time the pre kernel alone for each tuning variant of a plan, with its relative errors."""
    from mhc_lab.kernels.pre_cuda import run_pre_cuda

    x, phi, bias, alpha = _inputs(tokens, C, seed=1)
    ref_pre, ref_post, ref_res = mhc_coefficients(x, phi, bias, alpha)
    ref_y = mhc_pre(x, ref_pre)
    rows = []
    for cfg in variants:
        row = {"plan": plan, **cfg}
        try:
            y = torch.full((tokens, C), float("nan"), dtype=x.dtype, device="cuda")
            pre, post = (torch.full((tokens, N), float("nan"), device="cuda") for _ in range(2))
            res = torch.full((tokens, N, N), float("nan"), device="cuda")
            run_pre_cuda(x, phi, bias, alpha, y, pre, post, res, plan=plan, **cfg)
            torch.cuda.synchronize()
            row["rel_err"] = {"layer_input": _rel(y, ref_y), "pre": _rel(pre, ref_pre), "post": _rel(post, ref_post),
                              "res": _rel(res, ref_res)}
            row["time_ms"] = bench(lambda: run_pre_cuda(x, phi, bias, alpha, y, pre, post, res, plan=plan,
                                                        **cfg)) * 1e3
            row["gbps_pre_bytes"] = tokens * 10 * C / (row["time_ms"] * 1e-3) / 1e9
            log(f"  {plan} {cfg}: {row['time_ms']:.3f} ms, {row['gbps_pre_bytes']:.0f} GB/s on 10C bytes, "
                f"err y {row['rel_err']['layer_input']:.1e} res {row['rel_err']['res']:.1e}")
        except Exception as e:  # noqa: BLE001
            row["error"] = repr(e)[:500]
            log(f"  {plan} {cfg}: FAILED {repr(e)[:300]}")
        rows.append(row)
    return rows


def summarize(results: dict) -> str:
    copy = results["copy_gbps"]
    lines = [f"copy bandwidth {copy:.0f} GB/s; L2 re-read {results.get('l2_read_gbps', float('nan')):.0f} GB/s",
             f"{'shape':>12s} {'impl':>14s} {'ms':>8s} {'GB/s(14C)':>10s} {'%copy':>6s} {'rel err':>8s}"]
    for r in results["shapes"]:
        for name, ms in r["time_ms"].items():
            if "." in name:
                continue
            gbps = r["min_bytes"] / (ms * 1e-3) / 1e9
            err = r["rel_err"].get(name)
            err_s = f"{err:.1e}" if isinstance(err, float) else ""
            lines.append(f"{r['tokens']:>6d}x{r['C']:<5d} {name:>14s} {ms:8.3f} {gbps:10.0f} "
                         f"{100 * gbps / copy:6.1f} {err_s:>8s}")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mhc_lab.bench forward", description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default=",".join(f"{t}x{c}" for t, c in SHAPES),
                        help="comma-separated TOKENSxC (default: the three issue shapes)")
    parser.add_argument("--skip", default="", help="comma-separated parts to skip: eager,compile,tilekernels,stream")
    parser.add_argument("--plans", default=",".join(PLANS), help="pre plans of ours to time: split,lookback,cluster")
    parser.add_argument("--name", default="forward_h200", help="recording name (mhc_lab/recorded/NAME.json)")
    parser.add_argument("--out", "--out-dir", dest="out_dir", default=None,
                        help="write the JSON here instead of mhc_lab/recorded")
    parser.add_argument("--no-save", action="store_true", help="print only")
    parser.add_argument("--sweep", default="", help="JSON {plan: [tuning dicts]} to time the pre kernel alone")
    parser.add_argument("--sweep-only", action="store_true", help="only the --sweep part (no site timings)")
    parser.add_argument("--variants", default="", help='JSON [{"name", "plan", "tuning"}]: more tunings of ours')
    parser.add_argument("--stream-variants", default="", help="JSON [tuning dicts] of the fused post + next "
                        "projection (kernels/post_project.py), each timed as a site inside a stack")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench forward needs a CUDA GPU; recorded H200 results: mhc_lab/recorded/forward_h200.json")
        return 1
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",") if s]
    skip = {s for s in args.skip.split(",") if s}
    plans = tuple(p for p in args.plans.split(",") if p)
    bench, timer_name = _timer()
    t0 = time.time()
    results = {"timer": timer_name, "n": N, "dtype": "bfloat16", "sinkhorn_iterations": 20, "post_mult": 2.0,
               "min_bytes_per_token": "14 C elements x 2 bytes", "copy_gbps": copy_bandwidth(bench),
               "l2_read_gbps": l2_read_bandwidth(), "shapes": []}
    print(f"copy {results['copy_gbps']:.0f} GB/s, L2 re-read {results['l2_read_gbps']:.0f} GB/s")
    sweep = json.loads(args.sweep) if args.sweep else {}
    results["sweeps"] = []
    for tokens, C in shapes:
        print(f"shape {tokens} x {C}")
        for plan, variants in sweep.items():
            results["sweeps"].append({"tokens": tokens, "C": C,
                                      "rows": sweep_pre(tokens, C, bench, plan, variants)})
        if not args.sweep_only:
            variants = json.loads(args.variants) if args.variants else []
            stream_variants = json.loads(args.stream_variants) if args.stream_variants else []
            results["shapes"].append(bench_shape(tokens, C, bench, skip=skip, plans=plans, variants=variants,
                                                 stream_variants=stream_variants))
            if not args.no_save:  # keep what is measured so far, should a later shape not finish
                save_recording(args.name, {**results, "partial": True}, directory=args.out_dir)
        torch.cuda.empty_cache()
    results["wall_s"] = round(time.time() - t0, 1)
    print(summarize(results))
    if not args.no_save:
        path = save_recording(args.name, results, directory=args.out_dir)
        print(f"saved {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
