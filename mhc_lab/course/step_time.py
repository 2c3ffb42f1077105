"""Lab 08 (where a training step's time goes): the H200 case study, read from the recordings that
``python -m mhc_lab.bench training`` and ``python -m mhc_lab.bench forward`` write (mhc_lab/recorded/
training_h200.json and forward_h200.json), and, on a CUDA GPU, the two clocks of a plain block measured live.
The training loop's stack of layers is mhc_lab.course.stack_clocks.

    load_recorded()                                    both recordings, {"training": ..., "forward": ...}
    copy_floor_overhead(read_C, written_C, ...)        exercise 8.1: the copy floor's extra time and overhead
    host_share(launched_ms, graph_ms)                  exercise 8.2: the host's share of a launched step
    instruction_bound(alone_ms, block_ms, threshold)   exercise 8.4: slowed beside the layers' GEMMs or not
    host_per_site(launched_ms, gpu_ms, plain_launched_ms, plain_gpu_ms, layers)
                                                       exercise 8.3: what the host adds per site, host-bound or not
    floor_table, site_clocks_table, step_profile_table, power_cap_table, bytes_table
                                                       the lab's tables, each with a reading printed from its data

Every figure a table shows is read from the recording it is given (or from a live measurement); the tables
label nothing themselves: the lab prints each section's recording_label beside it.
"""

from __future__ import annotations

import statistics

import torch

from mhc_lab.bench.common import N
from mhc_lab.bench.copy_floor import copy_floor_counts, copy_floor_plan
from mhc_lab.course.training_recorded import (
    BLOCK_IMPLEMENTATIONS, CHAINED_KERNEL_ELEMENTS, SITE_IMPLEMENTATIONS, kernel_label,
)
from mhc_lab.measure import bytes_model, recorded_or_none, recording_label

RECORDINGS = {"training": "training_h200", "forward": "forward_h200"}
# Kernels shorter than this per step are listed but not read: a few microseconds move by tens of percent
# between two profiles.
TOO_SHORT_MS = 0.01
# The share of the copy's pace at which a kernel counts as streaming at its bytes' pace (the course's target
# for a site, lab 06).
NEAR_COPY = 0.85


# ---- the recordings ------------------------------------------------------------------------------------------


def load_recorded() -> dict:
    """{"training": the training recording or None, "forward": the forward recording or None}."""
    return {key: recorded_or_none(name) for key, name in RECORDINGS.items()}


def section(recorded: dict | None, recording: str, key: str) -> dict | None:
    """One section of one recording: section(recorded, "training", "block"), (..., "forward", "sites")."""
    return (((recorded or {}).get(recording) or {}).get("results") or {}).get(key)


def section_label(recorded: dict | None, recording: str, key: str) -> str:
    """Where and when that section was measured (its recording_label)."""
    part = section(recorded, recording, key)
    if not part:
        return f"(no '{key}' section in mhc_lab/recorded/{RECORDINGS[recording]}.json)"
    return f"{recording_label(part)}; made by `{part.get('command', '?')}`"


def _median(values) -> float | None:
    return statistics.median(values) if values else None


def kernel_name(name: str) -> str:
    """A kernel's name for the tables: what it does where known (training_recorded.KERNEL_NAMES), else the
    profiler's name, short."""
    if "FillFunctor" in name:
        return "torch: a fill"
    return kernel_label(name)


# ---- the exercises' reference solutions ----------------------------------------------------------------------


def copy_floor_overhead(read_C, written_C, C, tokens, copy_gbps, block_ms, itemsize=2):
    """Exercise 8.1. The least extra time of a step whose extra work is ``read_C`` C-wide elements read and
    ``written_C`` written per token (``itemsize`` bytes each), moved at a copy's pace of ``copy_gbps`` GB/s
    (10^9 bytes read plus written per second), for ``tokens`` tokens: (extra ms, overhead over a block of
    ``block_ms`` in percent)."""
    moved = (read_C + written_C) * C * itemsize * tokens  # bytes read + written
    extra_ms = moved / (copy_gbps * 1e9) * 1e3
    return extra_ms, 100.0 * extra_ms / block_ms


