"""Benchmark of lab 05's TileLang kernels (fused RMSNorm, residual add, copy) against eager PyTorch, and the
figures lab 05 draws from it. Writes one JSON recording tagged with GPU, driver, torch, tilelang and date.

    python -m mhc_lab.bench tilelang --out DIR    # CUDA: RMSNorm 8192 x 4096 and add 16384 x 4096, bf16,
                                                  #       several tile shapes each (the best one is reported)
    python -m mhc_lab.bench tilelang --out DIR    # CPU: a small float32 version on TileLang's C target

GB/s is always counted bytes over measured time: each input read once and each output written once
(``rmsnorm_bytes``, ``residual_add_bytes``, ``copy_bytes`` next to the kernels), for every implementation,
eager included, so that the numbers compare work done, not traffic caused. ``fraction_of_copy`` divides by
the bandwidth of a torch copy of 16384 x 4096 bf16 measured in the same run. Before timing, each TileLang
variant is run once on NaN-poisoned output and compared with the float64 reference.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from mhc_lab.measure import (  # noqa: F401 (labs use recording_label)
    bench_command, recorded_or_none, recording_label, resolve_device, save_recording, time_fn,
)
from mhc_lab.kernels import elementwise, rmsnorm

RECORDING = "tilelang_h200"
EPS = 1e-6
GPU_SHAPES = {"rmsnorm": (8192, 4096), "residual_add": (16384, 4096), "copy": (16384, 4096)}
CPU_SHAPES = {"rmsnorm": (512, 1024), "residual_add": (512, 1024), "copy": (512, 1024)}
# Tile shapes tried on a GPU: (block_rows, threads) for RMSNorm, (block_rows, block_cols, threads) for add/copy.
RMSNORM_VARIANTS = [(1, 128), (2, 128), (1, 256), (2, 256), (4, 256), (1, 512)]
ELEMENTWISE_VARIANTS = [(8, 512, 256), (16, 512, 256), (4, 1024, 256), (32, 256, 256), (16, 1024, 512)]
# H200 numbers for the chef picture (NVIDIA H200 SXM datasheet, Hopper tuning guide).
H200 = {"hbm_gb": 141, "hbm_tbs": 4.8, "sms": 132, "registers_kb_per_sm": 256, "shared_kb_per_sm": 228,
        "l2_mb": 50}


def fraction_of_copy_roof(nbytes: float, seconds: float, copy_gbs: float) -> float:
    """A kernel's bandwidth (counted bytes over seconds) as a fraction of the copy bandwidth in GB/s."""
    return nbytes / seconds / 1e9 / copy_gbs


# ---- measuring ----------------------------------------------------------------------------------------------


def _seconds(fn, device, *, repeat: int, inner: int) -> dict:
    """Median seconds per call of ``fn``, timing ``inner`` calls at a time (short kernels, one timer)."""
    stats = time_fn(lambda: [fn() for _ in range(inner)], warmup=2, repeat=repeat, device=device)
    return {"median_s": stats["median_s"] / inner, "min_s": stats["min_s"] / inner, "repeat": repeat,
            "inner": inner}


def _row(kernel: str, impl: str, shape, dtype, counted: int, timing: dict, copy_gbs: float | None, **extra):
    gbs = counted / timing["median_s"] / 1e9
    row = {"kernel": kernel, "impl": impl, "shape": list(shape), "dtype": str(dtype).replace("torch.", ""),
           "counted_bytes": counted, "median_s": timing["median_s"], "min_s": timing["min_s"],
           "repeat": timing["repeat"], "gbs": gbs,
           "fraction_of_copy": None if not copy_gbs else fraction_of_copy_roof(counted, timing["median_s"], copy_gbs)}
    row.update(extra)
    return row


def _max_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    """Relative error ||got - expected|| / ||expected|| (NaN, e.g. an unwritten output, gives inf)."""
    if not got.numel():
        return 0.0
    got, expected = got.double(), expected.double()
    if not torch.isfinite(got).all():
        return float("inf")
    return float((got - expected).norm() / expected.norm().clamp_min(1e-300))


