"""docs/results.md and the README's results table, written from the recordings in mhc_lab/recorded.

    python -m mhc_lab.bench results            # rewrite docs/results.md and the README's table
    python -m mhc_lab.bench results --check    # exit 1 if either is not what the recordings give

Both are generated, never edited by hand, so every figure a reader sees is the recording's, with the date and GPU
it was measured on; tests/test_results_docs.py fails when a recording changed and they were not regenerated.
"""

from __future__ import annotations

import argparse
import statistics
import sys

from mhc_lab.measure.recordings import RECORDED_DIR, recorded_or_none

ROOT = RECORDED_DIR.parent.parent
RESULTS_MD = ROOT / "docs" / "results.md"
README = ROOT / "README.md"
README_BEGIN = "<!-- results -->"
README_END = "<!-- end of results -->"


def _median_or_none(values) -> float | None:
    return statistics.median(values) if values else None


def _measured(section: dict) -> str:
    env = section.get("environment") or {}
    return f"{env.get('gpu', '?')}, {env.get('date', '?')}"


def _measured_shapes(section: dict) -> str:
    """_measured of a section whose shapes each carry the environment that made them (part 'stack'), or else
    the section's."""
    return "; ".join(dict.fromkeys(_measured(shape if shape.get("environment") else section)
                                   for shape in section.get("shapes", [])))


def _ms(value) -> str:
    return "-" if value is None else f"{value:.3f}"


def _pct(value) -> str:
    return "-" if value is None else f"{value:+.1f}%"


def _shape(row: dict) -> str:
    return f"{row['tokens']} × {row['C']}"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return lines


def forward_site_rows(forward: dict | None) -> tuple[list[str], list[list[str]], str]:
    """One site's forward (n = 4, bf16): TileKernels against ours, and ours as a share of copy bandwidth."""
    sites = (forward or {}).get("results", {}).get("sites")
    if not sites:
        return [], [], ""
    header = ["shape (tokens × C)", "TileKernels ms", "ours: alone / in a stack ms", "in a stack / TileKernels",
              "in a stack, share of copy"]
    rows = []
    for row in sites["shapes"]:
        t = row.get("time_ms", {})
        ours, chained, theirs = t.get("ours"), t.get("ours_chained"), t.get("tilekernels")
        share = row["min_bytes"] / (chained * 1e-3) / (sites["copy_gbps"] * 1e9) if chained else None
        rows.append([_shape(row), _ms(theirs), f"{_ms(ours)} / {_ms(chained)}",
                     f"{chained / theirs:.2f}x" if chained and theirs else "-", f"{share:.0%}" if share else "-"])
    return header, rows, _measured(sites)


def training_site_rows(training: dict | None) -> tuple[list[str], list[list[str]], str]:
    """One site's forward + backward as a CUDA graph (the GPU's time) and launched from Python."""
    site = (training or {}).get("results", {}).get("site")
    if not site:
        return [], [], ""
    header = ["shape (tokens × C)", "TileKernels ms", "ours: separate ops / linked / chained ms",
              "chained / TileKernels", "chained, launched ms"]
    rows = []
    for row in site["shapes"]:
        g, launched = row.get("graph_ms", {}), row.get("launched_ms", {})
        chained, theirs = g.get("ours_chained"), g.get("tilekernels")
        rows.append([_shape(row), _ms(theirs),
                     " / ".join(_ms(g.get(k)) for k in ("ours_separate", "ours_linked", "ours_chained")),
                     f"{chained / theirs:.2f}x" if chained and theirs else "-", _ms(launched.get("ours_chained"))])
    return header, rows, _measured(site)


BLOCK_KINDS = {"mhc_ours": "mHC, our kernels", "mhc_ours_recompute": "mHC, our kernels, recompute",
               "mhc_tilekernels": "mHC, TileKernels", "copy_floor": "the copy floor of mHC's bytes"}


