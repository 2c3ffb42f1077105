"""Lab 07 (backward, recomputation, training with fused mHC): the backward pieces a learner writes, the
bytes of each pass, measuring what a forward keeps for its backward, a language model on MHCResidualStream,
and the views of the recorded H200 training benchmark.

    normalize_step_backward(p, grad_q, dim, eps)      one Sinkhorn normalisation step, backward
    norm_scale_backward(x, grad_r, rms_eps)           the RMS scale r of the flattened lanes, backward
    activation_memory(model, step)                    bytes kept between forward and backward, and the peak
    StreamLM(...)                                     a byte-level transformer: residual, or mHC lanes
    load_recorded() / recording_label(...)            mhc_lab/recorded/training_h200.json, if present
    lane_mix_table(n, C)                              a mix's lane values bound once or pasted n times, counted
                                                      in the CUDA TileLang generates

Everything here runs on the CPU; on a CUDA GPU the memory figures come from the CUDA allocator instead.
"""

from __future__ import annotations

import gc
import json
import math
import statistics
import textwrap
from typing import Callable, Sequence

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from mhc_lab.measure import bytes_model
from mhc_lab.measure import (  # noqa: F401 (labs use recording_label)
    recorded_or_none, recording_label, synchronize, time_fn,
)
from mhc_lab.models import MLP, CausalSelfAttention
from mhc_lab.reference.recompute import memory_without_recompute, optimal_block, recompute_memory
from mhc_lab.ops.training import LANE_TUNABLE, MHCResidualStream

RECORDING = "training_h200"


# ---- the backward pieces (the library versions of the lab's exercises) --------------------------------------


def normalize_step_backward(p: torch.Tensor, grad_q: torch.Tensor, dim: int, eps: float = 1e-6) -> torch.Tensor:
    """dL/dP of one Sinkhorn step Q = P / (sum of P along ``dim`` + eps), given dL/dQ.

    With s the sum plus eps: dP = (dQ - sum(dQ * Q along dim)) / s. The sum uses Q, the step's *output*:
    every entry of a row (or column) shares the one denominator s."""
    s = p.sum(dim=dim, keepdim=True) + eps
    q = p / s
    return (grad_q - (grad_q * q).sum(dim=dim, keepdim=True)) / s


def norm_scale_backward(x: torch.Tensor, grad_r: torch.Tensor, rms_eps: float = 1e-6) -> torch.Tensor:
    """dL/dx through the RMS scale of the flattened lanes, r = (sum(x^2) / (n C) + rms_eps)^(-1/2).

    x [..., n, C], grad_r [..., 1] (one number per token). ds = -r^3 / (2 n C) dr, then dx = 2 ds x."""
    k = x.shape[-2] * x.shape[-1]
    s = x.pow(2).sum(dim=(-2, -1), keepdim=True)
    r = torch.rsqrt(s / k + rms_eps)
    ds = -0.5 * r.pow(3) / k * grad_r.unsqueeze(-1)
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
    """One site with F = tanh between pre and post (mhc_lab.ops.training, the given backend): its output and the
    gradients of x, phi, bias and alpha for the upstream gradient inputs["grad"]."""
    from mhc_lab.ops.training import mhc_post, mhc_pre

    leaves = {k: inputs[k].detach().clone().requires_grad_(True) for k in ("x", "phi", "bias", "alpha")}
    y, post, res = mhc_pre(leaves["x"], leaves["phi"], leaves["bias"], leaves["alpha"], backend=backend)
    out = mhc_post(leaves["x"], torch.tanh(y), post, res, backend=backend)
    grads = torch.autograd.grad(out, list(leaves.values()), inputs["grad"].to(out.dtype))
    return {"output": out.detach(), **{f"d{k}": g_ for k, g_ in zip(leaves, grads)}}


def relative_errors(got: dict, reference: dict) -> dict:
    """max |got - reference| / max |reference| for every entry, in float64."""
    return {k: ((got[k].double() - reference[k].double()).abs().max() / reference[k].double().abs().max()).item()
            for k in reference}


# ---- two sites' backward in one pass (the joined kernel, C target) ------------------------------------------

JOINED_NAMES = ("dx_prev", "df_prev", "dres", "dpost", "dphi")


def joined_operands(n: int, C: int, tokens: int, seed: int = 0) -> dict:
    """Random float64 operands of the joined backward: site i's lanes, dy, kernel 1's outputs (pre, dmix, extra),
    phi and dx_post; site p's lanes, f, H_post and (row-stochastic) H_res."""
    from mhc_lab.reference.mhc import mixes_width

    gen, m = torch.Generator().manual_seed(seed), mixes_width(n)

    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    return {"x": rand(tokens, n, C), "dy": rand(tokens, C), "pre": rand(tokens, n), "dmix": rand(tokens, m),
            "extra": rand(tokens, 4), "phi": rand(m, n * C) / (n * C) ** 0.5, "dx_post": rand(tokens, n, C),
            "x_prev": rand(tokens, n, C), "f_prev": rand(tokens, C), "post_prev": rand(tokens, n),
            "res_prev": torch.softmax(rand(tokens, n, n), -1)}


