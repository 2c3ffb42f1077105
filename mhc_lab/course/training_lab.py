"""Lab 07 (backward, recomputation, training with fused mHC): the backward pieces a learner writes, the
bytes of each pass, measuring what a forward keeps for its backward, a language model on MHCResidualStream,
and (from mhc_lab.course.training_recorded) the views of the H200 training benchmark.

    normalize_step_backward(p, grad_q, dim, eps)      one Sinkhorn normalisation step, backward
    norm_scale_backward(x, grad_inv_r, rms_eps)       the norm's scale 1/r of the flattened lanes, backward
    curves_reading(runs)                              whether the loss figure can tell mHC from the residual
    activation_memory(model, step)                    bytes kept between forward and backward, and the peak
    StreamLM(...)                                     a byte-level transformer: residual, or mHC lanes
    load_recorded(), section(...), site_table(...)    mhc_lab/recorded/training_h200.json, section by section

Everything here runs on the CPU; on a CUDA GPU the memory figures come from the CUDA allocator instead.
"""

from __future__ import annotations

import gc
import math
import statistics
from typing import Callable, Sequence

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from mhc_lab.bench.copy_floor import residual_elements
from mhc_lab.course.training_recorded import (  # noqa: F401 (lab 07 reads the recording through training_lab)
    BLOCK_IMPLEMENTATIONS, RECORDING, SITE_IMPLEMENTATIONS, block_breakdown_table, block_figure, block_overheads,
    block_table, breakdown_reading, clocks_reading, floor_inputs, floor_kernel_rows, floor_kernels_reading,
    floor_kernels_table, load_recorded, measure_live, section, section_label, site_table,
)
from mhc_lab.measure import bytes_model
from mhc_lab.measure import recording_label, synchronize, time_fn  # noqa: F401 (labs use recording_label)
from mhc_lab.models import MLP, CausalSelfAttention
from mhc_lab.ops import MHCResidualStream
from mhc_lab.reference.recompute import memory_without_recompute, optimal_block, recompute_memory


# ---- the backward pieces (the library versions of the lab's exercises) --------------------------------------


def normalize_step_backward(p: torch.Tensor, grad_q: torch.Tensor, dim: int, eps: float = 1e-6) -> torch.Tensor:
    """dL/dP of one Sinkhorn step Q = P / (sum of P along ``dim`` + eps), given dL/dQ.

    With s the sum plus eps: dP = (dQ - sum(dQ * Q along dim)) / s. The sum uses Q, the step's *output*:
    every entry of a row (or column) shares the one denominator s."""
    s = p.sum(dim=dim, keepdim=True) + eps
    q = p / s
    return (grad_q - (grad_q * q).sum(dim=dim, keepdim=True)) / s


def norm_scale_backward(x: torch.Tensor, grad_inv_r: torch.Tensor, rms_eps: float = 1e-6) -> torch.Tensor:
    """dL/dx through the norm's scale 1/r of the flattened lanes, r = sqrt(sum(x^2) / (n C) + rms_eps) their RMS.

    x [..., n, C], grad_inv_r [..., 1] (dL/d(1/r), one number per token). With s = sum(x^2):
    ds = -d(1/r) / (2 n C r^3), then dx = 2 ds x."""
    k = x.shape[-2] * x.shape[-1]
    s = x.pow(2).sum(dim=(-2, -1), keepdim=True)
    r = torch.sqrt(s / k + rms_eps)
    ds = -grad_inv_r.unsqueeze(-1) / (2 * k * r.pow(3))
    return 2 * ds * x


