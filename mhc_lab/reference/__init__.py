"""Reference math: each function is the equation it implements, in plain PyTorch.

Layout convention everywhere: the residual stream has shape ``[..., n, C]`` (n lanes of width C);
coefficients and Sinkhorn run in float32 (float64 when the input is float64).
"""

from mhc_lab.reference.validate import InputError
from mhc_lab.reference.residual import residual_step
from mhc_lab.reference.hyper_connections import (
    expand_lanes,
    collapse_lanes,
    hc_static_init,
    hc_apply,
    hc_dynamic_coefficients,
    HyperConnection,
)
from mhc_lab.reference.sinkhorn import (
    SINKHORN_VARIANTS,
    sinkhorn,
    sinkhorn_paper,
    sinkhorn_deepseek_v4,
    sinkhorn_log_domain,
)
from mhc_lab.reference.mhc import (
    MHCCoefficients,
    mhc_coefficients,
    mhc_pre,
    mhc_post,
    mhc_identity_init,
    ManifoldHyperConnection,
)
from mhc_lab.reference.metrics import amax_gain, composite_gain, composite_product

__all__ = [
    "InputError",
    "residual_step",
    "expand_lanes",
    "collapse_lanes",
    "hc_static_init",
    "hc_apply",
    "hc_dynamic_coefficients",
    "HyperConnection",
    "SINKHORN_VARIANTS",
    "sinkhorn",
    "sinkhorn_paper",
    "sinkhorn_deepseek_v4",
    "sinkhorn_log_domain",
    "MHCCoefficients",
    "mhc_coefficients",
    "mhc_pre",
    "mhc_post",
    "mhc_identity_init",
    "ManifoldHyperConnection",
    "amax_gain",
    "composite_gain",
    "composite_product",
]
