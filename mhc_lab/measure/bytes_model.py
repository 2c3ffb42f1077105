"""Bytes and FLOPs per token of one residual site: the plain residual, Hyper-Connections and mHC, unfused
and fused, forward and backward, as rows of operations (one row = one kernel) with their totals.

Every count is per token, excluding the layer function F's own traffic (as in mHC, arXiv 2512.24880,
Table 2). A count is ``a*C + b`` elements: the ``a*C`` part is lane-wide activations (the residual stream,
F's input and output), stored in the stream dtype (bf16 on a GPU); the ``b`` part is the per-token
coefficients (H_pre, H_post, H_res, their logits), stored in float32. That split is what
:func:`bytes_per_token` uses.

Where the numbers come from (each row carries its source):

- ``residual``, ``hc`` forward: mHC Table 2, row by row.
- ``mhc`` forward: the same rows. Table 2 is printed for HC; mHC computes its coefficients differently
  (RMSNorm of the flattened nC stream, one projection, Sinkhorn) but, one kernel per operation, moves the same
  elements per token. Only its FLOPs differ.
- ``mhc_fused`` forward: the paper's fused kernels (mHC Sec. 4.3.1): the projection + norm kernel, the
  coefficient kernel, the Sinkhorn kernel, F_pre, and F_post,res, which fuses H_post, H_res and the merge and
  so reads (n+1)C instead of (3n+1)C and writes nC instead of 3nC.
- ``mhc_minimal`` forward: the fewest bytes a site can move with F in between (two kernels: everything before
  F in one pass over x, everything after F in one pass over x): reads (2n+1)C, writes (n+1)C.
- Every backward row is **derived** (not printed in the paper) by one rule: the backward of an operation reads
  the gradient of its output and the forward tensors its derivative needs (saved or recomputed), and writes one
  gradient per input; weight gradients are accumulated over tokens (amortised, not counted). Where x feeds
  several operations, its gradient contributions are summed by one more pass (read k gradients, write one),
  except in ``mhc_minimal``, whose last kernel adds them on chip. For ``mhc_minimal`` this gives about 41C
  elements forward + backward at n = 4, the figure of the course's baseline notes.

FLOPs count 2 per multiply-add and 1 per elementwise operation; norms and Sinkhorn are counted by their
passes (see each row). Backward FLOPs are taken as twice the forward FLOPs of the same operation (each product
needs two products in backward), a rule of thumb, marked as such.
"""

from __future__ import annotations

import textwrap
from dataclasses import dataclass
from typing import NamedTuple

import torch

METHODS = ("residual", "hc", "mhc", "mhc_fused", "mhc_minimal")
# this course's kernels (mhc_lab.kernels, run by mhc_lab.ops), as they move bytes
IMPLEMENTATIONS = ("ours", "ours_linked", "ours_chained")
DIRECTIONS = ("forward", "backward")
LABELS = {
    "residual": "plain residual",
    "hc": "HC, unfused (Table 2)",
    "mhc": "mHC, unfused (Table 2 rows)",
    "mhc_fused": "mHC, the paper's fused kernels",
    "mhc_minimal": "mHC, fewest bytes (2 kernels)",
    "ours": "ours: mhc_pre then mhc_post",
    "ours_linked": "ours: mhc_site (linked)",
    "ours_chained": "ours: run_sites (linked and chained)",
}
# token splits of the pre's projection partial sums (mhc_lab.kernels.pre_split.PROJECTION_SPLITS), and of
# those a chained post projects for the next pre (mhc_lab.ops.dispatch.CHAIN_SPLITS)
PARTIAL_SPLITS = 4
CHAIN_PARTIAL_SPLITS = 1
SINKHORN_ITERATIONS = 20


class Elements(NamedTuple):
    """``per_C * C + fixed`` elements per token: per_C lane-wide activations, fixed coefficients."""

    per_C: int
    fixed: int = 0

    def at(self, C: int) -> int:
        return self.per_C * C + self.fixed

    def __add__(self, other: "Elements") -> "Elements":  # type: ignore[override]
        return Elements(self.per_C + other.per_C, self.fixed + other.fixed)

    def __str__(self) -> str:
        if self.per_C == 0:
            return str(self.fixed)
        lane = "C" if self.per_C == 1 else f"{self.per_C}C"
        return lane if self.fixed == 0 else f"{lane} + {self.fixed}"