def site_inputs(n: int, C: int, tokens: int, seed: int = 0, dtype=torch.float64) -> dict:
    """Random inputs of one site (lanes, phi, bias, alpha) and a random upstream gradient of its output, with
    coefficients that vary from token to token (phi not zero, gates not small)."""
    from mhc_lab.reference.mhc import mixes_width

    g = torch.Generator().manual_seed(seed)
    m = mixes_width(n)
    return {
        "x": torch.randn(tokens, n, C, generator=g, dtype=torch.float64).to(dtype),
        "phi": (torch.randn(m, n * C, generator=g, dtype=torch.float64) / (n * C) ** 0.5).to(dtype),
        "bias": (torch.randn(m, generator=g, dtype=torch.float64) * 0.5).to(dtype),
        "alpha": (torch.rand(3, generator=g, dtype=torch.float64) + 0.5).to(dtype),
        "grad": torch.randn(tokens, n, C, generator=g, dtype=torch.float64).to(dtype),
    }


def site_gradients(inputs: dict, backend: str) -> dict:
    """One site with F = tanh between pre and post (mhc_lab.ops, the given backend): its output and the
    gradients of x, phi, bias and alpha for the upstream gradient inputs["grad"]."""
    from mhc_lab.ops import mhc_post, mhc_pre

    leaves = {k: inputs[k].detach().clone().requires_grad_(True) for k in ("x", "phi", "bias", "alpha")}
    y, post, res = mhc_pre(leaves["x"], leaves["phi"], leaves["bias"], leaves["alpha"], backend=backend)
    out = mhc_post(leaves["x"], torch.tanh(y), post, res, backend=backend)
    grads = torch.autograd.grad(out, list(leaves.values()), inputs["grad"].to(out.dtype))
    return {"output": out.detach(), **{f"d{k}": g_ for k, g_ in zip(leaves, grads)}}


def relative_errors(got: dict, reference: dict) -> dict:
    """max |got - reference| / max |reference| for every entry, in float64."""
    return {k: ((got[k].double() - reference[k].double()).abs().max() / reference[k].double().abs().max()).item()
            for k in reference}


# ---- bytes of each pass, per token (units of C elements) ----------------------------------------------------

# (read, written) lane-wide elements per token and site, in units of C, for n lanes. Each tensor is read once and
# written once (the least any implementation must move); the O(n^2) coefficients are left out.
def site_elements(n: int) -> dict[str, tuple[int, int]]:
    """Least lane-wide elements (read, written) per token of one site's passes, in units of C: the lanes part
    of bytes_model's "mhc_minimal" rows, named for lab 07 (tests/test_backward.py keeps the two equal)."""
    return {
        "forward pre   (x -> y = H_pre x)": (n, 1),
        "forward post  (x, f -> H_res x + H_post f)": (n + 1, n),
        "backward post (g, x, f -> dx, df)": (2 * n + 1, n + 1),
        "backward pre  (x, dy, dx from post -> dx)": (2 * n + 1, n),
    }


def bytes_table(n: int, C: int, itemsize: int = 2) -> str:
    """The least lane-wide bytes of a site's forward and backward (and the plain residual's), per token."""
    lines = [f"{'pass':<46}{'read':>8}{'written':>9}{'bytes per token':>17}"]
    total = {"mHC": 0, "residual": 0}
    for label, rows in (("mHC", site_elements(n)), ("residual", residual_elements())):
        for name, (r, w) in rows.items():
            lines.append(f"{label + ' ' + name:<46}{f'{r}C':>8}{f'{w}C':>9}{(r + w) * C * itemsize:>17,}")
            total[label] += r + w
    lines.append(f"total per token and site: mHC {total['mHC']}C, residual {total['residual']}C "
                 f"({total['mHC'] / total['residual']:.1f}x), at C = {C} and {itemsize}-byte lanes: "
                 f"{total['mHC'] * C * itemsize:,} vs {total['residual'] * C * itemsize:,} bytes")
    return "\n".join(lines)


