"""Lab 06 (fused mHC forward): the kernels as a learner writes them, the numbers they are judged by, the H200
benchmark recorded or live, and the lab's figures.

Learner-style factories (compile-time n, C and tile size in, a tile program for TileLang's C target out):

    post_program(n, C, block_tokens)           out = H_res x + H_post f, one pass       (arXiv 2512.24880, Eq. 3)
    layer_input_program(n, C, block_tokens)    y = H_pre x, the layer's input            (Eq. 3)

The coefficient logits in both orders of the RMS norm (Eq. 7, and Eqs. 14-16 where the norm comes after the
projection), the bytes each plan of a site moves, phi's traffic per token, and the views of
``mhc_lab/recorded/forward_h200.json`` (made by ``python -m mhc_lab.bench forward`` on an H200; its sections
'sites' and 'reference' are shown as one table, each labelled with its own run) or of a live run of the same
benchmark functions on a CUDA GPU.
"""

from __future__ import annotations

import importlib.util
import math

import tilelang.language as T
import torch

from mhc_lab.measure import bytes_model
from mhc_lab.measure import recorded_or_none, recording_label  # noqa: F401 (labs use recording_label)
from mhc_lab.measure.roofline import Roof
from mhc_lab.kernels.post import post_bytes
from mhc_lab.reference import MHCCoefficients, sinkhorn
from mhc_lab.reference.mhc import mixes_width

RECORDING = "forward_h200"
ROOF_RECORDING = "memory_wall_h200"  # the same H200, same day: its measured bf16 matmul rate
PLANS = ("unfused", "split", "one_pass")
PLAN_LABELS = {
    "unfused": "unfused (one kernel per operation, lab 04)",
    "split": "split pre + post (x read twice)",
    "one_pass": "one-pass pre + post (the least bytes)",
}
# The implementations of a site in the benchmark, in the order the lab shows them.
IMPLEMENTATIONS = {
    "eager": "eager PyTorch",
    "compile": "torch.compile",
    "tilekernels": "DeepSeek TileKernels",
    "ours": "ours (split pre + post)",
    "ours_chained": "ours, chained (inside a stack)",
}
SHARED_MEMORY_PER_SM = 228 * 1024  # bytes, H200 (Hopper tuning guide)
TARGET_FRACTION = 0.85  # of the copy bandwidth, on the least bytes of a site


# ---- the post kernel, C target ---------------------------------------------------------------------------
#
#   out[t, i, c] = sum_j res[t, i, j] x[t, j, c] + post[t, i] f[t, c]
#
# Bytes per token: reads n C lane elements of x, C of the layer output f and n^2 + n float32 coefficients;
# writes n C. With bf16 lanes at n = 4 that is 10 C + 80 bytes read and 8 C written: 9 of the site's 14 C
# elements. Every element of x and f is loaded once into the instance's registers (the countertop), the n
# output lanes of that channel are computed there, and each is stored once.


def post_program(n: int, C: int, block_tokens: int):
    """Tile program (C target, float32): x [T, n, C], f [T, C], post [T, n], res [T, n, n] -> out [T, n, C]."""
    tokens = T.dynamic("tokens")

    @T.prim_func
    def post_kernel(x: T.Tensor((tokens, n, C), "float32"), f: T.Tensor((tokens, C), "float32"),
                    post: T.Tensor((tokens, n), "float32"), res: T.Tensor((tokens, n, n), "float32"),
                    out: T.Tensor((tokens, n, C), "float32")):
        with T.Kernel(T.ceildiv(tokens, block_tokens)) as b:
            lanes = T.alloc_local((n,), "float32")  # x[t, :, c], loaded once
            acc = T.alloc_local((1,), "float32")
            for k in T.serial(block_tokens):
                t = b * block_tokens + k
                if t < tokens:  # the last tile may hang over the end
                    for c in T.serial(C):
                        for j in T.serial(n):
                            lanes[j] = x[t, j, c]
                        for i in T.serial(n):
                            acc[0] = post[t, i] * f[t, c]
                            for j in T.serial(n):
                                acc[0] += res[t, i, j] * lanes[j]
                            out[t, i, c] = acc[0]

    return post_kernel


