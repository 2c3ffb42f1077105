"""Lab 08 exercises beyond one GPU's step: how much of the n lanes' transfer across a pipeline stage boundary
another micro-batch's compute hides (8.5), and what transformers' DeepSeek-V4 HyperConnection returns, through our
reference (8.6). Each check compares with mhc_lab.course.pipeline (8.5) or transformers' own HyperConnection module
(8.6) on seeded cases, and names a usual mistake that the answers match on every case.
"""

from __future__ import annotations

import torch

from mhc_lab.course import deepseek_v4
from mhc_lab.course.checks import CheckFailed, Mistake, assert_close, call, register, seeded
from mhc_lab.course.pipeline import boundary_exposed
from mhc_lab.reference import mhc_coefficients, mhc_pre

# ---- 8.5 the n lanes on the wire -------------------------------------------------------------------------------

# (compute_ms, link_gbit_s, tokens, C, n, itemsize, what the case is): each usual mistake gives a different answer on
# some case; the seeded cases follow
_WIRE_CASES = [
    (3.0, 400.0, 4096, 7168, 4, 2, "DeepSeek-V3's width, 4 lanes in bf16 over 400 Gbit/s"),
    (3.0, 400.0, 4096, 7168, 1, 2, "the same with one lane"),
    (0.32, 100.0, 1000, 1000, 2, 2, "compute exactly as long as the transfer"),
    (0.0, 200.0, 512, 2560, 4, 2, "no compute to hide behind"),
    (0.05, 25.0, 77, 333, 8, 1, "8 lanes in fp8, an odd shape, a slow link"),
    (40.0, 3200.0, 16384, 4096, 4, 4, "float32 lanes, a fast link, long compute"),
]
_WIRE_MISTAKES = {
    "no_n": "one hidden state counted, not n lanes. The boundary carries the whole stream, [tokens, n, C]: "
            "tokens * n * C * itemsize bytes.",
    "bits": "bytes divided by bits per second. The link's Gbit/s are 10^9 bits a second and a byte is 8 bits: "
            "seconds = bytes * 8 / (link_gbit_s * 1e9).",
    "elements": "elements counted as bytes: each element is itemsize bytes (2 for bf16), so the lanes are "
                "tokens * n * C * itemsize bytes.",
    "sum": "the whole transfer counted as exposed, as if it waited for the compute. The two run at the same time: only "
           "the part of the transfer that outlasts the compute shows, max(0, transfer_ms - compute_ms).",
    "no_clamp": "a negative exposed time where the compute outlasts the transfer. Hidden time is hidden: nothing shows, "
                "max(0, transfer_ms - compute_ms).",
}


def _wire_wrong(kind: str):
    def wrong(compute_ms, link_gbit_s, tokens, C, n, itemsize=2):
        nbytes = tokens * (1 if kind == "no_n" else n) * C * (1 if kind == "elements" else itemsize)
        transfer_ms = nbytes * (1 if kind == "bits" else 8) / (link_gbit_s * 1e9) * 1e3
        if kind == "sum":
            return transfer_ms, transfer_ms
        if kind == "no_clamp":
            return transfer_ms, transfer_ms - compute_ms
        return transfer_ms, max(0.0, transfer_ms - compute_ms)

    wrong.__name__ = f"boundary_exposed_{kind}"
    return wrong


def _wire_name(compute_ms, link_gbit_s, tokens, C, n, itemsize, what: str = "") -> str:
    return (f"{what + ': ' if what else ''}{tokens} tokens, n={n}, C={C}, itemsize {itemsize}, "
            f"{link_gbit_s:.6g} Gbit/s, {compute_ms:.6g} ms of compute")


def _wire_cases() -> list[tuple[tuple, str]]:
    cases = [(c[:6], _wire_name(*c)) for c in _WIRE_CASES]
    for k in range(3):
        g = seeded(8500 + k)
        u = torch.rand(3, generator=g, dtype=torch.float64).tolist()
        tokens = int(torch.randint(1, 20000, (), generator=g))
        C = int(torch.randint(64, 8193, (), generator=g))
        n = (1, 2, 3, 4, 6, 8)[int(torch.randint(6, (), generator=g))]
        itemsize = (1, 2, 4)[int(torch.randint(3, (), generator=g))]
        link = 10 + 1990 * u[0]
        transfer_ms = tokens * n * C * itemsize * 8 / (link * 1e9) * 1e3
        compute = transfer_ms * (0.2 + 1.6 * u[1])  # hidden or not
        args = (compute, link, tokens, C, n, itemsize)
        cases.append((args, _wire_name(*args)))
    return cases


def _wire_values(got, case: str) -> tuple[float, float]:
    if not isinstance(got, (tuple, list)) or len(got) != 2:
        length = f" of length {len(got)}" if isinstance(got, (tuple, list)) else ""
        raise CheckFailed(f"{case}: expected a tuple of two numbers (transfer_ms, exposed_ms), got "
                          f"{type(got).__name__}{length}")
    try:
        return float(got[0]), float(got[1])
    except (TypeError, ValueError):
        raise CheckFailed(f"{case}: expected (transfer_ms, exposed_ms) to be numbers, got "
                          f"({type(got[0]).__name__}, {type(got[1]).__name__})") from None


