"""Training loops the labs share: a progress bar, the loss and gradient norm of every step, an eval split."""

from __future__ import annotations

import math
import time
from typing import Callable

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm


def train(
    model: torch.nn.Module,
    batch: Callable[[torch.Generator, str], tuple[torch.Tensor, torch.Tensor]],
    *,
    steps: int,
    lr: float = 3e-3,
    seed: int = 0,
    device: torch.device | str = "cpu",
    eval_every: int = 0,
    eval_batches: int = 4,
    clip: float | None = 1.0,
    label: str = "training",
    progress: bool = True,
    warm_up: bool = True,
) -> dict:
    """AdamW on cross-entropy; ``batch(generator, split)`` returns (inputs, targets).

    Before the clock starts, one forward + backward on a batch of its own (``warm_up``) builds whatever the
    model compiles on first use (the fused kernels: TileLang compiles each once per machine, then reads its
    cache) and warms the allocator; the weights, the optimiser and the training batches are untouched, so the
    run is the same with or without it. Returns {"step", "loss", "grad_norm", "eval_step", "eval_loss",
    "seconds", "warm_up_seconds"}: the steps' time and the warm-up's, apart. A non-finite loss stops the run
    early and is recorded (that is a result, not an error).
    """
    device = torch.device(device)
    model.to(device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    g_train = torch.Generator().manual_seed(seed)
    history = {"step": [], "loss": [], "grad_norm": [], "eval_step": [], "eval_loss": [], "warm_up_seconds": 0.0}
    if warm_up:
        history["warm_up_seconds"] = warm_up_step(model, batch, seed=seed, device=device, label=label,
                                                  progress=progress)
    start = time.perf_counter()
    bar = tqdm(range(steps), desc=label, disable=not progress, mininterval=1.0)
    for step in bar:
        x, y = (t.to(device) for t in batch(g_train, "train"))
        loss = F.cross_entropy(model(x).flatten(0, -2), y.flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip if clip is not None else math.inf)
        optimizer.step()
        history["step"].append(step)
        history["loss"].append(loss.item())
        history["grad_norm"].append(norm.item())
        if not math.isfinite(loss.item()):
            break
        if eval_every and (step + 1) % eval_every == 0:
            history["eval_step"].append(step + 1)
            history["eval_loss"].append(evaluate(model, batch, batches=eval_batches, seed=seed, device=device))
            bar.set_postfix(eval_loss=f"{history['eval_loss'][-1]:.3f}")
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    history["seconds"] = time.perf_counter() - start
    return history


def warm_up_step(model: torch.nn.Module, batch, *, seed: int = 0, device="cpu", label: str = "model",
                 progress: bool = True) -> float:
    """One forward + backward on a batch of its own, gradients dropped: compiles what the model builds on first
    use (kernels), outside any timed loop. Returns its seconds."""
    device = torch.device(device)
    start = time.perf_counter()
    for _ in tqdm(range(1), desc=f"{label}: warm-up (compiles kernels on first use; cached after)",
                  disable=not progress):
        x, y = (t.to(device) for t in batch(torch.Generator().manual_seed(seed + 7_919), "train"))
        F.cross_entropy(model(x).flatten(0, -2), y.flatten()).backward()
        model.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    return time.perf_counter() - start


@torch.no_grad()
def evaluate(model, batch, *, batches: int = 4, seed: int = 0, device="cpu") -> float:
    """Mean cross-entropy on ``batches`` fixed validation batches (the same ones every call)."""
    model.eval()
    g = torch.Generator().manual_seed(10_000 + seed)
    total = 0.0
    for _ in range(batches):
        x, y = (t.to(device) for t in batch(g, "val"))
        total += F.cross_entropy(model(x).flatten(0, -2), y.flatten()).item()
    model.train()
    return total / batches
