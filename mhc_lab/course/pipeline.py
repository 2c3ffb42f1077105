"""Lab 08, section 6 (the n-fold residual on the wire): with pipeline parallelism a stage boundary carries an mHC
stream's n lanes, [tokens, n, C] per micro-batch, not one hidden state [tokens, C].

    boundary_bytes(tokens, n, C, itemsize)             the bytes one micro-batch sends across a stage boundary
    boundary_exposed(compute_ms, link_gbit_s, tokens, C, n, itemsize)
                                                       exercise 8.5: (transfer ms, exposed ms) when the transfer
                                                       overlaps another micro-batch's compute, as in DualPipe
    measure_boundary(ns, tokens=..., C=...)            two CPU processes as two pipeline stages over gloo: stage 0
                                                       sends each micro-batch's lanes to stage 1; bytes and time
    boundary_table(rows), overlap_table(...)           the section's tables
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from mhc_lab.measure.distributed import spawn

SEED = 0


# ---- the arithmetic ------------------------------------------------------------------------------------------


def boundary_bytes(tokens: int, n: int, C: int, itemsize: int = 2) -> int:
    """Bytes of one micro-batch's lanes, [tokens, n, C] of ``itemsize`` bytes each: what a stage boundary carries
    one way (the forward's lanes; the backward sends their gradient, the same size, the other way)."""
    return tokens * n * C * itemsize


def boundary_exposed(compute_ms, link_gbit_s, tokens, C, n, itemsize=2):
    """Exercise 8.5. (transfer_ms, exposed_ms): the time to send one micro-batch's lanes, [tokens, n, C] of
    ``itemsize`` bytes each, over a link of ``link_gbit_s`` Gbit/s (10^9 bits per second), and the part of it that
    ``compute_ms`` of another micro-batch's compute, running meanwhile, does not hide: max(0, transfer - compute)."""
    bits = tokens * n * C * itemsize * 8
    transfer_ms = bits / (link_gbit_s * 1e9) * 1e3
    return transfer_ms, max(0.0, transfer_ms - compute_ms)


# ---- the measurement: two processes, two stages ---------------------------------------------------------------


def _lanes(tokens: int, n: int, C: int, dtype: torch.dtype) -> torch.Tensor:
    """The micro-batch stage 0 sends (seeded, so stage 1 can tell that it arrived intact)."""
    g = torch.Generator().manual_seed(SEED + n)
    return torch.randn(tokens, n, C, generator=g).to(dtype)


def _stage_worker(ns: tuple, tokens: int, C: int, dtype: torch.dtype, warmup: int, repeats: int):
    """One pipeline stage (a rank of spawn's process group of 2). Stage 0 sends each micro-batch's lanes to stage
    1, which answers with a one-element acknowledgement once it holds them; stage 0 times send + acknowledgement.
    Stage 0 returns a row per n; stage 1 whether each last micro-batch arrived intact."""
    rank = dist.get_rank()
    ack = torch.zeros(1)
    rows, intact = [], []
    for n in ns:
        lanes = _lanes(tokens, n, C, dtype) if rank == 0 else torch.empty(tokens, n, C, dtype=dtype)
        times = []
        for i in range(warmup + repeats):
            if rank == 0:
                start = time.perf_counter()
                dist.send(lanes, dst=1)
                dist.recv(ack, src=1)
                if i >= warmup:
                    times.append(time.perf_counter() - start)
            else:
                lanes.zero_()
                dist.recv(lanes, src=0)
                dist.send(ack, dst=0)
        if rank == 0:
            nbytes = lanes.numel() * lanes.element_size()
            ms = statistics.median(times) * 1e3
            rows.append({"n": n, "tokens": tokens, "C": C, "itemsize": lanes.element_size(), "bytes": nbytes,
                         "ms": ms, "gb_per_s": nbytes / (ms * 1e-3) / 1e9, "repeats": repeats})
        else:
            intact.append(torch.equal(lanes, _lanes(tokens, n, C, dtype)))
    return rows if rank == 0 else intact


def measure_boundary(ns=(1, 2, 4), *, tokens: int, C: int, dtype: torch.dtype = torch.float32, warmup: int = 3,
                     repeats: int = 10, timeout: float = 120.0) -> list[dict]:
    """Two CPU processes as two pipeline stages (gloo, one thread each): for each n of ``ns``, stage 0 sends
    ``warmup`` + ``repeats`` micro-batches of lanes [tokens, n, C] to stage 1. One row per n: n, tokens, C,
    itemsize, bytes per micro-batch, ms (the median over ``repeats`` of the time from the send's start until stage
    1 acknowledges it holds the lanes), gb_per_s (bytes over that time, 10^9 bytes per second), intact (stage 1
    received exactly what stage 0 sent)."""
    rows, intact = spawn(_stage_worker, 2, tuple(ns), tokens, C, dtype, warmup, repeats, timeout=timeout, threads=1)
    for row, ok in zip(rows, intact):
        row["intact"] = ok
    return rows


# ---- the tables ----------------------------------------------------------------------------------------------


def _size(nbytes: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if nbytes >= scale:
            return f"{nbytes / scale:.3g} {unit}"
    return f"{nbytes:.0f} B"


def boundary_table(rows: list[dict]) -> str:
    """A markdown table of measure_boundary's rows: bytes and time per micro-batch, each over n = 1's."""
    first = rows[0]
    lines = ["| n | lanes per micro-batch | bytes | x bytes | time per micro-batch | x time | pace | intact |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['n']} | [{r['tokens']}, {r['n']}, {r['C']}], {8 * r['itemsize']}-bit | {_size(r['bytes'])} "
                     f"| {r['bytes'] / first['bytes']:.3g} | {r['ms']:.3f} ms | {r['ms'] / first['ms']:.2f} "
                     f"| {r['gb_per_s']:.3g} GB/s | {'yes' if r.get('intact', True) else 'NO'} |")
    return "\n".join(lines)


def overlap_table(*, tokens: int, C: int, compute_ms: float, link_gbit_s: float, itemsize: int = 2,
                  ns=(1, 2, 4)) -> str:
    """A markdown table of boundary_exposed for each n of ``ns``: bytes per micro-batch, transfer time, the time
    ``compute_ms`` of another micro-batch's compute does not hide, and the compute that would hide it all."""
    lines = [f"| n | bytes per micro-batch | transfer at {link_gbit_s:g} Gbit/s | exposed beside {compute_ms:g} ms "
             "of compute | compute that hides it |",
             "|---|---|---|---|---|"]
    for n in ns:
        transfer, exposed = boundary_exposed(compute_ms, link_gbit_s, tokens, C, n, itemsize)
        lines.append(f"| {n} | {_size(boundary_bytes(tokens, n, C, itemsize))} | {transfer:.2f} ms | {exposed:.2f} ms "
                     f"| {transfer:.2f} ms |")
    return "\n".join(lines)