def host_share(launched_ms: torch.Tensor, graph_ms: torch.Tensor) -> torch.Tensor:
    """Exercise 8.2. The fraction of a launched step that its GPU work (the CUDA graph's time) does not explain:
    (launched - graph) / launched, and 0 where the launched step reads shorter than its graph."""
    return torch.clamp(launched_ms - graph_ms, min=0) / launched_ms


def instruction_bound(alone_ms: torch.Tensor, block_ms: torch.Tensor, threshold: float) -> torch.Tensor:
    """Exercise 8.4. True where a kernel runs slower in the block than with identity layers by more than
    ``threshold`` (a fraction: 0.03 is 3%): block_ms / alone_ms - 1 > threshold."""
    return block_ms / alone_ms - 1 > threshold


def host_per_site(launched_ms, gpu_ms, plain_launched_ms, plain_gpu_ms, layers):
    """Exercise 8.3. What each of a stack's ``layers`` mHC sites adds to its launched step beyond its kernels' GPU
    time, in ms: the launched step's growth over the plain residual's, less its GPU time's growth, over the sites
    (negative where the sites' kernels ran in time the plain step's GPU spent waiting); and whether the launched
    step is host-bound: its GPU waits for the host (launched - GPU time) for more than half of it."""
    host_ms = ((launched_ms - plain_launched_ms) - (gpu_ms - plain_gpu_ms)) / layers
    return host_ms, launched_ms - gpu_ms > launched_ms / 2


# ---- section 1: the copy floor of a block ----------------------------------------------------------------------


def floor_elements(n: int = N) -> tuple[int, int]:
    """(read, written) C-wide elements per token of the copy floor's copies for a block's two chained sites:
    copy_floor_plan's counts, each copy reading half of what it moves and writing the other half."""
    moved = sum(copy_floor_counts(copy_floor_plan(n)))
    return moved // 2, moved - moved // 2


def _overhead_cell(o: dict | None) -> str:
    if not o:
        return "-"
    return f"{o['median']:+.1f}% ({o['least']:+.1f} to {o['most']:+.1f})"


def floor_rows(block: dict | None, copy_gbps: float | None = None) -> list[dict]:
    """Per width of a block section: the plain block's median time, the copy floor computed from its bytes
    (floor_elements at the section's copy bandwidth), and each kind's median overhead, launched and as graphs."""
    rows = []
    copy = copy_gbps or (block or {}).get("copy_gbps")
    read, written = floor_elements()
    for r in (block or {}).get("widths") or []:
        row = {"C": r["C"], "tokens": r["tokens"], "batch": r.get("batch"), "seq": r.get("seq"), "modes": {}}
        for mode in ("launched", "graph"):
            m = r.get(mode) or {}
            plain = _median((m.get("rounds_ms") or {}).get("residual"))
            if plain is None:
                continue
            extra, pct = copy_floor_overhead(read, written, r["C"], r["tokens"], copy, plain)
            row["modes"][mode] = {"plain_ms": plain, "bytes_ms": extra, "bytes_pct": pct,
                                  "overhead": m.get("overhead_pct") or {}}
        rows.append(row)
    return rows


def floor_table(block: dict | None) -> str:
    """Table 1: per width, the plain block, the copy floor from its bytes, the copy floor measured, and mHC's
    kinds, as median overheads (least to most over the rounds), launched and as CUDA graphs."""
    rows = floor_rows(block)
    if not rows:
        return "(no block measurements)"
    read, written = floor_elements()
    copy = block.get("copy_gbps")
    lines = []
    for row in rows:
        modes = row["modes"]
        lines.append(f"C = {row['C']}, {row['tokens']} tokens, forward + backward  {'launched':>26}"
                     f"{'as a CUDA graph':>28}")

        def line(label, cells):
            lines.append(f"  {label:<44}" + "".join(f"{c:>28}" for c in cells))

        line("plain residual block", [f"{modes[m]['plain_ms']:.2f} ms" if m in modes else "-"
                                      for m in ("launched", "graph")])
        line(f"copy floor from its bytes ({read + written}C at {copy:.0f} GB/s)",
             [f"{modes[m]['bytes_pct']:+.1f}% ({modes[m]['bytes_ms']:.2f} ms)" if m in modes else "-"
              for m in ("launched", "graph")])
        for kind in ("copy_floor", "mhc_ours", "mhc_ours_recompute", "mhc_tilekernels"):
            cells = [_overhead_cell(modes.get(m, {}).get("overhead", {}).get(kind)) for m in ("launched", "graph")]
            if all(c == "-" for c in cells):
                continue
            label = "copy floor, measured (copies in the block)" if kind == "copy_floor" \
                else BLOCK_IMPLEMENTATIONS[kind]
            line(label, cells)
            if kind == "mhc_ours":
                above = []
                for m in ("launched", "graph"):
                    o = modes.get(m, {}).get("overhead", {})
                    above.append(f"{o['mhc_ours']['median'] - o['copy_floor']['median']:+.1f} points"
                                 if "mhc_ours" in o and "copy_floor" in o else "-")
                line("  ours above the measured floor", above)
    lines.append("(overheads over the plain block: median of the rounds, least to most in brackets)")
    return "\n".join(lines)


