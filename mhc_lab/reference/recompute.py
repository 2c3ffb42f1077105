"""Recomputing mHC activations in blocks of layers (mHC, arXiv 2512.24880, Sec. 4.3.2, Table 3, Eq. 20).

Within a block of L_r consecutive layers only the block's input lanes x_{l0} (nC per token) are kept; the
transient activations of the active block ((n + 2) C per token and layer: x_l, H_pre x_l and its norm) are
recomputed in the backward pass. Per token, in units of C, the memory to minimise is

    M(L_r) = n * ceil(L / L_r) + (n + 2) * L_r                                                  (Eq. 20)

whose continuous minimum is at L_r ~ sqrt(n L / (n + 2)).
"""

from __future__ import annotations

import math


def _check(n: int, layers: int) -> None:
    for name, value in (("n", n), ("layers", layers)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}: expected a positive int, got {value!r}")


def recompute_memory(n: int, layers: int, block: int) -> int:
    """Eq. 20's memory per token, in units of C: resident block inputs plus the active block's transients."""
    _check(n, layers)
    if isinstance(block, bool) or not isinstance(block, int) or not 1 <= block <= layers:
        raise ValueError(f"block: expected an int in 1..{layers} (the number of layers), got {block!r}")
    return n * math.ceil(layers / block) + (n + 2) * block


def optimal_block(n: int, layers: int) -> tuple[int, int]:
    """The integer L_r minimising Eq. 20 (the smallest one on ties) and its memory in units of C."""
    _check(n, layers)
    best = min(range(1, layers + 1), key=lambda b: (recompute_memory(n, layers, b), b))
    return best, recompute_memory(n, layers, best)


def approximate_block(n: int, layers: int) -> float:
    """The continuous optimum sqrt(n L / (n + 2)) that the paper quotes."""
    _check(n, layers)
    return math.sqrt(n * layers / (n + 2))


def memory_without_recompute(n: int, layers: int) -> int:
    """Keeping every layer's transients, (n + 2) C per layer: the baseline Eq. 20 improves on."""
    _check(n, layers)
    return (n + 2) * layers