# ---- the layer input, C target ---------------------------------------------------------------------------
#
#   y[t, c] = sum_j pre[t, j] x[t, j, c]
#
# Bytes per token: reads n C lane elements and n float32 coefficients, writes C. In the pre kernel this is the
# second walk over the token's row, after the coefficients are known (lab 06, section 3).


def layer_input_program(n: int, C: int, block_tokens: int):
    """Tile program (C target, float32): x [T, n, C], pre [T, n] -> y [T, C]."""
    tokens = T.dynamic("tokens")

    @T.prim_func
    def layer_input(x: T.Tensor((tokens, n, C), "float32"), pre: T.Tensor((tokens, n), "float32"),
                    y: T.Tensor((tokens, C), "float32")):
        with T.Kernel(T.ceildiv(tokens, block_tokens)) as b:
            acc = T.alloc_local((1,), "float32")
            for k in T.serial(block_tokens):
                t = b * block_tokens + k
                if t < tokens:
                    for c in T.serial(C):
                        acc[0] = 0.0
                        for j in T.serial(n):
                            acc[0] += pre[t, j] * x[t, j, c]
                        y[t, c] = acc[0]

    return layer_input


# ---- the coefficient logits: norm first (Eq. 7) or after the projection (Eqs. 14-16) --------------------


def _gates(alpha: torch.Tensor, n: int) -> torch.Tensor:
    """alpha [3] spread over the n^2 + 2n outputs: alpha_pre on n, alpha_post on n, alpha_res on n^2."""
    return torch.cat([alpha[0].expand(n), alpha[1].expand(n), alpha[2].expand(n * n)])


def logits_norm_first(x, phi, bias, alpha, rms_eps: float = 1e-6) -> torch.Tensor:
    """[H~pre, H~post, H~res] as mhc_lab.reference computes them: RMSNorm of the nC row, then the projection
    (arXiv 2512.24880, Eq. 7): alpha * (x' phi^T) + b with x' = x / sqrt(mean(x^2) + eps). [..., n^2 + 2n]."""
    n, C = x.shape[-2:]
    flat = x.reshape(*x.shape[:-2], n * C)
    normed = flat * torch.rsqrt(flat.pow(2).mean(dim=-1, keepdim=True) + rms_eps)  # nC multiplies per token
    return _gates(alpha, n) * (normed @ phi.t()) + bias


def logits_norm_after(x, phi, bias, alpha, rms_eps: float = 1e-6) -> torch.Tensor:
    """The same logits with the norm applied after the projection (arXiv 2512.24880, Eqs. 14-16):
    mixes = x phi^T and r = sqrt(mean(x^2) + eps) from one walk over the raw row, then (alpha / r) mixes + b.
    The norm is a per-token scalar, so only n^2 + 2n numbers get scaled instead of nC."""
    n, C = x.shape[-2:]
    flat = x.reshape(*x.shape[:-2], n * C)
    mixes = flat @ phi.t()  # Eq. 14, on the raw row
    r = torch.sqrt(flat.pow(2).mean(dim=-1, keepdim=True) + rms_eps)  # Eq. 15 (with the reference's eps)
    return _gates(alpha, n) * mixes / r + bias  # Eq. 16


def coefficients_from_logits(logits: torch.Tensor, n: int, *, eps: float = 1e-6,
                             iterations: int = 20) -> MHCCoefficients:
    """H_pre, H_post, H_res from the logits, in DeepSeek-V4's convention (as mhc_lab.reference, Eqs. 8-9)."""
    pre = torch.sigmoid(logits[..., :n]) + eps
    post = 2.0 * torch.sigmoid(logits[..., n : 2 * n])
    res_logits = logits[..., 2 * n :].reshape(*logits.shape[:-1], n, n)
    return MHCCoefficients(pre, post, sinkhorn(res_logits, "deepseek_v4", iterations, eps))


# ---- bytes ------------------------------------------------------------------------------------------------


