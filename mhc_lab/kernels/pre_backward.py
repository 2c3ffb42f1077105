# pre backward: the gradients of one mHC site's pre (coefficients and layer input), in two kernels.
#
#   forward (pre.py): mix = x_flat phi^T, s = sum(x^2), r = rsqrt(s / nC + eps), coefficients from r * mix
#                     (sigmoids and 20 Sinkhorn rounds), y = sum_j H_pre[j] x_j
#   backward, given dy = dL/dy, dH_post and dH_res (from the post backward):
#     kernel 1 (pre_backward_coefficients.py): dH_pre[j] = sum_c dy[c] x_j[c], then per token the backward of
#              the sigmoids, of Sinkhorn (recomputed on chip) and of the norm: dmix (the gradient of the raw
#              projections), dlogit (= the bias gradient per token), the alpha gradients and ds (the gradient of
#              s); on CUDA also kernel 2's operands (pre_backward_operands.py).
#     kernel 2 (pre_backward_lanes.py): dx = H_pre dy + dmix phi + 2 ds x (+ the linked post's gradient of the
#              same lanes) and dphi = dmix^T x_flat, on tensor cores.
#
# Bytes per token (bf16, n = 4): kernel 1 reads x and dy (5C); kernel 2 reads x and dy (+ 4C of the post's dx
# or g in a linked site) and writes dx (4C). Two kernels, because kernel 2's CTAs own blocks of columns while
# each token's dmix depends on dH_pre, a reduction over all of the token's columns.
"""pre backward: kernel 1 (coefficient gradients) and kernel 2 (lane and phi gradients), compiled as a pair."""


import functools

from mhc_lab.kernels._target import PORTABLE_LOWERING, canonical_target, compile_program, is_hopper
from mhc_lab.kernels.pre_backward_coefficients import coefficients_kernel
from mhc_lab.kernels.pre_backward_lanes import pre_backward_lanes_program


@functools.lru_cache(maxsize=None)
def pre_backward_kernels(n: int, C: int, dtype: str = "bfloat16", target: str = "cuda", *, splits: int = 1,
                         add_dx: bool = False, post_grad: bool = False, lane_splits: int = 1,
                         hopper: bool | None = None):
    """(coefficients, lanes): kernel 1 (coefficients_kernel, one function whichever form runs) and kernel 2
    (pre_backward_lanes_program with add_dx or post_grad), compiled and cached per process. ``splits``: the
    forward partial's splits; ``lane_splits``: kernel 2's token splits on CUDA (the first axis of its dphi
    output; the C target has one); ``hopper``: kernel 2's Hopper or portable program on CUDA (by default the
    one of the target's architecture)."""
    t = canonical_target(target)
    coefficients = coefficients_kernel(n, C, dtype, t, splits=splits)
    lanes_kw = {} if t == "c" else {"splits": lane_splits, "hopper": hopper}
    portable = t != "c" and not (is_hopper(t) if hopper is None else hopper)
    lanes = compile_program(pre_backward_lanes_program(n, C, dtype, t, add_dx=add_dx, post_grad=post_grad,
                                                       **lanes_kw), t,
                            pass_configs=PORTABLE_LOWERING if portable else None)
    return coefficients, lanes