def block_rows(training: dict | None) -> tuple[list[str], list[list[str]], str]:
    """mHC's overhead on a transformer block (median of interleaved rounds), launched and as CUDA graphs."""
    block = (training or {}).get("results", {}).get("block")
    if not block:
        return [], [], ""
    widths = block["widths"]
    header = ["overhead over the plain residual block"] + [f"C = {w['C']}: launched / graph" for w in widths]
    rows = []
    for kind, label in BLOCK_KINDS.items():
        cells = []
        for w in widths:
            pair = [w.get(mode, {}).get("overhead_pct", {}).get(kind, {}).get("median") for mode in ("launched", "graph")]
            cells.append(" / ".join(_pct(v) for v in pair))
        if any(c != "- / -" for c in cells):
            rows.append([label] + cells)
    plain = ["plain residual block, ms"] + [
        " / ".join(_ms(_median_or_none(w.get(mode, {}).get("rounds_ms", {}).get("residual"))) for mode in ("launched", "graph"))
        for w in widths]
    return header, [plain] + rows, _measured(block)


STACK_COLUMNS = {"residual": "plain", "mhc_kernels": "ours", "mhc_tilekernels": "TileKernels",
                 "mhc_reference": "reference"}


def stack_rows(training: dict | None) -> tuple[list[str], list[list[str]], str]:
    """A stack of MLP layers trained one step at a time: each kind's step launched and as a CUDA graph (ms, and
    over the plain stack's), and under torch.compile's reduce-overhead where recorded."""
    stack = (training or {}).get("results", {}).get("stack")
    if not stack:
        return [], [], ""
    header = ["shape (tokens × C), layers", "step", *STACK_COLUMNS.values()]
    rows = []
    for shape in stack["shapes"]:
        over = shape.get("over_residual", {})
        where = f"{_shape(shape)}, {shape['layers']}"
        for mode, times, label in (("launched", shape.get("launched_ms", {}), "launched ms"),
                                   ("graph", shape.get("graph_ms", {}), "CUDA graph ms")):
            cells = []
            for kind in STACK_COLUMNS:
                ratio = over.get(mode, {}).get(kind, {}).get("median")
                cells.append(_ms(times.get(kind)) + (f" ({ratio:.2f}x)" if ratio else ""))
            rows.append([where, label] + cells)
        times = shape.get("launched_ms", {})
        if any(f"{kind}_reduce_overhead" in times for kind in STACK_COLUMNS):
            cells = []
            for kind in STACK_COLUMNS:
                compiled = f"{kind}_reduce_overhead"
                ratio = over.get("launched", {}).get(compiled, {}).get("median")
                cells.append(_ms(times.get(compiled)) + (f" ({ratio:.2f}x)" if ratio else ""))
            rows.append([where, "torch.compile, reduce-overhead, ms"] + cells)
    return header, rows, _measured_shapes(stack)


DEEPSEEK_V4_PASSES = {"step": "training step", "forward": "forward, autograd recording",
                      "forward_no_grad": "forward, no grad"}


def _mib_to_gib(value) -> str:
    return "-" if value is None else f"{value / 1024:.2f}"


def deepseek_v4_rows(training: dict | None) -> tuple[list[str], list[list[str]], str]:
    """transformers' DeepSeek-V4, unpatched and under use_mhc_lab: each pass's median time (and the ratio of the
    two printed medians, as the README prints it), its peak memory, and the two losses."""
    part = (training or {}).get("results", {}).get("deepseek_v4")
    if not part:
        return [], [], ""
    header = ["shape (tokens × C), layers", "pass", "unpatched ms", "use_mhc_lab ms", "peak GiB: unpatched / ours",
              "loss: unpatched / ours"]
    rows = []
    for shape in part["shapes"]:
        where = f"{shape['tokens']} × {shape['hidden']}, {shape['layers']}"
        loss = shape.get("loss", {})
        losses = " / ".join("-" if loss.get(k) is None else f"{loss[k]:.4f}" for k in ("unpatched", "patched"))
        for name, label in DEEPSEEK_V4_PASSES.items():
            times = [shape.get("time_ms", {}).get(kind, {}).get(name) for kind in ("unpatched", "patched")]
            ratio = times[1] / times[0] if times[0] and times[1] else None
            peaks = [((shape.get("peak_memory_mib") or {}).get(kind) or {}).get(name)
                     for kind in ("unpatched", "patched")]
            rows.append([where, label, _ms(times[0]), _ms(times[1]) + (f" ({ratio:.2f}x)" if ratio else ""),
                         " / ".join(_mib_to_gib(p) for p in peaks), losses if name == "step" else ""])
    return header, rows, _measured(part)


