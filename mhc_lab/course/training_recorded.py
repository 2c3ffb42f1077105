"""Lab 07's views of the training benchmark: mhc_lab/recorded/training_h200.json (made by ``python -m mhc_lab.bench
training`` on an H200), or a live run of the same benchmark functions on a CUDA GPU. Every function takes one
section of the recording (site, block, block_kernels; mhc_lab.measure.schemas documents each key) or the same
dict from measure_live, and labels nothing itself: the lab prints each section's recording_label beside it.
"""

from __future__ import annotations

import statistics
from typing import Sequence

import torch

from mhc_lab.bench.copy_floor import copy_floor_counts, copy_floor_plan
from mhc_lab.measure import recorded_or_none, recording_label

RECORDING = "training_h200"
SITE_IMPLEMENTATIONS = {"ours_separate": "ours, separate ops", "ours_linked": "ours, linked",
                        "ours_chained": "ours, chained", "tilekernels": "TileKernels", "compiled": "torch.compile",
                        "eager": "eager"}
BLOCK_IMPLEMENTATIONS = {"residual": "plain residual", "copy_floor": "copy floor (mHC's bytes)",
                         "mhc_ours": "mHC, ours (chained)", "mhc_ours_recompute": "mHC, ours + recompute",
                         "mhc_tilekernels": "mHC, TileKernels", "mhc_compiled": "mHC, torch.compile"}
PAPER_OVERHEAD_PCT = 6.7  # mHC at n = 4 over a plain residual, training time (arXiv 2512.24880, Sec. 4.3)


def load_recorded(name: str = RECORDING) -> dict | None:
    """This benchmark's recording, or None when there is none (yet)."""
    return recorded_or_none(name)


def section(recording: dict | None, key: str) -> dict | None:
    """One section of the recording (site, block, block_kernels), or None."""
    return ((recording or {}).get("results") or {}).get(key)


def section_label(recording: dict | None, key: str) -> str:
    """The recording_label of one section: where and when that part ran."""
    part = section(recording, key)
    return recording_label(part) if part else f"(no '{key}' section in mhc_lab/recorded/{RECORDING}.json)"


def _ms(value, unit: str = "") -> str:
    return f"{value:.2f}{unit}" if isinstance(value, (int, float)) else "-"


def site_table(site: dict | None) -> str:
    """One site (pre + post, F = identity), forward + backward: ms per implementation. First the GPU's time (each
    site captured as a CUDA graph and replayed), then the time launched op by op from Python, which adds whatever
    host work outlasts the kernels. The ratio and the share of copy speed are those of the chained site, what a
    stack of MHCConnections runs."""
    rows = (site or {}).get("shapes") or []
    if not rows:
        return "(no site measurements)"
    copy = site.get("copy_gbps")
    tables = []
    for key, title in (("graph_ms", "GPU time (CUDA graph replay):"), ("launched_ms", "launched op by op:")):
        names = [k for k in SITE_IMPLEMENTATIONS if any(k in (r.get(key) or {}) for r in rows)]
        if not names:
            continue
        lines = [title, f"{'tokens':>7}{'C':>6}{'n':>3}" + "".join(f"{SITE_IMPLEMENTATIONS[k]:>20}" for k in names)
                 + f"{'chained vs TK':>15}{'chained, 41C at':>18}"]
        for r in rows:
            times = r.get(key) or {}
            ours, tk = times.get("ours_chained"), times.get("tilekernels")
            number = isinstance(ours, (int, float)) and ours > 0
            ratio = f"{ours / tk:.2f}x" if number and isinstance(tk, (int, float)) and tk > 0 else "-"
            least = (r.get("bytes") or {}).get("least")
            fraction = f"{least / (ours * 1e-3) / 1e9 / copy:.0%} of copy" if number and least and copy else "-"
            lines.append(f"{r.get('tokens', '?'):>7}{r.get('C', '?'):>6}{r.get('n', 4):>3}"
                         + "".join(f"{_ms(times.get(k), ' ms'):>20}" for k in names) + f"{ratio:>15}{fraction:>18}")
        tables.append("\n".join(lines))
    rounds = [(r, r["chained_vs_tilekernels_graph_rounds"]) for r in rows
              if r.get("chained_vs_tilekernels_graph_rounds")]
    if rounds:
        tables.append("chained / TileKernels as CUDA graphs, interleaved rounds:\n" + "\n".join(
            f"{r['tokens']:>7}{r['C']:>6}   median {q['median']:.3f}x over {len(q['ratios'])} rounds "
            f"({q['least']:.3f}x to {q['most']:.3f}x)" for r, q in rounds))
    return "\n\n".join(tables)