ZERO = Elements(0, 0)


@dataclass(frozen=True)
class Row:
    """One operation (one kernel): elements read and written, FLOPs, per token; where the count comes from."""

    operation: str
    read: Elements
    write: Elements
    flops: Elements
    source: str

    @property
    def moved(self) -> Elements:
        return self.read + self.write


def _require_n(n) -> int:
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n: expected the number of lanes, a positive int, got {n!r}")
    return n


# ---- forward rows ----------------------------------------------------------------------------------------


def _coefficient_flops(method: str, n: int, iterations: int) -> Elements:
    if method == "hc":
        # LayerNorm per lane (~4 passes), each lane's row times [C, n + 2], tanh / scale / bias on n(n + 2) values.
        return Elements(4 * n + 2 * n * (n + 2), 3 * n * (n + 2))
    # RMSNorm of the flat nC vector (square, sum, scale), projection nC x (n^2 + 2n), gates / bias / sigmoid,
    # and Sinkhorn: softmax (~3n^2) and 2t normalisations of n^2 entries (a sum and a divide each).
    return Elements(3 * n + 2 * n * (n * n + 2 * n), 4 * (n * n + 2 * n) + 3 * n * n + 4 * iterations * n * n)


def _forward_rows(method: str, n: int, iterations: int) -> list[Row]:
    t2 = "mHC Table 2"
    if method == "residual":
        return [Row("residual merge x + F(x)", Elements(2), Elements(1), Elements(1), t2)]
    k = n * n + 2 * n  # coefficients per token: H_pre (n), H_post (n), H_res (n^2)
    coefficients = _coefficient_flops("hc" if method == "hc" else "mhc", n, iterations)
    pre = Row("H_pre (apply): layer input H_pre x", Elements(n, n), Elements(1), Elements(2 * n), t2)
    if method in ("hc", "mhc"):
        name = "compute H_pre, H_post, H_res" + ("" if method == "hc" else " (RMSNorm, projection, Sinkhorn)")
        source = t2 if method == "hc" else t2 + " (HC's rows; mHC moves the same elements)"
        return [
            Row(name, Elements(n), Elements(0, k), coefficients, source),
            Row(pre.operation, pre.read, pre.write, pre.flops, source),
            Row("H_post (apply): H_post^T F(.) on n lanes", Elements(1, n), Elements(n), Elements(n), source),
            Row("H_res (apply): H_res x", Elements(n, n * n), Elements(n), Elements(2 * n * n), source),
            Row("residual merge", Elements(2 * n), Elements(n), Elements(n), source),
        ]
    post_flops = Elements(n + 2 * n * n + n)  # H_post, H_res and the merge, now in one kernel
    if method == "mhc_fused":
        s = "mHC Sec. 4.3.1"
        return [
            Row("projection + norm (Eqs. 14-15)", Elements(n), Elements(0, k + 1),
                Elements(coefficients.per_C), s),
            Row("coefficients (Eqs. 16-18)", Elements(0, k + 1), Elements(0, k), Elements(0, 4 * k), s),
            Row("Sinkhorn (Eq. 19)", Elements(0, n * n), Elements(0, n * n),
                Elements(0, coefficients.fixed - 4 * k), s),
            Row("F_pre: H_pre x", Elements(n, n), Elements(1), Elements(2 * n), s),
            Row("F_post,res: H_res x + H_post^T F(.) (fused)", Elements(n + 1, n + n * n), Elements(n),
                post_flops, s + ": reads (n+1)C, writes nC"),
        ]
    if method == "mhc_minimal":
        s = "fewest bytes with F in between"
        return [
            Row("pre side: norm, projection, Sinkhorn, H_pre x (one pass over x)", Elements(n),
                Elements(1, n + n * n), coefficients + Elements(2 * n), s),
            Row("post side: H_res x + H_post^T F(.) (one pass over x)", Elements(n + 1, n + n * n),
                Elements(n), post_flops, s),
        ]
    raise ValueError(f"method: expected one of {METHODS}, got {method!r}")