PEER_LABELS = {"ours": "ours", "tilekernels": "TileKernels", "liger": "Liger-Kernel",
               "transformer_engine": "TransformerEngine"}


def peer_label(name: str, versions: dict) -> str:
    """'TileKernels 2.1.0': the peer and the version the recording compared (ours carries none)."""
    version = versions.get(name)
    return PEER_LABELS.get(name, name) + (f" {version}" if version else "")


def peers_rows(training: dict | None) -> tuple[list[str], list[list[str]], str]:
    """One site beside the fused implementations of other libraries: per shape and implementation, the forward
    and forward + backward as CUDA graphs and launched, the share of the copy floor, and the largest relative
    error against the float64 site (output or any gradient)."""
    part = (training or {}).get("results", {}).get("peers")
    if not part:
        return [], [], ""
    versions = part.get("versions") or {}
    header = ["shape (tokens × C)", "implementation", "forward ms: graph / launched",
              "forward + backward ms: graph / launched", "share of copy floor (fwd+bwd, graph)",
              "largest error vs float64"]
    rows = []
    for shape in part["shapes"]:
        for name in ("ours", "tilekernels", "liger", "transformer_engine"):
            label = peer_label(name, versions)
            if name in shape.get("errors", {}):
                rows.append([_shape(shape), label, "did not run: " + shape["errors"][name][:120].replace("|", "/"),
                             "", "", ""])
                continue
            g, launched = shape["graph_ms"].get(name, {}), shape["launched_ms"].get(name, {})
            share = (shape.get("copy_floor_share", {}).get(name) or {}).get("forward_backward")
            err = max((shape.get("rel_err", {}).get(name) or {"": float("nan")}).values())
            rows.append([_shape(shape), label, f"{_ms(g.get('forward'))} / {_ms(launched.get('forward'))}",
                         f"{_ms(g.get('forward_backward'))} / {_ms(launched.get('forward_backward'))}",
                         "-" if share is None else f"{share:.0%}", f"{err:.1e}"])
    return header, rows, _measured(part)


def results_markdown(recordings: dict) -> str:
    forward, training = recordings.get("forward_h200"), recordings.get("training_h200")
    out = ["# Results", "",
           "Written by `python -m mhc_lab.bench results` from the recordings in `mhc_lab/recorded/` (never by hand).",
           "Each table says where and when it was measured; each recording holds the command that regenerates it",
           "and the full environment (driver, CUDA, torch, TileLang). n = 4 lanes, bf16 lanes, float32 coefficients.",
           "Words are defined in [the glossary](glossary.md).", "", results_legend(recordings, "glossary.md")[0], ""]
    sections = [
        ("One site's forward", forward_site_rows(forward),
         "Pre and post with the layer taken as the identity. In a "
         "stack each post also projects its lanes for the next pre (chained sites), so a site moves the least "
         "bytes, 14C per token; the share of copy is those bytes over its time, against a device-to-device copy "
         "in the same run."),
        ("One site's forward + backward", training_site_rows(training),
         "Gradients of the lanes, phi, bias and alpha for a random upstream gradient. Separate ops run pre and "
         "post apart; a linked site sums the lanes' two gradients in one pass; a chained site (what a stack runs) "
         "also has each post project its lanes for the next pre. Launched: op by op from Python, the host's time "
         "included."),
        ("One site beside other libraries' fused mHC", peers_rows(training),
         "The same numbers handed to each implementation in its own layout and recommended dtypes "
         "(`python -m mhc_lab.bench training --parts peers`; how each was called is in the recording's notes). "
         "Errors: the output and every gradient against a float64 site, mapped back to our convention; the "
         "largest is shown. The share of the copy floor: the least bytes a site moves over its time, against a "
         "device-to-device copy in the same run."),
        ("A training loop: a stack of MLP layers", stack_rows(training),
         "Pre-norm MLP layers (4C hidden, bf16) joined by the plain residual or by mHC, one training step at a time "
         "as a user's loop runs it: launched op by op from Python (the host's time included), as a CUDA graph (the "
         "GPU's time alone), and compiled by torch.compile in its reduce-overhead mode (CUDA graphs of its own). "
         "In parentheses: over the plain stack run alike."),
        ("DeepSeek-V4 in transformers, with and without use_mhc_lab", deepseek_v4_rows(training),
         "A small random DeepSeek-V4 (`python -m mhc_lab.bench training --parts deepseek_v4`: n = 4, attention of "
         "its three kinds, a few small experts per MoE layer, bf16) as transformers runs it, and with both mHC sites "
         "of every decoder layer run by our ops (`mhc_lab.integrations.transformers.use_mhc_lab`), on the same "
         "weights and tokens. Each pass launched from Python; each time the median of interleaved rounds; in "
         "parentheses, ours over transformers' own. Peak memory includes the weights."),
        ("mHC on a transformer block", block_rows(training),
         "Attention + 4C MLP, 16384 tokens, forward + backward; overheads are the median over interleaved rounds. "
         "The copy floor is the plain block plus device-to-device copies of the bytes mHC moves beyond it."),
    ]
    for title, (header, rows, measured), what in sections:
        out += [f"## {title}", "", what, ""]
        if rows:
            out += _table(header, rows) + ["", f"Measured on {measured}.", ""]
        else:
            out += ["Not recorded yet.", ""]
    return "\n".join(out).rstrip() + "\n"


