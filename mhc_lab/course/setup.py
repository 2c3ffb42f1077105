"""The first call of every lab: read the parameters cell (SIZE, DEVICE, SEED), seed, pick the device."""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass

import numpy as np
import torch

from mhc_lab.course.measure import resolve_device

SIZES = ("small", "full")


@dataclass(frozen=True)
class LabConfig:
    size: str
    device: torch.device
    seed: int

    @property
    def small(self) -> bool:
        return self.size == "small"

    @property
    def on_gpu(self) -> bool:
        return self.device.type == "cuda"

    def pick(self, small, full):
        """The small-mode value or the full-mode value of a setting."""
        return small if self.small else full


def setup(SIZE: str = "small", DEVICE: str = "auto", SEED: int = 0, quiet: bool = False) -> LabConfig:
    """Validate the notebook parameters, seed every generator, set the plot renderer; returns a LabConfig."""
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
    config = LabConfig(SIZE, device, SEED)
    if not quiet:
        print(f"mhc-lab: SIZE={SIZE}, DEVICE={device.type}, SEED={SEED}")
    return config
