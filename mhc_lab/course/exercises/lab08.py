"""Lab 08 exercises: where a training step's time goes. The copy floor's extra time and overhead from bytes and the
copy bandwidth, the host's share of a launched step from its launched and CUDA-graph times, what the host adds per
mHC site of a stack and whether its launched step is host-bound, which kernels the power cap slows
(instruction-bound) from their time with identity layers and in the block, how much of the n lanes' transfer
across a pipeline stage boundary another micro-batch's compute hides, and what transformers' DeepSeek-V4
HyperConnection returns, through our reference.

Each check draws seeded random inputs for several block shapes (or tensor shapes) and compares with the reference
in mhc_lab.course.step_time (mhc_lab.course.pipeline for 8.5; for 8.6, transformers' own HyperConnection module),
computed independently; a wrong answer that matches a usual mistake on every case is named.
"""

from __future__ import annotations

import torch

from mhc_lab.course import deepseek_v4
from mhc_lab.course.checks import CheckFailed, Mistake, assert_close, call, register, seeded
from mhc_lab.course.pipeline import boundary_exposed
from mhc_lab.course.step_time import copy_floor_overhead, host_per_site, host_share, instruction_bound
from mhc_lab.reference import mhc_coefficients, mhc_pre


def _close(a: float, b: float, rel: float = 1e-6) -> bool:
    return abs(a - b) <= rel * max(abs(b), 1e-300)


# ---- 8.1 the copy floor from bytes ---------------------------------------------------------------------------

# (C, tokens, itemsize): the H200 block's widths, a DeepSeek-V3 width, small and odd blocks; bf16, fp8 and float32
_FLOOR_SHAPES = [(2560, 16384, 2), (4096, 16384, 2), (7168, 8192, 4), (1024, 4096, 1), (333, 77, 2)]


def _floor_cases() -> list[tuple]:
    cases = []
    for k, (C, tokens, itemsize) in enumerate(_FLOOR_SHAPES):
        g = seeded(8100 + k)
        read_C, written_C = (int(v) for v in torch.randint(1, 61, (2,), generator=g))
        if written_C == read_C:
            written_C += 7
        copy_gbps = float(300 + 4700 * torch.rand((), generator=g, dtype=torch.float64))
        block_ms = float(0.5 + 60 * torch.rand((), generator=g, dtype=torch.float64))
        cases.append((read_C, written_C, C, tokens, copy_gbps, block_ms, itemsize))
    return cases


def _floor_wrong(kind: str):
    def wrong(read_C, written_C, C, tokens, copy_gbps, block_ms, itemsize=2):
        elements = read_C if kind == "reads_only" else read_C + written_C
        moved = elements * C * tokens * (1 if kind == "elements" else itemsize)
        extra_ms = moved / (copy_gbps * (2**30 if kind == "gib" else 1e9)) * 1e3
        pct = 100.0 * extra_ms / (block_ms + extra_ms if kind == "over_floor" else block_ms)
        if kind == "fraction":
            pct /= 100.0
        if kind == "seconds":
            extra_ms /= 1e3
        return extra_ms, pct

    wrong.__name__ = f"copy_floor_overhead_{kind}"
    return wrong


_FLOOR_MISTAKES = {
    "elements": "elements counted as bytes: each C-wide element is itemsize bytes (2 for bf16), so the bytes are "
                "(read_C + written_C) * C * itemsize * tokens.",
    "reads_only": "only the reads were counted. A copy's pace counts the bytes it reads plus those it writes, and so "
                  "must the floor: (read_C + written_C) C-wide elements per token.",
    "fraction": "the overhead came out as a fraction. overhead_pct is in percent: 100 * extra_ms / block_ms.",
    "seconds": "the extra time came out in seconds. copy_gbps is 10^9 bytes per second, so bytes / (copy_gbps * "
               "1e9) is seconds; multiply by 1e3 for milliseconds.",
    "gib": "GB/s taken as 2^30 bytes per second. The benchmark's GB/s are 10^9 bytes per second: divide by "
           "copy_gbps * 1e9.",
    "over_floor": "the overhead was taken over the block with the floor added. An overhead is over the plain "
                  "block: 100 * extra_ms / block_ms.",
}


