"""Ops: wrappers that check inputs, allocate outputs and dispatch to the TileLang kernels or the references."""

from mhc_lab.ops.forward import PreOutputs, mhc_post_fused, mhc_pre_fused

__all__ = ["PreOutputs", "mhc_post_fused", "mhc_pre_fused"]
