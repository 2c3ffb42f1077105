"""The portable programs beside the Hopper ones, on a Hopper GPU (part 'portable' of the training benchmark).

On sm_80 to sm_89 and on Blackwell the ops run portable programs where the Hopper ones use TMA and wgmma: kernel 2
of the pre backward has a portable program of its own, and chained sites run unchained (the post kernel, then
the next pre's projection pass) instead of the fused post + projection. This part runs one site both ways on the
GPU at hand, the portable way by answering the dispatch's one architecture question (dispatch.hopper_programs)
as a GPU without wgmma would, and times, as CUDA graphs (the GPU's time): the forward of a linked site, and the
forward + backward of a linked and of a chained site, with each way's gradients against the float32 reference.
"""

from __future__ import annotations

import contextlib
from unittest import mock

import torch

from mhc_lab.bench.common import N, graph_replay, interleaved_rounds, reference_site, rel
from mhc_lab.bench.site import GRADIENTS, site_implementations, site_operands

PATHS = ("hopper", "portable")


@contextlib.contextmanager
def path(name: str):
    """Within the block the ops take the ``name`` programs on this GPU."""
    from mhc_lab.ops import dispatch

    if name == "hopper":
        yield
        return
    with mock.patch.object(dispatch, "hopper_programs", lambda capability: False):
        yield


def bench_portable(tokens: int, C: int, bench, *, rounds: int = 3, log=print) -> dict:
    """Both paths at one shape: {"tokens", "C", "n", "graph_rounds_ms": {"<path>.<what>": [ms per round]},
    "graph_ms": the medians, "rel_err": {"<path>.<what>": {gradient: relative error}}, "errors"}."""
    from mhc_lab.ops.dispatch import kernel_paths_line

    leaves, g = site_operands(tokens, C)
    impls, _ = site_implementations(skip=("tilekernels", "compile", "eager"))
    want = torch.autograd.grad(reference_site(*leaves), leaves, g)
    out = {"tokens": tokens, "C": C, "n": N, "graph_ms": {}, "graph_rounds_ms": {}, "rel_err": {}, "errors": {}}
    replays = {}
    for way in PATHS:
        with path(way):
            log(f"  {way}: {kernel_paths_line(leaves[0].device, N)}")
            steps = {
                "linked_forward": lambda: impls["ours_linked"](*(t.detach() for t in leaves)),
                "linked": lambda: torch.autograd.grad(impls["ours_linked"](*leaves), leaves, g),
                "chained": lambda: torch.autograd.grad(impls["ours_chained"](*leaves), leaves, g),
            }
            for what, step in steps.items():
                key = f"{way}.{what}"
                try:
                    got = step()
                    if what != "linked_forward":
                        out["rel_err"][key] = {k: rel(a, b) for k, a, b in zip(GRADIENTS, got, want)}
                    replays[key] = graph_replay(step)  # captured here: the graph keeps this way's kernels
                except Exception as e:  # noqa: BLE001 - record why this one is missing
                    out["errors"][key] = repr(e)[:500]
                    log(f"  {key} FAILED {repr(e)[:300]}")
    out["graph_rounds_ms"] = interleaved_rounds(replays, bench, rounds)
    for key, values in out["graph_rounds_ms"].items():
        out["graph_ms"][key] = sorted(values)[len(values) // 2]
    for what in ("linked_forward", "linked", "chained"):
        h, p = out["graph_ms"].get(f"hopper.{what}"), out["graph_ms"].get(f"portable.{what}")
        if h and p:
            log(f"  site {tokens}x{C} {what:15s} hopper {h:8.3f} ms, portable {p:8.3f} ms ({p / h:.2f}x)")
    return out
