"""Lab 08's sentences about the H200's recordings (training_h200, forward_h200), each bound to a check on them."""

from __future__ import annotations

from claims import Claim, Recordings

from mhc_lab.course import stack_clocks, step_time

TRAINING = "training_h200"
MHC_BLOCK_KINDS = ("mhc_ours", "mhc_ours_recompute", "mhc_tilekernels")
EAGER_MHC = ("mhc_kernels", "mhc_tilekernels", "mhc_reference")


def _floors_under_every_mhc_row(r: Recordings) -> bool:
    for row in step_time.floor_rows(r.results(TRAINING, "block")):
        for mode in row["modes"].values():
            o = mode["overhead"]
            mhc = [o[k]["median"] for k in MHC_BLOCK_KINDS if k in o]
            if not mhc or max(mode["bytes_pct"], o["copy_floor"]["median"]) >= min(mhc):
                return False
    return True


def _floor_larger_at_the_narrower_width(r: Recordings) -> bool:
    share = {row["C"]: row["modes"]["graph"]["bytes_pct"] for row in step_time.floor_rows(r.results(TRAINING, "block"))}
    return share[2560] > share[4096]


def _site_host_share_small(r: Recordings) -> bool:
    shares = [row["host_share"] for row in step_time.site_clocks(r.results(TRAINING, "site"))]
    return bool(shares) and max(shares) < 0.025  # "at most 2%", as the table rounds it


def _stack_shapes(r: Recordings) -> tuple[list[dict], list[dict]]:
    rows = stack_clocks.stack_rows(r.results(TRAINING, "stack"))
    sizes = sorted({(row["tokens"] * row["C"], row["tokens"], row["C"]) for row in rows})
    small, wide = sizes[0][1:], sizes[-1][1:]
    return ([row for row in rows if (row["tokens"], row["C"]) == small],
            [row for row in rows if (row["tokens"], row["C"]) == wide])


def _eager(row: dict) -> bool:
    return not row["kind"].endswith(("_compiled", "_reduce_overhead"))


def _small_host_bound_wide_gpu_bound(r: Recordings) -> bool:
    small, wide = _stack_shapes(r)
    return (all(row["host_bound"] for row in small if _eager(row))
            and not any(row["host_bound"] for row in wide if _eager(row)))


def _reduce_overhead_gpu_bound(r: Recordings) -> bool:
    small, _ = _stack_shapes(r)
    bound = {row["kind"]: row["host_bound"] for row in small}
    return bound["mhc_kernels"] is True and bound["mhc_kernels_reduce_overhead"] is False


def _graph_orders_as_gpu(r: Recordings) -> bool:
    for rows in _stack_shapes(r):
        kinds = [row for row in rows if row["kind"] in EAGER_MHC]
        if sorted(kinds, key=lambda row: row["gpu_ratio"]) != sorted(kinds, key=lambda row: row["graph_ratio"]):
            return False
    return True


def _slowed_at(r: Recordings) -> dict[str, set[int]]:
    """Each of mHC's own kernels (plain name) -> the widths at which the power cap slowed it."""
    out: dict[str, set[int]] = {}
    for width in step_time.power_cap_rows(r.results(TRAINING, "block_kernels")):
        for k in width["kernels"]:
            out.setdefault(step_time.kernel_name(k["kernel"]), set())
            if k["verdict"].startswith("slowed"):
                out[step_time.kernel_name(k["kernel"])].add(width["C"])
    return out


def _slowed(kernels: tuple[str, ...], widths: set[int]):
    return lambda r: all(_slowed_at(r)[k] == widths for k in kernels)


STREAMING = ("post (the last site)", "post backward", "pre apply: lane mix", "pre backward 1: dH_pre stream")
PER_TOKEN = ("pre backward 1: per token", "pre backward: parameter sums")
TENSOR_CORE = ("pre backward 2: dx, dphi", "post + next projection")

CLAIMS = [
    Claim("In the recording, both floors sit below every mHC row.", _floors_under_every_mhc_row),
    Claim("The computed floor is the larger share at C = 2560", _floor_larger_at_the_narrower_width),
    Claim("At every shape of the recording, the host's share of one site is at most 2%", _site_host_share_small),
    Claim("the graph column tells the same story", _graph_orders_as_gpu),
    Claim("In the recording, the small shape's eager steps are all host-bound and the wide shape's all GPU-bound",
          _small_host_bound_wide_gpu_bound),
    Claim("At the small shape, reduce-overhead turns the fused stack's launched step GPU-bound",
          _reduce_overhead_gpu_bound),
    Claim("The post, the post's backward, the lane mix and the dH_pre stream are slowed at no width",
          _slowed(STREAMING, set())),
    Claim("The small per-token kernels are slowed at every width", _slowed(PER_TOKEN, {2560, 4096})),
    Claim("Kernel 2 of the pre's backward and the post + next projection are slowed at C = 4096 only",
          _slowed(TENSOR_CORE, {4096})),
]

# Sentences with a comparing word that speak of the concept, not of a recorded figure.
GENERAL = [
    "run the check(...) cell below it",
    "so a site costs at least the time its bytes take to cross HBM",
    "so an implementation can only approach it from above",
    "mHC's bytes per token grow with C",
    "the chained block's distance above the measured floor",
    "when it falls behind, the GPU idles between kernels",
    "True when its GPU waits (launched less GPU time) for more than half of it",
    "is the plain stack host-bound?",
    "is your plain stack host-bound",
    "is slowed by the cap (instruction-bound, at least in part)",
    "True where a kernel runs longer in the block by more than the threshold",
    "bound by its instructions for part of its time",
    "Fewer instructions pay an instruction-bound kernel twice",
    "only fewer bytes make them faster",
    "0 when the compute lasts at least as long",
    "3 ms of compute to hide behind",
    "a cluster's links are many times quicker",
    "twice a layer",
    "the table above says what it is to us",
    "What would the model lose",
]


def break_one(recordings: Recordings) -> str:
    """Make one site's launched step take twice its graph: its host share is then far over 2%."""
    shape = recordings.results(TRAINING, "site")["shapes"][0]
    shape["launched_ms"]["ours_chained"] = 2 * shape["graph_ms"]["ours_chained"]
    return "At every shape of the recording, the host's share of one site is at most 2%"