def _median(values) -> float | None:
    return statistics.median(values) if values else None


def block_table(block: dict | None) -> str:
    """A transformer block, forward + backward, per width: each kind's median time over the interleaved rounds,
    launched and as a CUDA graph, its overhead over the plain residual round by round (median, least to most),
    and its peak memory."""
    widths = (block or {}).get("widths") or []
    if not widths:
        return "(no block measurements)"
    lines = []
    for r in widths:
        lines.append(f"C = {r['C']}, {r['tokens']} tokens{'':6}{'launched':>10}{'overhead':>10}{'as graph':>11}"
                     f"{'overhead':>10}{'peak':>11}")
        for kind, label in BLOCK_IMPLEMENTATIONS.items():
            cells = []
            for mode in ("launched", "graph"):
                m = r.get(mode) or {}
                ms = _median((m.get("rounds_ms") or {}).get(kind))
                o = (m.get("overhead_pct") or {}).get(kind)
                cells += [_ms(ms, " ms"), f"{o['median']:+.1f}%" if o else ""]
            peak = (r.get("peak_gib") or {}).get(kind)
            if all(c in ("-", "") for c in cells) and peak is None:
                why = (r.get("errors") or {}).get(kind)
                if why:
                    lines.append(f"  {label:<27} not measured: {why[:60]}")
                continue
            lines.append(f"  {label:<27}{cells[0]:>10}{cells[1]:>10}{cells[2]:>11}{cells[3]:>10}"
                         f"{_ms(peak, ' GiB'):>11}")
        rounds = {mode: len(next(iter((r.get(mode) or {}).get("rounds_ms", {}).values()), []))
                  for mode in ("launched", "graph")}
        lines.append(f"  (medians of {rounds['launched']} rounds launched, {rounds['graph']} as graphs; overheads "
                     "taken round by round)")
    return "\n".join(lines)


def block_overheads(block: dict | None, mode: str = "launched") -> dict:
    """{C: {kind: (median, least, most) percent over the plain residual}} of one mode (launched or graph)."""
    return {r["C"]: {k: (o["median"], o["least"], o["most"]) for k, o in ((r.get(mode) or {}).get("overhead_pct")
                                                                           or {}).items()}
            for r in (block or {}).get("widths") or []}


def block_figure(block: dict | None, label: str):
    """Each kind's median overhead over the plain residual per width, launched and as CUDA graphs (bars), with the
    paper's 6.7%."""
    import plotly.graph_objects as go

    fig = go.Figure()
    for mode, pattern in (("launched", ""), ("graph", "/")):
        found = block_overheads(block, mode)
        for kind in (k for k in BLOCK_IMPLEMENTATIONS if k != "residual"):
            xs = [f"C = {C}" for C, kinds in found.items() if kind in kinds]
            ys = [kinds[kind][0] for kinds in found.values() if kind in kinds]
            if xs:
                fig.add_bar(x=xs, y=ys, name=f"{BLOCK_IMPLEMENTATIONS[kind]} ({mode})", text=[f"{y:+.1f}%" for y in ys],
                            marker_pattern_shape=pattern)
    fig.add_hline(y=PAPER_OVERHEAD_PCT, line_dash="dash", annotation_text=f"paper: +{PAPER_OVERHEAD_PCT}% (n = 4)")
    fig.update_layout(title=f"Transformer block, forward + backward: over the plain residual<br><sup>{label}</sup>",
                      height=450, yaxis_title="extra time over the plain residual (%)", barmode="group")
    return fig


# What each of the chained block's own kernels does, by its name in the profiler (mhc_lab.kernels; docs/kernels.md
# has each one's plan): the names the tables print.
KERNEL_NAMES = {
    "lanes_backward_cuda_post_grad_kernel": "pre backward 2: dx, dphi",
    "post_backward_without_dx_kernel": "post backward",
    "post_project_cuda_kernel": "post + next projection",
    "mix_lanes_kernel": "pre apply: lane mix",
    "post_cuda_kernel": "post (the last site)",
    "dpre_reduce_kernel": "pre backward 1: dH_pre stream",
    "project_kernel": "pre projection (the first site)",
    "coefficients_backward_tokens_kernel": "pre backward 1: per token",
    "pre_backward_sums_kernel": "pre backward: parameter sums",
    "token_coefficients_kernel": "pre apply: coefficients",
    "phi_split_kernel": "phi into bf16 hi + lo",
}