def run(device: str = "auto", *, quick: bool = False, repeat: int | None = None, log=print) -> dict:
    """Measure copy, residual add and RMSNorm on ``device``; returns {"device", "copy_gbs", "rows", "variants", ...}:
    variants holds every tile shape tried.

    On a CPU, PyTorch is timed on one thread, like the C target's kernels, which run one program instance after
    another on one core: the comparison is then kernel against kernel, not one core against all of them.
    """
    dev = resolve_device(device)
    if dev.type == "cuda":
        return _measure(dev, quick=quick, repeat=repeat, log=log)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _measure(dev, quick=quick, repeat=repeat, log=log)
    finally:
        torch.set_num_threads(threads)


def _measure(dev: torch.device, *, quick: bool, repeat: int | None, log) -> dict:
    gpu = dev.type == "cuda"
    shapes = GPU_SHAPES if gpu else CPU_SHAPES
    dtype = torch.bfloat16 if gpu else torch.float32
    name = "bfloat16" if gpu else "float32"
    target = "cuda" if gpu else "c"
    itemsize = torch.empty((), dtype=dtype).element_size()
    repeat = repeat or (20 if gpu else 5)
    inner = 10 if gpu else 1
    g = torch.Generator(device="cpu").manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float32).to(device=dev, dtype=dtype)

    rows, tile_configs = [], []

    # The roof: a torch copy of the residual-add-sized tensor.
    N, C = shapes["copy"]
    src, dst = rand(N, C), torch.empty(N, C, device=dev, dtype=dtype)
    counted = elementwise.copy_bytes(N, C, itemsize)["total"]
    timing = _seconds(lambda: dst.copy_(src), dev, repeat=repeat, inner=inner)
    copy_gbs = counted / timing["median_s"] / 1e9
    rows.append(_row("copy", "torch copy_", (N, C), dtype, counted, timing, copy_gbs))
    log(f"copy {N}x{C} {name}: torch copy_ {copy_gbs:.0f} GB/s (the roof of this run)")

    def measure_tile_shapes(kernel_name, configs, make, check, counted, shape):
        best = None
        for config in configs:
            try:
                fn = make(config)
                error = check(fn)
                # bf16 outputs carry ~3e-3 relative rounding; float32 on the CPU far less.
                ok = error is not None and error <= (1e-2 if gpu else 1e-5)
                timing = _seconds(fn, dev, repeat=repeat, inner=inner) if ok else None
            except Exception as failure:  # one bad tile shape must not stop the others
                tile_configs.append({"kernel": kernel_name, "config": list(config), "ok": False,
                                 "error": f"{type(failure).__name__}: {str(failure).splitlines()[0][:200]}"})
                log(f"  {kernel_name} {config}: failed ({type(failure).__name__})")
                continue
            entry = {"kernel": kernel_name, "config": list(config), "ok": ok, "relative_error": error}
            if timing:
                entry.update(_row(kernel_name, "tilelang", shape, dtype, counted, timing, copy_gbs))
                log(f"  {kernel_name} {config}: {timing['median_s'] * 1e6:.1f} us, {entry['gbs']:.0f} GB/s")
                if best is None or timing["median_s"] < best[1]["median_s"]:
                    best = (config, timing, error)
            tile_configs.append(entry)
        if best is not None:
            rows.append(_row(kernel_name, "tilelang", shape, dtype, counted, best[1], copy_gbs,
                             config=list(best[0]), relative_error=best[2]))

    # Copy and residual add with TileLang.
    for kernel_name in ("copy", "residual_add"):
        N, C = shapes[kernel_name]
        x, f = rand(N, C), rand(N, C)
        out = torch.empty_like(x)
        if kernel_name == "copy":
            counted = elementwise.copy_bytes(N, C, itemsize)["total"]
            factory, args, expected = elementwise.copy_kernel, (x, out), x
        else:
            counted = elementwise.residual_add_bytes(N, C, itemsize)["total"]
            factory, args, expected = elementwise.residual_add_kernel, (x, f, out), x + f
            timing = _seconds(lambda: torch.add(x, f, out=out), dev, repeat=repeat, inner=inner)
            rows.append(_row(kernel_name, "eager (x + f)", (N, C), dtype, counted, timing, copy_gbs))

        def make(config, factory=factory, args=args, C=C):
            if gpu:
                br, bc, th = config
                kernel = factory(C, br, dtype=name, target=target, block_cols=bc, threads=th)
            else:
                kernel = factory(C, config[0], dtype=name, target=target)
            return lambda: kernel(*args)

        def check(fn, out=out, expected=expected):
            out.fill_(float("nan"))
            fn()
            return _max_error(out, expected)

        configs = (ELEMENTWISE_VARIANTS[:2] if quick else ELEMENTWISE_VARIANTS) if gpu else [(4,)]
        measure_tile_shapes(kernel_name, configs, make, check, counted, (N, C))

    # RMSNorm: eager (8 kernels), torch's own rms_norm, TileLang fused.
    N, C = shapes["rmsnorm"]
    x, w = rand(N, C), rand(C)
    counted = rmsnorm.rmsnorm_bytes(N, C, name)["fused"]
    reference = rmsnorm.rmsnorm_reference(x, w, EPS)
    timing = _seconds(lambda: rmsnorm.rmsnorm_eager(x, w, EPS), dev, repeat=repeat, inner=inner)
    rows.append(_row("rmsnorm", "eager (8 kernels)", (N, C), dtype, counted, timing, copy_gbs,
                     eager_bytes=rmsnorm.rmsnorm_bytes(N, C, name)["eager"]))
    if hasattr(torch.nn.functional, "rms_norm"):
        fn = lambda: torch.nn.functional.rms_norm(x, (C,), w, EPS)  # noqa: E731
        timing = _seconds(fn, dev, repeat=repeat, inner=inner)
        rows.append(_row("rmsnorm", "torch rms_norm", (N, C), dtype, counted, timing, copy_gbs,
                         relative_error=_max_error(fn(), reference)))
    y = torch.empty_like(x)

    def make_rms(config):
        if gpu:
            kernel = rmsnorm.rmsnorm_kernel(C, config[0], EPS, dtype=name, target=target, threads=config[1])
        else:
            kernel = rmsnorm.rmsnorm_kernel(C, config[0], EPS, dtype=name, target=target)
        return lambda: kernel(x, w, y)

    def check_rms(fn):
        y.fill_(float("nan"))
        fn()
        return _max_error(y, reference)

    configs = (RMSNORM_VARIANTS[:2] if quick else RMSNORM_VARIANTS) if gpu else [(4,)]
    measure_tile_shapes("rmsnorm", configs, make_rms, check_rms, counted, (N, C))

    device_name = torch.cuda.get_device_name(dev) if gpu else "CPU (TileLang C target and torch, one thread)"
    return {"device": device_name, "copy_gbs": copy_gbs, "rows": rows, "variants": tile_configs, "eps": EPS,
            "torch_threads": torch.get_num_threads()}