def _floor_mistake(values: list, cases: list) -> str:
    """The usual mistake the answers match on every case ("" if none does)."""
    for kind, explanation in _FLOOR_MISTAKES.items():
        wrong = _floor_wrong(kind)
        if all(v is not None and all(_close(a, b) for a, b in zip(v, wrong(*c))) for v, c in zip(values, cases)):
            return f" This looks like the usual mistake: {explanation}"
    return ""


def _two_numbers(got, case: str):
    if not isinstance(got, (tuple, list)) or len(got) != 2:
        length = f" of length {len(got)}" if isinstance(got, (tuple, list)) else ""
        raise CheckFailed(f"{case}: expected a tuple of two numbers (extra_ms, overhead_pct), got "
                          f"{type(got).__name__}{length}")
    try:
        return float(got[0]), float(got[1])
    except (TypeError, ValueError):
        raise CheckFailed(f"{case}: expected (extra_ms, overhead_pct) to be numbers, got "
                          f"({type(got[0]).__name__}, {type(got[1]).__name__})") from None


@register(
    "8.1", "the copy floor from bytes",
    hints=[
        "Bytes first: per token the floor moves read_C + written_C C-wide elements, each of itemsize bytes, and a step "
        "has `tokens` tokens. Then time = bytes / bandwidth, with the bandwidth in bytes per second.",
        "bytes = (read_C + written_C) * C * itemsize * tokens; seconds = bytes / (copy_gbps * 1e9) (a GB/s is 10^9 "
        "bytes a second, counting read plus written, as the benchmark measures the copy); extra_ms = seconds * 1e3; "
        "overhead_pct = 100 * extra_ms / block_ms.",
        "moved = (read_C + written_C) * C * itemsize * tokens; extra_ms = moved / (copy_gbps * 1e9) * 1e3; "
        "return extra_ms, 100 * extra_ms / block_ms",
    ],
    library="mhc_lab.course.step_time.copy_floor_overhead",
    mistakes=[
        Mistake(_floor_wrong("elements"), "elements counted as bytes"),
        Mistake(_floor_wrong("reads_only"), "only the reads were counted"),
        Mistake(_floor_wrong("fraction"), "the overhead came out as a fraction"),
        Mistake(_floor_wrong("seconds"), "the extra time came out in seconds"),
        Mistake(_floor_wrong("gib"), "GB/s taken as 2^30"),
        Mistake(_floor_wrong("over_floor"), "the block with the floor added"),
    ],
)
def _check_copy_floor(answer):
    cases = _floor_cases()
    names = [f"C={c[2]}, {c[3]} tokens, {c[0]}C read + {c[1]}C written, itemsize {c[6]}, {c[4]:.0f} GB/s, "
             f"block {c[5]:.2f} ms" for c in cases]
    values = []
    for case, name in zip(cases, names):
        values.append(_two_numbers(call(answer, *case, case=name), name))
    for case, name, (extra, pct) in zip(cases, names, values):
        want_extra, want_pct = copy_floor_overhead(*case)
        for label, got, want in (("extra_ms", extra, want_extra), ("overhead_pct", pct, want_pct)):
            if not _close(got, want):
                raise CheckFailed(f"{name}: expected {label} = {want:.6g}, got {got:.6g}."
                                  + _floor_mistake(values, cases))
    return names


# ---- 8.2 the host's share of a launched step -------------------------------------------------------------------

# tensor shapes; every case but the 0-d one has an entry whose launched time reads below its graph time
_SHARE_SHAPES = [(6,), (2, 3), (4, 1, 2), (), (1,)]
_SHARE_MISTAKES = {
    "over_graph": "divided by the graph's time. The share is of the launched step: (launched - graph) / launched.",
    "percent": "a percentage. Return the fraction (0.25, not 25): the tables format it.",
    "no_clamp": "negative shares where the launched step reads shorter than its graph. Two medians of noisy "
                "timings can do that; a launched step cannot take less than its GPU work, so the host's share "
                "there is 0: torch.clamp(launched_ms - graph_ms, min=0).",
    "gpu_share": "the GPU's share, graph / launched. The host's share is the part the GPU work does not explain, "
                 "(launched - graph) / launched.",
    "absolute": "the difference's size. Where the launched step reads shorter than its graph the difference is "
                "noise, not host time: clamp it at 0 instead of taking its absolute value.",
}


