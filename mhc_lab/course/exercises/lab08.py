"""Lab 08 exercises: where a training step's time goes. The copy floor's extra time and overhead from bytes and the
copy bandwidth, the host's share of a launched step from its launched and CUDA-graph times, what the host adds per
mHC site of a stack and whether its launched step is host-bound, and which kernels the power cap slows
(instruction-bound) from their time with identity layers and in the block (8.1-8.4; 8.5 and 8.6 are in
lab08_models).

Each check draws seeded random inputs for several block shapes (or tensor shapes) and compares with the reference
in mhc_lab.course.step_time, computed independently; a wrong answer that matches a usual mistake on every case is
named.
"""

from __future__ import annotations

import torch

from mhc_lab.course.checks import CheckFailed, Mistake, assert_close, call, register, seeded
from mhc_lab.course.exercises import lab08_models  # noqa: F401 - registers exercises 8.5 and 8.6
from mhc_lab.course.step_time import copy_floor_overhead, host_per_site, host_share, instruction_bound


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
    (12.0, 8.0, 10.0, 4.0, 8, "a host-bound plain step whose waits the sites' kernels filled"),
    (20.0, 6.0, 8.0, 6.0, 8, "a GPU-bound plain step made host-bound by its sites"),
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
    "plain_verdict": "the plain stack's verdict returned. host_bound is about the mHC stack's own launched step: "
                     "launched_ms - gpu_ms > launched_ms / 2, not plain_launched_ms - plain_gpu_ms; adding sites "
                     "can turn a step host-bound, or fill the plain step's waits.",
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
                 "any_wait": wait > 0,
                 "plain_verdict": plain_launched_ms - plain_gpu_ms > plain_launched_ms / 2}.get(kind, wait > launched_ms / 2)
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
        Mistake(_site_wrong("plain_verdict"), "the plain stack's verdict returned"),
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
