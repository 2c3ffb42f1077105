"""Benchmark of the memory wall: copy bandwidth, the plain residual add, and the naive HC and mHC sites
(eager and torch.compile, forward and forward + backward) with their kernel launches and GB/s on the bytes
the bytes model counts. Writes one JSON recording tagged with GPU, driver, torch, tilelang and date.

    python -m mhc_lab.bench memory-wall --out DIR           # on a CUDA GPU: 16384 tokens, C 2560 and 4096
    python -m mhc_lab.bench memory-wall --out DIR           # on a CPU: a small version (1024 tokens, C 256)

GB/s is always counted bytes over measured time: the bytes of mHC Table 2 (unfused, bf16 lanes, float32
coefficients) for the sites, 3C elements per token for the residual. ``fraction_of_copy`` compares that with
the machine's measured copy bandwidth; ``minimal_bytes`` is what the fewest-bytes fused site would move.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from mhc_lab.measure import bytes_model, profiling, roofline
from mhc_lab.measure import (  # noqa: F401 (labs use recording_label)
    bench_command, load_recording, recording_label, resolve_device, save_recording, time_interleaved,
)
from mhc_lab.models.naive_layers import LAYERS, make_layer

RECORDING = "memory_wall_h200"
_NAMES = {"residual": "residual merge", "hc": "HC site", "mhc": "mHC site"}


def _row(layer, mode: str, direction: str, timing: dict, launches, copy_gbs: float, **extra) -> dict:
    counted = layer.counted_bytes("forward")
    if direction == "forward+backward":
        counted += layer.counted_bytes("backward")
    gbs = counted / timing["median_s"] / 1e9
    row = {
        "layer": layer.method, "label": layer.name, "mode": mode, "pass": direction,
        "tokens": layer.tokens, "n": layer.n, "C": layer.C, "dtype": str(layer.stream_dtype).replace("torch.", ""),
        "median_s": timing["median_s"], "min_s": timing["min_s"], "repeat": timing["repeat"],
        "launches": launches, "counted_bytes": counted, "gbs": gbs, "fraction_of_copy": gbs / copy_gbs,
    }
    if layer.method != "residual":
        minimal = layer.tokens * bytes_model.bytes_per_token("mhc_minimal", layer.n, layer.C,
                                                             stream_dtype=layer.stream_dtype)
        if direction == "forward+backward":
            minimal += layer.tokens * bytes_model.bytes_per_token("mhc_minimal", layer.n, layer.C, "backward",
                                                                  stream_dtype=layer.stream_dtype)
        row["minimal_bytes"] = minimal
    row.update(extra)
    return row


def measure_shape(tokens: int, n: int, C: int, device, dtype: torch.dtype, *, copy_gbs: float,
                  compile: bool = True, backward: bool = True, rounds: int = 5, calls: int = 3,
                  layers=("residual", "hc", "mhc"), log=print) -> list[dict]:
    """Time, count and trace the naive layers at one shape; one row per (layer, mode, pass).

    The eager calls are timed against each other by :func:`measure.time_interleaved` (``rounds`` rounds of
    ``calls`` calls, caches flushed before each, the median over rounds of each round's fastest call), so a
    busy spell of the machine slows them alike. Compiled calls (``compile``) are timed one by one right after
    their compile, which resets torch.compile's caches."""
    device = torch.device(device)
    made, passes = _layers_and_passes(tokens, n, C, device, dtype, layers, backward)
    timings = time_interleaved(passes, rounds=rounds, calls=calls, cold=True, device=device)
    return _rows(made, passes, timings, device, copy_gbs, compile, rounds * calls, log)


def measure_live(tokens: int, n: int, C: int, device, dtype: torch.dtype, *, small: bool = True,
                 backward: bool = False, rounds: int = 5, calls: int = 3) -> tuple[roofline.Roof, list[dict]]:
    """This machine's roof and the naive layers' eager rows (as :func:`measure_shape` makes them), all timed in
    the same interleaved rounds from cold caches: a busy spell slows the roof's copy and the layers alike, so
    each layer's share of the roof holds from run to run. Returns (roof, rows)."""
    device = torch.device(device)
    kernels = roofline.roof_kernels(device, small)
    made, passes = _layers_and_passes(tokens, n, C, device, dtype, LAYERS, backward)
    timings = time_interleaved({**{name: k["fn"] for name, k in kernels.items()}, **passes}, rounds=rounds,
                               calls=calls, cold=True, device=device)
    roof = roofline.roof_from(device, kernels, timings)
    return roof, _rows(made, passes, timings, device, roof.bandwidth_gbs, False, rounds * calls, lambda line: None)


def _layers_and_passes(tokens, n, C, device, dtype, layers, backward):
    made = {name: make_layer(name, tokens, n, C, device, dtype) for name in layers}
    passes = {(name, direction): fn for name, layer in made.items()
              for direction, fn in [("forward", layer.forward)]
              + ([("forward+backward", layer.forward_backward)] if backward else [])}
    return made, passes


def _rows(made, passes, timings, device, copy_gbs, compile, repeat, log) -> list[dict]:
    rows = []
    for (name, direction), fn in passes.items():
        layer = made[name]
        extra = {}
        if direction == "forward":
            trace = profiling.trace_ops(fn)
            extra = {"traced_ops": trace.launches, "traced_bytes": trace.bytes_moved, "syncs": trace.syncs}
        cpu_forward = direction == "forward" and device.type != "cuda"
        launches = trace.launches if cpu_forward else profiling.launches(fn, device)
        rows.append(_row(layer, "eager", direction, timings[(name, direction)], launches, copy_gbs, **extra))
        log(_describe(rows[-1]))
        if compile and name != "residual":
            fast = profiling.compile_call(fn, device, repeat=repeat)
            rows.append(_row(layer, "compiled", direction, fast["timing"], fast["launches"], copy_gbs,
                             compile_s=fast["compile_s"]))
            log(_describe(rows[-1]))
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def _describe(r: dict) -> str:
    launches = "-" if r["launches"] is None else r["launches"]
    return (f"  C={r['C']:>5} {r['label']:<18} {r['mode']:<8} {r['pass']:<16} {r['median_s'] * 1e3:9.3f} ms  "
            f"launches {launches:>4}  {r['gbs']:8.1f} GB/s on counted bytes ({100 * r['fraction_of_copy']:.0f}% of copy)")


def run(device="auto", tokens: int | None = None, widths=None, n: int = 4, dtype: torch.dtype | None = None,
        compile: bool | None = None, backward: bool = True, repeat: int | None = None, out=None,
        name: str | None = None, merge_with=None, command: str = "python -m mhc_lab.bench memory-wall",
        log=print) -> dict:
    """Measure everything, save it with :func:`measure.save_recording` after every shape (so a run cut short
    still leaves its rows), and return the results and where they went. ``merge_with``: a recording (JSON path)
    whose rows for other widths are kept, so one recording can be made in several runs. ``command``: the command
    line recorded with it."""
    device = resolve_device(device)
    gpu = device.type == "cuda"
    tokens = tokens or (16384 if gpu else 1024)
    widths = list(widths or ([2560, 4096] if gpu else [256]))
    dtype = dtype or (torch.bfloat16 if gpu else torch.float32)
    compile = gpu if compile is None else compile
    rounds = repeat or (20 if gpu else 5)  # interleaved rounds, each the fastest of 3 calls
    name = name or (RECORDING if gpu else "memory_wall_cpu")
    log(f"memory-wall bench on {device} ({torch.cuda.get_device_name(device) if gpu else 'CPU'}): "
        f"{tokens} tokens, C in {widths}, n = {n}, {dtype}, compile={compile}, backward={backward}")
    roof = roofline.measure_roof(device, small=not gpu)
    log(f"  copy {roof.bandwidth_gbs:.0f} GB/s (read + written), matmul {roof.matmul_tflops:.3g} TFLOP/s "
        f"{roof.matmul_dtype}")
    config = {"tokens": tokens, "n": n, "widths": widths, "dtype": str(dtype).replace("torch.", ""),
              "layer_function": "identity", "sinkhorn": "deepseek_v4, 20 iterations",
              "coefficients": "float32",
              "timer": "eager: measure.time_interleaved (CUDA events on a GPU, the thread's CPU time on a CPU), "
                       "caches flushed before each call, median over rounds of each round's fastest of 3 calls; "
                       "compiled: measure.time_fn after the compile, median",
              "counted_bytes": "bytes_model: mHC Table 2 rows (unfused), lanes in the stream dtype, "
                               "coefficients in float32; backward rows derived",
              "launches": "CUDA kernels in the profiler (GPU); operations that compute (CPU)"}
    results = {"config": config, "copy_bandwidth_gbs": roof.bandwidth_gbs,
               "roof": {"device": roof.device, "bandwidth_gbs": roof.bandwidth_gbs,
                        "matmul_tflops": roof.matmul_tflops, "matmul_dtype": roof.matmul_dtype}, "rows": []}
    if merge_with is not None:
        import json

        earlier = json.loads(Path(merge_with).read_text())["results"]["rows"]
        results["rows"] = [r for r in earlier if r["C"] not in widths]
        config["widths"] = sorted({r["C"] for r in results["rows"]} | set(widths))
        log(f"  keeping {len(results['rows'])} rows of {merge_with} (widths "
            f"{sorted({r['C'] for r in results['rows']})})")
    path = None
    for C in widths:
        results["rows"] += measure_shape(tokens, n, C, device, dtype, copy_gbs=roof.bandwidth_gbs, compile=compile,
                                         backward=backward, rounds=rounds, log=log)
        path = save_recording(name, results, command=command, directory=out)
    log(f"wrote {path}")
    return {"name": name, "results": results, "path": str(path)}


def lane_sweep(tokens: int, C: int, ns=(1, 2, 4, 8), device="cpu", dtype: torch.dtype = torch.float32,
               rounds: int = 5, calls: int = 3) -> list[dict]:
    """Forward time of the residual merge, the HC site and the mHC site for each n at one (tokens, C), with the
    operations each launches: the data for 'n lanes cost far more than n times'.

    All the calls of all n are timed against each other by :func:`measure.time_interleaved` (caches flushed
    before each call; per call, the median over ``rounds`` rounds of the round's fastest of ``calls``), so the
    ratios between them hold on a busy machine; the residual, one lane whatever n, is timed once. Each row also
    says where it was timed: the device and, on a CPU, PyTorch's threads (the labs' setup() pins them to one;
    see mhc_lab.course.setup)."""
    device = torch.device(device)
    # the residual merge has one lane whatever n is: one timing serves every row, so no ratio carries its noise
    made = {("residual", None): make_layer("residual", tokens, 1, C, device, dtype)}
    made.update({(name, n): make_layer(name, tokens, n, C, device, dtype) for n in ns for name in ("hc", "mhc")})
    timings = time_interleaved({key: layer.forward for key, layer in made.items()}, rounds=rounds, calls=calls,
                               cold=True, device=device)
    launches = {key: profiling.launches(layer.forward, device) for key, layer in made.items()}
    where = timing_label(device)
    out = []
    for n in ns:
        row = {"n": n, "tokens": tokens, "C": C, "where": where, "rounds": rounds, "calls": calls}
        for name in LAYERS:
            key = (name, None if name == "residual" else n)
            row[f"{name}_s"] = timings[key]["median_s"]
            row[f"{name}_launches"] = launches[key]
        out.append(row)
    return out


def timing_statistic(rounds: int, calls: int) -> str:
    """How the interleaved timings of this module are taken, as figure titles and tables say it."""
    return f"median of {rounds} rounds, each the fastest of {calls} calls from cold caches"


def timing_label(device) -> str:
    """Where a timing runs, as figure titles say it: "CPU, 1 thread" (PyTorch's threads now), or the GPU."""
    device = torch.device(device)
    if device.type == "cuda":
        return f"GPU: {torch.cuda.get_device_name(device)}"
    threads = torch.get_num_threads()
    return f"CPU, {threads} thread{'s' if threads != 1 else ''}"


def lane_sweep_figure(sweep: list[dict]):
    """Time relative to the plain residual against n, beside 'n times' and the bytes model's ratio (plotly).

    The title says what was measured (time per forward call, where, the shape), not what it shows: on a busy
    machine a learner's numbers may show something else, and the figure must not contradict them."""
    import plotly.graph_objects as go

    ns = [r["n"] for r in sweep]
    C = sweep[0]["C"]
    fig = go.Figure()
    fig.add_trace(go.Scatter(x=ns, y=ns, mode="lines", line=dict(dash="dot", color="gray"),
                             name="n times the residual (what intuition says)"))
    bytes_ratio = [bytes_model.elements_per_token("hc", n, C) / bytes_model.elements_per_token("residual", n, C)
                   for n in ns]
    fig.add_trace(go.Scatter(x=ns, y=bytes_ratio, mode="lines+markers", line=dict(dash="dash"),
                             name="bytes ratio, Table 2 (what the fridge says)"))
    for name, label in (("hc", "HC site, measured"), ("mhc", "mHC site, measured")):
        fig.add_trace(go.Scatter(
            x=ns, y=[r[f"{name}_s"] / r["residual_s"] for r in sweep], mode="lines+markers", name=label,
            hovertext=[f"{r[name + '_launches']} launches" for r in sweep]))
    fig.update_xaxes(title="lanes n", tickvals=ns)
    fig.update_yaxes(title="time / time of the plain residual", type="log")
    first = sweep[0]
    measured = ", ".join(part for part in (first.get("where"), f"{first['tokens']} tokens, C = {C}",
                                          timing_statistic(first["rounds"], first["calls"])
                                          if "rounds" in first else None)
                         if part)
    fig.update_layout(title=f"Time per forward call, n lanes, relative to the plain residual ({measured})",
                      height=420, legend=dict(font=dict(size=10)))
    return fig


def recorded_roofline(recording: dict, direction: str = "forward", C: int | None = None):
    """The recorded machine's roofline with the recorded layers (at width C, the widest if None) placed on it by
    counted FLOPs and bytes."""
    rf = recording["results"]["roof"]
    roof = roofline.Roof(rf["device"], rf["bandwidth_gbs"], rf["matmul_tflops"], rf["matmul_dtype"])
    C = C if C is not None else max(r["C"] for r in recording["results"]["rows"])
    rows = [r for r in recording["results"]["rows"] if r["pass"] == direction and r["C"] == C]
    points = [dict(p, name=f"{_NAMES.get(r['layer'], r['layer'])} ({r['mode']})")
              for r, p in zip(rows, layer_points(rows, direction))]
    env = recording["environment"]
    title = (f"RECORDED roofline: {env.get('gpu') or 'a CPU'}, {env.get('date')} "
             f"(naive layers, {direction}, {rows[0]['tokens'] if rows else '?'} tokens, C = {C})")
    return roofline.roofline_figure(roof, points, title=title, spec=roofline.SPEC_SHEETS.get(env.get("gpu") or ""))


# ---- reading a recording back (the lab's side) ------------------------------------------------------------


def load_memory_wall(name: str = RECORDING, directory=None) -> dict | None:
    """The recorded benchmark, or None when nothing has been recorded yet."""
    try:
        return load_recording(name, directory=directory)
    except FileNotFoundError:
        return None


def copy_lines(recording: dict, other: dict | None) -> list[str]:
    """The recorded copy bandwidth with the size it copied, and, where another recording (``other``, lab 05's,
    with a "copy" row) measured a copy on the same GPU, why the two differ: a fixed cost per copy (the launch,
    the start and the tail of its blocks) weighs more on the smaller one. Every figure is read or derived."""
    gbs = recording["results"]["copy_bandwidth_gbs"]
    big = roofline.copy_bytes(roofline.roof_sizes(gpu=True)[0] * 2**20 // 4, torch.float32)
    lines = [f"copy bandwidth (recorded): {gbs:.0f} GB/s, copying {big / 2 / 2**20:.0f} MiB of float32 "
             f"({big / 1e9:.2f} GB read + written, {big / gbs / 1e3:.1f} us)"]
    row = next((r for r in (other or {}).get("results", {}).get("rows", []) if r.get("kernel") == "copy"), None)
    if row is None or other["environment"].get("gpu") != recording["environment"].get("gpu"):
        return lines
    at_rate_us = row["counted_bytes"] / gbs / 1e3
    fixed_us = row["median_s"] * 1e6 - at_rate_us
    lines.append(
        f"lab 05's recording ({other['environment'].get('date')}) copies {row['counted_bytes'] / 2 / 2**20:.0f} MiB "
        f"of {row['dtype']} at {row['gbs']:.0f} GB/s: {row['median_s'] * 1e6:.1f} us, of which {at_rate_us:.1f} us "
        f"is its bytes at {gbs:.0f} GB/s; the other {fixed_us:.1f} us is what a copy pays once however large "
        f"(the launch, the start and the tail of its blocks): {100 * fixed_us / (row['median_s'] * 1e6):.1f}% of "
        f"that copy, {100 * fixed_us / (big / gbs / 1e3):.1f}% of this one")
    return lines


def results_table(results: list[dict]) -> str:
    """A plain-text table of benchmark rows (recorded or live)."""
    lines = [f"{'C':>6}  {'layer':<18}{'mode':<10}{'pass':<18}{'time':>11}{'launches':>10}{'GB/s':>9}"
             f"{'% of copy':>11}"]
    for r in results:
        launches = "-" if r.get("launches") is None else str(r["launches"])
        lines.append(f"{r['C']:>6}  {r['label']:<18}{r['mode']:<10}{r['pass']:<18}"
                     f"{r['median_s'] * 1e3:>8.3f} ms{launches:>10}{r['gbs']:>9.1f}{100 * r['fraction_of_copy']:>10.0f}%")
    return "\n".join(lines)


def slowdown(results: list[dict], C: int | None = None, direction: str = "forward") -> dict[str, float]:
    """Time of each (layer, mode) divided by the plain residual's, at one width (the first if None)."""
    C = C if C is not None else results[0]["C"]
    mine = [r for r in results if r["C"] == C and r["pass"] == direction]
    base = next((r["median_s"] for r in mine if r["layer"] == "residual"), None)
    if base is None:
        return {}
    return {f"{_NAMES.get(r['layer'], r['layer'])} ({r['mode']})": r["median_s"] / base for r in mine}


def bound_lines(results: list[dict], copy_gbs: float) -> list[str]:
    """Per forward row, its measured time over the least time its counted bytes take at the copy rate, in words;
    a row under 1 (faster than its bytes allow) says so, and why a point can get there."""
    lines = []
    for r in results:
        if r["pass"] != "forward":
            continue
        ratio = r["median_s"] / (r["counted_bytes"] / (copy_gbs * 1e9))
        if ratio >= 1:
            lines.append(f"{r['label']:<16} {ratio:6.1f}x the least time its counted bytes take at the copy rate")
        else:
            lines.append(f"{r['label']:<16} {ratio:6.2f}x the least time its counted bytes take at the copy rate: "
                         f"FASTER than its bytes allow ({_ABOVE_ROOF})")
    return lines


_ABOVE_ROOF = ("the bytes model counts every read and write as a trip to memory, and some found their data still in "
               "the cache (an operation reading what the one before it wrote), or this layer streams its bytes faster "
               "than the copy that set the roof (a copy of another size, with its own pattern of reads and writes)")
EXPECTED_FURTHEST = "mhc"


def layer_points(results: list[dict], direction: str = "forward") -> list[dict]:
    """The rows of one pass as roofline points: {"name", "layer", "launches", "flops", "bytes", "seconds"}."""
    points = []
    for r in results:
        if r["pass"] != direction:
            continue
        flops = r["tokens"] * bytes_model.flops_per_token(r["layer"], r["n"], r["C"], "forward")
        if direction == "forward+backward":
            flops += r["tokens"] * bytes_model.flops_per_token(r["layer"], r["n"], r["C"], "backward")
        points.append({"name": r["label"], "layer": r["layer"], "launches": r["launches"], "flops": flops,
                       "bytes": r["counted_bytes"], "seconds": r["median_s"]})
    return points


def roof_lines(results: list[dict], roof: roofline.Roof) -> list[str]:
    """What the roofline of the forward rows shows, in sentences computed from them: each layer's intensity
    against the ridge and its share of the roof above it; which sits furthest below, checked against the
    expectation (the mHC site, the layer of the most operations) and, where the machine disagrees, why it may."""
    points = layer_points(results)
    share = {p["layer"]: roofline.position(roof, p) for p in points}
    label = {p["layer"]: p["name"] for p in points}
    lines = []
    for p in points:
        intensity = p["flops"] / p["bytes"]
        side = "left of" if intensity < roof.ridge else "right of"
        lines.append(f"{p['name']:<16} {intensity:6.3f} FLOP/byte, {side} the ridge ({roof.ridge:.1f}); "
                     f"{100 * share[p['layer']]:.0f}% of the roof above it")
    if not points:
        return lines
    lowest = min(share, key=share.get)
    lines.append(f"Furthest below the roof: the {label[lowest]} ({100 * share[lowest]:.0f}% of it).")
    launches = {p["layer"]: p["launches"] for p in points}
    if lowest == EXPECTED_FURTHEST:
        lines.append(f"As expected: the {label[lowest]} runs the most operations ({launches[lowest]}), each a "
                     "full pass (on a GPU, a launch) that its counted bytes do not pay for.")
    elif EXPECTED_FURTHEST in share:
        lines.append(
            f"Not the {label[EXPECTED_FURTHEST]}, which the expectation puts there for its "
            f"{launches[EXPECTED_FURTHEST]} operations against the {label[lowest]}'s {launches[lowest]}: this "
            f"machine disagrees. On a CPU an operation costs no launch, so the many tiny steps of a small matrix "
            "(Sinkhorn's, on n x n) add little, and which layer is slower depends on how fast this CPU runs its "
            "few large passes over the lanes; a busy spell during one layer's timing can also tip the order.")
    above = [label[layer] for layer, value in share.items() if value > 1]
    if above:
        lines.append(f"Above the roof: {', '.join(above)}; {_ABOVE_ROOF}.")
    return lines


def comparison_figure(local: list[dict], recording: dict | None, where: str | None = None):
    """Slowdown against the plain residual: this machine (live) beside the recording (labelled), plotly.
    ``where``: how the live rows were timed, for the legend (e.g. "CPU, 1 thread", timing_label())."""
    import plotly.graph_objects as go

    fig = go.Figure()
    here = slowdown(local)
    live = ", ".join(part for part in ("live", where, f"C = {local[0]['C']}") if part)
    fig.add_trace(go.Bar(name=f"this machine ({live})", x=list(here), y=list(here.values())))
    if recording is not None:
        rec = recording["results"]["rows"]
        widest = max(r["C"] for r in rec)
        there = slowdown(rec, widest)
        env = recording["environment"]
        fig.add_trace(go.Bar(name=f"RECORDED: {env.get('gpu') or 'a CPU'}, {env.get('date')} (C = {widest})",
                             x=list(there), y=list(there.values()), marker_pattern_shape="/"))
    fig.update_layout(barmode="group", height=400, yaxis_title="time / time of the plain residual add",
                      title="Time per forward call relative to the plain residual add (n = 4)")
    fig.update_yaxes(type="log")
    return fig


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m mhc_lab.bench memory-wall", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--tokens", type=int, help="default: 16384 on a GPU, 1024 on a CPU")
    parser.add_argument("--widths", type=int, nargs="+", help="C values; default: 2560 4096 on a GPU, 256 on a CPU")
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--compile", dest="compile", action="store_true", default=None,
                        help="also time torch.compile (default on a GPU)")
    parser.add_argument("--no-compile", dest="compile", action="store_false")
    parser.add_argument("--no-backward", dest="backward", action="store_false", default=True)
    parser.add_argument("--repeat", type=int, help="interleaved rounds of 3 timed calls each, per measurement (default "
                                                   "20 on a GPU, 5 on a CPU)")
    parser.add_argument("--out", type=Path, default=Path("build/recorded"),
                        help="directory for <name>.json (commit it into mhc_lab/recorded/)")
    parser.add_argument("--name", help=f"recording name (default: {RECORDING} on a GPU, memory_wall_cpu on a CPU)")
    parser.add_argument("--merge-with", type=Path, help="an earlier recording whose other widths are kept")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    result = run(args.device, args.tokens, args.widths, args.n, compile=args.compile, backward=args.backward,
                 repeat=args.repeat, out=args.out, name=args.name, merge_with=args.merge_with,
                 command=bench_command("memory-wall", argv))
    print()
    print(results_table(result["results"]["rows"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