def floor_reading(block: dict | None) -> str:
    """A line per width: how far the chained block sits above the measured floor, as GPU time (graphs)."""
    out = []
    for row in floor_rows(block):
        o = row["modes"].get("graph", {}).get("overhead", {})
        if "mhc_ours" in o and "copy_floor" in o:
            plain = row["modes"]["graph"]["plain_ms"]
            points = o["mhc_ours"]["median"] - o["copy_floor"]["median"]
            out.append(f"C = {row['C']}: as GPU time the chained block is {points:+.1f} points above the measured "
                       f"floor, about {points / 100 * plain:.2f} ms per step beyond its bytes at the copy's pace")
    return "\n".join(out)


# ---- section 2: two clocks -------------------------------------------------------------------------------------


def site_clocks(site: dict | None) -> list[dict]:
    """Per shape of a site section and implementation timed both ways: launched ms, graph ms, host share."""
    rows = []
    for r in (site or {}).get("shapes") or []:
        launched, graph = r.get("launched_ms") or {}, r.get("graph_ms") or {}
        for name in (k for k in SITE_IMPLEMENTATIONS if k in launched and k in graph):
            share = float(host_share(torch.tensor(launched[name]), torch.tensor(graph[name])))
            rows.append({"tokens": r["tokens"], "C": r["C"], "name": name, "launched_ms": launched[name],
                         "graph_ms": graph[name], "host_share": share})
    return rows


def site_clocks_table(site: dict | None) -> str:
    """Table 2: one site's forward + backward launched op by op and as a CUDA graph, and the host's share of the
    launched step (the part its GPU work does not explain)."""
    rows = site_clocks(site)
    if not rows:
        return "(no site measurements)"
    lines = [f"{'tokens x C':<14}{'implementation':<22}{'launched':>11}{'as a graph':>12}{'host share':>12}"]
    last = None
    for r in rows:
        shape = f"{r['tokens']} x {r['C']}"
        lines.append(f"{shape if shape != last else '':<14}{SITE_IMPLEMENTATIONS[r['name']]:<22}"
                     f"{r['launched_ms']:>8.2f} ms{r['graph_ms']:>9.2f} ms{r['host_share']:>12.0%}")
        last = shape
    return "\n".join(lines)


def block_clocks(block: dict | None) -> list[dict]:
    """Per width and kind of a block section: median launched and graph ms and the host share of the launched
    step."""
    rows = []
    for r in (block or {}).get("widths") or []:
        launched = (r.get("launched") or {}).get("rounds_ms") or {}
        graph = (r.get("graph") or {}).get("rounds_ms") or {}
        for kind in (k for k in BLOCK_IMPLEMENTATIONS if k in launched and k in graph):
            lm, gm = _median(launched[kind]), _median(graph[kind])
            rows.append({"C": r["C"], "tokens": r["tokens"], "kind": kind, "launched_ms": lm, "graph_ms": gm,
                         "host_share": float(host_share(torch.tensor(lm), torch.tensor(gm)))})
    return rows