def kernel_label(name: str) -> str:
    """A profiler's kernel name for the tables: what it does (KERNEL_NAMES) where known; else ours without the
    "_kernel" suffix, PyTorch's by its function name."""
    if name in KERNEL_NAMES:
        return KERNEL_NAMES[name]
    if name.startswith("void at::native::"):
        return "torch " + name[len("void at::native::"):].split("<")[0]
    return name.removesuffix("_kernel")


def _entries(block_kernels: dict | None, kind: str) -> list[dict]:
    return [e for e in (block_kernels or {}).get("widths") or [] if e.get("kind") == kind]


def block_breakdown_table(block_kernels: dict | None, kind: str = "mhc_ours", top: int = 4) -> str:
    """The block breakdown per width: the plain block, the ``kind`` block and its connections alone (identity
    layers): wall time per step, kernel time, the rest (the GPU idle), launches; then the ``kind`` block's own
    kernels that take longest beside the layers against the same kernels without them."""
    lines = []
    for r in _entries(block_kernels, kind):
        lines.append(f"C = {r['C']}, {r['tokens']} tokens{'':14}{'wall ms':>9}{'kernels':>9}{'idle':>7}"
                     f"{'launches':>10}")
        for key, label in (("residual_block", "plain residual"), ("kind_block", BLOCK_IMPLEMENTATIONS[kind]),
                           ("kind_without_layers", "  its connections alone")):
            row = r[key]
            lines.append(f"  {label:<35}{row['wall_ms']:>9.2f}{row['kernel_ms']:>9.2f}{row['idle_ms']:>7.2f}"
                         f"{row['launches']:>10.0f}")
        c, a = r["comparison"], r["own_against_alone"]
        lines.append(f"  the kernels both blocks launch: {c['shared_base_ms']:.2f} ms plain, "
                     f"{c['shared_other_ms']:.2f} with mHC; mHC's own {c['only_other_ms']:.2f} ms")
        lines.append(f"  mHC's own kernels: {a['shared_other_ms']:.3f} ms in the block, {a['shared_base_ms']:.3f} with "
                     "identity layers; the largest differences:")
        for d in a["largest_differences"][:top]:
            lines.append(f"    {kernel_label(d['kernel'])[:38]:<38}{d['other_ms']:>7.3f} in the block "
                         f"{d['base_ms']:>7.3f} without layers ({d['other_ms'] / d['base_ms']:.2f}x)")
    return "\n".join(lines) if lines else f"(no block breakdown of {kind} recorded)"


# lane-wide elements per token (units of C, read + written) that each of the chained block's own kernels moves per
# launch at n = 4 (bytes_model's rows of our chained kernels; kernel 2 and the post backward with the post's
# gradient handed to the pre), by the kernel's name in the profiler
CHAINED_KERNEL_ELEMENTS = {"lanes_backward_cuda_post_grad_kernel": 13, "post_backward_without_dx_kernel": 10,
                           "post_project_cuda_kernel": 9, "post_cuda_kernel": 9, "mix_lanes_kernel": 5,
                           "dpre_reduce_kernel": 5, "project_kernel": 4}
COPY_KERNEL = "Memcpy DtoD (Device -> Device)"


def floor_kernel_rows(block_kernels: dict | None) -> list[dict]:
    """Per width: the copy floor's copies (ms, lane-wide elements per token, their pace in the block in TB/s) and
    each of the chained block's own kernels, longest first: time per step, launches, the lane-wide elements per
    token it moves per launch (CHAINED_KERNEL_ELEMENTS; 0 for the small ones), that many bytes at the copies' pace
    (ms), and the rest ("beyond")."""
    floors = {e["C"]: e for e in _entries(block_kernels, "copy_floor")}
    out = []
    for chained in _entries(block_kernels, "mhc_ours"):
        C, tokens, floor = chained["C"], chained["tokens"], floors.get(chained["C"])
        if not floor or COPY_KERNEL not in floor["kind_block"]["kernels"]:
            continue
        copies = floor["kind_block"]["kernels"][COPY_KERNEL]["ms"]
        moved = sum(copy_floor_counts(copy_floor_plan(4)))
        pace = moved * C * 2 * tokens / (copies * 1e-3) / 1e12  # TB/s
        plain = chained["residual_block"]["kernels"]
        kernels = []
        for name, v in sorted(((k, v) for k, v in chained["kind_block"]["kernels"].items() if k not in plain),
                              key=lambda kv: -kv[1]["ms"]):
            elements = CHAINED_KERNEL_ELEMENTS.get(name, 0)
            at_pace = elements * v["launches"] * C * 2 * tokens / (pace * 1e12) * 1e3
            kernels.append({"kernel": name, "ms": v["ms"], "launches": v["launches"], "elements": elements,
                            "at_pace_ms": at_pace, "beyond_ms": v["ms"] - at_pace})
        out.append({"C": C, "tokens": tokens, "copies_ms": copies, "moved": moved, "pace_tbs": pace,
                    "kernels": kernels})
    return out


