"""TileLang tile programs, one factory per kernel (compile-time parameters in, tile program out).

The compiled kernels exported here (post_kernel, pre_kernel_c) check every call's tensors (CheckedKernel)."""

from mhc_lab.kernels._target import canonical_target, nvcc_path
from mhc_lab.kernels.checked import CheckedKernel
from mhc_lab.kernels.post import post_bytes, post_kernel, post_kernel_program
from mhc_lab.kernels.pre import pre_bytes, pre_kernel_c, pre_program


__all__ = [
    "CheckedKernel",
    "canonical_target",
    "nvcc_path",
    "post_bytes",
    "post_kernel",
    "post_kernel_program",
    "pre_bytes",
    "pre_kernel_c",
    "pre_program",
]