def tilekernels_version(recordings: dict) -> str | None:
    """The TileKernels version the recordings compared against: the `tilekernels` tag of a section's
    environment, where the benchmark wrote one (the sections that time TileKernels), else None."""
    peers = ((recordings.get("training_h200") or {}).get("results") or {}).get("peers") or {}
    if (peers.get("versions") or {}).get("tilekernels"):
        return peers["versions"]["tilekernels"]
    for recording in recordings.values():
        for section in ((recording or {}).get("results") or {}).values():
            version = (section.get("environment") or {}).get("tilekernels") if isinstance(section, dict) else None
            if version:
                return str(version)
    return None


def results_legend(recordings: dict, glossary: str) -> list[str]:
    """What the README's table compares and what its words mean, one line each; glossary is the path of
    docs/glossary.md from the page the lines go on."""
    version = tilekernels_version(recordings)
    compared = (f"the version compared is tile-kernels {version}" if version
                else "the recordings do not tag which version was compared")
    return [
        f"[TileKernels](https://github.com/deepseek-ai/TileKernels) is DeepSeek's open library of GPU kernels, "
        f"mHC's among them; {compared}.",
        f"A [site]({glossary}#site) is mHC's connection around one layer; ours run "
        f"[chained]({glossary}#chained-sites), as a stack does. Shapes: tokens × C, C a lane's width. "
        f"*GPU time*: the GPU's own clock, without Python's launching ([CUDA graph]({glossary}#cuda-graph)); "
        f"*launched*: op by op from Python, as a training loop runs. In `a / b ms (r x)`, r = a / b: below 1, "
        f"the first is faster.",
    ]


def _pair(first: float | None, second: float | None) -> str:
    """"a / b ms (r x)" with r = a / b, the figures in the order they are printed."""
    ratio = f" ({first / second:.2f}x)" if first and second else ""
    return f"{_ms(first)} / {_ms(second)} ms{ratio}"


