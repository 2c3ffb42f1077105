"""The first call of every lab: read the parameters cell (SIZE, DEVICE, SEED), seed, pick the device."""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass, field

import numpy as np
import torch

from mhc_lab.measure import resolve_device

SIZES = ("small", "full")


@dataclass(frozen=True)
class LabConfig:
    size: str
    device: torch.device
    seed: int
    # Lab parameters that make this run a variant (besides SEED), as passed to setup(); see checks.variant().
    variant: dict = field(default_factory=dict, hash=False, compare=False)

    @property
    def small(self) -> bool:
        return self.size == "small"

    @property
    def on_gpu(self) -> bool:
        return self.device.type == "cuda"

    def pick(self, small, full):
        """The small-mode value or the full-mode value of a setting."""
        return small if self.small else full


def setup(SIZE: str = "small", DEVICE: str = "auto", SEED: int = 0, quiet: bool = False, **variant) -> LabConfig:
    """Validate the notebook parameters, seed every generator, set the plot renderer; returns a LabConfig.

    Extra keyword arguments are lab parameters that define a variant (``setup(SIZE, DEVICE, SEED, n=n, C=C)``);
    they and SEED are recorded for the checks (checks.variant()), so a value answer depends on the variant."""
    if SIZE not in SIZES:
        raise ValueError(f"SIZE: expected one of {SIZES}, got {SIZE!r}")
    if isinstance(SEED, bool) or not isinstance(SEED, int):
        raise ValueError(f"SEED: expected an int, got {SEED!r}")
    device = resolve_device(DEVICE)
    random.seed(SEED)
    np.random.seed(SEED)
    torch.manual_seed(SEED)
    try:
        import plotly.io as pio

        pio.renderers.default = "plotly_mimetype"
    except ImportError:  # plotly is a dependency; without it the labs still compute, only plots fail later
        pass
    # TileLang reports every compile at INFO level; the labs only want its warnings.
    logging.getLogger("TileLang").setLevel(logging.WARNING)
    from mhc_lab.course.checks import set_variant

    set_variant(SEED=SEED, **variant)
    config = LabConfig(SIZE, device, SEED, dict(variant))
    if not quiet:
        extra = "".join(f", {name}={value!r}" for name, value in variant.items())
        print(f"mhc-lab: SIZE={SIZE}, DEVICE={device.type}, SEED={SEED}{extra}")
    return config