def site_lane_bytes(n: int, C: int, plan: str, itemsize: int = 2) -> int:
    """Bytes of lane-wide tensors (x, y, f, out; itemsize each) one site's forward moves per token.

    unfused: lab 04's Table 2 rows, (8n + 2) C; one_pass: pre reads nC and writes C, post reads (n + 1) C and
    writes nC, (3n + 2) C = 14 C at n = 4; split: x read once more by the second pass, (4n + 2) C = 18 C.
    The float32 coefficients (about 4 (2n^2 + 3n) bytes per token) are left out, as in the benchmark's metric.
    """
    if plan not in PLANS:
        raise ValueError(f"plan: expected one of {PLANS}, got {plan!r}")
    method = {"unfused": "mhc", "split": "mhc_minimal", "one_pass": "mhc_minimal"}[plan]
    elements = bytes_model.total(method, n).moved.per_C + (n if plan == "split" else 0)
    return elements * C * itemsize


def phi_bytes_per_token(n: int, C: int, tile_tokens: int) -> float:
    """Bytes of phi ([n^2 + 2n, nC] float32) a token costs when phi is read once per tile of tile_tokens tokens."""
    return 4 * mixes_width(n) * n * C / tile_tokens


def rows_in_shared_memory(n: int, C: int, itemsize: int = 2, shared_bytes: int = SHARED_MEMORY_PER_SM) -> int:
    """How many tokens' whole nC rows fit in one SM's shared memory (H200: 228 KB)."""
    return shared_bytes // (n * C * itemsize)


def phi_traffic_figure(C: int, n: int = 4, split_tile: int = 256):
    """phi bytes per token against the tile size, next to the bytes of x a token must read (bf16)."""
    import plotly.graph_objects as go

    tiles = [2**k for k in range(0, 11)]
    x_bytes = n * C * 2
    whole_rows = max(1, rows_in_shared_memory(n, C))
    fig = go.Figure()
    fig.add_trace(go.Scatter(x=tiles, y=[phi_bytes_per_token(n, C, t) / 1e3 for t in tiles], mode="lines+markers",
                             name="phi, read once per tile (from L2)"))
    fig.add_trace(go.Scatter(x=[tiles[0], tiles[-1]], y=[x_bytes / 1e3] * 2, mode="lines", line=dict(dash="dot"),
                             name="x, read once (from HBM)"))
    for t, text in ((whole_rows, f"whole rows in one SM's shared memory: {whole_rows} tokens"),
                    (split_tile, f"split plan's projection tile: {split_tile} tokens")):
        fig.add_trace(go.Scatter(x=[t], y=[phi_bytes_per_token(n, C, t) / 1e3], mode="markers+text", text=[text],
                                 textposition="top right", marker=dict(size=12, symbol="diamond"), showlegend=False))
    fig.update_xaxes(type="log", title="tokens per tile")
    fig.update_yaxes(type="log", title="KB per token")
    fig.update_layout(height=420, title=f"phi ({4 * mixes_width(n) * n * C / 2**20:.2f} MiB at n = {n}, C = {C}) "
                                        "against x: bytes per token")
    return fig


# ---- the benchmark: recorded on an H200, or live -----------------------------------------------------------


def load_recorded(name: str = RECORDING) -> dict | None:
    """This benchmark's recording, or None when there is none (yet)."""
    return recorded_or_none(name)


def merge_sections(sites: dict | None, reference: dict | None) -> dict | None:
    """The benchmark's two parts as one view for the tables: per shape every site's time (TileKernels and ours
    from ``sites``, eager and torch.compile from ``reference``), their errors and our kernels alone, with the
    copy bandwidth of ``sites``, the run ours is judged in. None where neither part is there."""
    if not sites and not reference:
        return None
    shapes: dict = {}
    for section in (reference, sites):
        for r in (section or {}).get("shapes", []):
            s = shapes.setdefault((r["tokens"], r["C"]), {"tokens": r["tokens"], "C": r["C"], "n": r["n"],
                                                          "min_bytes": r["min_bytes"], "time_ms": {},
                                                          "rel_err": {}, "kernel_ms": {}, "errors": {}})
            for key in ("time_ms", "rel_err", "kernel_ms", "errors"):
                s[key].update(r.get(key) or {})
    return {"copy_gbps": (sites or reference)["copy_gbps"], "shapes": list(shapes.values())}