def best(results: dict, kernel: str, impl: str) -> dict | None:
    """The row of ``kernel`` measured with ``impl`` (e.g. 'tilelang', 'eager (8 kernels)'), or None."""
    return next((r for r in results["rows"] if r["kernel"] == kernel and r["impl"] == impl), None)


def results_table(results: dict) -> str:
    """A plain-text table of the rows: kernel, implementation, shape, time, GB/s on counted bytes, of copy."""
    lines = [f"{'kernel':<13} {'implementation':<18} {'shape':<12} {'dtype':<9} {'time':>11} {'GB/s':>8} "
             f"{'of copy':>8}", "-" * 85]
    for r in results["rows"]:
        shape = "x".join(str(s) for s in r["shape"])
        fraction = f"{r['fraction_of_copy']:.0%}" if r.get("fraction_of_copy") else "-"
        lines.append(f"{r['kernel']:<13} {r['impl']:<18} {shape:<12} {r['dtype']:<9} "
                     f"{r['median_s'] * 1e6:>8.1f} us {r['gbs']:>8.1f} {fraction:>8}")
    return "\n".join(lines)


def load_recorded(name: str = RECORDING) -> dict | None:
    """This benchmark's recording, or None when there is none (yet)."""
    return recorded_or_none(name)


# ---- figures lab 05 draws --------------------------------------------------------------------------------


