"""One mHC site's forward + backward on a CUDA GPU (part 'site' of the training benchmark).

n = 4, bf16 lanes, float32 coefficients, 20 Sinkhorn rounds, layer F = identity: the gradients of x, phi, bias
and alpha for a random upstream gradient, per implementation: ours as separate ops (mhc_pre, then mhc_post),
as a linked site (mhc_site: the lanes' two gradients summed in the pre's backward) and as a site inside a chain
(mhc_site_chained: its pre takes x's projection from the previous post, its post projects for the next pre),
DeepSeek's TileKernels (its autograd path), torch.compile of the reference and the eager reference. Every
gradient is compared with the float32 reference on the same inputs. Each is timed twice: launched op by op from
Python, and captured once as a CUDA graph and replayed (the GPU's time alone, without the host's per-op work);
the graphs are then timed again in interleaved rounds.
"""

from __future__ import annotations

import torch

from mhc_lab.bench.common import (
    N,
    graph_replay,
    interleaved_rounds,
    reference_site,
    rel,
    round_ratios,
    site_inputs,
    tilekernels_ops,
    tilekernels_site,
)
from mhc_lab.measure import bytes_model

# The sites also timed as CUDA graphs. Not the eager reference and torch.compile's code: capturing the compiled
# site failed on the H200, and a failed capture left the process's CUDA generator unusable for what followed.
# Both are host-bound at 10-20 ms per site anyway, and their launched time is what a user of them gets.
GRAPHED = ("ours_separate", "ours_linked", "ours_chained", "tilekernels")
GRADIENTS = ("x", "phi", "bias", "alpha")


def site_elements(n: int = N, post_grad: bool = True) -> dict[str, int]:
    """Lane-wide elements per token of one site's forward + backward, units of C (mhc_lab.measure.bytes_model):
    the least any design moves (41 at n = 4) and ours as separate ops (58), as a linked site and as chained
    sites; with post_grad their post hands its output gradient to the pre's backward and writes no dx (46 and
    42 at n = 4, what the ops do on CUDA there: mhc_lab.ops.dispatch.post_gradient_to_pre_for)."""
    saving = bytes_model.post_gradient_saving(n) if post_grad else 0
    out = {}
    for key, method in (("least", "mhc_minimal"), ("ours_separate", "ours"), ("ours_linked", "ours_linked"),
                        ("ours_chained", "ours_chained")):
        per_C = sum(bytes_model.total(method, n, d).moved.per_C for d in bytes_model.DIRECTIONS)
        out[key] = per_C - (saving if key in ("ours_linked", "ours_chained") else 0)
    return out


def handed_partial(x, phi, bias, alpha):
    """x's projection with phi as a previous site's post hands it to this pre (the chained splits), made from
    the pre's own projection: its splits summed into the first."""
    from mhc_lab.ops.dispatch import partial_splits

    with torch.no_grad():
        own = torch.ops.mhc_lab.pre_forward(x, phi, bias, alpha, "kernels")[4]
        handed = torch.zeros((partial_splits("kernels", x, chained=True), *own.shape[1:]), dtype=own.dtype,
                             device=own.device)
        handed[0] = own.sum(0)
    return handed


def site_implementations(skip=()) -> tuple[dict, dict]:
    """{name: site(x, phi, bias, alpha) -> lanes}, and {name: why it is missing}."""
    from mhc_lab.ops import mhc_post, mhc_pre, mhc_site, mhc_site_chained

    made = {}

    def chain_partial(x, phi, bias, alpha):  # made once per input, outside the timing
        key = (x.data_ptr(), phi.data_ptr(), tuple(x.shape))
        if key not in made:
            made.clear()
            made[key] = handed_partial(x.detach(), phi.detach(), bias.detach(), alpha.detach())
        return made[key]

    def ours_separate(x, phi, bias, alpha):
        y, post, res = mhc_pre(x, phi, bias, alpha, backend="kernels")
        return mhc_post(x, y, post, res, backend="kernels")

    def ours_linked(x, phi, bias, alpha):
        return mhc_site(x, phi, bias, alpha, lambda y: y, backend="kernels")

    def ours_chained(x, phi, bias, alpha):  # the previous post projected x for this pre, and this post projects
        # its lanes for the next pre (with the same phi here: the cost does not depend on its values)
        return mhc_site_chained(x, phi, bias, alpha, lambda y: y, partial=chain_partial(x, phi, bias, alpha),
                                next_phi=phi, backend="kernels")[0]

    impls = {"ours_separate": ours_separate, "ours_linked": ours_linked, "ours_chained": ours_chained}
    errors = {}
    if "tilekernels" not in skip:
        try:
            tilekernels_ops()  # the package loads, or the baseline is missing and says why
            impls["tilekernels"] = tilekernels_site
        except Exception as e:  # noqa: BLE001 - record why the baseline is missing
            errors["tilekernels"] = repr(e)[:500]
    if "compile" not in skip:
        impls["compiled"] = torch.compile(reference_site)
    if "eager" not in skip:
        impls["eager"] = reference_site
    return impls, errors