def recorded_results(recording: dict | None) -> dict | None:
    """merge_sections of a forward recording's sections."""
    results = (recording or {}).get("results") or {}
    return merge_sections(results.get("sites"), results.get("reference"))


def recorded_labels(recording: dict | None) -> str:
    """One label per section of the recording: which run each figure comes from."""
    results = (recording or {}).get("results") or {}
    what = {"sites": "TileKernels, ours and our kernels", "reference": "eager and torch.compile"}
    return "\n".join(f"{what[k]}: {recording_label(results[k])}" for k in what if k in results)


def recorded_roof(recording: dict) -> Roof:
    """The H200's roof for the roofline: the copy bandwidth of the forward recording and the bf16 matmul rate
    of the memory-wall recording (the same kind of GPU); the spec sheet's rate if that one is missing."""
    matmul, dtype = 989.0, "bfloat16 (spec sheet)"
    roof = ((load_recorded(ROOF_RECORDING) or {}).get("results") or {}).get("roof")
    if roof:
        matmul, dtype = roof["matmul_tflops"], roof["matmul_dtype"]
    section = recording["results"].get("sites") or recording["results"].get("reference")
    return Roof(section["environment"].get("gpu") or "GPU", section["copy_gbps"], matmul, dtype)


def recorded_copy_gbps(recording: dict | None = None) -> float | None:
    """The copy bandwidth ours was judged against in the recording (its 'sites' part), GB/s."""
    results = recorded_results(recording if recording is not None else load_recorded())
    return results["copy_gbps"] if results else None