def joined_outputs(o: dict, joined: bool) -> dict:
    """Site p's dx_post (dx_prev), df, dH_res, dH_post and site i's dphi from the C-target kernels in float32:
    the joined kernel (joined), or kernel 2 writing site i's dx and the post backward reading it back."""
    from mhc_lab.kernels._target import compile_program
    from mhc_lab.kernels.joined_backward import coef_blocks, coefficients_from_partial, joined_backward_kernel
    from mhc_lab.kernels.post_backward import post_backward_kernel
    from mhc_lab.kernels.pre_backward import pre_backward_lanes_program
    from mhc_lab.reference.mhc import mixes_width

    f32 = {k: v.float().contiguous() for k, v in o.items()}
    tokens, n, C = o["x"].shape
    site = [f32[k] for k in ("x", "dy", "pre", "dmix", "extra", "phi", "dx_post")]
    dx_prev, df_prev, dphi = torch.empty(tokens, n, C), torch.empty(tokens, C), torch.empty(1, mixes_width(n), n * C)
    if joined:
        coef = torch.empty(tokens, coef_blocks(C), n * n + n)
        joined_backward_kernel(n, C)(*site, *(f32[k] for k in ("x_prev", "f_prev", "post_prev", "res_prev")),
                                     dx_prev, df_prev, dphi, coef)
        dres, dpost = coefficients_from_partial(coef, n)
    else:
        dx, dpost, dres = torch.empty(tokens, n, C), torch.empty(tokens, n), torch.empty(tokens, n, n)
        compile_program(pre_backward_lanes_program(n, C, "float32", "c", add_dx=True), "c")(*site, dx, dphi)
        post_backward_kernel(n, C, "float32", "c")(f32["x_prev"], f32["f_prev"], dx, f32["post_prev"],
                                                   f32["res_prev"], dx_prev, df_prev, dpost, dres)
    return dict(zip(JOINED_NAMES, (dx_prev, df_prev, dres, dpost, dphi[0])))


def joined_table(n: int, C: int, tokens: int, seed: int = 0) -> str:
    """The joined kernel against the two it joins, on the CPU (C target), and the lane-wide elements each way
    moves per token (bf16 on a GPU; the partial sums of dH_res and dH_post, n^2 + n floats per token and column
    block, are left out)."""
    o = joined_operands(n, C, tokens, seed)
    one, two = joined_outputs(o, True), joined_outputs(o, False)
    errors = relative_errors(one, two)
    lines = [f"n = {n}, C = {C}, {tokens} tokens: joined against apart, relative difference < 1e-6: "
             + ", ".join(f"{k} {errors[k] < 1e-6}" for k in JOINED_NAMES)]
    # (read, written): kernel 2 reads x, dy, dx_post and writes dx; the post backward reads that dx as g, with
    # site p's x and f, and writes site p's dx_post and df; joined, the five inputs in and the two outputs out
    apart = (2 * n + 1, n), (2 * n + 1, n + 1)
    joined = (3 * n + 2, n + 1)
    total_apart = sum(r + w for r, w in apart)
    lines.append(f"apart: kernel 2 {sum(apart[0])}C + post backward {sum(apart[1])}C = {total_apart}C per token; "
                 f"joined: {sum(joined)}C ({total_apart - sum(joined)}C fewer: site i's dx neither written nor "
                 "read back)")
    return "\n".join(lines)


JOINED_PARTS = {(): "the joined kernel", ("row_sums",): "  without the row sums",
                ("outputs",): "  without dx_prev and df_prev", ("second_barrier",): "  without the second barrier",
                ("outputs", "row_sums"): "  without both"}


def joined_h200_table(results: dict | None, epilogue: str = "reduce_sum") -> str:
    """The joined kernel on the H200 (the recording's sweeps with "joined" rows whose epilogue is ``epilogue``),
    per shape: kernel 2 with dx_post and the post backward apart, the joined kernel, and (where the sweep has
    them) the joined kernel with parts of its epilogue left out (joined_leave_out: timing experiments, their
    outputs are wrong); then the pass that sums its partials, as each run summed them."""
    sweeps = (results or {}).get("sweeps") or []
    one_pass = {(sw["tokens"], sw["C"]): (r["sums_ms"], sw["run"]) for sw in sweeps for r in sw.get("lanes") or []
                if r.get("joined") and str(r.get("sums_pass", "")).startswith("one pass")}
    width = 40
    lines = [f"{'tokens':>7}{'C':>6}  {'':{width}}{'ms':>7}{'vs apart':>10}  run"]
    for sweep in sweeps:
        rows = [r for r in sweep.get("lanes") or [] if r.get("joined") and "ms" in r
                and str(r.get("epilogue", "")).startswith(epilogue)]
        if not rows:
            continue
        apart = rows[0]["kernel2_ms"] + rows[0]["post_backward_ms"]
        lines.append(f"{sweep['tokens']:>7}{sweep['C']:>6}  {'kernel 2 with dx_post + post backward':{width}}"
                     f"{apart:>7.3f}{'':>10}  {sweep['run']}")
        for r in rows:
            part = JOINED_PARTS.get(tuple(sorted(r.get("joined_leave_out") or ())), str(r.get("joined_leave_out")))
            lines.append(f"{'':15}{part:{width}}{r['ms']:>7.3f}{r['ms'] / apart:>9.2f}x  {sweep['run']}")
        lines.append(f"{'':15}{'  + its partials summed in three slices':{width}}{rows[0]['sums_ms']:>7.3f}"
                     f"{'':>10}  {sweep['run']}")
        if (sweep["tokens"], sweep["C"]) in one_pass:
            ms, run = one_pass[sweep["tokens"], sweep["C"]]
            lines.append(f"{'':15}{'  + its partials summed in one pass':{width}}{ms:>7.3f}{'':>10}  {run}")
    return "\n".join(lines) if len(lines) > 1 else "(no recorded runs of the joined kernel)"


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