def _wire_near(a: float, b: float, scale: float) -> bool:
    return abs(a - b) <= 1e-9 * (1 + scale) + 1e-6 * abs(b)


def _wire_mistake(values: list, cases: list) -> str:
    """The usual mistake the answers match on every case ("" if none does)."""
    for kind, explanation in _WIRE_MISTAKES.items():
        wrong = [_wire_wrong(kind)(*args) for args, _ in cases]
        if all(_wire_near(v[0], w[0], abs(w[0])) and _wire_near(v[1], w[1], abs(w[0]))
               for v, w in zip(values, wrong)):
            return f" This looks like the usual mistake: {explanation}"
    return ""


@register(
    "8.5", "the n lanes on the wire",
    hints=[
        "Bytes first: the boundary carries the lanes, [tokens, n, C], each element itemsize bytes. The link is "
        "quoted in bits per second. Then ask which part of the transfer is left over once the other micro-batch's "
        "compute, running at the same time, is done.",
        "bits = tokens * n * C * itemsize * 8; transfer_ms = bits / (link_gbit_s * 1e9) * 1e3. The transfer and the "
        "compute overlap, so only the excess shows: max(0, transfer_ms - compute_ms).",
        "transfer_ms = tokens * n * C * itemsize * 8 / (link_gbit_s * 1e9) * 1e3; "
        "return transfer_ms, max(0.0, transfer_ms - compute_ms)",
    ],
    library="mhc_lab.course.pipeline.boundary_exposed",
    mistakes=[
        Mistake(_wire_wrong("no_n"), "one hidden state counted, not n lanes"),
        Mistake(_wire_wrong("bits"), "bytes divided by bits per second"),
        Mistake(_wire_wrong("elements"), "elements counted as bytes"),
        Mistake(_wire_wrong("sum"), "the whole transfer counted as exposed"),
        Mistake(_wire_wrong("no_clamp"), "a negative exposed time"),
    ],
)
def _check_boundary_exposed(answer):
    cases = _wire_cases()
    values = [_wire_values(call(answer, *args, case=name), name) for args, name in cases]
    for (args, name), (transfer, exposed) in zip(cases, values):
        want_transfer, want_exposed = boundary_exposed(*args)
        for label, got, want in (("transfer_ms", transfer, want_transfer), ("exposed_ms", exposed, want_exposed)):
            if not _wire_near(got, want, abs(want_transfer)):
                raise CheckFailed(f"{name}: expected {label} = {want:.6g}, got {got:.6g}."
                                  + _wire_mistake(values, cases))
    return [name for _, name in cases]



# ---- 8.6 a DeepSeek-V4 HyperConnection through our reference --------------------------------------------------

# (n, C, batch, tokens, lanes' dtype, what the case is): DeepSeek-V4's four lanes at two widths (float32 and
# bfloat16, as a real model trains), then two and eight lanes
_HC_CASES = [(4, 64, 2, 5, torch.float32, "DeepSeek-V4's four lanes, C = 64"),
             (4, 256, 1, 3, torch.bfloat16, "four bfloat16 lanes, C = 256"),
             (2, 32, 1, 7, torch.float32, "two lanes, C = 32"), (8, 16, 2, 2, torch.float32, "eight lanes, C = 16")]
_HC_OUTPUTS = ("post", "comb", "collapsed")
_ROWS = ("the rows of fn (and base) reordered. Both are [pre, post, res], n rows for H_pre, n for H_post and n^2 "
         "for H_res, in transformers' module as in ours: phi is fn as it stands, and bias is base.")
_SCALE = "scale read in another order. Its three entries are [pre, post, res], as alpha's: alpha is scale as it stands."
_HC_MISTAKES = {
    "comb": "comb taken as H_res itself. transformers' layer mixes the lanes with comb transposed (new lane k = "
            "sum_j comb[j, k] x_j), ours with H_res (new lane i = sum_j H_res[i, j] x_j): comb is "
            "H_res.transpose(-1, -2).",
    "rows_post_first": _ROWS,
    "rows_res_first": _ROWS,
    "scale_reversed": _SCALE,
    "scale_swapped": _SCALE,
    "collapsed_post": "the layer input collapsed with H_post. The module returns the layer input H_pre x: "
                      "mhc_pre(x, pre).",
    "collapsed_float32": "the layer input collapsed in float32. The module hands its layer the lanes' dtype "
                         "(bfloat16 in a real model): mhc_pre(x, pre) on the lanes as they are, not on x.float().",
}


def _reordered(fn, base, n: int, read: tuple):
    """fn and base read as if their rows were in the order ``read`` and put back as [pre, post, res]."""
    sizes = {"pre": n, "post": n, "res": n * n}
    start = {name: sum(sizes[r] for r in read[:read.index(name)]) for name in read}
    rows = [slice(start[name], start[name] + sizes[name]) for name in ("pre", "post", "res")]
    return torch.cat([fn[r] for r in rows]), torch.cat([base[r] for r in rows])