def measure_live(shapes, *, compile: bool, repeat_ms: int = 100, log=print) -> dict:
    """The benchmark's own functions (mhc_lab.bench.forward) on this CUDA GPU, for ``shapes``
    [(tokens, C), ...]: the same view as recorded_results, plus the device name, the timer and the seconds spent
    building the kernels first (``compile_seconds``: no timed figure includes a compile)."""
    from mhc_lab.bench import forward as bench_forward
    from mhc_lab.bench.common import compile_pass, copy_bandwidth, gpu_timer

    timer, timer_name = gpu_timer()

    def bench(fn):
        return timer(fn, warmup_ms=max(5, repeat_ms // 4), rep_ms=repeat_ms)

    skipped = {}
    if not compile:
        skipped["compile"] = "skipped (compiling takes minutes); see the recording"
    if importlib.util.find_spec("tile_kernels") is None:
        skipped["tilekernels"] = "not installed (pip install tile-kernels)"
    quiet = lambda *args, **kwargs: None  # noqa: E731
    compile_seconds = compile_pass(lambda shape, once: bench_forward.bench_sites(*shape, once, skip=tuple(skipped),
                                                                                 log=quiet), list(shapes))
    copy = copy_bandwidth(bench)
    sites = {"copy_gbps": copy, "shapes": []}
    reference = {"copy_gbps": copy, "shapes": []}
    for tokens, C in shapes:
        log(f"shape {tokens} x {C}")
        sites["shapes"].append(bench_forward.bench_sites(tokens, C, bench, skip=tuple(skipped), log=log))
        reference["shapes"].append(bench_forward.bench_reference(tokens, C, bench, skip=tuple(skipped), log=log))
        torch.cuda.empty_cache()
    results = merge_sections(sites, reference)
    for r in results["shapes"]:
        r["errors"].update(skipped)
    return {"device": torch.cuda.get_device_name(), "timer": timer_name, "compile_seconds": compile_seconds,
            **results}


def _shape_name(r: dict) -> str:
    return f"{r['tokens']} x {r['C']}"


def site_fraction(r: dict, name: str, copy_gbps: float) -> float:
    """Fraction of the copy bandwidth an implementation reaches on the site's least bytes (14 C x 2 per token)."""
    return r["min_bytes"] / (r["time_ms"][name] * 1e-3) / 1e9 / copy_gbps


def site_table(results: dict) -> str:
    """Time, GB/s on the least bytes, fraction of the copy bandwidth, and time relative to TileKernels."""
    copy = results["copy_gbps"]
    lines = [f"copy bandwidth (read + written): {copy:.0f} GB/s; GB/s below count 14 C x 2 bytes per token",
             f"{'tokens x C':<13} {'implementation':<31} {'time':>10} {'GB/s':>7} {'of copy':>8} {'/ TileKernels':>14}",
             "-" * 88]
    for r in results["shapes"]:
        tk = r["time_ms"].get("tilekernels")
        for name, label in IMPLEMENTATIONS.items():
            if name not in r["time_ms"]:
                why = r.get("errors", {}).get(name) or "not in this measurement"
                lines.append(f"{_shape_name(r):<13} {label:<31} not measured: {why[:70]}")
                continue
            ms = r["time_ms"][name]
            gbs = r["min_bytes"] / (ms * 1e-3) / 1e9
            versus = f"{ms / tk:.2f}x" if tk else "-"
            lines.append(f"{_shape_name(r):<13} {label:<31} {ms:7.3f} ms {gbs:7.0f} {gbs / copy:8.1%} {versus:>14}")
        target_ms = r["min_bytes"] / (TARGET_FRACTION * copy * 1e9) * 1e3
        lines.append(f"{_shape_name(r):<13} {'target: 85% of copy':<31} {target_ms:7.3f} ms")
    return "\n".join(lines)


def kernel_rows(n: int, C: int) -> list[tuple[str, str, int | None]]:
    """(label, kernel_ms key, least bytes per token) of each of our kernels alone, in the order the lab shows them;
    the phi split reads phi once per call, no bytes per token."""
    post = post_bytes(n, C)["total"]
    return [("post (reads 10C, writes 8C)", "post", post),
            ("pre: phi into bf16 hi and lo (once)", "pre.phi_split", None),
            ("pre: projection (reads 8C)", "pre.project", n * C * 2),
            ("pre: apply (reads 8C, writes 2C)", "pre.apply", (n + 1) * C * 2),
            ("pre, whole (on its least: 10C)", "pre", (n + 1) * C * 2),
            ("chained: apply (reads 8C, writes 2C)", "chained.apply", (n + 1) * C * 2),
            ("chained: post + next projection (18C)", "chained.post_project", post)]


def kernel_fractions(r: dict, copy_gbps: float) -> dict:
    """Our kernels alone at one measured shape: kernel_ms key -> fraction of the copy bandwidth on the kernel's own
    least bytes (kernel_rows); kernels not measured, or without bytes per token, left out."""
    t = r.get("kernel_ms") or {}
    return {key: r["tokens"] * per_token / (t[key] * 1e-3) / 1e9 / copy_gbps
            for _, key, per_token in kernel_rows(r["n"], r["C"]) if key in t and per_token is not None}


def kernel_table(results: dict) -> str:
    """Our kernels alone, each on its own least bytes: post, the pre and its two passes, the chained site's two."""
    copy = results["copy_gbps"]
    lines = [f"{'tokens x C':<13} {'kernel':<40} {'time':>10} {'bytes/token':>12} {'of copy':>8}", "-" * 87]
    for r in results["shapes"]:
        t = r.get("kernel_ms") or {}
        fractions = kernel_fractions(r, copy)
        for label, key, per_token in kernel_rows(r["n"], r["C"]):
            if key in t and per_token is None:
                lines.append(f"{_shape_name(r):<13} {label:<40} {t[key]:7.3f} ms {'-':>12} {'-':>8}")
            elif key in t:
                lines.append(f"{_shape_name(r):<13} {label:<40} {t[key]:7.3f} ms {per_token:>12,} "
                             f"{fractions[key]:8.1%}")
            else:
                lines.append(f"{_shape_name(r):<13} {label:<40} not measured")
    return "\n".join(lines)


def reading(results: dict) -> dict:
    """The numbers the lab's reading of the benchmark rests on, (min, max) over the shapes (None where no shape
    has them)."""
    copy = results["copy_gbps"]
    shapes = results["shapes"]

    def span(values):
        values = [v for v in values if v is not None]
        return (min(values), max(values)) if values else None

    def fraction(name):
        return span([site_fraction(r, name, copy) if name in r["time_ms"] else None for r in shapes])

    def ratio(name, base):
        return span([r["time_ms"][name] / r["time_ms"][base] for r in shapes
                     if name in r["time_ms"] and base in r["time_ms"]])

    kernels = [kernel_fractions(r, copy) for r in shapes]

    def kernel_ratio(name, base):  # shares of the copy bandwidth, each kernel on its own bytes
        return span([k[name] / k[base] for k in kernels if name in k and base in k])

    split_share = site_lane_bytes(4, 1, "split") / site_lane_bytes(4, 1, "one_pass")
    return {
        "post": span([k.get("post") for k in kernels]),
        "ours": fraction("ours"),
        "ours_chained": fraction("ours_chained"),
        "tilekernels": fraction("tilekernels"),
        "ours_over_tilekernels": ratio("ours", "tilekernels"),
        "chained_over_tilekernels": ratio("ours_chained", "tilekernels"),
        "eager_over_ours": ratio("eager", "ours"),
        "compile_over_ours": ratio("compile", "ours"),
        "eager_over_tilekernels": ratio("eager", "tilekernels"),
        "compile_over_tilekernels": ratio("compile", "tilekernels"),
        "projection_over_apply": kernel_ratio("pre.project", "pre.apply"),
        "projection_over_post": kernel_ratio("pre.project", "post"),
        "chained_post_over_post": kernel_ratio("chained.post_project", "post"),
        "split_on_its_bytes": span([site_fraction(r, "ours", copy) * split_share if "ours" in r["time_ms"] else None
                                    for r in shapes]),
        "rel_err": {name: max(r["rel_err"][name] for r in shapes if name in r["rel_err"])
                    for name in IMPLEMENTATIONS if any(name in r["rel_err"] for r in shapes)},
    }


def reading_text(results: dict) -> str:
    """The reading of a benchmark in a few lines: fractions of the copy bandwidth and the ratios between sites."""
    facts = reading(results)

    def span(key, fmt="{:.0%}"):
        if facts[key] is None:
            return "not measured"
        lo, hi = (fmt.format(v) for v in facts[key])
        return lo if lo == hi else f"{lo} to {hi}"

    return "\n".join([
        f"post kernel alone, on its own bytes:          {span('post')} of the copy bandwidth",
        f"our site (split pre), on the 14C metric:      {span('ours')}",
        f"  the same, on the 18C it really moves:       {span('split_on_its_bytes')}",
        f"our chained site (in a stack), on the 14C:    {span('ours_chained')}",
        f"TileKernels' site, on the 14C metric:         {span('tilekernels')}",
        f"our split site / TileKernels:                 {span('ours_over_tilekernels', '{:.2f}x')}",
        f"our chained site / TileKernels:               {span('chained_over_tilekernels', '{:.2f}x')}",
        f"eager PyTorch / our split site:               {span('eager_over_ours', '{:.0f}x')}",
        f"torch.compile / our split site:               {span('compile_over_ours', '{:.0f}x')}",
        "each kernel's share of copy on its own bytes, against another's:",
        f"  projection pass / apply pass:               {span('projection_over_apply', '{:.2f}x')}",
        f"  projection pass / post kernel:              {span('projection_over_post', '{:.2f}x')}",
        f"  chained post + projection / post kernel:    {span('chained_post_over_post', '{:.2f}x')}",
        f"target:                                       {TARGET_FRACTION:.0%} on the 14C metric",
        "largest relative error against the float32 reference, over the shapes:",
        *(f"  {IMPLEMENTATIONS[name]:<44}{err:.0e}" for name, err in facts["rel_err"].items()),
    ])


def results_figure(results: dict, title: str):
    """Fraction of the copy bandwidth on the site's least bytes, per implementation and shape (log scale)."""
    import plotly.graph_objects as go

    copy = results["copy_gbps"]
    fig = go.Figure()
    for name, label in IMPLEMENTATIONS.items():
        xs, ys, texts = [], [], []
        for r in results["shapes"]:
            if name in r["time_ms"]:
                xs.append(_shape_name(r))
                ys.append(site_fraction(r, name, copy))
                texts.append(f"{r['time_ms'][name]:.2f} ms")
        fig.add_trace(go.Bar(name=label, x=xs, y=ys, text=texts, textposition="outside"))
    fig.add_hline(y=1.0, line_dash="dot", annotation_text="copy bandwidth", annotation_position="top left")
    fig.add_hline(y=TARGET_FRACTION, line_dash="dash", annotation_text="target 85%", annotation_position="bottom left")
    fig.update_yaxes(type="log", title="fraction of the copy bandwidth (14 C x 2 bytes per token)", tickformat=".0%")
    fig.update_layout(barmode="group", height=450, title=title)
    return fig


def roofline_points(r: dict, *, include_split_bytes: bool = True) -> list[dict]:
    """roofline.roofline_figure points of one measured shape: every implementation of the site on the site's
    least bytes and FLOPs, our split site also on the bytes it really moves, and the post kernel alone."""
    n, C, tokens = r["n"], r["C"], r["tokens"]
    site_flops = tokens * bytes_model.flops_per_token("mhc_minimal", n, C)
    points = [{"name": label, "flops": site_flops, "bytes": r["min_bytes"], "seconds": r["time_ms"][key] * 1e-3}
              for key, label in IMPLEMENTATIONS.items() if key in r["time_ms"]]
    if include_split_bytes and "ours" in r["time_ms"]:
        points.append({"name": "ours (split pre), on the 18C it moves", "flops": site_flops,
                       "bytes": tokens * site_lane_bytes(n, C, "split"), "seconds": r["time_ms"]["ours"] * 1e-3})
    if "post" in (r.get("kernel_ms") or {}):
        post = post_bytes(n, C)
        points.append({"name": "post kernel alone", "flops": tokens * post["flops"], "bytes": tokens * post["total"],
                       "seconds": r["kernel_ms"]["post"] * 1e-3})
    return points


def roof_time_figure(C: int, plan: str, efficiency: float, results: dict | None, label: str = ""):
    """Time per token of one site against C: each plan's bytes at ``efficiency`` x the copy bandwidth (lines),
    the 85% target, and the measured implementations (markers) at their shapes."""
    import plotly.graph_objects as go

    copy = results["copy_gbps"] if results else 4800.0
    widths = [1024, 1536, 2048, 2560, 3072, 4096, 5120, 6144, 7168, 8192]
    fig = go.Figure()
    for p in PLANS:
        chosen = p == plan
        eff = efficiency if chosen else 1.0
        fig.add_trace(go.Scatter(
            x=widths, y=[site_lane_bytes(4, c, p) / (eff * copy * 1e9) * 1e9 for c in widths], mode="lines",
            line=dict(width=4 if chosen else 1.5, dash=None if chosen else "dot"),
            name=f"{PLAN_LABELS[p]} at {eff:.0%} of copy"))
    fig.add_trace(go.Scatter(
        x=widths, y=[site_lane_bytes(4, c, "one_pass") / (TARGET_FRACTION * copy * 1e9) * 1e9 for c in widths],
        mode="lines", line=dict(dash="dash", color="black"), name="target: least bytes at 85% of copy"))
    for name, impl in IMPLEMENTATIONS.items():
        xs, ys = [], []
        for r in (results or {}).get("shapes", []):
            if name in r["time_ms"]:
                xs.append(r["C"])
                ys.append(r["time_ms"][name] * 1e-3 / r["tokens"] * 1e9)
        if xs:
            fig.add_trace(go.Scatter(x=xs, y=ys, mode="markers", marker=dict(size=11, symbol="x"),
                                     name=f"{label}: {impl}"))
    predicted = site_lane_bytes(4, C, plan) / (efficiency * copy * 1e9) * 1e9
    fig.add_trace(go.Scatter(x=[C], y=[predicted], mode="markers+text", marker=dict(size=14, symbol="diamond"),
                             text=[f"{predicted:.1f} ns per token"], textposition="middle right", showlegend=False))
    fig.update_xaxes(type="log", title="C (lane width), n = 4, bf16 lanes")
    fig.update_yaxes(type="log", title="nanoseconds per token")
    fig.update_layout(height=480, title=f"One site at C = {C}: {PLAN_LABELS[plan]} at {efficiency:.0%} of "
                                        f"{copy:.0f} GB/s predicts {predicted:.1f} ns per token")
    return fig


def _site_inputs(tokens: int, n: int, C: int, generator: torch.Generator):
    """Random float32 lanes, phi, bias, alpha and layer output f of one site (never zeros)."""
    m = mixes_width(n)
    x = torch.randn(tokens, n, C, generator=generator)
    phi = torch.randn(m, n * C, generator=generator) / math.sqrt(n * C)
    bias, alpha = torch.randn(m, generator=generator) * 0.5, torch.rand(3, generator=generator) + 0.5
    return x, phi, bias, alpha, torch.randn(tokens, C, generator=generator)


def fused_against_reference(tokens: int, n: int, C: int, seed: int = 0, tol: float = 1e-5) -> dict:
    """The library's fused kernels on CPU tensors (TileLang's C target), every output poisoned with NaN first,
    against the float64 reference: {"no_nan": ..., "close": ...} (close: |got - want| <= tol (1 + |want|))."""
    from mhc_lab.ops import PreOutputs, mhc_post_fused, mhc_pre_fused
    from mhc_lab.reference import mhc_coefficients, mhc_post, mhc_pre

    x, phi, bias, alpha, f = _site_inputs(tokens, n, C, torch.Generator().manual_seed(seed))
    nan = float("nan")
    got = mhc_pre_fused(x, phi, bias, alpha, out=PreOutputs(
        torch.full((tokens, C), nan), torch.full((tokens, n), nan), torch.full((tokens, n, n), nan),
        torch.full((tokens, n), nan)))
    out = mhc_post_fused(x, f, got.post, got.res, out=torch.full((tokens, n, C), nan))
    pre, post, res = mhc_coefficients(x.double(), phi.double(), bias.double(), alpha.double())
    want = {"layer input": mhc_pre(x.double(), pre), "H_pre": pre, "H_post": post, "H_res": res,
            # post on the kernel's own coefficients, so that it is judged alone
            "new lanes": mhc_post(x.double(), f.double(), got.post.double(), got.res.double())}
    have = {"layer input": got.layer_input, "H_pre": got.pre, "H_post": got.post, "H_res": got.res, "new lanes": out}
    return {"no_nan": not any(bool(v.isnan().any()) for v in have.values()),
            "close": all(bool(((have[k].double() - want[k]).abs() <= tol * (1 + want[k].abs())).all()) for k in want)}


def cpu_site_seconds(tokens: int, n: int, C: int, repeat: int, seed: int = 0) -> dict:
    """One site (F = identity) on this CPU, float32, one thread: the library's fused kernels (TileLang C target)
    and the eager reference, median seconds each; checked against each other first."""
    from mhc_lab.measure import time_fn
    from mhc_lab.ops import mhc_post_fused, mhc_pre_fused
    from mhc_lab.reference import mhc_coefficients, mhc_post, mhc_pre

    x, phi, bias, alpha, _ = _site_inputs(tokens, n, C, torch.Generator().manual_seed(seed))

    def fused():
        o = mhc_pre_fused(x, phi, bias, alpha)
        return mhc_post_fused(x, o.layer_input, o.post, o.res)

    def eager():
        pre, post, res = mhc_coefficients(x, phi, bias, alpha)
        return mhc_post(x, mhc_pre(x, pre), post, res)

    error = float((fused() - eager()).abs().max() / eager().abs().max())
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the C target runs on one core: time PyTorch on one too
    try:
        return {"fused": time_fn(fused, warmup=1, repeat=repeat)["median_s"],
                "eager": time_fn(eager, warmup=1, repeat=repeat)["median_s"], "max_relative_error": error}
    finally:
        torch.set_num_threads(threads)
