"""The first call of every lab: read the parameters cell (SIZE, DEVICE, SEED), seed, pick the device, and fix
the number of CPU threads PyTorch uses (TIMING_THREADS), so that every timing cell of every lab measures the
same thing on every machine."""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass, field

import numpy as np
import torch

from mhc_lab.measure import resolve_device

SIZES = ("small", "full")

# PyTorch's CPU threads in every lab, set by setup(); the timing cells rely on it (setup()'s docstring says why).
TIMING_THREADS = 1


@dataclass(frozen=True)
class LabConfig:
    size: str
    device: torch.device
    seed: int
    # Lab parameters that make this run a variant (besides SEED), as passed to setup(); see checks.variant().
    variant: dict = field(default_factory=dict, hash=False, compare=False)
    # PyTorch's CPU threads, as setup() set them (TIMING_THREADS).
    threads: int = TIMING_THREADS

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
    """Validate the notebook parameters, seed every generator, pin PyTorch's CPU threads, set the plot renderer;
    returns a LabConfig.

    Plot renderer: every plotly figure then shows as one output with the interactive figure, which JupyterLab
    shows, and, where the notebook runs headless (mhc-lab run, refresh-solutions), a PNG of it, which viewers
    that run no JavaScript show (GitHub, nbconvert's HTML); elsewhere those viewers show one line saying why
    there is no picture (mhc_lab.course.display).

    Extra keyword arguments are lab parameters that define a variant (``setup(SIZE, DEVICE, SEED, n=n, C=C)``);
    they and SEED are recorded for the checks (checks.variant()), so a value answer depends on the variant.

    Threads: setup() calls ``torch.set_num_threads(TIMING_THREADS)`` (1), whatever the device, and every lab's
    timing cells rely on it instead of choosing their own. One thread, because it is the only count that is the
    same on every machine and robust on a busy one:

    - an operation split over k threads ends when its slowest thread ends. When another program holds one of the
      cores (a test run, a browser), the operation waits for the scheduler to give that thread a core back, a
      time slice of milliseconds, for work of tens of microseconds. On a busy 2-core machine that swung the
      n-lanes ratios of lab 04 a hundredfold between two runs (the residual add took 0.04 ms in one, 13 ms in
      the next); on one thread, which runs on whichever core is free, the same sweeps repeated within ~15%;
    - the labs compare layers with each other (n lanes against one, fused against eager, PyTorch against
      TileLang's C target, which runs on one core), not how well PyTorch scales over cores: one thread compares
      like with like, whatever number of cores the machine has;
    - the labs' tensors are small (4 x 4 matrices, 64-wide models, a few MB of lanes): several threads win
      little on them.

    The price: large CPU matmuls (the roofline's matmul roof) run at one core's rate, and the figures say so
    ("CPU, 1 thread": mhc_lab.bench.memory_wall.timing_label). On a GPU the timed work runs on the GPU and the
    one CPU thread only launches it. Call ``torch.set_num_threads(k)`` after setup() to try more threads; the
    timings then are k-thread timings and no longer comparable with the labs' text."""
    if SIZE not in SIZES:
        raise ValueError(f"SIZE: expected one of {SIZES}, got {SIZE!r}")
    if isinstance(SEED, bool) or not isinstance(SEED, int):
        raise ValueError(f"SEED: expected an int, got {SEED!r}")
    device = resolve_device(DEVICE)
    random.seed(SEED)
    np.random.seed(SEED)
    torch.manual_seed(SEED)
    torch.set_num_threads(TIMING_THREADS)
    try:
        from mhc_lab.course.display import use_lab_renderer

        use_lab_renderer()
    except ImportError:  # plotly is a dependency; without it the labs still compute, only plots fail later
        pass
    # TileLang reports every compile at INFO level; the labs only want its warnings.
    logging.getLogger("TileLang").setLevel(logging.WARNING)
    from mhc_lab.course.checks import set_variant

    set_variant(SEED=SEED, **variant)
    config = LabConfig(SIZE, device, SEED, dict(variant), torch.get_num_threads())
    if not quiet:
        extra = "".join(f", {name}={value!r}" for name, value in variant.items())
        print(f"mhc-lab: SIZE={SIZE}, DEVICE={device.type}, SEED={SEED}{extra}")
    return config