def _hc_wrong(kind: str):
    def wrong(fn, base, scale, x):
        n = x.shape[-2]
        if kind == "rows_post_first":
            fn, base = _reordered(fn, base, n, ("post", "pre", "res"))
        if kind == "rows_res_first":
            fn, base = _reordered(fn, base, n, ("res", "pre", "post"))
        if kind == "scale_reversed":
            scale = scale.flip(0)
        if kind == "scale_swapped":
            scale = scale[[1, 0, 2]]
        pre, post, res = mhc_coefficients(x, fn, base, scale)
        comb = res if kind == "comb" else res.transpose(-1, -2)
        lanes = x.float() if kind == "collapsed_float32" else x
        return post, comb, mhc_pre(lanes, post if kind == "collapsed_post" else pre)

    wrong.__name__ = f"hyper_connection_{kind}"
    return wrong


def _hc_cases() -> list[tuple]:
    """(module, (fn, base, scale, x), what the case is) per case: transformers' HyperConnection with seeded random
    parameters, and seeded lanes [batch, tokens, n, C]."""
    if deepseek_v4.TRANSFORMERS is None:
        raise ImportError(f"exercise 8.6 checks against transformers' DeepSeek-V4 HyperConnection: "
                          f"{deepseek_v4.INSTALL}")
    cases = []
    for k, (n, C, batch, tokens, dtype, what) in enumerate(_HC_CASES):
        g = seeded(8600 + k)
        hc = deepseek_v4.hyper_connection(n, C, g)
        x = torch.randn(batch, tokens, n, C, generator=g).to(dtype)
        args = (hc.fn.detach().clone(), hc.base.detach().clone(), hc.scale.detach().clone(), x)
        cases.append((hc, args, f"{what}, {batch} x {tokens} tokens"))
    return cases


def _three_tensors(got, case: str) -> tuple:
    if not isinstance(got, (tuple, list)) or len(got) != 3:
        length = f" of length {len(got)}" if isinstance(got, (tuple, list)) else ""
        raise CheckFailed(f"{case}: expected a tuple of three tensors (post, comb, collapsed), got "
                          f"{type(got).__name__}{length}")
    return tuple(got)


def _hc_mistake(values: list, cases: list) -> str:
    """The usual mistake the answers match on every case ("" if none does)."""

    def near(a, b) -> bool:
        return (isinstance(a, torch.Tensor) and a.shape == b.shape
                and torch.allclose(a.detach().double(), b.double(), rtol=1e-4, atol=1e-5))

    for kind, explanation in _HC_MISTAKES.items():
        wrong = [_hc_wrong(kind)(*args) for _, args, _ in cases]
        if all(near(a, b) for got, want in zip(values, wrong) for a, b in zip(got, want)):
            return f" This looks like the usual mistake: {explanation}"
    return ""


@register(
    "8.6", "a DeepSeek-V4 HyperConnection through our reference",
    hints=[
        "Our site's parameters are the module's as they stand: phi = fn, bias = base, alpha = scale (rows and "
        "entries [pre, post, res] in both). mhc_coefficients gives H_pre, H_post and H_res; then ask which of them "
        "the module returns as it is, which transposed, and what it does with H_pre.",
        "post is H_post. The layer mixes the lanes with comb transposed, while ours mixes them with H_res: comb is "
        "H_res.transpose(-1, -2). collapsed is the layer input, H_pre x: mhc_pre(x, pre).",
        "pre, post, res = mhc_coefficients(x, fn, base, scale); return post, res.transpose(-1, -2), mhc_pre(x, pre)",
    ],
    library="mhc_lab.course.deepseek_v4.hyper_connection_outputs",
    mistakes=[Mistake(_hc_wrong(kind), explanation.split(".")[0]) for kind, explanation in _HC_MISTAKES.items()],
)
def _check_hyper_connection(answer):
    cases = _hc_cases()
    values = [_three_tensors(call(answer, *(t.clone() for t in args), case=name), name) for _, args, name in cases]
    for (hc, args, name), got in zip(cases, values):
        with torch.no_grad():
            want = hc(args[3])
        for label, g, w in zip(_HC_OUTPUTS, got, want):
            if label == "collapsed" and isinstance(g, torch.Tensor) and g.dtype != w.dtype:
                raise CheckFailed(f"{name}: expected collapsed in the lanes' dtype {w.dtype}, got {g.dtype}: "
                                  + (_HC_MISTAKES["collapsed_float32"] if g.dtype == torch.float32
                                     else "the layer input keeps the lanes' dtype: mhc_pre(x, pre)."))
            try:
                assert_close(g, w, case=name, name=label)
            except CheckFailed as failure:
                raise CheckFailed(f"{failure}.{_hc_mistake(values, cases)}") from None
    return [name for _, _, name in cases]