def designs_table(n: int) -> str:
    """Lane-wide elements per token of one site, forward and backward, for this course's three ways of running
    the kernels and for the least design (mhc_lab.measure.bytes_model)."""
    width = 58
    lines = [f"{'design':<{width}}{'forward':>9}{'backward':>10}{'total':>8}"]

    def line(label, forward, backward):
        lines.append(f"{label:<{width}}{f'{forward}C':>9}{f'{backward}C':>10}{f'{forward + backward}C':>8}")

    for method in bytes_model.IMPLEMENTATIONS + ("mhc_minimal",):
        forward, backward = (bytes_model.total(method, n, d).moved.per_C for d in bytes_model.DIRECTIONS)
        line(bytes_model.LABELS[method], forward, backward)
        if method == "ours_chained":  # the same with the post's output gradient handed to the pre
            line("  ... the post's output gradient to the pre", forward,
                 backward - bytes_model.post_gradient_saving(n))
    return "\n".join(lines)


def site_total_elements(n: int, recompute: bool = False) -> int:
    """Least lane-wide elements per token of one site's forward + backward (units of C); with recompute, the
    forward's mHC part runs a second time in the backward."""
    forward, backward = (bytes_model.total("mhc_minimal", n, d).moved.per_C for d in bytes_model.DIRECTIONS)
    return forward + backward + (forward if recompute else 0)


def overhead_floor(n: int, C: int, tokens: int, block_ms: float, bandwidth_gbps: float, *, sites: int = 2,
                   itemsize: int = 2, recompute: bool = False) -> tuple[float, float]:
    """(ms, percent of block_ms) that the least bytes of ``sites`` mHC sites' forward + backward take at
    ``bandwidth_gbps``, minus the plain residual's bytes that they replace: mHC's extra time if it ran at the
    copy bandwidth and overlapped nothing."""
    extra = site_total_elements(n, recompute) - sum(r + w for r, w in residual_elements().values())
    ms = sites * extra * C * itemsize * tokens / (bandwidth_gbps * 1e9) * 1e3
    return ms, ms / block_ms * 100


# ---- what a forward keeps for its backward ------------------------------------------------------------------


def _storage_key(t: torch.Tensor):
    s = t.untyped_storage()
    return s.data_ptr(), s


class _LiveStorages(TorchDispatchMode):
    """Tracks every tensor storage created by an operation under it: the bytes still alive, op by op, and the
    largest sum seen. Storages that existed before (parameters, inputs, preallocated gradients) are left out."""

    def __init__(self, existing: set[int]):
        super().__init__()
        self.existing = existing
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.peak = 0

    def current(self) -> int:
        for key in [k for k, (ref, _) in self.live.items() if ref.expired()]:
            del self.live[key]
        total = sum(size for _, size in self.live.values())
        self.peak = max(self.peak, total)
        return total

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.current()  # storages freed by this op first, so a reused address is a new storage
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                key, storage = _storage_key(t)
                if key and key not in self.existing and key not in self.live and storage.nbytes():
                    self.live[key] = (StorageWeakRef(storage), storage.nbytes())
        self.current()
        return out


def activation_memory(model: nn.Module, forward: Callable[[], torch.Tensor], inputs: Sequence = ()) -> dict:
    """Run ``loss = forward()`` and ``loss.backward()`` once; return the bytes of tensors the forward left alive
    for the backward ("kept"), and the largest number of bytes alive at any moment of forward and backward
    ("peak"); parameters, their gradients and ``inputs`` not counted.

    On the CPU the bytes are counted tensor by tensor (every storage an operation creates, until it is freed):
    the same on every machine. On CUDA they are the allocator's, torch.cuda.memory_allocated and
    max_memory_allocated, relative to before the forward."""
    params = list(model.parameters())
    for p in params:  # gradients allocated now, so the backward's accumulation is not counted as activations
        if p.requires_grad and p.grad is None:
            p.grad = torch.zeros_like(p)
    device = params[0].device if params else torch.device("cpu")
    gc.collect()
    if device.type == "cuda":
        synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        loss = forward()
        synchronize(device)
        kept = torch.cuda.memory_allocated(device) - before
        loss.backward()
        synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) - before
        del loss
        return {"kept": kept, "peak": peak}
    existing = {_storage_key(t)[0] for t in [*params, *[p.grad for p in params if p.grad is not None], *inputs]}
    tracker = _LiveStorages(existing)
    with tracker:
        loss = forward()
        kept = tracker.current()
        loss.backward()
        del loss
        tracker.current()
    return {"kept": kept, "peak": tracker.peak}