def floor_kernels_table(block_kernels: dict | None) -> str:
    """Per width: the copy floor's copies (their pace in the block), then each of the chained block's own kernels:
    time per step, launches, the lane-wide elements per token it moves (none for the small ones), that many bytes
    at the copies' pace, and the rest."""
    lines = []
    for w in floor_kernel_rows(block_kernels):
        lines.append(f"C = {w['C']}, {w['tokens']} tokens: the copy floor's copies {w['copies_ms']:.3f} ms for "
                     f"{w['moved']}C per token ({w['pace_tbs']:.2f} TB/s in the block)")
        head = "the chained block's own kernels"
        lines.append(f"  {head:<38}{'ms':>7}{'launches':>9}{'moves':>7}{'at that pace':>13}{'beyond':>8}")
        for k in w["kernels"]:
            moves = f"{k['elements']}C" if k["elements"] else "-"
            lines.append(f"  {kernel_label(k['kernel'])[:38]:<38}{k['ms']:>7.3f}{k['launches']:>9.0f}{moves:>7}"
                         f"{k['at_pace_ms']:>13.3f}{k['beyond_ms']:>8.3f}")
        total, beyond = sum(k["ms"] for k in w["kernels"]), sum(k["beyond_ms"] for k in w["kernels"])
        lines.append(f"  {'all':<38}{total:>7.3f}{'':>9}{'':>7}{total - beyond:>13.3f}{beyond:>8.3f}")
    return "\n".join(lines) if lines else "(no copy floor breakdown recorded)"


AT_PACE = 0.10  # a kernel within this share of its time of its bytes at the copies' pace streams at that pace


def floor_kernels_reading(block_kernels: dict | None, at_pace: float = AT_PACE) -> str:
    """floor_kernels_table in words, per width: which of the chained block's own kernels that move lane-wide
    bytes run at the copies' pace (their "beyond" within ``at_pace`` of their time), which run above it and by
    how much, and what the small kernels, which move no lane-wide bytes, take together."""
    lines = []
    for w in floor_kernel_rows(block_kernels):
        moving = [k for k in w["kernels"] if k["elements"]]
        near = [kernel_label(k["kernel"]) for k in moving if k["beyond_ms"] <= at_pace * k["ms"]]
        above = [f"{kernel_label(k['kernel'])} (+{k['beyond_ms']:.3f} ms, {k['beyond_ms'] / k['ms']:.0%} of its time)"
                 for k in moving if k["beyond_ms"] > at_pace * k["ms"]]
        small = sum(k["ms"] for k in w["kernels"] if not k["elements"])
        lines.append(f"C = {w['C']}: at their bytes' pace (within {at_pace:.0%}): {', '.join(near) or 'none'}; "
                     f"above it: {', '.join(above) or 'none'}; the small kernels, no lane-wide bytes: {small:.3f} ms")
    return "\n".join(lines) if lines else "(no copy floor breakdown recorded)"


def breakdown_reading(block_kernels: dict | None, kind: str = "mhc_ours") -> str:
    """Per width, the ``kind`` step's extra wall time over the plain step, split: the kind's own kernels, the plain
    block's own (its residual adds, which mHC replaces), the kernels both launch, and the GPU's idle time."""
    lines = []
    for r in _entries(block_kernels, kind):
        plain, other, c = r["residual_block"], r["kind_block"], r["comparison"]
        lines.append(f"C = {r['C']}: the {BLOCK_IMPLEMENTATIONS[kind]} step is "
                     f"{other['wall_ms'] - plain['wall_ms']:.2f} ms longer than the plain one: mHC's own kernels "
                     f"+{c['only_other_ms']:.2f} ms, the plain "
                     f"block's own (its residual adds) -{c['only_base_ms']:.2f} ms, the kernels both launch "
                     f"{c['shared_other_ms'] - c['shared_base_ms']:+.2f} ms, the GPU's idle time "
                     f"{other['idle_ms'] - plain['idle_ms']:+.2f} ms")
    return "\n".join(lines) if lines else f"(no block breakdown of {kind} recorded)"