# ---- backward rows (derived) -----------------------------------------------------------------------------


def _twice(flops: Elements) -> Elements:
    return Elements(2 * flops.per_C, 2 * flops.fixed)


def _backward_rows(method: str, n: int, iterations: int) -> list[Row]:
    fwd = _forward_rows(method, n, iterations)
    d = "derived"
    if method == "residual":
        return [Row("merge backward: dy goes to F unchanged; then dx = dy + F's input gradient",
                    Elements(2), Elements(1), Elements(1), d)]
    k = n * n + 2 * n
    sum_x = Row("sum of the 3 gradients of x", Elements(3 * n), Elements(n), Elements(2 * n),
                d + ": x feeds 3 operations")
    if method in ("hc", "mhc"):
        coeff, pre, post, res, merge = fwd
        return [
            Row("residual merge backward (passes d(out) to both inputs)", ZERO, ZERO, ZERO,
                d + ": no traffic"),
            Row("H_res backward: dx = H_res^T d(out), dH_res = d(out) x^T", Elements(2 * n, n * n),
                Elements(n, n * n), _twice(res.flops), d + ": reads d(out), x, H_res"),
            Row("H_post backward: dF = sum_i H_post,i d(out)_i, dH_post", Elements(n + 1, n), Elements(1, n),
                _twice(post.flops), d + ": reads d(out), F(.), H_post"),
            Row("H_pre backward: dx = H_pre dh, dH_pre = x . dh", Elements(n + 1, n), Elements(n, n),
                _twice(pre.flops), d + ": reads dh, x, H_pre"),
            Row("coefficients backward (norm recomputed, x read once)", Elements(n, k), Elements(n),
                _twice(coeff.flops), d + ": reads x and d(H_pre, H_post, H_res)"),
            sum_x,
        ]
    if method == "mhc_fused":
        proj, coeffs, sink, pre, post = fwd
        return [
            Row("F_post,res backward (fused)", Elements(2 * n + 1, n + n * n), Elements(n + 1, n + n * n),
                _twice(post.flops), d + ": reads d(out), x, F(.), H_post, H_res"),
            Row("F_pre backward", Elements(n + 1, n), Elements(n, n), _twice(pre.flops),
                d + ": reads dh, x, H_pre"),
            Row("Sinkhorn backward (iterations recomputed on chip)", Elements(0, 2 * n * n), Elements(0, n * n),
                _twice(sink.flops), d + ": reads logits and dH_res"),
            Row("coefficients backward (Eqs. 16-18)", Elements(0, 2 * k + 1), Elements(0, k + 1),
                _twice(coeffs.flops), d + ": reads the saved mixes and their gradients"),
            Row("projection + norm backward (x read once)", Elements(n, k + 1), Elements(n), _twice(proj.flops),
                d + ": reads x and d(mixes, r)"),
            sum_x,
        ]
    if method == "mhc_minimal":
        pre_side, post_side = fwd
        return [
            Row("post side backward", Elements(2 * n + 1, n + n * n), Elements(n + 1, n + n * n),
                _twice(post_side.flops), d + ": reads d(out), x, F(.), H_post, H_res"),
            Row("pre side backward (recomputes the coefficients, adds the post side's dx)",
                Elements(2 * n + 1, n + n * n), Elements(n), _twice(pre_side.flops),
                d + ": reads dh, x, dx from the post side, dH_post, dH_res"),
        ]
    raise ValueError(f"method: expected one of {METHODS}, got {method!r}")


# ---- this course's kernels --------------------------------------------------------------------------------