def site_operands(tokens: int, C: int):
    """A site's inputs, autograd leaves made from them, and the random upstream gradient (seed 7)."""
    x, phi, bias, alpha = site_inputs(tokens, C)
    g = torch.randn(x.shape, device="cuda", generator=torch.Generator(device="cuda").manual_seed(7)).bfloat16()
    leaves = [t.detach().clone().requires_grad_() for t in (x, phi, bias, alpha)]
    return leaves, g


def bench_site(tokens: int, C: int, bench, *, skip=(), graph_rounds: int = 3, log=print) -> dict:
    """One site's forward + backward per implementation at one shape: launched, as a CUDA graph, and the graphs
    again in ``graph_rounds`` interleaved rounds (with the chained site's ratio to TileKernels per round)."""
    leaves, g = site_operands(tokens, C)
    from mhc_lab.ops.dispatch import post_gradient_to_pre_for

    impls, errors = site_implementations(skip)
    elements = site_elements(N, post_gradient_to_pre_for(leaves[0], "kernels"))
    out = {"tokens": tokens, "C": C, "n": N, "elements_per_token": elements,
           "bytes": {k: tokens * v * C * 2 for k, v in elements.items()}, "launched_ms": {}, "graph_ms": {},
           "graph_rounds_ms": {}, "rel_err": {}, "errors": errors}
    want = torch.autograd.grad(reference_site(*leaves), leaves, g)
    replays = {}
    for name, fn in impls.items():
        def step(fn=fn):
            return torch.autograd.grad(fn(*leaves), leaves, g)
        try:
            got = step()
            torch.cuda.synchronize()
            out["rel_err"][name] = {k: rel(a, b) for k, a, b in zip(GRADIENTS, got, want)}
            out["launched_ms"][name] = bench(step) * 1e3
            graphed = "not captured as a CUDA graph"
            if name in GRAPHED:
                try:
                    replays[name] = graph_replay(step)
                    out["graph_ms"][name] = bench(replays[name]) * 1e3
                    graphed = f"{out['graph_ms'][name]:8.3f} ms as a CUDA graph"
                except Exception as e:  # noqa: BLE001 - the launched timing stands; say why there is no graph
                    out["errors"][f"{name}.graph"] = repr(e)[:500]
                    graphed = f"no CUDA graph ({repr(e)[:120]})"
            errs = " ".join(f"{k} {v:.1e}" for k, v in out["rel_err"][name].items())
            log(f"  site {tokens}x{C} {name:14s} {out['launched_ms'][name]:8.3f} ms launched, {graphed}  "
                f"rel err {errs}")
        except Exception as e:  # noqa: BLE001
            out["errors"][name] = repr(e)[:500]
            log(f"  site {tokens}x{C} {name:14s} FAILED {repr(e)[:300]}")
    if replays:
        out["graph_rounds_ms"] = interleaved_rounds(replays, bench, graph_rounds)
        replays.clear()
        ratio = round_ratios(out["graph_rounds_ms"].get("ours_chained"), out["graph_rounds_ms"].get("tilekernels"))
        if ratio:
            out["chained_vs_tilekernels_graph_rounds"] = ratio
            log(f"  site {tokens}x{C} chained / TileKernels as CUDA graphs over {graph_rounds} interleaved rounds: "
                f"median {ratio['median']:.4f}x ({ratio['least']:.4f}-{ratio['most']:.4f})")
    return out