def step_profile_table(block_kernels: dict | None) -> str:
    """Table 3: one launched step profiled kernel by kernel, per width: the plain block beside the copy floor
    and beside the chained mHC block (each pair profiled together): wall time, kernel time, the rest (the GPU
    idle), launches; and what each adds to the plain step."""
    entries = (block_kernels or {}).get("widths") or []
    if not entries:
        return "(no block breakdown recorded)"
    lines = []
    for C in sorted({e["C"] for e in entries}):
        lines.append(f"C = {C}, {entries[0]['tokens']} tokens: one launched step, profiled")
        lines.append(f"  {'':<38}{'wall':>9}{'kernels':>11}{'idle':>9}{'launches':>10}")
        for e in (e for e in entries if e["C"] == C):
            plain, other = e["residual_block"], e["kind_block"]
            for label, row in (("plain residual", plain), (BLOCK_IMPLEMENTATIONS[e["kind"]], other)):
                lines.append(f"  {label:<38}{row['wall_ms']:>6.2f} ms{row['kernel_ms']:>8.2f} ms"
                             f"{row['idle_ms']:>6.2f} ms{row['launches']:>10.0f}")
            lines.append(f"    added to the plain step: kernels {other['kernel_ms'] - plain['kernel_ms']:+.2f} ms, "
                         f"wall {other['wall_ms'] - plain['wall_ms']:+.2f} ms, idle "
                         f"{other['idle_ms'] - plain['idle_ms']:+.2f} ms")
    return "\n".join(lines)


def profile_reading(block_kernels: dict | None) -> str:
    """A line per profiled pair: whether the idle time shrank (the added kernels ran where the plain step's GPU
    waited) or grew (they ran beside none of those waits, and the wall grew by more than the kernels)."""
    out = []
    for e in (block_kernels or {}).get("widths") or []:
        plain, other = e["residual_block"], e["kind_block"]
        idle = other["idle_ms"] - plain["idle_ms"]
        verdict = (f"shrank by {-idle:.2f} ms: part of the added kernels ran where the plain step's GPU waited"
                   if idle < 0 else f"grew by {idle:.2f} ms: the added kernels filled none of the plain step's "
                   "waits, and the wall grew by more than the kernels")
        out.append(f"C = {e['C']}, {BLOCK_IMPLEMENTATIONS[e['kind']]}: the idle time {verdict}")
    return "\n".join(out)


def clocks_reading(block: dict | None) -> str:
    """A line per width and kind: whether its launched overhead reads below its graph overhead, and by how much
    against the rounds' spread."""
    out = []
    for r in (block or {}).get("widths") or []:
        launched = (r.get("launched") or {}).get("overhead_pct") or {}
        graph = (r.get("graph") or {}).get("overhead_pct") or {}
        for kind in ("copy_floor", "mhc_ours"):
            if kind not in launched or kind not in graph:
                continue
            lo, go = launched[kind], graph[kind]
            gap = go["median"] - lo["median"]
            apart = lo["most"] < go["least"] or go["most"] < lo["least"]
            verdict = ("lower launched" if gap > 0 else "higher launched") + (
                ", the rounds' ranges apart" if apart else ", within the rounds' ranges")
            out.append(f"C = {r['C']}, {BLOCK_IMPLEMENTATIONS[kind]}: launched {lo['median']:+.1f}%, as a graph "
                       f"{go['median']:+.1f}%: {abs(gap):.1f} points {verdict}")
    return "\n".join(out)


# ---- section 3: the power cap ----------------------------------------------------------------------------------


def repeatability(entry: dict, least_ms: float = 0.1) -> float:
    """The largest relative change, between the plain block and the other block of one profile, of a kernel
    both launch (those of at least ``least_ms`` per step): the same kernel in the same conditions, so what one
    profile's time moves by without any cause."""
    base, other = entry["residual_block"]["kernels"], entry["kind_block"]["kernels"]
    changes = [abs(other[k]["ms"] / base[k]["ms"] - 1) for k in base if k in other and base[k]["ms"] >= least_ms]
    return max(changes) if changes else 0.0


def own_kernels(entry: dict) -> list[dict]:
    """The chained block's own kernels (those the plain block does not launch), longest first: per step in the
    block, with identity layers, their launches and the ratio."""
    plain = entry["residual_block"]["kernels"]
    alone = entry["kind_without_layers"]["kernels"]
    rows = []
    for name, v in entry["kind_block"]["kernels"].items():
        if name in plain or name not in alone:
            continue
        rows.append({"kernel": name, "block_ms": v["ms"], "alone_ms": alone[name]["ms"], "launches": v["launches"],
                     "ratio": v["ms"] / alone[name]["ms"]})
    return sorted(rows, key=lambda r: -r["block_ms"])


