"""Ops: wrappers that check inputs, allocate outputs and dispatch to the TileLang kernels or the references.

    from mhc_lab.ops import mhc_pre, mhc_post, mhc_site, run_sites, MHCConnection, MHCResidualStream

- forward.py: the autograd-free forward ops (mhc_pre_fused, mhc_post_fused).
- dispatch.py: the backends, their input checks and which kernel path applies to given lanes.
- site_ops.py: the site's forward and backward as torch.library custom ops (torch.ops.mhc_lab.*), with autograd;
  importing mhc_lab.ops registers them.
- modules.py: the differentiable functions and the modules that train with them.

Values are never checked here, on any backend: the ops check shapes, dtypes and devices, but a NaN or inf check
reads a value back to the host, a sync on every call that also stops CUDA graphs and torch.compile. NaN or inf in
the inputs comes out as NaN or inf in the outputs, the same way on both backends (the reference backend runs
mhc_lab.reference's math without its value checks: reference.validate.skipping_value_checks). Called directly,
mhc_lab.reference checks values and names the input at fault. Range: the kernels sum x^2 in float32, so a
token's lanes need sum(x^2) below 3.4e38 (|x| up to about 1.8e19 / sqrt(nC)); past it r = 0 and the coefficients
come from the biases alone. The reference sums the squares in float64: no limit for float32, bfloat16 or float16
lanes.
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