def readme_table(recordings: dict) -> str:
    """At most nine rows: the headline figures, each with where and when."""
    forward, training = recordings.get("forward_h200"), recordings.get("training_h200")
    lines = ["| what is timed (n = 4 lanes, bf16) | figure | measured |", "|---|---|---|"]
    peers = (training or {}).get("results", {}).get("peers")
    if peers:  # the field as it stands: every implementation on the same numbers
        versions = peers.get("versions") or {}
        names = [n for n in PEER_LABELS if any(n in row.get("graph_ms", {}) for row in peers["shapes"])]
        labels = " / ".join(peer_label(n, versions) for n in names)
        for what, key in (("forward + backward", "forward_backward"), ("forward", "forward")):
            for row in peers["shapes"][: 3 if key == "forward_backward" else 1]:
                times = [(row["graph_ms"].get(n) or {}).get(key) for n in names]
                lines.append(f"| one site, {what}, {_shape(row)}, GPU time: {labels} | "
                             f"{' / '.join(_ms(t) for t in times)} ms | {_measured(peers)} |")
    else:
        site = (training or {}).get("results", {}).get("site")
        for row in (site or {}).get("shapes", [])[:3]:
            g = row.get("graph_ms", {})
            lines.append(f"| one site, forward + backward, {_shape(row)}, GPU time: ours / TileKernels | "
                         f"{_pair(g.get('ours_chained'), g.get('tilekernels'))} | {_measured(site)} |")
        sites = (forward or {}).get("results", {}).get("sites")
        for row in (sites or {}).get("shapes", [])[:1]:
            t = row.get("time_ms", {})
            lines.append(f"| one site, forward only, {_shape(row)}, GPU time: ours / TileKernels | "
                         f"{_pair(t.get('ours_chained'), t.get('tilekernels'))} | {_measured(sites)} |")
    _, rows, measured = stack_rows(training)
    launched = next((r for r in rows if r[1] == "launched ms"), None)
    if launched:
        where, layers = launched[0].rsplit(", ", 1)
        lines.append(f"| training step, {layers} MLP layers, {where}, launched: plain residual / mHC on ours / "
                     f"mHC on TileKernels | {' / '.join(c.split(' ')[0] for c in launched[2:5])} ms | {measured} |")
    part = (training or {}).get("results", {}).get("deepseek_v4")
    for shape in (part or {}).get("shapes", [])[:1]:
        step = {kind: times.get("step") for kind, times in shape.get("time_ms", {}).items()}
        lines.append(f"| training step, a small DeepSeek-V4 in transformers ({shape['layers']} layers, "
                     f"{shape['tokens']} × {shape['hidden']}), launched: with use_mhc_lab / as is | "
                     f"{_pair(step.get('patched'), step.get('unpatched'))} | {_measured(part)} |")
    header, rows, measured = block_rows(training)
    ours = next((r for r in rows if r[0] == BLOCK_KINDS["mhc_ours"]), None)
    if ours:
        for col, cell in zip(header[1:], ours[1:]):
            width, _ = col.split(": ", 1)
            lines.append(f"| mHC's added time on a transformer block (attention + MLP), {width}: launched / "
                         f"GPU time | {cell} | {measured} |")
    return "\n".join(lines[:11])


def readme_block(recordings: dict) -> str:
    """What goes between the README's markers: the legend, then the table."""
    return "\n".join(results_legend(recordings, "docs/glossary.md") + ["", readme_table(recordings)])


def readme_with_table(readme: str, table: str) -> str:
    if README_BEGIN not in readme or README_END not in readme:
        raise ValueError(f"README.md: expected the markers {README_BEGIN!r} and {README_END!r} around the results")
    head, rest = readme.split(README_BEGIN, 1)
    _, tail = rest.split(README_END, 1)
    return f"{head}{README_BEGIN}\n{table}\n{README_END}{tail}"


def load_all() -> dict:
    return {name: recorded_or_none(name) for name in ("forward_h200", "training_h200")}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mhc_lab.bench results", description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if docs/results.md or the README's table is stale")
    args = parser.parse_args(argv)
    recordings = load_all()
    wanted_md = results_markdown(recordings)
    wanted_readme = readme_with_table(README.read_text(), readme_block(recordings))
    if args.check:
        stale = [p.name for p, text in ((RESULTS_MD, wanted_md), (README, wanted_readme))
                 if not p.exists() or p.read_text() != text]
        if stale:
            print(f"stale: {', '.join(stale)}; run python -m mhc_lab.bench results")
            return 1
        print("docs/results.md and the README's table match the recordings")
        return 0
    RESULTS_MD.write_text(wanted_md)
    README.write_text(wanted_readme)
    print(f"wrote {RESULTS_MD.relative_to(ROOT)} and the README's results table")
    return 0


if __name__ == "__main__":
    sys.exit(main())