def chef_figure(eager_passes: int = 8):
    """The kitchen picture: HBM is the fridge, registers and shared memory the countertop, the kernel the
    recipe. Arrows count the trips to the fridge of the eager RMSNorm and of the fused one."""
    import plotly.graph_objects as go

    fig = go.Figure()
    boxes = [
        (0.0, 0.0, 3.0, 4.0, "#dbe9f6", f"<b>HBM = the fridge</b><br>{H200['hbm_gb']} GB, "
                                        f"{H200['hbm_tbs']} TB/s<br>(H200 datasheet)<br><br>x, w, y live here"),
        (6.0, 2.2, 9.5, 4.0, "#fde9c9", f"<b>on-chip = the countertop</b><br>registers {H200['registers_kb_per_sm']} KB"
                                        f" + shared {H200['shared_kb_per_sm']} KB<br>per SM, x {H200['sms']} SMs"),
        (6.0, 0.0, 9.5, 1.6, "#e2f0d9", "<b>the kernel = the recipe</b><br>fetch once, do every step<br>"
                                        "at the counter, put back once"),
    ]
    for x0, y0, x1, y1, color, text in boxes:
        fig.add_shape(type="rect", x0=x0, y0=y0, x1=x1, y1=y1, fillcolor=color, line=dict(color="#555"))
        fig.add_annotation(x=(x0 + x1) / 2, y=(y0 + y1) / 2, text=text, showarrow=False, font=dict(size=12))
    fig.add_annotation(x=6.0, y=3.5, ax=3.0, ay=3.5, xref="x", yref="y", axref="x", ayref="y", showarrow=True,
                       arrowhead=3, text="")
    fig.add_annotation(x=3.0, y=2.7, ax=6.0, ay=2.7, xref="x", yref="y", axref="x", ayref="y", showarrow=True,
                       arrowhead=3, text="")
    fig.add_annotation(x=4.5, y=3.85, text=f"eager RMSNorm: {eager_passes} round trips<br>fused: 1 read of x, "
                                          "1 write of y", showarrow=False, font=dict(size=11))
    fig.update_xaxes(visible=False, range=[-0.2, 9.7])
    fig.update_yaxes(visible=False, range=[-0.2, 4.3])
    fig.update_layout(height=330, margin=dict(l=10, r=10, t=40, b=10), title="The chef picture of a GPU kernel",
                      plot_bgcolor="white")
    return fig