# ---- recomputation in blocks (selective activation checkpointing) --------------------------------------------


# ---- the layers and models the lab trains ------------------------------------------------------------------


class RMSNorm(nn.Module):
    """RMSNorm written without in-place operations (torch.nn.RMSNorm adds eps in place on the CPU), so that
    selective activation checkpointing may keep its intermediate results (mhc_lab.ops.recompute_policy
    refuses layers that modify a kept tensor in place)."""

    def __init__(self, width: int, eps: float = 1e-6):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(width)), eps

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h * torch.rsqrt(h.pow(2).mean(dim=-1, keepdim=True) + self.eps) * self.weight


class Sublayer(nn.Module):
    """F(h) = sublayer(RMSNorm(h)): the layer function a connection wraps (pre-norm). With ``autocast`` a 16-bit
    float dtype, F runs under torch.autocast of that dtype (its matrix products in 16 bits, its parameters kept
    in float32); the connection around it, and the mHC ops, stay outside autocast."""

    def __init__(self, width: int, sublayer: nn.Module, autocast: torch.dtype | None = None):
        super().__init__()
        self.norm, self.sublayer, self.autocast = RMSNorm(width), sublayer, autocast

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.autocast is None:
            return self.sublayer(self.norm(h))
        with torch.autocast(device_type=h.device.type, dtype=self.autocast):
            return self.sublayer(self.norm(h)).to(h.dtype)


def mlp_stack(width: int, layers: int, seed: int = 0) -> list[nn.Module]:
    """``layers`` pre-norm MLP sub-layers (4 width hidden, GELU), seeded."""
    torch.manual_seed(seed)
    return [Sublayer(width, MLP(width)) for _ in range(layers)]


class StreamLM(nn.Module):
    """A byte-level transformer whose 2 * depth sub-layers (attention, MLP) are joined by a plain residual
    (connection="residual") or by mHC lanes on mhc_lab.ops.MHCResidualStream (connection="mhc",
    with its backend and recompute_block).

    The weights are created in the same order for both connections, so the same seed gives the same embedding,
    sub-layers and head; the mHC sites start near the identity (mhc_identity_init) and draw no random numbers.
    lane_dtype: the dtype of the hidden state and of the lanes (bfloat16 for the CUDA kernels). With a 16-bit
    lane dtype the sub-layers run under torch.autocast of that dtype; the embedding, the mHC coefficients, the
    final norm and the head stay in float32, and every parameter is float32."""

    def __init__(self, vocab: int = 256, width: int = 64, depth: int = 2, heads: int = 4, seq_len: int = 64,
                 connection: str = "mhc", n: int = 4, backend: str = "auto", recompute_block=None,
                 lane_dtype: torch.dtype | None = None):
        super().__init__()
        if connection not in ("residual", "mhc"):
            raise ValueError(f"connection: expected 'residual' or 'mhc', got {connection!r}")
        self.connection, self.seq_len, self.lane_dtype = connection, seq_len, lane_dtype
        autocast = lane_dtype if lane_dtype in (torch.bfloat16, torch.float16) else None
        self.embed = nn.Embedding(vocab, width)
        self.position = nn.Parameter(torch.randn(seq_len, width) * 0.02)
        sublayers = []
        for _ in range(depth):
            sublayers += [Sublayer(width, CausalSelfAttention(width, heads), autocast),
                          Sublayer(width, MLP(width), autocast)]
        self.norm = RMSNorm(width)
        self.head = nn.Linear(width, vocab)
        if connection == "mhc":
            self.stream = MHCResidualStream(sublayers, n, width, backend=backend, recompute_block=recompute_block)
        else:
            self.sublayers = nn.ModuleList(sublayers)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        T = idx.shape[1]
        if T > self.seq_len:
            raise ValueError(f"sequence of {T} tokens is longer than the model's seq_len {self.seq_len}")
        h = self.embed(idx) + self.position[:T]
        if self.lane_dtype is not None:
            h = h.to(self.lane_dtype)
        if self.connection == "mhc":
            h = self.stream(h)
        else:
            for f in self.sublayers:
                h = h + f(h)
        return self.head(self.norm(h.float()))


