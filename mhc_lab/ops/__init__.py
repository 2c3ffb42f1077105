"""Ops: wrappers that check inputs, allocate outputs and dispatch to the TileLang kernels or the references.

    from mhc_lab.ops import mhc_pre, mhc_post, mhc_site, run_sites, MHCConnection, MHCResidualStream

- forward.py: the autograd-free forward ops (mhc_pre_fused, mhc_post_fused).
- dispatch.py: the backends, their input checks and which kernel path applies to given lanes.
- site_ops.py: the site's forward and backward as torch.library custom ops (torch.ops.mhc_lab.*), with autograd;
  importing mhc_lab.ops registers them.
- modules.py: the differentiable functions and the modules that train with them.
"""

from mhc_lab.ops import site_ops  # noqa: F401  (registers torch.ops.mhc_lab.*)
from mhc_lab.ops.dispatch import BACKENDS, kernels_apply, resolve_backend
from mhc_lab.ops.forward import PreOutputs, mhc_post_fused, mhc_pre_fused
from mhc_lab.ops.modules import (
    MHCConnection,
    MHCResidualStream,
    mhc_post,
    mhc_pre,
    mhc_site,
    mhc_site_chained,
    recompute_policy,
    run_sites,
)

__all__ = [
    "BACKENDS",
    "MHCConnection",
    "MHCResidualStream",
    "PreOutputs",
    "kernels_apply",
    "mhc_post",
    "mhc_post_fused",
    "mhc_pre",
    "mhc_pre_fused",
    "mhc_site",
    "mhc_site_chained",
    "recompute_policy",
    "resolve_backend",
    "run_sites",
]