def _implementation_rows(method: str, n: int, direction: str, iterations: int) -> list[Row]:
    """What our kernels move per token (counted from their code; the coefficient parts roughly)."""
    k = n * n + 2 * n
    # float32 partial sums of the projection and the squared norm, as the pre reads them
    partials = (CHAIN_PARTIAL_SPLITS if method == "ours_chained" else PARTIAL_SPLITS) * (k + 1)
    coefficients = _coefficient_flops("mhc", n, iterations)
    post_flops = Elements(n + 2 * n * n + n)
    apply = Row("pre apply: coefficients, H_pre x (pre_split.py)", Elements(n, partials),
                Elements(1, k + n), Elements(2 * n, coefficients.fixed),
                "kernels/pre_split.py")
    if direction == "forward":
        post = Row("post: H_res x + H_post^T F(.) (post.py)", Elements(n + 1, n + n * n), Elements(n), post_flops,
                   "kernels/post.py")
        if method == "ours_chained":
            return [
                Row("pre apply, with the previous post's partials", apply.read, apply.write, apply.flops,
                    apply.source),
                Row("post + next projection (post_project.py)", Elements(n + 1, n + n * n),
                    Elements(n, partials), post_flops + Elements(coefficients.per_C), "kernels/post_project.py"),
            ]
        return [
            Row("pre projection: x phi^T, sum x^2 (pre_split.py)", Elements(n), Elements(0, partials),
                Elements(coefficients.per_C), "kernels/pre_split.py"),
            apply,
            post,
        ]
    linked = method != "ours"
    dsplit = 3 * 2 * (-(-k // 32) * 32) // 2  # kernel 2's bf16 operands, counted in float32-sized elements
    rows_ = [
        Row("post backward (post_backward.py)", Elements(2 * n + 1, n + n * n),
            Elements(n + 1, n + n * n), _twice(post_flops), "kernels/post_backward.py"),
        Row("pre backward 1: coefficients (pre_backward.py)",
            Elements(n + 1, partials + 2 * n + n * n), Elements(0, n + 2 * k + 4 + dsplit + n + 1),
            _twice(Elements(2 * n, coefficients.fixed)), "kernels/pre_backward.py"),
        Row("pre backward 2: dx, dphi (pre_backward.py)",
            Elements(2 * n + 1 if linked else n + 1, dsplit + n + 1), Elements(n),
            _twice(Elements(coefficients.per_C)), "kernels/pre_backward.py"),
    ]
    if not linked:
        rows_.append(Row("autograd's sum of two dx", Elements(2 * n), Elements(n), Elements(n),
                         "torch autograd: x feeds the pre and the post"))
    return rows_


def post_gradient_saving(n: int) -> int:
    """Lane-wide elements per token (units of C) that a linked or chained site saves when its post hands its
    output gradient to the pre's backward (mhc_lab.ops.dispatch.post_gradient_to_pre_for): the post's backward
    writes no dx (n C), and the pre's kernel 2 reads g where it read dx_post (the same n C) with H_res."""
    return _require_n(n)


# ---- public API ------------------------------------------------------------------------------------------


def rows(method: str, n: int, direction: str = "forward", iterations: int = SINKHORN_ITERATIONS) -> list[Row]:
    """The operations of one site of ``method`` with n lanes, one row per kernel, per token."""
    if method not in METHODS + IMPLEMENTATIONS:
        raise ValueError(f"method: expected one of {METHODS + IMPLEMENTATIONS}, got {method!r}")
    if direction not in DIRECTIONS:
        raise ValueError(f"direction: expected one of {DIRECTIONS}, got {direction!r}")
    n = 1 if method == "residual" else _require_n(n)
    if method in IMPLEMENTATIONS:
        return _implementation_rows(method, n, direction, iterations)
    build = _forward_rows if direction == "forward" else _backward_rows
    return build(method, n, iterations)


def total(method: str, n: int, direction: str = "forward", iterations: int = SINKHORN_ITERATIONS) -> Row:
    """The sum of :func:`rows`: elements read, written and FLOPs per token."""
    read = write = flops = ZERO
    for row in rows(method, n, direction, iterations):
        read, write, flops = read + row.read, write + row.write, flops + row.flops
    return Row("total", read, write, flops, "sum of the rows")


def elements_per_token(method: str, n: int, C: int, direction: str = "forward") -> int:
    """Elements read plus written per token by one site."""
    return total(method, n, direction).moved.at(C)


def _element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def bytes_per_token(method: str, n: int, C: int, direction: str = "forward", *,
                    stream_dtype: torch.dtype = torch.bfloat16,
                    coefficient_dtype: torch.dtype = torch.float32) -> int:
    """Bytes read plus written per token: lane-wide elements in ``stream_dtype``, coefficients in
    ``coefficient_dtype``."""
    moved = total(method, n, direction).moved
    return moved.per_C * C * _element_size(stream_dtype) + moved.fixed * _element_size(coefficient_dtype)


def flops_per_token(method: str, n: int, C: int, direction: str = "forward") -> int:
    return total(method, n, direction).flops.at(C)


def table(method: str, n: int, direction: str = "forward", C: int | None = None) -> str:
    """A plain-text table of the rows and their total (formulas, and numbers when C is given)."""
    lines = []
    head = f"{LABELS[method]}, {direction}, n = {n}" + (f", C = {C}" if C is not None else "")
    lines.append(head)
    width = max(len(r.operation) for r in rows(method, n, direction)) + 2
    cols = f"{'operation':<{width}}{'read':>14}{'write':>14}"
    if C is not None:
        cols += f"{'read @C':>12}{'write @C':>12}"
    lines.append(cols)
    for r in rows(method, n, direction) + [total(method, n, direction)]:
        line = f"{r.operation:<{width}}{str(r.read):>14}{str(r.write):>14}"
        if C is not None:
            line += f"{r.read.at(C):>12,}{r.write.at(C):>12,}"
        lines.append(line)
    return "\n".join(lines)


# ---- the numbers the exercises ask for (their reference solutions) ---------------------------------------


def hc_forward_elements(n: int, C: int) -> int:
    """Elements read + written per token by an unfused HC (or mHC) forward: Table 2's two totals added,
    (8n + 2)C + 2n^2 + 4n."""
    return elements_per_token("hc", n, C)


def minimal_site_forward_elements(n: int, C: int) -> int:
    """Elements read + written per token by the fewest-bytes mHC forward (two kernels around F):
    (3n + 2)C + 2n^2 + 2n."""
    return elements_per_token("mhc_minimal", n, C)


def memory_bound_seconds(tokens: int, n: int, C: int, bandwidth_gbs: float, method: str = "mhc") -> float:
    """The least time the unfused ``method`` forward can take on a machine that moves ``bandwidth_gbs`` GB/s
    (bytes read + written): its bytes (bf16 lanes, float32 coefficients) over the bandwidth."""
    return tokens * bytes_per_token(method, n, C) / (bandwidth_gbs * 1e9)


def res_apply_intensity(n: int, C: int, stream_bytes: int, coefficient_bytes: int) -> float:
    """FLOP per byte of applying H_res to the lanes (Table 2's 'H_res (apply)' row): 2n^2 C FLOPs over
    nC + n^2 elements read and nC written."""
    flops = 2 * n * n * C
    moved = 2 * n * C * stream_bytes + n * n * coefficient_bytes
    return flops / moved


# ---- figures ---------------------------------------------------------------------------------------------


def traffic_figure(C: int, ns=(1, 2, 4, 8), direction: str = "forward", methods=METHODS):
    """Grouped bars: elements moved per token by each method, for each n (plotly)."""
    import plotly.graph_objects as go

    fig = go.Figure()
    for method in methods:
        values = [elements_per_token(method, n, C, direction) for n in ns]
        fig.add_trace(go.Bar(name=LABELS[method], x=[f"n = {n}" for n in ns], y=[v / C for v in values],
                             hovertext=[f"{v:,} elements per token" for v in values]))
    fig.update_layout(barmode="group", height=380,
                      title=f"Elements moved per token, in units of C ({direction}, C = {C})",
                      yaxis_title="elements per token / C", legend=dict(font=dict(size=10)))
    return fig


def chef_figure(method: str = "hc", n: int = 4, C: int | None = None):
    """The memory hierarchy as a kitchen: HBM is the fridge, on-chip memory the countertop, each kernel a
    recipe that fetches its ingredients from the fridge and puts its result back. One arrow pair per kernel,
    as thick as the elements it carries per token."""
    import plotly.graph_objects as go

    ops = rows(method, n)
    tot = total(method, n)
    fig = go.Figure()
    boxes = [
        (0.0, 0.28, "#cfe3f7", "<b>the fridge = HBM</b><br>big (an H200: 141 GB)<br>far: every trip costs time<br>"
                               "(4.8 TB/s shared by all)"),
        (0.48, 0.76, "#fde9c9", "<b>the countertop = on-chip memory</b><br>registers, shared memory, L2<br>"
                                "small (tens of MB in all)<br>close: many times faster"),
        (0.84, 1.0, "#d9f2d9", "<b>the chef = the SMs</b><br>arithmetic is cheap:<br>~1000 TFLOP/s bf16"),
    ]
    for x0, x1, color, text in boxes:
        fig.add_shape(type="rect", x0=x0, x1=x1, y0=0, y1=1, fillcolor=color, line=dict(color="#888"), layer="below")
        fig.add_annotation(x=(x0 + x1) / 2, y=1.0, yanchor="bottom", text=text, showarrow=False, font=dict(size=11))
    k = len(ops)
    lanes = 1 if method == "residual" else n
    biggest = 2 * lanes  # the widest single trip of any plan (the unfused merge reads 2nC): one scale for all
    fridge = (f"holds, per token:<br>x: {lanes} lane{'s' if lanes > 1 else ''} of C<br>F's input and output: C each"
              + ("" if method == "residual" else f"<br>coefficients: {lanes * lanes + 2 * lanes} numbers"))
    fig.add_annotation(x=0.14, y=0.02, yanchor="bottom", text=fridge, showarrow=False, font=dict(size=10))
    fig.add_annotation(x=0.92, y=0.02, yanchor="bottom", showarrow=False, font=dict(size=10),
                       text=f"cooks, per token:<br>{tot.flops} FLOPs<br>for {tot.moved} elements<br>carried")
    for i, r in enumerate(ops):
        y = 0.9 - (i + 0.5) * 0.85 / k
        for src, dst, amount, dy, color, word in ((0.28, 0.48, r.read, 0.025, "#1f77b4", "fetch"),
                                                  (0.48, 0.28, r.write, -0.025, "#d62728", "put back")):
            if amount == ZERO:
                continue
            width = 1 + 7 * min(amount.per_C / biggest, 1.0)
            label = f"{word} {amount}" + (f" = {amount.at(C):,}" if C else "")
            fig.add_annotation(x=dst, y=y + dy, ax=src, ay=y + dy, xref="x", yref="y", axref="x", ayref="y",
                               showarrow=True, arrowhead=2, arrowwidth=width, arrowcolor=color, text="")
            fig.add_annotation(x=0.38, y=y + dy, text=label, showarrow=False, font=dict(size=10, color=color),
                               yshift=9 if dy > 0 else -9)
        wrapped = "<br>".join(textwrap.wrap(f"recipe {i + 1}: {r.operation}", 38))
        fig.add_annotation(x=0.62, y=y, text=wrapped, showarrow=False, font=dict(size=9), xanchor="center")
        fig.add_annotation(x=0.84, y=y, ax=0.77, ay=y, xref="x", yref="y", axref="x", ayref="y", text="",
                           showarrow=True, arrowhead=2, arrowcolor="#2ca02c")
    moved = tot.moved
    summary = (f"{LABELS[method]}, n = {n}: {k} kernel{'s' if k != 1 else ''} (trips to the fridge), "
               f"{tot.read} fetched + {tot.write} put back = {moved} elements per token")
    fig.update_xaxes(visible=False, range=[-0.01, 1.01])
    fig.update_yaxes(visible=False, range=[-0.02, 1.25])
    fig.update_layout(title=dict(text=summary, font=dict(size=13)), height=520, showlegend=False,
                      margin=dict(l=10, r=10, t=60, b=10), plot_bgcolor="white")
    return fig