def tiling_figure(N: int, C: int, block_rows: int, block_cols: int):
    """An N x C tensor cut into tiles, one program instance each; tiles that hang over the edge are marked."""
    import plotly.graph_objects as go

    rows_t, cols_t = -(-N // block_rows), -(-C // block_cols)
    fig = go.Figure()
    for i in range(rows_t):
        for j in range(cols_t):
            r0, c0 = i * block_rows, j * block_cols
            tail = r0 + block_rows > N or c0 + block_cols > C
            fig.add_shape(type="rect", x0=c0, x1=c0 + block_cols, y0=r0, y1=r0 + block_rows,
                          line=dict(color="#333", width=1), fillcolor="#f4b183" if tail else "#9dc3e6",
                          opacity=0.75)
            if rows_t * cols_t <= 64:
                fig.add_annotation(x=c0 + block_cols / 2, y=r0 + block_rows / 2, text=str(i * cols_t + j),
                                   showarrow=False, font=dict(size=10))
    fig.add_shape(type="rect", x0=0, x1=C, y0=0, y1=N, line=dict(color="black", width=3))
    padded = rows_t * block_rows * cols_t * block_cols
    fig.update_xaxes(range=[-1, max(C, cols_t * block_cols) + 1], title="column c")
    fig.update_yaxes(range=[max(N, rows_t * block_rows) + 1, -1], title="row r")
    tails = sum(1 for i in range(rows_t) for j in range(cols_t)
                if (i + 1) * block_rows > N or (j + 1) * block_cols > C)
    fig.update_layout(height=420, plot_bgcolor="white", title=(
        f"{N} x {C} in tiles of {block_rows} x {block_cols}: {rows_t * cols_t} instances, {tails} hang over "
        f"the edge (orange); {padded - N * C} of {padded} tile slots are outside the tensor"))
    return fig


def eager_passes_figure(N: int, C: int, dtype: str = "bfloat16"):
    """Bytes moved pass by pass by the eager RMSNorm, next to the fused kernel's single pass."""
    import plotly.graph_objects as go

    counted = rmsnorm.rmsnorm_bytes(N, C, dtype)
    fig = go.Figure()
    for what, read, write in counted["eager_passes"]:
        fig.add_trace(go.Bar(name=what, x=["eager (one kernel per step)"], y=[(read + write) / 1e6]))
    fig.add_trace(go.Bar(name="fused kernel", x=["fused (one kernel)"], y=[counted["fused"] / 1e6]))
    fig.update_layout(barmode="stack", height=380, yaxis_title="MB moved (read + written)",
                      title=f"RMSNorm of {N} x {C} {dtype}: {counted['eager'] / 1e6:.0f} MB eager, "
                            f"{counted['fused'] / 1e6:.0f} MB fused ({counted['eager'] / counted['fused']:.1f}x)")
    return fig


def results_figure(results: dict, title: str):
    """GB/s on counted bytes of every measured row, with the copy bandwidth of the same run as a line."""
    import plotly.graph_objects as go

    labels = [f"{r['kernel']}<br>{r['impl']}" for r in results["rows"]]
    fig = go.Figure(go.Bar(x=labels, y=[r["gbs"] for r in results["rows"]],
                           text=[f"{r['median_s'] * 1e6:.0f} us" for r in results["rows"]], textposition="outside"))
    fig.add_hline(y=results["copy_gbs"], line_dash="dot",
                  annotation_text=f"copy: {results['copy_gbs']:.0f} GB/s", annotation_position="top left")
    fig.update_layout(title=title, yaxis_title="GB/s on counted bytes", height=420)
    return fig


def predicted_time_figure(N: int, C: int, copy_gbs: float, measured: list[dict] | None = None,
                          roof_label: str = "copy roof"):
    """Best-case time of the fused and the eager RMSNorm (bf16) for N rows of width 256..16384: counted bytes
    over the copy bandwidth. The chosen C is marked; measured rows of the same shape are drawn as points."""
    import plotly.graph_objects as go

    widths = [256 * 2**k for k in range(7)]
    fig = go.Figure()
    for key, label in (("eager", "eager, at the roof"), ("fused", "fused, at the roof")):
        fig.add_trace(go.Scatter(x=widths, y=[rmsnorm.rmsnorm_bytes(N, c)[key] / (copy_gbs * 1e9) * 1e6
                                              for c in widths], mode="lines+markers", name=label))
    counted = rmsnorm.rmsnorm_bytes(N, C)
    for key in ("eager", "fused"):
        t = counted[key] / (copy_gbs * 1e9) * 1e6
        fig.add_trace(go.Scatter(x=[C], y=[t], mode="markers+text", text=[f"{key}: {t:.1f} us"],
                                 textposition="middle right", marker=dict(size=12, symbol="diamond"),
                                 name=f"C = {C}, {key}"))
    for row in measured or []:
        if row["kernel"] == "rmsnorm" and row["shape"][0] == N:
            fig.add_trace(go.Scatter(x=[row["shape"][1]], y=[row["median_s"] * 1e6], mode="markers",
                                     marker=dict(size=11, symbol="x"), name=f"measured: {row['impl']}"))
    fig.update_xaxes(type="log", title="C (row width)")
    fig.update_yaxes(type="log", title="microseconds")
    fig.update_layout(height=420, title=f"RMSNorm of {N} rows in bf16 on the {roof_label} ({copy_gbs:.0f} GB/s)")
    return fig


# ---- command line ----------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m mhc_lab.bench tilelang", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--quick", action="store_true", help="two tile shapes per kernel instead of all")
    parser.add_argument("--repeat", type=int, help="timed calls per measurement (default 20 on a GPU, 5 on a CPU)")
    parser.add_argument("--out", type=Path, default=Path("build/recorded"),
                        help="directory for <name>.json (commit the GPU one into mhc_lab/recorded/)")
    parser.add_argument("--name", help=f"recording name (default: {RECORDING} on an H200, tilelang_cpu on a CPU)")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    results = run(args.device, quick=args.quick, repeat=args.repeat)
    name = args.name
    if name is None:
        gpu = results["device"]
        if "H200" in gpu:
            name = RECORDING
        elif gpu.startswith("CPU"):
            name = "tilelang_cpu"
        else:
            name = "tilelang_" + "".join(ch if ch.isalnum() else "_" for ch in gpu.lower()).strip("_")
    path = save_recording(name, results, command=bench_command("tilelang", argv), directory=args.out)
    print()
    print(results_table(results))
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
