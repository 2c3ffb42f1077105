"""Lab 07's sentences about the training recording (mhc_lab/recorded/training_h200.json) and about the byte counts
of mhc_lab.measure.bytes_model, each with the check that the recording (or the count) still bears it out."""

from __future__ import annotations

import statistics

from claims import Claim, Recordings
from mhc_lab.bench.copy_floor import copy_floor_counts, copy_floor_plan
from mhc_lab.course import training_lab
from mhc_lab.measure import bytes_model

N = 4
RECORDING = "training_h200"


def _part(r: Recordings, key: str) -> dict:
    return r.results(RECORDING, key)


def _per_C(method: str, direction: str) -> int:
    return bytes_model.total(method, N, direction).moved.per_C


def _floor_pct(r: Recordings, C: int, recompute: bool = False) -> float:
    floor = training_lab.floor_inputs(r[RECORDING])
    return training_lab.overhead_floor(N, C, floor["tokens"], floor["block_ms"][C], floor["copy_gbps"],
                                       recompute=recompute)[1]


def _breakdown(r: Recordings, C: int, kind: str = "mhc_ours") -> dict:
    return next(e for e in _part(r, "block_kernels")["widths"] if e["C"] == C and e["kind"] == kind)


def _noise(entry: dict) -> float:
    """The largest relative change between the plain and the other block of a kernel both launch (0.1 ms or more
    per step): what one profile moves by with no cause (lab 08's rule)."""
    base, other = entry["residual_block"]["kernels"], entry["kind_block"]["kernels"]
    return max(abs(other[k]["ms"] / base[k]["ms"] - 1) for k in base if k in other and base[k]["ms"] >= 0.1)


def _beside_layers(entry: dict, kernel: str) -> float:
    """A kernel's time in the block over its time with identity layers, less one."""
    return entry["kind_block"]["kernels"][kernel]["ms"] / entry["kind_without_layers"]["kernels"][kernel]["ms"] - 1


KERNEL_2, POST_PROJECT = "lanes_backward_cuda_post_grad_kernel", "post_project_cuda_kernel"


def _site_fastest(r: Recordings) -> bool:
    for shape in _part(r, "site")["shapes"]:
        for clock in ("graph_ms", "launched_ms"):
            t = shape[clock]
            ordered = t["ours_chained"] < t["ours_linked"] < t["ours_separate"]
            if not ordered or not t["ours_chained"] < t["tilekernels"]:
                return False
    return True


def _clocks_apart(r: Recordings) -> float:
    gaps = [abs(s["launched_ms"][k] / s["graph_ms"][k] - 1) for s in _part(r, "site")["shapes"]
            for k in s["graph_ms"] if k in s["launched_ms"]]
    for w in _part(r, "block")["widths"]:
        launched, graph = w["launched"]["rounds_ms"], w["graph"]["rounds_ms"]
        gaps += [abs(statistics.median(launched[k]) / statistics.median(graph[k]) - 1) for k in launched if k in graph]
    return max(gaps)


def _overhead(w: dict, mode: str, kind: str) -> float:
    return w[mode]["overhead_pct"][kind]["median"]


def _floor_kernels_split(r: Recordings) -> bool:
    """The kernels that only stream are within 10% of their bytes at the copies' pace; those with a matrix product
    per tile are above it by more."""
    streaming = {"post_cuda_kernel", "post_backward_without_dx_kernel", "mix_lanes_kernel", "dpre_reduce_kernel"}
    products = {KERNEL_2, POST_PROJECT, "project_kernel"}
    for width in training_lab.floor_kernel_rows(_part(r, "block_kernels")):
        for k in width["kernels"]:
            near = k["beyond_ms"] <= 0.10 * k["ms"]
            if (k["kernel"] in streaming and not near) or (k["kernel"] in products and near):
                return False
    return True


def _copies_exceed_added_wall(r: Recordings) -> bool:
    for e in (e for e in _part(r, "block_kernels")["widths"] if e["kind"] == "copy_floor"):
        copies = e["kind_block"]["kernels"]["Memcpy DtoD (Device -> Device)"]["ms"]
        added = e["kind_block"]["wall_ms"] - e["residual_block"]["wall_ms"]
        if not copies > added or e["residual_block"]["idle_ms"] <= 0:
            return False
    return True