def power_cap_rows(block_kernels: dict | None) -> list[dict]:
    """Per width, the chained block's own kernels with the verdict of exercise 8.4 at that profile's
    repeatability: {"C", "threshold", "kernels": [... "verdict"]}."""
    out = []
    for entry in ((block_kernels or {}).get("widths") or []):
        if entry.get("kind") != "mhc_ours":
            continue
        threshold = repeatability(entry)
        kernels = own_kernels(entry)
        if kernels:
            flags = instruction_bound(torch.tensor([k["alone_ms"] for k in kernels], dtype=torch.float64),
                                      torch.tensor([k["block_ms"] for k in kernels], dtype=torch.float64), threshold)
            for k, flag in zip(kernels, flags.tolist()):
                k["verdict"] = ("too short to read" if k["alone_ms"] < TOO_SHORT_MS else
                                "slowed: instruction-bound" if flag else "unchanged: memory-bound")
        out.append({"C": entry["C"], "tokens": entry["tokens"], "threshold": threshold, "kernels": kernels})
    return out


def power_cap_table(block_kernels: dict | None) -> str:
    """Table 4: each of the chained block's own kernels per step with identity layers (no GEMMs: the SM clock
    high) and in the block (beside the GEMMs, at the power cap), their ratio and exercise 8.4's verdict."""
    rows = power_cap_rows(block_kernels)
    if not rows:
        return "(no block breakdown of the chained block recorded)"
    lines = []
    for r in rows:
        lines.append(f"C = {r['C']}, {r['tokens']} tokens: threshold {r['threshold']:.1%} (the largest change of a "
                     "kernel both blocks launch)")
        lines.append(f"  {'kernel':<36}{'identity layers':>16}{'in the block':>14}{'ratio':>8}   verdict")
        for k in r["kernels"]:
            lines.append(f"  {kernel_name(k['kernel'])[:36]:<36}{k['alone_ms']:>13.3f} ms{k['block_ms']:>11.3f} ms"
                         f"{k['ratio']:>7.3f}x   {k['verdict']}")
    return "\n".join(lines)


def power_cap_reading(block_kernels: dict | None) -> str:
    """mHC's own kernels grouped by the widths at which the power cap slowed them (exercise 8.4's verdict)."""
    rows = power_cap_rows(block_kernels)
    widths = [r["C"] for r in rows]
    slowed_at: dict[str, list[int]] = {}
    for r in rows:
        for k in r["kernels"]:
            if k["verdict"] != "too short to read":
                slowed_at.setdefault(kernel_name(k["kernel"]), [])
                if k["verdict"].startswith("slowed"):
                    slowed_at[kernel_name(k["kernel"])].append(r["C"])
    groups: dict[str, list[str]] = {}
    for name, at in slowed_at.items():
        where = ("at every width" if at == widths else "at no width" if not at
                 else "at C = " + " and ".join(str(C) for C in at) + " only")
        groups.setdefault(where, []).append(name)
    order = ["at every width"] + sorted(w for w in groups if w.endswith("only")) + ["at no width"]
    return "\n".join(f"slowed {where}: {'; '.join(groups[where])}" for where in order if where in groups)


# ---- section 4: bytes against instructions ---------------------------------------------------------------------

# Our forward kernels alone (the forward recording's kernel_ms keys), with the C-wide elements per token each
# moves as bytes_model counts our kernels: (label, key, implementation, row of bytes_model.rows(..., "forward")).
FORWARD_KERNELS = (
    ("post", "post", "ours", 2),
    ("pre: projection pass", "pre.project", "ours", 0),
    ("pre: apply pass (coefficients, lane mix)", "pre.apply", "ours", 1),
    ("chained: apply pass", "chained.apply", "ours_chained", 0),
    ("chained: post + next projection", "chained.post_project", "ours_chained", 1),
)


