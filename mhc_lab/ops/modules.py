"""The mHC site as functions and modules for training, on the custom ops of mhc_lab.ops.site_ops.

    y, post, res = mhc_pre(x, phi, bias, alpha)          # x: lanes [..., n, C]
    x_next = mhc_post(x, layer(y), post, res)
    x_next = mhc_site(x, phi, bias, alpha, layer)       # the same, the lanes' two gradients summed in one pass
    x = run_sites(x, connections, layers)                # a chain: each post projects for the next pre

Every function takes ``backend`` ("auto", "reference", "kernels"; mhc_lab.ops.dispatch).
"""

from __future__ import annotations

import functools
from typing import Sequence

import torch
from torch import nn

from mhc_lab.ops.dispatch import (
    BACKENDS,
    check_layer_output,
    check_site,
    fused_projection_applies,
    resolve_backend,
)
from mhc_lab.ops.forward import _describe
from mhc_lab.ops.site_ops import post_then_pre, run_post_forward, run_post_forward_linked, run_pre_forward
from mhc_lab.reference.hyper_connections import collapse_lanes, expand_lanes
from mhc_lab.reference.mhc import mhc_identity_init
from mhc_lab.reference.validate import InputError, require_lanes, require_positive_int, require_tensor


def mhc_pre(x, phi, bias, alpha, *, backend: str = "auto"):
    """(layer input H_pre x [..., C], H_post [..., n] f32, H_res [..., n, n] f32), differentiable in x, phi,
    bias and alpha. DeepSeek-V4 convention, 20 Sinkhorn rounds (mhc_lab.reference.mhc_coefficients)."""
    check_site(x, phi, bias, alpha, "mhc_pre")
    y, post, res, _, _, _ = run_pre_forward(x, phi, bias, alpha, resolve_backend(backend, x))
    return y, post, res


def mhc_post(x, layer_output, post, res, *, backend: str = "auto"):
    """The next lanes sum_j H_res[i, j] x_j + H_post[i] layer_output, differentiable in every input."""
    n, C = require_lanes("x", x)
    batch = tuple(x.shape[:-2])
    check_layer_output(x, layer_output, "mhc_post")
    for name, value, shape in (("post", post, batch + (n,)), ("res", res, batch + (n, n))):
        require_tensor(name, value)
        if tuple(value.shape) != shape or value.device != x.device:
            raise InputError(f"mhc_post: {name}: expected shape {shape} on {x.device}, got {_describe(value)}")
        if not value.is_floating_point():
            raise InputError(f"mhc_post: {name}: expected a floating-point tensor, got {value.dtype} "
                             f"({_describe(value)})")
    return run_post_forward(x, layer_output, post, res, resolve_backend(backend, x))


def mhc_site(x, phi, bias, alpha, layer, *, backend: str = "auto"):
    """One whole site, x_next = H_res x + H_post^T layer(H_pre x), the same values as mhc_post(x, layer(y), ...)
    after mhc_pre, but the lanes' two gradients (the post's H_res^T g and the pre's) are summed inside the pre's
    backward pass instead of by autograd in a pass of their own: 50C per token at n = 4 instead of 58C.
    layer: a function of [..., C] -> [..., C]."""
    return mhc_site_chained(x, phi, bias, alpha, layer, backend=backend)[0]