def training_step(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> Callable[[], torch.Tensor]:
    """A function computing the cross-entropy of ``model`` on ``batch`` (the forward of one training step)."""
    x, y = batch

    def forward() -> torch.Tensor:
        return nn.functional.cross_entropy(model(x).flatten(0, -2), y.flatten())

    return forward


def step_profile(model: nn.Module, batch, *, repeat: int = 5, warmup: int = 2) -> dict:
    """Median seconds of forward + backward of one step, and its activation memory (see activation_memory)."""
    forward = training_step(model, batch)

    def step():
        model.zero_grad(set_to_none=False)
        forward().backward()

    device = next(model.parameters()).device
    timing = time_fn(step, warmup=warmup, repeat=repeat, device=device)
    memory = activation_memory(model, forward, inputs=batch)
    return {"seconds": timing["median_s"], **memory}


# ---- the recompute trade-off, measured ------------------------------------------------------------------------


class _ResidualStack(nn.Module):
    def __init__(self, layers: Sequence[nn.Module]):
        super().__init__()
        self.layers = nn.ModuleList(layers)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        for f in self.layers:
            h = h + f(h)
        return h


def recompute_sweep(blocks: Sequence, *, n: int = 4, width: int = 64, layers: int = 12, tokens: int = 256,
                    backend: str = "reference", device="cpu", repeat: int = 5, seed: int = 0) -> list[dict]:
    """Forward + backward of a stack of ``layers`` pre-norm MLP sub-layers, joined by a plain residual (first
    row, block "residual") and by mHC lanes (MHCResidualStream) for every recompute block size in ``blocks`` (None:
    keep everything). One row each: kept and peak bytes (activation_memory), the median time; for mHC also
    the part above the residual stack in C-wide float32 vectors per token, and Eq. 20's memory in units of C."""
    rows = []
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(tokens, width, generator=g).to(device)
    unit = tokens * width * 4  # one float32 C-wide vector per token
    for block in ["residual", *blocks]:
        if block == "residual":
            model = _ResidualStack(mlp_stack(width, layers, seed))
        else:
            model = MHCResidualStream(mlp_stack(width, layers, seed), n, width, backend=backend, recompute_block=block)
            with torch.no_grad():  # coefficients that depend on the lanes, as after some training
                for site in model.connections:
                    site.phi.normal_(0, 0.02, generator=torch.Generator().manual_seed(seed + 1))
        model.to(device)

        def forward(model=model):
            return model(h).square().mean()

        def step(model=model, forward=forward):
            model.zero_grad(set_to_none=False)
            forward().backward()

        seconds = time_fn(step, warmup=2, repeat=repeat, device=device)["median_s"]
        memory = activation_memory(model, forward, inputs=[h])
        row = {"block": block, "seconds": seconds, "kept": memory["kept"], "peak": memory["peak"]}
        if block != "residual":
            base = rows[0]
            row.update(kept_C=(memory["kept"] - base["kept"]) / unit, peak_C=(memory["peak"] - base["peak"]) / unit,
                       eq20_C=memory_without_recompute(n, layers) if block is None
                       else recompute_memory(n, layers, block))
        rows.append(row)
    return rows


def recompute_table(rows: Sequence[dict], n: int, layers: int) -> str:
    """The sweep as text: Eq. 20 against the measured part above the plain residual, and the time."""
    best, _ = optimal_block(n, layers)
    base = next(r for r in rows if r["block"] == "residual")
    lines = [f"plain residual stack: kept {base['kept'] / 2**20:.2f} MiB, peak {base['peak'] / 2**20:.2f} MiB, "
             f"fwd+bwd {base['seconds'] * 1e3:.1f} ms",
             "mHC, above the plain residual (C-wide float32 vectors per token):",
             f"{'block L_r':>10}{'Eq. 20':>9}{'kept':>9}{'peak':>9}{'fwd+bwd':>12}{'vs residual':>13}"]
    for r in rows:
        if r["block"] == "residual":
            continue
        name = "none" if r["block"] is None else str(r["block"])
        mark = "  <- Eq. 20's optimum" if r["block"] == best else ""
        lines.append(f"{name:>10}{r['eq20_C']:>9}{r['kept_C']:>9.1f}{r['peak_C']:>9.1f}"
                     f"{r['seconds'] * 1e3:>9.1f} ms{(r['seconds'] / base['seconds'] - 1) * 100:>+12.0f}%{mark}")
    return "\n".join(lines)


def recompute_figure(rows: Sequence[dict], n: int, layers: int, where: str = "this machine"):
    """Memory (kept and peak, C per token) against the fwd + bwd time, one point per block size."""
    import plotly.graph_objects as go

    best, _ = optimal_block(n, layers)
    rows = [r for r in rows if r["block"] != "residual"]
    names = ["none" if r["block"] is None else f"L_r={r['block']}" for r in rows]
    fig = go.Figure()
    for key, label, symbol in (("peak_C", "peak during forward + backward", "circle"),
                               ("kept_C", "kept from forward for backward", "square")):
        fig.add_scatter(x=[r["seconds"] * 1e3 for r in rows], y=[r[key] for r in rows], mode="markers+text",
                        text=names, textposition="top center", name=label, marker=dict(size=10, symbol=symbol))
    opt = [r for r in rows if r["block"] == best]
    if opt:
        fig.add_scatter(x=[opt[0]["seconds"] * 1e3], y=[opt[0]["peak_C"]], mode="markers",
                        marker=dict(size=22, color="rgba(0,0,0,0)", line=dict(width=3, color="#d62728")),
                        name=f"Eq. 20's optimum, L_r = {best}")
    fig.update_layout(title=f"Recompute blocks: {layers} mHC sub-layers, n = {n} ({where})", height=430,
                      xaxis_title="forward + backward (ms)", yaxis_title="memory above the plain residual (C-wide "
                      "vectors per token)")
    return fig


def eq20_figure(n: int, layers: int):
    """Eq. 20's memory n ceil(L / L_r) + (n + 2) L_r against L_r, with the integer optimum and sqrt(nL/(n+2))."""
    import plotly.graph_objects as go

    blocks = list(range(1, layers + 1))
    memory = [recompute_memory(n, layers, b) for b in blocks]
    best, best_memory = optimal_block(n, layers)
    approx = math.sqrt(n * layers / (n + 2))
    fig = go.Figure()
    fig.add_scatter(x=blocks, y=memory, mode="lines+markers", name="n ceil(L/L_r) + (n+2) L_r")
    fig.add_scatter(x=blocks, y=[n * math.ceil(layers / b) for b in blocks], mode="lines", name="block inputs kept",
                    line=dict(dash="dot"))
    fig.add_scatter(x=blocks, y=[(n + 2) * b for b in blocks], mode="lines", name="active block's transients",
                    line=dict(dash="dot"))
    fig.add_scatter(x=[best], y=[best_memory], mode="markers", marker=dict(size=14, color="#d62728"),
                    name=f"integer optimum L_r = {best}: {best_memory}C")
    fig.add_vline(x=approx, line_dash="dash", annotation_text=f"sqrt(nL/(n+2)) = {approx:.2f}")
    fig.add_hline(y=memory_without_recompute(n, layers), line_dash="dash", line_color="#7f7f7f",
                  annotation_text=f"no recompute: {memory_without_recompute(n, layers)}C")
    fig.update_layout(title=f"Eq. 20 at n = {n}, L = {layers}", height=400, xaxis_title="block size L_r",
                      yaxis_title="memory per token (units of C)", yaxis_rangemode="tozero")
    return fig


# ---- training three ways -----------------------------------------------------------------------------------


def curves_reading(runs: dict, smooth: int = 5) -> str:
    """Whether the loss figure can tell each run from the residual one: over the last quarter of the steps (at
    least ``smooth``), each run's mean loss less the residual's on the same batches, against the wiggle of the
    plotted curve (the residual's standard deviation over those steps, over sqrt(smooth) for the mean of
    ``smooth`` the figure draws)."""
    base = runs["residual"]["loss"]
    k = max(smooth, len(base) // 4)
    wiggle = statistics.stdev(base[-k:]) / math.sqrt(smooth)
    lines = [f"mean loss of the last {k} steps: "
             + ", ".join(f"{name} {statistics.fmean(run['loss'][-k:]):.3f}" for name, run in runs.items())]
    apart = []
    for name, run in runs.items():
        if name == "residual":
            continue
        gap = statistics.fmean(a - b for a, b in zip(run["loss"][-k:], base[-k:]))
        apart.append(abs(gap) > wiggle)
        lines.append(f"{name} less residual, step by step: {gap:+.4f} nats per byte, against the plotted curves' "
                     f"wiggle of {wiggle:.4f}: " + ("apart" if apart[-1] else "too close to tell apart"))
    lines.append(f"after {len(base)} steps: " + ("the figure cannot tell mHC from the residual" if not any(apart)
                                                 else "mHC and the residual train apart"))
    return "\n".join(lines)


def loss_figure(runs: dict, title: str, smooth: int = 5):
    import plotly.graph_objects as go

    fig = go.Figure()
    styles = {"residual": dict(color="#7f7f7f"), "mHC, reference": dict(color="#1f77b4"),
              "mHC, kernels": dict(color="#ff7f0e", dash="dot")}
    for name, run in runs.items():
        losses = run["loss"]
        mean = [sum(losses[max(0, i - smooth + 1):i + 1]) / (i + 1 - max(0, i - smooth + 1))
                for i in range(len(losses))]
        fig.add_scatter(x=run["step"], y=mean, name=f"{name} (mean of {smooth})", line=styles.get(name, {}))
    fig.update_layout(title=title, height=420, xaxis_title="step", yaxis_title="cross-entropy (nats per byte)")
    return fig


def profile_table(profiles: dict, device_type: str) -> str:
    memory = "CUDA allocator" if device_type == "cuda" else "tensors counted"
    base = profiles.get("residual")
    lines = [f"{'model':<26}{'fwd+bwd':>12}{'vs residual':>13}{'kept (MiB)':>13}{'peak (MiB)':>13}   memory: {memory}"]
    for name, p in profiles.items():
        over = f"{(p['seconds'] / base['seconds'] - 1) * 100:+.0f}%" if base else ""
        lines.append(f"{name:<26}{p['seconds'] * 1e3:>9.1f} ms{over:>13}{p['kept'] / 2**20:>13.2f}"
                     f"{p['peak'] / 2**20:>13.2f}")
    if device_type == "cuda":
        lines.append("At this size the host sets these times, not the GPU: each op waits for Python and dispatch to "
                     "launch it. Lab 08 takes the two clocks apart (launched against GPU time).")
    return "\n".join(lines)