def forward_kernel_elements(n: int = N) -> dict[str, int]:
    """The forward kernels' C-wide elements read + written per token, by the recording's key."""
    return {key: bytes_model.rows(impl, n, "forward")[row].moved.per_C for _, key, impl, row in FORWARD_KERNELS}


def _pace(elements: int, C: int, tokens: int, ms: float, copy_gbps: float, itemsize: int = 2) -> tuple[float, float]:
    """(share of the copy's pace on these bytes, ms beyond the bytes at the copy's pace)."""
    bytes_ = elements * C * itemsize * tokens
    at_copy_ms = bytes_ / (copy_gbps * 1e9) * 1e3
    return at_copy_ms / ms, ms - at_copy_ms


def bytes_rows(forward_sites: dict | None, block_kernels: dict | None) -> dict:
    """{"forward": [...], "block": [...]}: each kernel's C-wide elements, ms per launch, share of the copy's pace
    on those bytes and ms beyond them; the block's kernels with identity layers carry section 3's verdict."""
    out = {"forward": [], "block": []}
    elements = forward_kernel_elements()
    copy = (forward_sites or {}).get("copy_gbps")
    for r in (forward_sites or {}).get("shapes") or []:
        times = r.get("kernel_ms") or {}
        for label, key, _, _ in FORWARD_KERNELS:
            if key in times:
                share, beyond = _pace(elements[key], r["C"], r["tokens"], times[key], copy)
                out["forward"].append({"tokens": r["tokens"], "C": r["C"], "kernel": label,
                                       "elements": elements[key], "ms": times[key], "share": share,
                                       "beyond_ms": beyond})
    copy = (block_kernels or {}).get("copy_gbps")
    for cap in power_cap_rows(block_kernels):
        for k in cap["kernels"]:
            per_launch = CHAINED_KERNEL_ELEMENTS.get(k["kernel"])
            if not per_launch:
                continue
            ms = k["alone_ms"] / k["launches"]
            share, beyond = _pace(per_launch, cap["C"], cap["tokens"], ms, copy)
            out["block"].append({"tokens": cap["tokens"], "C": cap["C"], "kernel": kernel_name(k["kernel"]),
                                 "elements": per_launch, "ms": ms, "share": share, "beyond_ms": beyond,
                                 "verdict": k["verdict"]})
    return out


def bytes_table(forward_sites: dict | None, block_kernels: dict | None, forward_label: str = "",
                block_label: str = "") -> str:
    """Table 5: each kernel's time per launch against its least bytes at the copy's pace: our forward kernels
    alone (forward recording), and the training step's kernels with identity layers (training recording) beside
    section 3's verdict."""
    rows = bytes_rows(forward_sites, block_kernels)
    if not rows["forward"] and not rows["block"]:
        return "(no kernel times recorded)"
    head = f"  {'kernel':<42}{'moves':>6}{'ms':>8}{'of copy':>9}{'beyond':>9}"
    lines = []

    def by_shape(kernel_rows, head_suffix: str = "", last_column=lambda r: ""):
        shape = None
        for r in kernel_rows:
            if (r["tokens"], r["C"]) != shape:
                lines.append(f"{r['tokens']} x {r['C']}\n{head}{head_suffix}")
                shape = (r["tokens"], r["C"])
            lines.append(f"  {r['kernel']:<42}{r['elements']:>5}C{r['ms']:>8.3f}{r['share']:>9.0%}"
                         f"{r['beyond_ms']:>9.3f}{last_column(r)}")

    if rows["forward"]:
        lines.append(f"Our forward kernels, each timed alone (copy {forward_sites['copy_gbps']:.0f} GB/s). "
                     + forward_label)
        by_shape(rows["forward"])
    if rows["block"]:
        lines.append(f"\nThe training step's kernels with identity layers, per launch (copy "
                     f"{block_kernels['copy_gbps']:.0f} GB/s). " + block_label)
        by_shape(rows["block"], "   in the block (section 3)", lambda r: f"   {r['verdict']}")
    lines.append("(moves: C-wide bf16 elements read + written per token; of copy: those bytes' time at the copy's "
                 "pace over the kernel's; beyond: ms above that time)")
    return "\n".join(lines)