def mhc_site_chained(x, phi, bias, alpha, layer, *, partial=None, next_phi=None, backend: str = "auto"):
    """mhc_site inside a chain of sites: (x_next, partial_next).

    partial: the projection of x with this site's phi, made by the previous site (or None: this site's pre
    projects x itself). next_phi: the next site's phi (or None): this site's post then projects x_next with it
    while x_next is on chip, so the next pre reads the lanes once instead of twice (4C fewer per token at
    n = 4 in the forward). partial_next is None when next_phi is None or the fused projection does not apply
    (fused_projection_applies)."""
    check_site(x, phi, bias, alpha, "mhc_site")
    chosen = resolve_backend(backend, x)
    if next_phi is not None:
        require_tensor("next_phi", next_phi)
        if tuple(next_phi.shape) != tuple(phi.shape) or next_phi.device != x.device:
            raise InputError(f"mhc_site: next_phi: expected shape {tuple(phi.shape)} on {x.device} (the next site "
                             f"of the same n and C), got {_describe(next_phi)}")
        if not next_phi.is_floating_point():
            raise InputError(f"mhc_site: next_phi: expected a floating-point tensor, got {next_phi.dtype} "
                             f"({_describe(next_phi)})")
        if not fused_projection_applies(chosen, x):
            next_phi = None
    return _checked_site(x, phi, bias, alpha, layer, partial, next_phi, chosen)


def _checked_site(x, phi, bias, alpha, layer, partial, next_phi, backend: str):
    """mhc_site_chained on inputs already checked, with the backend that runs and a next_phi the post projects
    with (None where it does not)."""
    y, post, res, _, _, link = run_pre_forward(x, phi, bias, alpha, backend, partial, linked=True)
    f = layer(y)
    check_layer_output(x, f, "mhc_site")
    out, partial_next = run_post_forward_linked(x, link, f, post, res, backend, next_phi)
    return out, (partial_next if next_phi is not None else None)


def run_sites(x, connections, layers):
    """x through a chain of MHCConnections, each around its layer. Each post and the next site's pre run as one
    step (site_ops.post_then_pre: on CUDA one autograd node), and the post projects its lanes for that pre
    where both run the same backend and the projection applies (fused_projection_applies), so inside the chain
    the lanes are read once per site, not twice. Every connection's parameters are checked against x before the
    first site runs (the lanes keep x's shape from site to site)."""
    connections, layers = list(connections), list(layers)
    if len(connections) != len(layers):
        raise InputError(f"run_sites: expected one connection per layer, got {len(connections)} connections and "
                         f"{len(layers)} layers")
    sites = []
    n, _ = require_lanes("x", x)
    for connection in connections:
        if connection.n != n:
            require_lanes("x", x, n=connection.n)  # refuses x, naming the dims
        parameters = connection.phi, connection.bias, connection.alpha
        check_site(x, *parameters, "mhc_site")
        sites.append((parameters, resolve_backend(connection.backend, x)))
    if not sites:
        return x
    projects = {backend: fused_projection_applies(backend, x) for backend in {backend for _, backend in sites}}
    parameters, backend = sites[0]
    y, post, res, _, _, link = run_pre_forward(x, *parameters, backend, linked=True)
    steps = {}  # (backend, next backend) -> the step from a post to the next pre (site_ops.post_then_pre)
    for layer, (parameters, following) in zip(layers, sites[1:]):
        f = layer(y)
        check_layer_output(x, f, "mhc_site")
        step = steps.get((backend, following))
        if step is None:
            step = steps[backend, following] = post_then_pre(x, backend, following,
                                                             following == backend and projects[backend])
        x, y, post, res, link = step(x, link, f, post, res, *parameters)
        backend = following
    f = layers[-1](y)
    check_layer_output(x, f, "mhc_site")
    return run_post_forward_linked(x, link, f, post, res, backend)[0]


class MHCConnection(nn.Module):
    """One mHC site around a layer function: x_next = H_res x + H_post^T layer(H_pre x).

    Parameters in DeepSeek-V4's layout (phi [n^2+2n, nC], bias [n^2+2n], alpha [3], float32), initialised
    near the identity (mhc_lab.reference.mhc_identity_init)."""

    def __init__(self, n: int, width: int, *, backend: str = "auto"):
        super().__init__()
        if backend not in BACKENDS:
            raise InputError(f"backend: expected one of {BACKENDS}, got {backend!r}")
        self.n, self.width, self.backend = require_positive_int("n", n), require_positive_int("width", width), backend
        phi, bias, alpha = mhc_identity_init(n, width)
        self.phi, self.bias, self.alpha = nn.Parameter(phi), nn.Parameter(bias), nn.Parameter(alpha)

    def forward(self, x: torch.Tensor, layer) -> torch.Tensor:
        require_lanes("x", x, n=self.n)
        return mhc_site(x, self.phi, self.bias, self.alpha, layer, backend=self.backend)