CLAIMS = [
    Claim("the backward of an mHC site moves about twice the bytes of its forward",
          lambda r: 1.8 <= _per_C("mhc_minimal", "backward") / _per_C("mhc_minimal", "forward") <= 2.2),
    Claim("the backward is two thirds of an mHC site's traffic",
          lambda r: round(3 * _per_C("mhc_minimal", "backward") / (_per_C("mhc_minimal", "backward")
                                                                   + _per_C("mhc_minimal", "forward"))) == 2),
    Claim("at C = 4096 the bytes alone, at 100% of the copy bandwidth, cost about 6% of this block, and recomputing "
          "costs more",
          lambda r: round(_floor_pct(r, 4096)) == 6 and _floor_pct(r, 4096, recompute=True) > _floor_pct(r, 4096)),
    Claim("Chained sites move the least forward",
          lambda r: _per_C("ours_chained", "forward") == _per_C("mhc_minimal", "forward")),
    Claim("In the backward they move more than the least in two places",
          lambda r: _per_C("ours_chained", "backward") - bytes_model.post_gradient_saving(N)
          > _per_C("mhc_minimal", "backward")),
    Claim("apply H_resᵀ itself, 42C per chained site",
          lambda r: _per_C("ours_chained", "forward") + _per_C("ours_chained", "backward")
          - bytes_model.post_gradient_saving(N) == 42),
    Claim("76C per token beyond the residual's, as 11 copies per step",
          lambda r: [sum(counts := copy_floor_counts(copy_floor_plan(N))), len(counts)] == [76, 11]),
    Claim("Here the two clocks agree within 3% for every site and block", lambda r: _clocks_apart(r) < 0.03),
    Claim("Chained sites are the fastest of our three designs, and faster than TileKernels at every shape",
          _site_fastest),
    Claim("the interleaved rounds below it show how little that ratio moves from round to round",
          lambda r: all((q["most"] - q["least"]) / q["median"] < 0.03 for s in _part(r, "site")["shapes"]
                        for q in [s["chained_vs_tilekernels_graph_rounds"]])),
    Claim("The chained block sits above it at every width and on both clocks",
          lambda r: all(_overhead(w, mode, "mhc_ours") > _overhead(w, mode, "copy_floor")
                        for w in _part(r, "block")["widths"] for mode in ("launched", "graph"))),
    Claim("They take more than all of the chained step's extra time",
          lambda r: all(e["comparison"]["only_other_ms"] >= e["kind_block"]["wall_ms"] - e["residual_block"]["wall_ms"]
                        for e in _part(r, "block_kernels")["widths"] if e["kind"] == "mhc_ours")),
    Claim("the kernels both blocks launch (the layers' matrix products, attention, the norms) take no longer beside "
          "them",
          lambda r: all(e["comparison"]["shared_other_ms"] <= e["comparison"]["shared_base_ms"]
                        for e in _part(r, "block_kernels")["widths"] if e["kind"] == "mhc_ours")),
    Claim("The kernels both blocks launch move by up to 4% between the two blocks with no cause",
          lambda r: round(100 * max(_noise(_breakdown(r, C)) for C in (2560, 4096))) == 4),
    Claim("At C = 4096 two kernels run slower beside the layers by more than that: kernel 2 of the pre backward by 9% "
          "and the fused post + projection by 8%",
          lambda r: (round(100 * _beside_layers(_breakdown(r, 4096), KERNEL_2)) == 9
                     and round(100 * _beside_layers(_breakdown(r, 4096), POST_PROJECT)) == 8
                     and min(_beside_layers(_breakdown(r, 4096), k) for k in (KERNEL_2, POST_PROJECT))
                     > _noise(_breakdown(r, 4096)))),
    Claim("At C = 2560 the same two move by 3% and 2%, within the noise",
          lambda r: (round(100 * _beside_layers(_breakdown(r, 2560), KERNEL_2)) == 3
                     and round(100 * _beside_layers(_breakdown(r, 2560), POST_PROJECT)) == 2
                     and max(abs(_beside_layers(_breakdown(r, 2560), k)) for k in (KERNEL_2, POST_PROJECT))
                     <= _noise(_breakdown(r, 2560)))),
    Claim("the kernels that only stream (the post, its backward, the lane mix, the dH_pre stream) run at it; those "
          "above it do a matrix product per tile (kernel 2, the post + projection, the first site's projection)",
          _floor_kernels_split),
    Claim("Lab 08's recorded stack of layers at that size takes about twice its GPU time when launched op by op",
          lambda r: all(1.5 <= s["launched_ms"][k] / s["gpu_ms"][k] <= 2.5 for s in _part(r, "stack")["shapes"]
                        if (s["tokens"], s["C"]) == (4096, 768) for k in ("residual", "mhc_kernels"))
          and any((s["tokens"], s["C"]) == (4096, 768) for s in _part(r, "stack")["shapes"])),
    Claim("The overhead floor at C = 2560 was higher than at C = 4096",
          lambda r: _floor_pct(r, 2560) > _floor_pct(r, 4096)),
    Claim("the copy floor's copies take more kernel time per step than the floor adds to the block's wall time, and "
          "the plain block's GPU sits idle for part of every step", _copies_exceed_added_wall),
]

# Sentences with a comparing word that say nothing about a recorded figure: where a cell is (below, above), the
# concept, the questions of the reflection, and the live measurements that a printed check right beside them
# decides (True or False, from this run's data).
GENERAL = [
    "run the check(...) cell below it",
    "the gradient arriving from above",
    "the extra time over the plain residual would be the floor below",
    "Both agree with autograd of the forward to rounding",  # the cell below prints the check
    "it passes only if every entry of every gradient agrees",
    "since it runs the forward twice per input entry",
    "the pre reads x twice",
    "Where does the saving grow fastest",
    "mHC keeps about (n + 2)C per layer above the plain residual",  # the live sweep printed above it
    "The check above finds the lowest peak",
    "with the copy floor (the plain block plus copies of mHC's bytes, below)",
    "is what an implementation can only approach from above",
    "Launched, a site takes the longer of its kernels' time and the host's time",
    "A gradient of all ones makes dx = H_res g and dx = H_resᵀ g agree",
    "when would that undoing lose accuracy",
    "Which part of the block grows faster than the mHC bytes as C grows",
    "which of the block's overheads (mHC's or the copies') grows",
]


def break_one(recordings: Recordings) -> str:
    """TileKernels' site made faster than the chained one at the first shape, on the GPU's clock."""
    shape = recordings.results(RECORDING, "site")["shapes"][0]
    shape["graph_ms"]["tilekernels"] = shape["graph_ms"]["ours_chained"] / 2
    return "Chained sites are the fastest of our three designs, and faster than TileKernels at every shape"