def residual_elements() -> dict[str, tuple[int, int]]:
    """The plain residual h + F(h): the add forward, and in backward the gradient copied past F and added."""
    return {"forward add (h, f -> h + f)": (2, 1), "backward add (g, dh from F -> dh)": (2, 1)}


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
    selective activation checkpointing may keep its intermediate results (mhc_lab.ops.training.recompute_policy
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
    (connection="residual") or by mHC lanes on mhc_lab.ops.training.MHCResidualStream (connection="mhc",
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
    return "\n".join(lines)


# ---- the recorded H200 benchmark (mhc_lab/recorded/training_h200.json) ------------------------------------------


def load_recorded(name: str = RECORDING) -> dict | None:
    """This benchmark's recording, or None when there is none (yet)."""
    return recorded_or_none(name)


SITE_IMPLEMENTATIONS = {"ours": "ours (TileLang)", "ours_linked": "ours, linked", "ours_chained": "ours, chained",
                        "tilekernels": "TileKernels",
                        "compiled": "torch.compile", "eager": "eager"}
BLOCK_IMPLEMENTATIONS = {"residual": "plain residual", "copy_floor": "copy floor (mHC's bytes)",
                         "mhc_ours": "mHC, ours",
                         "mhc_ours_chained": "mHC, ours, chained", "mhc_ours_joined": "mHC, ours, joined",
                         "mhc_ours_recompute": "mHC, ours + recompute", "mhc_tilekernels": "mHC, TileKernels",
                         "mhc_compiled": "mHC, torch.compile",
                         "residual_weight_grads_inline": "plain, no side stream"}


def _ms(value, unit: str = "") -> str:
    return f"{value:.2f}{unit}" if isinstance(value, (int, float)) else "-"


def site_table(results: dict) -> str:
    """One site (pre + post, F = identity), forward + backward: ms per implementation. Where the recording has
    them, first the GPU's time (each site captured as a CUDA graph and replayed), then the time launched op by
    op from Python, which adds whatever host work outlasts the kernels. The ratio and the share of copy speed
    are those of the chained site, what a stack of MHCConnections runs on CUDA."""
    rows = (results or {}).get("site") or []
    if not rows:
        return "(no site measurements)"
    copy = (results or {}).get("copy_gbps")
    tables = []
    for key, title in (("graph_ms", "GPU time (CUDA graph replay):"), ("times_ms", "launched op by op:")):
        names = [k for k in SITE_IMPLEMENTATIONS if any(k in (r.get(key) or {}) for r in rows)]
        if not names:
            continue
        lines = [title, f"{'tokens':>7}{'C':>6}{'n':>3}" + "".join(f"{SITE_IMPLEMENTATIONS[k]:>17}" for k in names)
                 + f"{'chained vs TK':>15}{'chained, 41C at':>18}"]
        for r in rows:
            times = r.get(key) or {}
            ours, tk = times.get("ours_chained"), times.get("tilekernels")
            number = isinstance(ours, (int, float)) and ours > 0
            ratio = f"{ours / tk:.2f}x" if number and isinstance(tk, (int, float)) and tk > 0 else "-"
            least = (r.get("bytes") or {}).get("least")
            fraction = f"{least / (ours * 1e-3) / 1e9 / copy:.0%} of copy" if number and least and copy else "-"
            lines.append(f"{r.get('tokens', '?'):>7}{r.get('C', '?'):>6}{r.get('n', 4):>3}"
                         + "".join(f"{_ms(times.get(k), ' ms'):>17}" for k in names) + f"{ratio:>15}{fraction:>18}")
        tables.append("\n".join(lines))
    return "\n\n".join(tables)


def kernel2_steps_command() -> str:
    """The benchmark command that records kernel 2's steps: each leave_out prefix with dx_post, and the whole
    kernel and its last step without."""
    from mhc_lab.kernels.pre_backward import LANE_LEAVE_OUT_STEPS as steps

    variants = [{"add_dx": True, **({"leave_out": list(steps[:k])} if k else {})} for k in range(len(steps) + 1)]
    variants += [{}, {"leave_out": list(steps)}]
    return f"python -m mhc_lab.bench training --parts sweep --sweep '{json.dumps(variants, separators=(',', ':'))}'"


KERNEL2_STEP_LABELS = ("  without the dphi GEMM", "  also without the dx GEMMs",
                      "  also without the dmix operands' loads")


def kernel2_steps_table(recording: dict | None = None, run: str = "U", lane_group: int = 2) -> str:
    """Kernel 2 of the pre backward (dx and the dphi partials) taken apart on the H200: its time as it is, then
    with one part after another left out (timing experiments: python -m mhc_lab.bench training --parts sweep
    with "leave_out"), and its bytes at the recording's copy bandwidth; with the linked site's dx_post (13C per
    token) and without it (9C). Only shapes where the sweep's one token split is what the site runs too (the
    wave rule of lane_splits_for on the recording's GPU; a row's "token_splits", or 1 where an older sweep did not
    record it), so that each column is the kernel as a site runs it. ``lane_group``: the lanes per CTA a site's
    kernel 2 took when the run was made (two in run U; the splits rule depends on it)."""
    from mhc_lab.kernels.pre_backward import LANE_LEAVE_OUT_STEPS, lane_splits_for

    recording = recording if recording is not None else load_recorded()
    results = (recording or {}).get("results") or {}
    sms = ((recording or {}).get("environment") or {}).get("sm_count")
    copy = results.get("copy_gbps")
    n = results.get("n", 4)

    def as_a_site_runs(shape, row):  # the splits a site runs, and no other tuning
        rule = (lane_splits_for(n, shape["C"], sms, add_dx=bool(row.get("add_dx")), lane_group=lane_group,
                                consumer_groups=1)  # one consumer warpgroup before run AV
                if sms else None)
        tuned = set(row) & set(LANE_TUNABLE)
        return row.get("token_splits", 1) == rule and not tuned

    def timed(shape, add_dx, left):
        for row in shape.get("lanes", []):
            if (bool(row.get("add_dx")) == add_dx and tuple(row.get("leave_out") or ()) == left
                    and as_a_site_runs(shape, row)):
                return row.get("ms")
        return None

    sweeps = results.get("sweeps") or []
    # the named run's entries; in a recording the benchmark wrote itself (no run names), all of them
    shapes = [s for s in sweeps if s.get("run") == run] or [s for s in sweeps if "run" not in s]
    shapes = [s for s in shapes if timed(s, True, ()) is not None]
    if not shapes:
        return (f"(no kernel 2 leave_out sweep of run {run} in mhc_lab/recorded/training_h200.json; on a CUDA GPU "
                f"{kernel2_steps_command()} records one)")

    labels = ("as it is",) + KERNEL2_STEP_LABELS + (f"its bytes at the copy bandwidth ({copy:.0f} GB/s)"
                                                     if copy else "its bytes at the copy bandwidth",)
    width = max(map(len, labels)) + 2
    steps = [tuple(LANE_LEAVE_OUT_STEPS[:k]) for k in range(len(LANE_LEAVE_OUT_STEPS) + 1)]
    lines = [recording_label(recording)]
    for s in shapes:
        title = f"kernel 2 at {s['tokens']} x {s['C']}, ms"
        lines.append(f"{title:<{width}}{'with dx_post (13C)':>20}{'without (9C)':>14}")
        for label, left in zip(labels, steps):
            cells = [timed(s, True, left), timed(s, False, left)]
            lines.append(f"{label:<{width}}" + "".join(f"{_ms3(v):>{w}}" for v, w in zip(cells, (20, 14))))
        floor = [s["tokens"] * elements * s["C"] * 2 / (copy * 1e9) * 1e3 if copy else None for elements in (13, 9)]
        lines.append(f"{labels[-1]:<{width}}" + "".join(f"{_ms3(v):>{w}}" for v, w in zip(floor, (20, 14))))
    return "\n".join(lines)


def kernel2_profile_table(recording: dict | None = None) -> str:
    """Kernel 2 of the pre backward under Nsight Compute (the recording's ``kernel2_profiles``): per profiled
    variant, its time under the profiler, how busy the L2 was (throughput and tag requests, % of peak), the L2's
    write requests and sectors, the shared-memory bank conflicts of its loads, and where its warps waited (the
    consumer's two largest stall reasons and the producer's waiting, % of all samples)."""
    recording = recording if recording is not None else load_recorded()
    profiles = ((recording or {}).get("results") or {}).get("kernel2_profiles") or {}
    rows = profiles.get("rows") or []
    if not rows:
        return "(no Nsight Compute profile of kernel 2 in mhc_lab/recorded/training_h200.json)"

    def variant(row):
        tuning = {k: v for k, v in (row.get("variant") or {}).items() if k != "add_dx"}
        return ", ".join(f"{k}={v}" for k, v in tuning.items()) or "the kernel's defaults"

    million = lambda value: f"{value / 1e6:.1f}" if isinstance(value, (int, float)) else "-"  # noqa: E731
    header = (f"{'variant':<44}{'us':>6}{'L2 %':>6}{'tags %':>7}{'writes M':>9}{'sectors M':>10}"
              f"{'conflicts M':>12}  consumer stalls (% of samples)    producer waits")
    lines = [recording_label(recording),
             f"kernel 2 with dx_post at {profiles.get('tokens')} x {profiles.get('C')} under Nsight Compute", header]
    kernel = None
    for row in rows:
        if row.get("kernel") != kernel:  # which kernel the run profiled
            kernel = row.get("kernel")
            lines.append(f"run {row.get('run', '?')}, {kernel}:")
        consumer = sorted((row.get("consumer_stall_pct") or {}).items(), key=lambda kv: -kv[1])[:2]
        waits = (row.get("producer_stall_pct") or {}).get("long_sb")
        lines.append(f"{variant(row)[:43]:<44}{row.get('duration_us', 0):>6.0f}"
                     f"{row.get('l2_throughput_pct', 0):>6.0f}{row.get('l2_tag_requests_pct', 0):>7.0f}"
                     f"{million(row.get('l2_write_requests')):>9}{million(row.get('l2_write_sectors')):>10}"
                     f"{million(row.get('shared_load_bank_conflicts')):>12}  "
                     + f"{', '.join(f'{k} {v:.0f}' for k, v in consumer):<34}"
                     + (f"{waits:.0f}" if isinstance(waits, (int, float)) else "-"))
    return "\n".join(lines)


# ---- reading the generated code: one value for n sums, bound once or pasted n times ----------------------------


def lane_mix_program(n: int, C: int, bound: bool, *, block_tokens: int = 64, block_c: int = 64):
    """A small TileLang program shaped like the fused post + projection's mix (kernels/post_project.py): the n
    bf16 lane tiles of a token block in shared memory, and n outputs out_i = sum_j w[i, j] x_j, each written
    to a shared tile (the real kernel hands it to the tensor cores) and to global memory. bound: each lane's
    value is bound to a name inside the loop (TileLang makes it a let, loaded once); otherwise the values are a
    Python list of expressions, which TileLang pastes into every output's sum. n is 1 to 8; arguments x
    [T, n, C] bf16, w [n, n] f32, out [T, n, C] bf16."""
    import tilelang.language as T

    if not isinstance(n, int) or not 1 <= n <= 8:
        raise ValueError(f"lane_mix_program: expected 1 <= n <= 8 lanes, got n = {n!r}")
    if not isinstance(C, int) or C < 1 or C % block_c:
        raise ValueError(f"lane_mix_program: expected C a positive multiple of block_c = {block_c}, got C = {C!r}")
    NT, BT, BC, lanes = T.dynamic("T"), block_tokens, block_c, list(range(n))

    @T.prim_func
    def lane_mix(x: T.Tensor((NT, n, C), "bfloat16"), w: T.Tensor((n, n), "float32"),
                 out: T.Tensor((NT, n, C), "bfloat16")):
        with T.Kernel(T.ceildiv(NT, BT), threads=128) as bt:
            xs = [T.alloc_shared((BT, BC), "bfloat16") for _ in lanes]
            os = [T.alloc_shared((BT, BC), "bfloat16") for _ in lanes]
            t0 = bt * BT
            for kk in T.serial(C // BC):
                for j in lanes:
                    T.copy(x[t0 : t0 + BT, j, kk * BC : kk * BC + BC], xs[j])
                for tt, c in T.Parallel(BT, BC):
                    if bound:  # names past n are bound to 0 and never used
                        x0, x1, x2, x3, x4, x5, x6, x7 = [T.cast(xs[j][tt, c], "float32") if j < n else T.float32(0)
                                                          for j in range(8)]
                        xv = [x0, x1, x2, x3, x4, x5, x6, x7][:n]
                    else:
                        xv = [T.cast(xs[j][tt, c], "float32") for j in lanes]
                    for i in lanes:
                        o = T.cast(sum([w[i, j] * xv[j] for j in lanes[1:]], w[i, 0] * xv[0]), "bfloat16")
                        os[i][tt, c] = o
                        out[t0 + tt, i, kk * BC + c] = o

    return lane_mix


def lane_mix_counts(n: int = 4, C: int = 256) -> dict[str, dict[str, int]]:
    """What the mix's loop body does in the CUDA TileLang generates for lane_mix_program both ways (lowered
    here, no GPU or nvcc needed): its vector loads of the lane tiles from shared memory and its bf16-to-float32
    pair conversions, per vector of elements each thread handles."""
    from mhc_lab.kernels._target import BF16_PAIR_CONVERSION
    from mhc_lab.kernels.source import generated_source, lines_matching

    counts = {}
    for name, bound in (("list", False), ("bound", True)):
        source = generated_source(lane_mix_program(n, C, bound), "sm_90")
        counts[name] = {"lane_loads": len(lines_matching(source, r"= \*\(uint\d?\*\)\(\(\(bfloat16_t\*\)")),
                        "conversions": len(lines_matching(source, BF16_PAIR_CONVERSION))}
    return counts


def lane_mix_table(n: int = 4, C: int = 256) -> str:
    """lane_mix_counts as a table: the same mix with its lane values pasted into every sum or bound once."""
    counts = lane_mix_counts(n, C)
    rows = (("lane values as a list of expressions", counts["list"]),
            ("each lane's value bound to a name", counts["bound"]))
    lines = [f"the mix of n = {n} lanes into {n} outputs: its loop body in the CUDA that TileLang generates for "
             "sm_90", f"{'':<40}{'lane-tile loads':>16}{'bf16 pair conversions':>23}"]
    lines += [f"{label:<40}{c['lane_loads']:>16}{c['conversions']:>23}" for label, c in rows]
    return "\n".join(lines)


def _ms3(value) -> str:
    return f"{value:.3f}" if isinstance(value, (int, float)) else "-"


def _block_overhead(row: dict, key: str):
    """Percent over the plain residual of one block row's implementation: as recorded, else from the times
    (None for the residual itself or when a time is missing)."""
    times = row.get("times_ms") or {}
    o = (row.get("overhead_pct") or {}).get(key)
    if o is None and key != "residual" and isinstance(times.get(key), (int, float)) and times.get("residual"):
        o = (times[key] / times["residual"] - 1) * 100
    return o


def _block_line(r: dict, key: str, label: str, note: str = "") -> str:
    times, peak = r.get("times_ms") or {}, r.get("peak_gib") or {}
    o = _block_overhead(r, key)
    o_text = f"{o:+.1f}%" if isinstance(o, (int, float)) else ""
    p_text = f"{peak[key]:.2f} GiB" if isinstance(peak.get(key), (int, float)) else "-"
    rounds = (r.get("overhead_pct_rounds") or {}).get(key)
    if rounds:
        note = f"   {len(r['rounds_ms'][key])} rounds: median {rounds['median']:+.1f}%{note}"
    return f"  {label:<26}{_ms(times.get(key), ' ms'):>12}  {o_text:>8}   peak {p_text}{note}"


def _latest_repeat_with(results: dict, C, key: str):
    """(run, block row) of the latest block_repeats entry that timed ``key`` at width C, or None."""
    for repeat in reversed(results.get("block_repeats") or []):
        for r in repeat.get("block") or []:
            if r.get("C") == C and key in (r.get("times_ms") or {}):
                return repeat.get("run", "?"), r
    return None


# kinds a main block run may skip (TileKernels: another package; torch.compile: minutes of compiling per width),
# shown from the latest block_repeats entry that timed them
BLOCK_KINDS_FROM_REPEATS = ("mhc_tilekernels", "mhc_compiled")


def _block_row_for(results: dict, r: dict, key: str):
    """(run, block row) that gives ``key`` at the width of main row r: (None, r) when r timed it, else the latest
    block_repeats entry that did (for BLOCK_KINDS_FROM_REPEATS), else None."""
    if key in (r.get("times_ms") or {}) or key in (r.get("peak_gib") or {}):
        return None, r
    return _latest_repeat_with(results, r.get("C"), key) if key in BLOCK_KINDS_FROM_REPEATS else None


def block_table(results: dict) -> str:
    """A transformer block, forward + backward: time, overhead over the plain residual, peak memory, and where the
    run timed the blocks in interleaved rounds the median of the rounds' overheads. TileKernels and
    torch.compile, where the main run skipped them, from the latest run that timed them, against that run's own
    plain residual."""
    rows = (results or {}).get("block") or []
    if not rows:
        return "(no block measurements)"
    lines = []
    for r in rows:
        lines.append(f"C = {r.get('C', '?')}, {r.get('tokens', '?')} tokens:")
        for key, label in BLOCK_IMPLEMENTATIONS.items():
            found = _block_row_for(results, r, key)
            if found:
                run, row = found
                lines.append(_block_line(row, key, label, f"   (run {run}, against its own plain residual)"
                                         if run else ""))
    return "\n".join(lines)


def kernel_label(name: str) -> str:
    """A profiler's kernel name, short: ours without the "_kernel" suffix, PyTorch's by its function name."""
    if name.startswith("void at::native::"):
        return "torch " + name[len("void at::native::"):].split("<")[0]
    return name.removesuffix("_kernel")


def block_rounds_table(results: dict | None) -> str:
    """The recorded blocks in interleaved rounds (block_rounds): per run and width, each kind's overhead over
    the plain residual per round, its median, least and most."""
    lines = []
    for entry in (results or {}).get("block_rounds") or []:
        if entry.get("invalid"):  # kept in the recording with its reason, never shown as a result
            lines.append(f"run {entry.get('run', '?')}: not shown, invalid ({entry['invalid'].split(':')[0]})")
            continue
        for r in entry.get("block") or []:
            rounds = r.get("overhead_pct_rounds") or {}
            if not rounds:
                continue
            lines.append(f"run {entry.get('run', '?')}, C = {r['C']}, {len(r['rounds_ms']['residual'])} rounds "
                         f"(plain residual {statistics.median(r['rounds_ms']['residual']):.2f} ms, median):")
            for key, o in rounds.items():
                lines.append(f"  {BLOCK_IMPLEMENTATIONS.get(key, key):<26}median {o['median']:+5.1f}%   "
                             f"rounds {o['least']:+5.1f}% to {o['most']:+5.1f}%")
    return "\n".join(lines) if lines else "(no block runs in rounds recorded)"


def block_breakdown_table(results: dict | None, run: str = "BN", top: int = 4) -> str:
    """The recorded block breakdown (block_kernels, one run): per width the plain, the chained block and its
    connections alone (identity layers): wall time per step, kernel time, the rest (the GPU idle); then the
    chained block's own kernels that take longest beside the layers against the same kernels without them."""
    entry = ((results or {}).get("block_kernels") or {}).get(run) or []
    lines = []
    for r in entry:
        kind = r["kind"]
        lines.append(f"C = {r['C']}, {r['tokens']} tokens{'':14}{'wall ms':>9}{'kernels':>9}{'idle':>7}"
                     f"{'launches':>10}")
        for name in ("residual", kind, f"{kind} without layers"):
            row = r.get(name)
            if row:
                label = {"residual": "plain residual", kind: "chained mHC"}.get(name, "chained, identity layers")
                lines.append(f"  {label:<35}{row['wall_ms']:>9.2f}{row['kernel_ms']:>9.2f}{row['idle_ms']:>7.2f}"
                             f"{row['launches']:>10.0f}")
        c, a = r["comparison"], r.get("own_against_alone") or {}
        lines.append(f"  the kernels both blocks launch: {c['shared_base_ms']:.2f} ms plain, "
                     f"{c['shared_other_ms']:.2f} chained; mHC's own {c['only_other_ms']:.2f} ms")
        if a:
            lines.append(f"  mHC's own kernels: {a['shared_other_ms']:.3f} ms in the block, {a['shared_base_ms']:.3f} "
                         "with identity layers; the largest differences:")
            for d in a["largest_differences"][:top]:
                lines.append(f"    {kernel_label(d['kernel'])[:38]:<38}{d['other_ms']:>7.3f} in the block "
                             f"{d['base_ms']:>7.3f} without layers ({d['other_ms'] / d['base_ms']:.2f}x)")
    return "\n".join(lines) if lines else f"(no block breakdown recorded for run {run})"


# lane-wide elements per token (units of C, read + written) that each of the chained block's own kernels moves per
# launch at n = 4 (bytes_model's rows of our chained kernels; kernel 2 and the post backward with the post's
# gradient handed to the pre)
CHAINED_KERNEL_ELEMENTS = {"lanes_backward_cuda_post_grad_kernel": 13, "post_backward_without_dx_kernel": 10,
                           "post_project_cuda_kernel": 9, "post_cuda_kernel": 9, "mix_lanes_kernel": 5,
                           "dpre_reduce_kernel": 5, "project_kernel": 4}
COPY_KERNEL = "Memcpy DtoD (Device -> Device)"


def floor_kernels_table(results: dict | None, run: str = "CC") -> str:
    """The recorded block breakdown of one run that profiled the copy floor and the chained block (block_kernels,
    --block-kernels-kinds copy_floor,mhc_ours_chained): per width the floor's copies (their pace in the block),
    then each of the chained block's own kernels: time per step, launches, the lane-wide elements per token it
    moves (CHAINED_KERNEL_ELEMENTS; none for the small ones), that many bytes at the copies' pace, and the rest."""
    from mhc_lab.bench.training import copy_floor_counts, copy_floor_plan

    entries = ((results or {}).get("block_kernels") or {}).get(run) or []
    by_width: dict = {}
    for e in entries:
        by_width.setdefault(e["C"], {})[e["kind"]] = e
    lines = []
    for C, kinds in by_width.items():
        floor, chained = kinds.get("copy_floor"), kinds.get("mhc_ours_chained")
        if not (floor and chained):
            continue
        tokens = chained["tokens"]
        copies = floor["kernels"]["copy_floor"][COPY_KERNEL]["ms"]
        moved = sum(copy_floor_counts(copy_floor_plan(4)))
        pace = moved * C * 2 * tokens / (copies * 1e-3) / 1e12  # TB/s
        lines.append(f"C = {C}, {tokens} tokens: the copy floor's copies {copies:.3f} ms for {moved}C per token "
                     f"({pace:.2f} TB/s in the block)")
        head = "the chained block's own kernels"
        lines.append(f"  {head:<38}{'ms':>7}{'launches':>9}{'moves':>7}"
                     f"{'at that pace':>13}{'beyond':>8}")
        own = {k: v for k, v in chained["kernels"]["mhc_ours_chained"].items()
               if k not in chained["kernels"]["residual"]}
        total = beyond_total = 0.0
        for name, v in sorted(own.items(), key=lambda kv: -kv[1]["ms"]):
            per_launch = CHAINED_KERNEL_ELEMENTS.get(name, 0)
            at_pace = per_launch * v["launches"] * C * 2 * tokens / (pace * 1e12) * 1e3
            total, beyond_total = total + v["ms"], beyond_total + v["ms"] - at_pace
            lines.append(f"  {kernel_label(name)[:38]:<38}{v['ms']:>7.3f}{v['launches']:>9.0f}"
                         f"{f'{per_launch}C' if per_launch else '-':>7}{at_pace:>13.3f}{v['ms'] - at_pace:>8.3f}")
        lines.append(f"  {'all':<38}{total:>7.3f}{'':>9}{'':>7}{total - beyond_total:>13.3f}{beyond_total:>8.3f}")
    return "\n".join(lines) if lines else f"(no copy floor breakdown recorded for run {run})"


def behind_gemms_table(results: dict | None, top: int = 5) -> str:
    """The recorded chained site's kernels alone and behind GEMMs (behind_gemms): per shape the ``top`` kernels
    by time alone, with their time behind the GEMMs and the ratio."""
    entry = (results or {}).get("behind_gemms") or {}
    lines = []
    for r in entry.get("shapes") or []:
        c = r["comparison"]
        lines.append(f"{r['tokens']} x {r['C']}: all its kernels {c['shared_base_ms']:.3f} ms alone, "
                     f"{c['shared_other_ms']:.3f} behind GEMMs")
        rows = sorted(c["largest_differences"], key=lambda d: -d["base_ms"])[:top]
        for d in rows:
            lines.append(f"  {kernel_label(d['kernel'])[:38]:<38}{d['base_ms']:>7.3f} alone {d['other_ms']:>7.3f} "
                         f"behind ({d['other_ms'] / d['base_ms']:.2f}x)")
    return "\n".join(lines) if lines else "(no runs behind GEMMs recorded)"


def overlap_table(results: dict | None, mode: str = "launched") -> str:
    """The recorded kernels beside a weight-gradient GEMM on a second stream (overlap, one table per run and shape,
    in ``mode``): the GEMM's time per carve-out, then per kernel its time alone and, per carve-out, the share of
    that time hidden and the milliseconds saved against the GEMM without a carve-out and the kernel in turn."""
    lines = []
    for run, entry in ((k, v) for k, v in ((results or {}).get("overlap") or {}).items() if k.startswith("run_")):
        for r in entry.get("shapes") or []:
            carves = list(r["carveouts"])
            rows = {k: r["carveouts"][k][mode] for k in carves}
            lines.append(f"run {run.split('_')[1]} ({entry.get('blas', '?')}), {r['tokens']} x {r['C']}, {mode}; SMs "
                         f"left out of the GEMM: {', '.join(carves)}")
            lines.append(f"  {'the GEMM alone':<29}" + "".join(f"{row['gemm_ms']:>12.3f} ms" for row in rows.values()))
            for name, alone in r["alone_ms"][mode].items():
                lines.append(f"  {name[:20]:<20}{alone:>6.3f} ms" + "".join(
                    f"{row['hidden_pct'][name]:>+7.0f}% {row['saved_ms'][name]:>+6.3f}" for row in rows.values()))
    if lines:
        lines.append("  (a kernel's cells: the share of its time alone hidden beside the GEMM; ms saved against the "
                     "GEMM without a carve-out and the kernel in turn)")
    return "\n".join(lines) if lines else "(no overlap runs recorded)"


HOT_KERNEL_PROFILES = ("hot_kernels_profile_run_BS", "hot_kernels_profile")  # before the last cuts, then now


def hot_kernels_table(results: dict | None, keys: tuple = HOT_KERNEL_PROFILES) -> str:
    """The recorded Nsight Compute summaries of the two kernels that set the block's extra time (each of
    ``keys`` that the results hold, earliest first): time, issue, warps, and each consumer warp's instructions
    per tile by class, a column per kernel and run."""
    profiles = [results[k] for k in keys if (results or {}).get(k, {}).get("kernels")]
    if not profiles:
        return "(no profile of the two kernels recorded)"
    names = list(dict.fromkeys(n for p in profiles for n in p["kernels"]))
    columns = [(p, n) for n in names for p in profiles if n in p["kernels"]]
    rows = [("time (us)", "duration_us", "{:.0f}"), ("SM clock (GHz)", "sm_clock_ghz", "{:.2f}"),
            ("DRAM (% of peak)", "dram_pct", "{:.0f}"), ("issue slots busy (%)", "issue_slots_busy_pct", "{:.0f}"),
            ("warps per scheduler", "active_warps_per_scheduler", "{:.2f}"),
            ("  of them eligible", "eligible_warps_per_scheduler", "{:.2f}"),
            ("instructions per warp and tile", "consumer_loop_instructions_per_warp_total", "{:.0f}")]
    width = 16
    shape = (profiles[-1].get("tokens"), profiles[-1].get("C"))
    lines = [f"{shape[0]} x {shape[1]}, Nsight Compute" if all(shape) else "Nsight Compute"]
    lines += [textwrap.fill(f"run {p.get('run', '?')}: {p['note']}", 110, subsequent_indent="  ")
              for p in profiles if p.get("note")]
    lines.append(f"{'':<34}" + "".join(f"{n.split(' (')[0][:width - 2]:>{width}}" for _, n in columns))
    lines.append(f"{'':<34}" + "".join(f"{('run ' + str(p.get('run', '?')))[:width - 1]:>{width}}" for p, _ in columns))
    for label, key, fmt in rows:
        values = [p["kernels"][n].get(key) for p, n in columns]
        lines.append(f"{label:<34}" + "".join(
            f"{fmt.format(v) if isinstance(v, (int, float)) else '-':>{width}}" for v in values))
    per_tile = [p["kernels"][n].get("consumer_loop_instructions_per_warp") or {} for p, n in columns]
    classes = sorted({c for counts in per_tile for c in counts}, key=lambda c: -sum(t.get(c, 0) for t in per_tile))
    for c in classes:
        lines.append(f"  {c:<32}" + "".join(f"{t.get(c, 0):>{width}}" for t in per_tile))
    return "\n".join(lines)


def block_figure(results: dict, label: str):
    """Overhead of each mHC implementation over the plain residual, per width C (bars), with the paper's 6.7%."""
    import plotly.graph_objects as go

    rows = (results or {}).get("block") or []
    fig = go.Figure()
    for key in (k for k in BLOCK_IMPLEMENTATIONS if k != "residual"):
        xs, ys, texts = [], [], []
        for r in rows:
            found = _block_row_for(results, r, key)
            o = _block_overhead(found[1], key) if found else None
            if isinstance(o, (int, float)):
                xs.append(f"C = {r.get('C')}, {r.get('tokens')} tokens")
                ys.append(o)
                texts.append(f"{o:+.1f}%" + (f" (run {found[0]})" if found[0] else ""))
        if xs:
            fig.add_bar(x=xs, y=ys, name=BLOCK_IMPLEMENTATIONS[key], text=texts)
    fig.add_hline(y=6.7, line_dash="dash", annotation_text="paper: +6.7% (n = 4)")
    fig.update_layout(title=f"Transformer block, forward + backward: mHC over the plain residual<br><sup>{label}"
                      "</sup>", height=430, yaxis_title="extra time over the plain residual (%)", barmode="group")
    return fig


# ---- a live measurement of the same quantities on a CUDA GPU ---------------------------------------------------


def measure_live(site_shapes: Sequence[tuple[int, int]], block_widths: Sequence[int], *, compile: bool = False,
                 repeat_ms: int = 100, log=print) -> dict:
    """The training benchmark's own functions (mhc_lab.bench.training) on this CUDA GPU: one site for each
    (tokens, C) in ``site_shapes``, one transformer block for each width, each timed for about ``repeat_ms``.
    torch.compile only with ``compile`` (minutes of compiling per shape; the recording has it). A dict like a
    recording's results, plus the device."""
    import importlib.util

    from mhc_lab.bench import forward as bench_forward, training as bench_training

    timer, timer_name = bench_forward._timer()

    def bench(fn, warmup_ms=None, rep_ms=None):
        return timer(fn, warmup_ms=max(5, repeat_ms // 4), rep_ms=repeat_ms)

    skip = set() if compile else {"compile"}
    if importlib.util.find_spec("tile_kernels") is None:
        skip.add("tilekernels")
    results = {"device": torch.cuda.get_device_name(), "timer": timer_name, "skipped": sorted(skip),
               "copy_gbps": bench_forward.copy_bandwidth(bench), "site": [], "block": []}
    for tokens, C in site_shapes:
        results["site"].append(bench_training.bench_site(tokens, C, bench, skip=skip, log=log))
        torch.cuda.empty_cache()
    for width in block_widths:
        results["block"].append(bench_training.bench_block(width, bench, skip=skip, log=log))
        torch.cuda.empty_cache()
    return results