def clocks_reading(site: dict | None, block: dict | None) -> str:
    """How far apart the two clocks are: the largest relative difference between launched and CUDA graph time,
    over every implementation and shape of the site, and over every kind and width of the block (medians)."""
    def farthest(pairs):
        return max(pairs, default=None, key=lambda p: abs(p[0] / p[1] - 1))

    sites = [(r["launched_ms"][k], r["graph_ms"][k], SITE_IMPLEMENTATIONS[k], f"{r['tokens']} x {r['C']}")
             for r in (site or {}).get("shapes") or [] for k in SITE_IMPLEMENTATIONS
             if k in (r.get("launched_ms") or {}) and k in (r.get("graph_ms") or {})]
    blocks = []
    for r in (block or {}).get("widths") or []:
        launched, graph = ((r.get(mode) or {}).get("rounds_ms") or {} for mode in ("launched", "graph"))
        blocks += [(_median(launched[k]), _median(graph[k]), BLOCK_IMPLEMENTATIONS.get(k, k), f"C = {r['C']}")
                   for k in launched if launched[k] and graph.get(k)]
    lines = []
    for what, pairs in (("every site", sites), ("every block", blocks)):
        worst = farthest(pairs)
        if worst:
            lines.append(f"launched against as a CUDA graph, {what}: at most {abs(worst[0] / worst[1] - 1):.1%} apart "
                         f"({worst[2]}, {worst[3]}: {worst[0]:.2f} against {worst[1]:.2f} ms)")
    return "\n".join(lines) if lines else "(no timings on both clocks)"


def floor_inputs(recording: dict | None = None) -> dict | None:
    """What lab 07's first overhead floor needs from the recording: the site part's copy bandwidth (GB/s) and the
    plain residual block's median launched time per width ({C: ms}); None without both."""
    recording = recording if recording is not None else load_recorded()
    site, block = section(recording, "site"), section(recording, "block")
    if not site or not block:
        return None
    plain = {r["C"]: _median(r["launched"]["rounds_ms"].get("residual")) for r in block["widths"]}
    return {"copy_gbps": site["copy_gbps"], "tokens": block["widths"][0]["tokens"],
            "block_ms": {C: ms for C, ms in sorted(plain.items(), reverse=True) if ms}}


def measure_live(site_shapes: Sequence[tuple[int, int]], block_widths: Sequence[int], *, compile: bool = False,
                 repeat_ms: int = 100, block_rounds: int = 2, log=print) -> dict:
    """The training benchmark's own functions (mhc_lab.bench) on this CUDA GPU: one site for each (tokens, C) in
    ``site_shapes``, one transformer block for each width in ``block_rounds`` interleaved rounds, each timing
    about ``repeat_ms``. torch.compile only with ``compile`` (minutes of compiling per shape; the recording has
    it). {"device", "skipped", "compile_seconds" (building the site's kernels before any clock starts), "site",
    "block"}: the last two as the recording's sections."""
    import importlib.util

    from mhc_lab.bench.block import bench_block
    from mhc_lab.bench.common import compile_pass, copy_bandwidth, gpu_timer
    from mhc_lab.bench.site import bench_site

    timer, _ = gpu_timer()

    def bench(fn, warmup_ms=None, rep_ms=None):
        return timer(fn, warmup_ms=max(5, repeat_ms // 4), rep_ms=repeat_ms)

    skip = set() if compile else {"compile"}
    if importlib.util.find_spec("tile_kernels") is None:
        skip.add("tilekernels")
    quiet = lambda *args, **kwargs: None  # noqa: E731
    compile_seconds = compile_pass(lambda shape, once: bench_site(*shape, once, skip=skip, graph_rounds=1, log=quiet),
                                   list(site_shapes))
    copy = copy_bandwidth(bench)
    site = {"copy_gbps": copy, "shapes": []}
    for tokens, C in site_shapes:
        site["shapes"].append(bench_site(tokens, C, bench, skip=skip, log=log))
        torch.cuda.empty_cache()
    block = {"copy_gbps": copy, "widths": [bench_block(width, bench, skip=skip, rounds=block_rounds, log=log)
                                           for width in block_widths]}
    return {"device": torch.cuda.get_device_name(), "skipped": sorted(skip), "compile_seconds": compile_seconds,
            "site": site, "block": block}