def recompute_policy(ctx, op, *args, **kwargs):
    """Selective checkpointing: recompute the mHC ops (torch.ops.mhc_lab.*) and views in backward, keep the
    rest. Views must be recomputed too: a kept view keeps its base alive, and the ops' outputs are viewed on
    their way out, so keeping views would keep every lane. Layers inside a recompute block must not modify
    their intermediate results in place (a kept tensor must not change before the backward): that is refused
    here, with the op named."""
    from torch.utils.checkpoint import CheckpointPolicy

    if getattr(op, "namespace", None) == "mhc_lab" or getattr(op, "is_view", False):
        return CheckpointPolicy.PREFER_RECOMPUTE
    if not ctx.is_recompute and getattr(op, "namespace", None) == "fsdp":
        raise InputError(
            f"recompute_block: FSDP2 gathers a layer's parameters inside a recompute block ({op}), and the "
            "recompute in backward runs other ops than the forward did, which selective checkpointing refuses; "
            "make the whole MHCResidualStream one fully_shard unit (no layer in it a unit of its own), or "
            "recompute_block=None"
        )
    if not ctx.is_recompute and op._schema.is_mutable:
        raise InputError(
            f"recompute_block: a layer modifies a tensor in place ({op}), which blocks that keep the layers' "
            "results cannot allow; use layers without in-place operations (on the CPU torch.nn.RMSNorm adds "
            "its eps in place; mhc_lab.course.training_lab.RMSNorm does not) or recompute_block=None"
        )
    return CheckpointPolicy.MUST_SAVE


class MHCResidualStream(nn.Module):
    """Layers joined by mHC: the hidden state is copied into n lanes, every layer is wrapped by its own
    MHCConnection, and the lanes are summed back into one hidden state at the end.

    recompute_block: None keeps every activation; k > 0 checkpoints blocks of k layers in which only the mHC
    ops are recomputed in backward (the layers' own activations are kept), so the lanes of a block's inner
    layers are not stored (arXiv 2512.24880 Sec. 4.3.2); "auto" takes the integer optimum of Eq. 20
    (mhc_lab.reference.recompute)."""

    def __init__(self, layers: Sequence[nn.Module], n: int, width: int, *, backend: str = "auto",
                 recompute_block: int | str | None = None):
        super().__init__()
        self.layers = nn.ModuleList(layers)
        if not len(self.layers):
            raise InputError("layers: expected at least one layer, got none")
        self.n = require_positive_int("n", n)
        self.connections = nn.ModuleList(MHCConnection(n, width, backend=backend) for _ in self.layers)
        if recompute_block == "auto":
            from mhc_lab.reference.recompute import optimal_block

            recompute_block, _ = optimal_block(n, len(self.layers))
        if recompute_block is not None and (not isinstance(recompute_block, int) or recompute_block < 1):
            raise InputError(f"recompute_block: expected None, 'auto' or a positive int, got {recompute_block!r}")
        self.recompute_block = recompute_block

    def _run(self, x: torch.Tensor, start: int, stop: int) -> torch.Tensor:
        return run_sites(x, self.connections[start:stop], self.layers[start:stop])

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        x = expand_lanes(h, self.n)
        block = self.recompute_block
        if block is None or not torch.is_grad_enabled():
            x = self._run(x, 0, len(self.layers))
        else:
            from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

            context = functools.partial(create_selective_checkpoint_contexts, recompute_policy)
            for start in range(0, len(self.layers), block):
                x = checkpoint(self._run, x, start, min(start + block, len(self.layers)), use_reentrant=False,
                               context_fn=context)
        return collapse_lanes(x)