def bytes_reading(forward_sites: dict | None, block_kernels: dict | None) -> str:
    """Which of the step's kernels stream near their bytes' pace (NEAR_COPY or more at every width), which do
    not, and which of those the power cap slows."""
    rows = bytes_rows(forward_sites, block_kernels)["block"]
    names = list(dict.fromkeys(r["kernel"] for r in rows))
    near = [k for k in names if all(r["share"] >= NEAR_COPY for r in rows if r["kernel"] == k)]
    below = [k for k in names if k not in near]
    slowed = [k for k in below if all(r["verdict"].startswith("slowed") for r in rows if r["kernel"] == k)]
    other = [k for k in below if k not in slowed]
    return "\n".join([
        f"at {NEAR_COPY:.0%} of the copy's pace or more at every width: {'; '.join(near) or 'none'}",
        f"below it, and slowed by the power cap at every width: {'; '.join(slowed) or 'none'}",
        f"below it, and not slowed at every width: {'; '.join(other) or 'none'}",
    ])


# ---- live, on a CUDA GPU: the two clocks of a plain block ------------------------------------------------------


def measure_live(shapes, *, rounds: int = 2, repeat_ms: int = 100, log=print) -> dict:
    """The plain residual block and the copy floor (no mHC kernels: plain PyTorch, any CUDA GPU) at each
    (width, batch, seq) of ``shapes``, launched and as CUDA graphs in ``rounds`` interleaved rounds, with this
    GPU's copy bandwidth: {"device", "timer", "block"}, "block" shaped as the recording's block section."""
    from mhc_lab.bench.block import block_step
    from mhc_lab.bench.common import copy_bandwidth, gpu_timer, graph_replay, interleaved_rounds, overheads

    bench, timer_name = gpu_timer()

    def timed(fn):
        return bench(fn, warmup_ms=max(5, repeat_ms // 4), rep_ms=repeat_ms)

    copy = copy_bandwidth(bench)
    widths = []
    for width, batch, seq in shapes:
        steps = {kind: block_step(width, kind, batch, seq) for kind in ("residual", "copy_floor")}
        for step in steps.values():
            step()
        launched = interleaved_rounds(steps, timed, rounds)
        replays = {kind: graph_replay(step) for kind, step in steps.items()}
        graph = interleaved_rounds(replays, timed, rounds)
        widths.append({"C": width, "tokens": batch * seq, "batch": batch, "seq": seq,
                       "launched": {"rounds_ms": launched, "overhead_pct": overheads(launched)},
                       "graph": {"rounds_ms": graph, "overhead_pct": overheads(graph)}})
        log(f"  block C={width}, {batch} x {seq} tokens: measured")
        replays.clear()
        steps.clear()
        torch.cuda.empty_cache()
    return {"device": torch.cuda.get_device_name(), "timer": timer_name,
            "block": {"copy_gbps": copy, "widths": widths}}


def live_clocks_table(block: dict | None) -> str:
    """The live measurement's blocks: per width, each kind launched and as a graph, the host's share of the
    launched step, and the copy floor's overhead both ways beside the one its bytes predict."""
    rows = block_clocks(block)
    if not rows:
        return "(nothing measured)"
    predicted = {r["C"]: r["modes"] for r in floor_rows(block)}
    lines = [f"{'C':>6}{'tokens':>8}  {'kind':<26}{'launched':>11}{'as a graph':>12}{'host share':>12}"
             "   overhead: launched / graph"]
    for r in rows:
        overhead = ""
        if r["kind"] == "copy_floor":
            modes = predicted.get(r["C"], {})
            cells = [f"{modes[m]['overhead']['copy_floor']['median']:+.1f}%" if m in modes else "-"
                     for m in ("launched", "graph")]
            bytes_pct = modes.get("graph", {}).get("bytes_pct")
            overhead = f"{cells[0]} / {cells[1]}" + (f" (bytes: {bytes_pct:+.1f}%)" if bytes_pct else "")
        lines.append(f"{r['C']:>6}{r['tokens']:>8}  {BLOCK_IMPLEMENTATIONS[r['kind']]:<26}{r['launched_ms']:>8.2f} ms"
                     f"{r['graph_ms']:>9.2f} ms{r['host_share']:>12.0%}   {overhead}".rstrip())
    return "\n".join(lines)