def _share_wrong(kind: str):
    def wrong(launched_ms, graph_ms):
        gap = launched_ms - graph_ms
        if kind == "over_graph":
            return torch.clamp(gap, min=0) / graph_ms
        if kind == "percent":
            return 100 * torch.clamp(gap, min=0) / launched_ms
        if kind == "no_clamp":
            return gap / launched_ms
        if kind == "gpu_share":
            return graph_ms / launched_ms
        return gap.abs() / launched_ms

    wrong.__name__ = f"host_share_{kind}"
    return wrong


def _share_inputs(shape: tuple, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    graph = 0.05 + 20 * torch.rand(shape, generator=seeded(seed), dtype=torch.float64)
    growth = -0.1 + 1.6 * torch.rand(shape, generator=seeded(seed + 1), dtype=torch.float64)
    if growth.dim():
        growth.view(-1)[0] = -0.05  # launched reads 5% below the graph: noise, a share of 0
    else:
        growth = growth.abs() + 0.2
    return graph * (1 + growth), graph


@register(
    "8.2", "the host's share of a launched step",
    hints=[
        "The graph's time is the GPU's work alone; the launched step took that plus whatever time the GPU spent "
        "waiting for the host. That wait, over the launched step, is the share. Work on whole tensors (torch "
        "operations), not on Python numbers.",
        "(launched_ms - graph_ms) / launched_ms, but where launched_ms < graph_ms (noise) the share is 0, not "
        "negative: torch.clamp(x, min=0) sets every negative entry to 0.",
        "return torch.clamp(launched_ms - graph_ms, min=0) / launched_ms",
    ],
    library="mhc_lab.course.step_time.host_share",
    mistakes=[
        Mistake(_share_wrong("over_graph"), "divided by the graph's time"),
        Mistake(_share_wrong("percent"), "a percentage"),
        Mistake(_share_wrong("no_clamp"), "negative shares"),
        Mistake(_share_wrong("gpu_share"), "the GPU's share"),
        Mistake(_share_wrong("absolute"), "the difference's size"),
    ],
)
def _check_host_share(answer):
    cases = []
    for k, shape in enumerate(_SHARE_SHAPES):
        case = f"launched and graph times of shape {shape}"
        launched, graph = _share_inputs(shape, 8200 + 10 * k)
        got = call(answer, launched.clone(), graph.clone(), case=case)
        mistakes = {text: _share_wrong(kind)(launched, graph) for kind, text in _SHARE_MISTAKES.items()}
        assert_close(got, host_share(launched, graph), case=case, name="host share", mistakes=mistakes)
        cases.append(case)
    return cases


# ---- 8.4 slowed by the power cap, or not ---------------------------------------------------------------------------

_BOUND_CASES = [((12,), 0.023), ((3, 4), 0.035), ((7,), 0.05), ((2,), 0.0)]
_BOUND_MISTAKES = {
    "inverted": "the ratio upside down: alone / block. A kernel the cap slows takes longer in the block, so "
                "block_ms / alone_ms is above 1; compare block_ms / alone_ms - 1 with the threshold.",
    "difference": "a difference in milliseconds against a fraction. The threshold is relative (0.03 is 3%): compare "
                  "block_ms / alone_ms - 1, not block_ms - alone_ms, with it.",
    "no_minus_one": "the ratio itself against the threshold. A ratio of 1.0 is a kernel the cap did not touch: "
                    "compare block_ms / alone_ms - 1 (the slowdown) with the threshold.",
    "absolute": "the size of the change. A kernel that runs faster in the block was not slowed by the cap: keep "
                "the sign, block_ms / alone_ms - 1 > threshold, without abs().",
}


def _bound_wrong(kind: str):
    def wrong(alone_ms, block_ms, threshold):
        if kind == "inverted":
            return alone_ms / block_ms - 1 > threshold
        if kind == "difference":
            return block_ms - alone_ms > threshold
        if kind == "no_minus_one":
            return block_ms / alone_ms > threshold
        return (block_ms / alone_ms - 1).abs() > threshold

    wrong.__name__ = f"instruction_bound_{kind}"
    return wrong


def _bound_inputs(shape: tuple, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    alone = 0.01 + 1.2 * torch.rand(shape, generator=seeded(seed), dtype=torch.float64)
    ratio = 0.95 + 0.25 * torch.rand(shape, generator=seeded(seed + 1), dtype=torch.float64)
    return alone, alone * ratio


def _compare_flags(got, alone, block, threshold, case: str) -> None:
    want = instruction_bound(alone, block, threshold)
    if not isinstance(got, torch.Tensor):
        raise CheckFailed(f"{case}: expected a tensor of booleans, got {type(got).__name__}")
    if tuple(got.shape) != tuple(want.shape):
        raise CheckFailed(f"{case}: expected a result of shape {tuple(want.shape)}, got {tuple(got.shape)}")
    if got.dtype != torch.bool:
        raise CheckFailed(f"{case}: expected a tensor of booleans (a comparison's result, dtype torch.bool), got "
                          f"{got.dtype}")
    wrong = (got != want).flatten().nonzero().flatten()
    if not len(wrong):
        return
    i = int(wrong[0])
    a, b = float(alone.flatten()[i]), float(block.flatten()[i])
    message = (f"{case}: {len(wrong)} of {want.numel()} kernels classified differently; the first: {a:.3f} ms with "
               f"identity layers, {b:.3f} ms in the block (ratio {b / a:.3f}): expected {bool(want.flatten()[i])}, "
               f"got {bool(got.flatten()[i])}.")
    for kind, explanation in _BOUND_MISTAKES.items():
        if torch.equal(got, _bound_wrong(kind)(alone, block, threshold)):
            message += f" This looks like the usual mistake: {explanation}"
            break
    raise CheckFailed(message)


@register(
    "8.4", "slowed by the power cap, or not",
    hints=[
        "For each kernel, how much slower is it in the block than with identity layers, as a fraction of its time "
        "with identity layers? Compare that with the threshold, entry by entry, with tensor operations.",
        "The slowdown is block_ms / alone_ms - 1 (0.05 is 5% slower; negative if faster in the block). A kernel is "
        "instruction-bound when the slowdown is more than the threshold: a comparison gives a boolean tensor.",
        "return block_ms / alone_ms - 1 > threshold",
    ],
    library="mhc_lab.course.step_time.instruction_bound",
    mistakes=[
        Mistake(_bound_wrong("inverted"), "the ratio upside down"),
        Mistake(_bound_wrong("difference"), "a difference in milliseconds"),
        Mistake(_bound_wrong("no_minus_one"), "the ratio itself against the threshold"),
        Mistake(_bound_wrong("absolute"), "the size of the change"),
    ],
)
def _check_instruction_bound(answer):
    cases = []
    for k, (shape, threshold) in enumerate(_BOUND_CASES):
        case = f"kernel times of shape {shape}, threshold {threshold}"
        alone, block = _bound_inputs(shape, 8300 + 10 * k)
        got = call(answer, alone.clone(), block.clone(), threshold, case=case)
        _compare_flags(got, alone, block, threshold, case)
        cases.append(case)
    return cases


# ---- 8.3 what the host adds per site -------------------------------------------------------------------------

# (launched_ms, gpu_ms, plain_launched_ms, plain_gpu_ms, layers, what the case is): each usual mistake gives a
# wrong answer on at least one of them
_SITE_CASES = [
    (27.5, 3.5, 8.0, 2.3, 8, "a small model's stack"),
    (41.0, 39.2, 33.5, 32.6, 12, "a wide stack, the host kept ahead"),
    (9.0, 5.4, 6.0, 4.9, 4, "a launched step between 1.5 and 2 times its GPU time"),
    (10.2, 4.0, 10.0, 3.2, 1, "one site whose kernels ran while the plain step's GPU waited"),
    (3.0, 3.1, 2.9, 2.8, 30, "a launched step that reads below its GPU time (noise)"),
]
# seeded random stacks: launched over GPU time (least, most) per regime, the plain step's range of GPU ms
_SITE_REGIMES = [((2.2, 12.0), (0.5, 10.0)), ((1.0, 1.4), (10.0, 80.0)), ((1.55, 1.95), (1.0, 20.0))]
_SITE_LAYERS = (2, 6, 24, 61)
_SITE_MISTAKES = {
    "twice": "divided by the layers twice. The two differences are per step; divide their difference by layers "
             "once to share it among the sites.",
    "no_gpu": "the launched step's growth taken as host time. Part of it is the sites' own kernels: take the GPU "
              "time's growth, gpu_ms - plain_gpu_ms, out of it.",
    "no_plain": "the whole gap between the launched step and its GPU time charged to the sites. The plain step has "
                "its own host time; compare with it: (launched_ms - plain_launched_ms) - (gpu_ms - plain_gpu_ms).",
    "per_step": "the host time per step, not per site. Divide by layers: the stack has one site per layer.",
    "sign": "the difference upside down: the GPU's growth less the launched step's. The host time is what the "
            "launched step grows beyond the GPU's work: (launched growth) - (GPU growth).",
    "against_gpu": "the wait compared with the GPU time instead of the launched step. Host-bound means the GPU "
                   "waits for more than half of the launched step: launched_ms - gpu_ms > launched_ms / 2.",
    "site_only": "the verdict taken from a site's figures (host time against GPU time per site). The question is "
                 "the whole launched step's: does its GPU wait, launched_ms - gpu_ms, for more than half of it?",
    "any_wait": "any wait at all counted as host-bound. A launched step always reads a little longer than its GPU "
                "time; host-bound means the GPU waits for more than half of it: launched_ms - gpu_ms > "
                "launched_ms / 2.",
}
_SITE_HOST_MISTAKES = ("twice", "no_gpu", "no_plain", "per_step", "sign")


def _site_wrong(kind: str):
    def wrong(launched_ms, gpu_ms, plain_launched_ms, plain_gpu_ms, layers):
        grown, gpu_grown = launched_ms - plain_launched_ms, gpu_ms - plain_gpu_ms
        host_ms = {"twice": (grown / layers - gpu_grown / layers) / layers, "no_gpu": grown / layers,
                   "no_plain": (launched_ms - gpu_ms) / layers, "per_step": grown - gpu_grown,
                   "sign": (gpu_grown - grown) / layers}.get(kind, (grown - gpu_grown) / layers)
        wait = launched_ms - gpu_ms
        bound = {"against_gpu": wait > gpu_ms / 2, "site_only": (grown - gpu_grown) / layers > gpu_grown / layers,
                 "any_wait": wait > 0}.get(kind, wait > launched_ms / 2)
        return host_ms, bound

    wrong.__name__ = f"host_per_site_{kind}"
    return wrong


def _site_name(launched_ms, gpu_ms, plain_launched_ms, plain_gpu_ms, layers, what: str = "") -> str:
    return (f"{what + ': ' if what else ''}{layers} site{'s' if layers != 1 else ''}, launched {launched_ms:.6g} ms "
            f"against {gpu_ms:.6g} ms of GPU time, the plain step {plain_launched_ms:.6g} ms against "
            f"{plain_gpu_ms:.6g} ms")


def _site_cases() -> list[tuple[tuple, str]]:
    cases = [(c[:5], _site_name(*c[:5], c[5])) for c in _SITE_CASES]
    for k, ((low, high), (gpu_low, gpu_high)) in enumerate(_SITE_REGIMES):
        g = seeded(8400 + k)
        u = torch.rand(4, generator=g, dtype=torch.float64).tolist()
        layers = _SITE_LAYERS[int(torch.randint(len(_SITE_LAYERS), (), generator=g))]
        plain_gpu = gpu_low + (gpu_high - gpu_low) * u[0]
        gpu = plain_gpu + layers * (0.01 + 0.5 * u[1])
        launched = gpu * (low + (high - low) * u[2])
        plain_launched = plain_gpu + (launched - gpu) * (0.1 + 0.8 * u[3])  # the plain step waits less
        args = (launched, gpu, plain_launched, plain_gpu, layers)
        cases.append((args, _site_name(*args)))
    return cases


def _near(a: float, b: float) -> bool:
    return abs(a - b) <= 1e-9 + 1e-6 * abs(b)


def _host_and_flag(got, case: str) -> tuple[float, bool]:
    if not isinstance(got, (tuple, list)) or len(got) != 2:
        length = f" of length {len(got)}" if isinstance(got, (tuple, list)) else ""
        raise CheckFailed(f"{case}: expected a tuple (host_ms, host_bound), got {type(got).__name__}{length}")
    host, flag = got
    try:
        host = float(host)
    except (TypeError, ValueError):
        raise CheckFailed(f"{case}: expected host_ms to be a number, got {type(host).__name__}") from None
    if isinstance(flag, torch.Tensor) and flag.dtype == torch.bool and flag.numel() == 1:
        flag = bool(flag)
    if not isinstance(flag, bool) and type(flag).__name__ != "bool_":
        raise CheckFailed(f"{case}: expected host_bound to be True or False (a comparison's result), got "
                          f"{type(flag).__name__} {flag!r}")
    return host, bool(flag)


def _site_mistake(values: list, cases: list, part: int) -> str:
    """The usual mistake whose ``part`` (0: host_ms, 1: host_bound) the answers match on every case."""
    for kind, explanation in _SITE_MISTAKES.items():
        if (kind in _SITE_HOST_MISTAKES) != (part == 0):
            continue
        wrong = [_site_wrong(kind)(*args)[part] for args, _ in cases]
        same = _near if part == 0 else (lambda a, b: a == b)
        if all(same(v[part], w) for v, w in zip(values, wrong)):
            return f" This looks like the usual mistake: {explanation}"
    return ""


@register(
    "8.3", "what the host adds per site",
    hints=[
        "Set the mHC stack against the plain one: each differs from it by its sites, once launched and once on the "
        "GPU. Of what the sites add to the launched step, the part their GPU time does not explain is the host's; "
        "share it among the sites. For the verdict, set the time the GPU waits in the launched step against the "
        "launched step itself.",
        "host_ms = ((launched_ms - plain_launched_ms) - (gpu_ms - plain_gpu_ms)) / layers: both differences are per "
        "step, so divide once. The GPU waits launched_ms - gpu_ms per step; the step is host-bound when that is "
        "more than half of launched_ms.",
        "return ((launched_ms - plain_launched_ms) - (gpu_ms - plain_gpu_ms)) / layers, "
        "launched_ms - gpu_ms > launched_ms / 2",
    ],
    library="mhc_lab.course.step_time.host_per_site",
    mistakes=[
        Mistake(_site_wrong("twice"), "divided by the layers twice"),
        Mistake(_site_wrong("no_gpu"), "the launched step's growth taken as host time"),
        Mistake(_site_wrong("no_plain"), "the whole gap between the launched step and its GPU time"),
        Mistake(_site_wrong("per_step"), "the host time per step, not per site"),
        Mistake(_site_wrong("sign"), "the difference upside down"),
        Mistake(_site_wrong("against_gpu"), "the wait compared with the GPU time"),
        Mistake(_site_wrong("site_only"), "the verdict taken from a site's figures"),
        Mistake(_site_wrong("any_wait"), "any wait at all counted as host-bound"),
    ],
)
def _check_host_per_site(answer):
    cases = _site_cases()
    values = [_host_and_flag(call(answer, *args, case=name), name) for args, name in cases]
    for (args, name), (host, _) in zip(cases, values):
        want = host_per_site(*args)[0]
        if not _near(host, want):
            raise CheckFailed(f"{name}: expected host_ms = {want:.6g}, got {host:.6g}."
                              + _site_mistake(values, cases, 0))
    for (args, name), (_, flag) in zip(cases, values):
        want = bool(host_per_site(*args)[1])
        if flag != want:
            raise CheckFailed(f"{name}: expected host_bound = {want}, got {flag}." + _site_mistake(values, cases, 1))
    return [name for _, name in cases]


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

# (n, C, batch, tokens, what the case is): DeepSeek-V4's four lanes at two widths, then two and eight lanes
_HC_CASES = [(4, 64, 2, 5, "DeepSeek-V4's four lanes, C = 64"), (4, 256, 1, 3, "four lanes, C = 256"),
             (2, 32, 1, 7, "two lanes, C = 32"), (8, 16, 2, 2, "eight lanes, C = 16")]
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
        return post, comb, mhc_pre(x, post if kind == "collapsed_post" else pre)

    wrong.__name__ = f"hyper_connection_{kind}"
    return wrong


def _hc_cases() -> list[tuple]:
    """(module, (fn, base, scale, x), what the case is) per case: transformers' HyperConnection with seeded random
    parameters, and seeded lanes [batch, tokens, n, C]."""
    if deepseek_v4.TRANSFORMERS is None:
        raise ImportError(f"exercise 8.6 checks against transformers' DeepSeek-V4 HyperConnection: "
                          f"{deepseek_v4.INSTALL}")
    cases = []
    for k, (n, C, batch, tokens, what) in enumerate(_HC_CASES):
        g = seeded(8600 + k)
        hc = deepseek_v4.hyper_connection(n, C, g)
        x = torch.randn(batch, tokens, n, C, generator=g)
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
            try:
                assert_close(g, w, case=name, name=label)
            except CheckFailed as failure:
                raise CheckFailed(f"{failure}.{_hc_mistake(values, cases)}") from None
    return [name for _, _, name in cases]
