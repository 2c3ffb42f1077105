"""Training across processes with torch.distributed: ranks started on one machine, a model wrapped for data
parallelism (DDP or FSDP2), and what each device holds.

    results = spawn(worker, 2, config)          # worker(config) runs on every rank; its return values, by rank
    model = data_parallel(model, "fsdp2")       # inside a worker: DDP or FSDP2 (fully_shard) over all ranks
    loss = global_mean(loss_sum, tokens)        # a mean over the whole global batch, scaled for the averaging
    held_bytes(model)                           # bytes of each parameter this rank holds (its shard under FSDP2)
    out, kept = saved_bytes(lambda: model(h), {"lanes": (n, C)})  # what the forward keeps for the backward
    stream_bytes_per_device(n, C, sites=..., tokens=..., wrapper="fsdp2", world_size=2)  # the same, computed

A worker is a function at the top level of a module (the spawn start method pickles it by name), called with the
process group already set up (gloo on the CPU) and torn down after it returns. See docs/distributed.md for what
data parallelism does to an mHC stream's memory.
"""

from __future__ import annotations

import datetime
import io
import os
import queue
import socket
import time
import traceback
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

WRAPPERS = ("ddp", "fsdp2")


# ---- processes -----------------------------------------------------------------------------------------------


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now (the system picks it); the rendezvous binds it moments later."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _rank_entry(fn, rank, world_size, address, backend, timeout, threads, results, args):
    """One rank: join the process group, run ``fn(*args)``, send back its value (or the traceback), leave."""
    try:
        torch.set_num_threads(threads)
        dist.init_process_group(backend, init_method=address, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout))
        try:
            value = fn(*args)
        finally:
            dist.destroy_process_group()
        buffer = io.BytesIO()
        torch.save(value, buffer)  # bytes, not shared tensors: the rank may exit before the parent reads them
        results.put((rank, True, buffer.getvalue()))
    except BaseException:  # noqa: BLE001 (a rank's failure, whatever it is, goes back to the parent)
        results.put((rank, False, traceback.format_exc()))


def spawn(fn: Callable, world_size: int, *args, timeout: float = 120.0, backend: str = "gloo",
          threads: int | None = None) -> list:
    """Run ``fn(*args)`` in ``world_size`` new processes, ranks 0 .. world_size - 1 of one process group
    (``backend``, rendezvous over TCP on a free local port); return their return values in rank order.

    A rank that raises makes this raise RuntimeError with that rank's traceback; a run longer than ``timeout``
    seconds raises TimeoutError. Either way every rank still running is terminated, so a hang in a collective
    fails instead of blocking. ``threads``: torch's intra-op threads per rank, by default the machine's cores
    divided among the ranks."""
    if not (isinstance(world_size, int) and world_size >= 1):
        raise ValueError(f"world_size: expected a positive int, got {world_size!r}")
    if threads is None:
        threads = max(1, (os.cpu_count() or 1) // world_size)
    context = torch.multiprocessing.get_context("spawn")
    results = context.Queue()
    address = f"tcp://127.0.0.1:{free_port()}"
    processes = [context.Process(target=_rank_entry, daemon=True,
                                 args=(fn, rank, world_size, address, backend, timeout, threads, results, args))
                 for rank in range(world_size)]
    for p in processes:
        p.start()
    values: dict[int, object] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(values) < world_size:
            try:
                rank, ok, payload = results.get(timeout=0.2)
            except queue.Empty:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"spawn: {world_size} ranks ran past {timeout:.0f} s; ranks "
                                       f"{sorted(set(range(world_size)) - set(values))} had not finished") from None
                dead = [r for r, p in enumerate(processes) if r not in values and p.exitcode not in (None, 0)]
                if dead:
                    time.sleep(0.5)  # a rank that failed in Python has sent its traceback: read that instead
                    if results.empty():
                        raise RuntimeError(f"spawn: rank {dead[0]} exited with code "
                                           f"{processes[dead[0]].exitcode} without a result") from None
                continue
            if not ok:
                raise RuntimeError(f"spawn: rank {rank} of {world_size} failed:\n{payload}")
            values[rank] = torch.load(io.BytesIO(payload), weights_only=False)
    finally:
        for p in processes:
            p.join(timeout=5 if len(values) == world_size else 0)
            if p.is_alive():
                p.kill()
                p.join()
        results.close()
    return [values[r] for r in range(world_size)]


# ---- wrapping and the loss -----------------------------------------------------------------------------------


def data_parallel(model: nn.Module, wrapper: str, *, units: Sequence[nn.Module] = ()) -> nn.Module:
    """``model`` replicated (``"ddp"``) or sharded (``"fsdp2"``) over every rank of the default process group.

    FSDP2: each module of ``units`` becomes a unit of its own (its parameters gathered just before its forward
    and freed after), then ``model`` one unit for the rest. A module reached other than through its own call
    (MHCResidualStream's connections: a site reads the next site's phi) must stay in ``model``'s unit, whose
    parameters are gathered for the whole forward and backward. Parameters are sharded on dim 0 over a 1-D
    mesh of all ranks on the model's device type, kept and reduced in their own dtype."""
    if wrapper not in WRAPPERS:
        raise ValueError(f"wrapper: expected one of {WRAPPERS}, got {wrapper!r}")
    if not dist.is_initialized():
        raise RuntimeError("data_parallel: no process group; call it inside a worker started by spawn")
    device = next(model.parameters()).device
    if wrapper == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model, device_ids=None if device.type == "cpu" else [device])
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    for unit in units:
        fully_shard(unit, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def global_mean(local_sum: torch.Tensor, local_count: int) -> torch.Tensor:
    """This rank's share of a mean over the global batch: ``local_sum`` (a sum over this rank's items) times
    world size / the items of all ranks. DDP and FSDP2 average gradients over ranks, so the gradients that
    result are those of sum(all items) / count(all items), whatever the split (ranks may hold different counts).
    Without a process group, the plain mean."""
    if not dist.is_initialized():
        return local_sum / local_count
    total = torch.tensor([float(local_count)], device=local_sum.device)
    dist.all_reduce(total)
    return local_sum * (dist.get_world_size() / total.item())


# ---- what a device holds -------------------------------------------------------------------------------------


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def local_shape(t: torch.Tensor) -> tuple[int, ...]:
    """The shape of what this rank holds of ``t``: its shard for a DTensor (FSDP2), else the whole shape."""
    return tuple(_local(t).shape)


def held_bytes(model: nn.Module) -> dict[str, int]:
    """Bytes of each parameter that this rank holds between steps (its local shard under FSDP2, the whole
    parameter under DDP or alone), by name as ``model.named_parameters()`` gives it."""
    return {name: _local(p).numel() * p.element_size() for name, p in model.named_parameters()}


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the optimizer's per-parameter state tensors on this rank (Adam's moments: shards under FSDP2)."""
    return sum(_local(v).numel() * v.element_size() for state in optimizer.state.values()
               for v in state.values() if isinstance(v, torch.Tensor) and v.dim() > 0)


def full_parameters(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter whole, detached, as a plain CPU tensor; under FSDP2 gathered from the shards (a
    collective: every rank must call it)."""
    out = {}
    for name, p in model.named_parameters():
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        out[name.removeprefix("module.")] = full.detach().cpu().clone()
    return out


def saved_bytes(forward: Callable[[], torch.Tensor], shapes: dict[str, tuple[int, ...]]) -> tuple[object, dict]:
    """(``forward()``, {name: bytes}): what ``forward`` keeps for the backward, by kind, on this rank. A tensor
    saved for backward counts under ``name`` when its last dimensions are ``shapes[name]`` (the lanes: (n, C);
    phi: (n*n + 2n, n*C)); each storage once, however many ops save it. Tensors saved inside a recompute block
    are held by the checkpoint, not seen here: measure with recompute_block=None."""
    seen: dict[str, dict[int, int]] = {name: {} for name in shapes}

    def pack(t: torch.Tensor):
        for name, shape in shapes.items():
            if t.dim() >= len(shape) and tuple(t.shape[t.dim() - len(shape):]) == tuple(shape):
                storage = t.untyped_storage()
                seen[name][storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = forward()
    return out, {name: sum(found.values()) for name, found in seen.items()}


# ---- what a device holds, computed -----------------------------------------------------------------------------


def shard_rows(rows: int, world_size: int, rank: int) -> int:
    """Rows of a dim-0 sharded tensor on ``rank``: FSDP2 cuts dim 0 as torch.chunk does, ceil(rows / world_size)
    rows a rank, the last ranks fewer or none (a rank past the last chunk holds an empty shard)."""
    size = -(-rows // world_size)
    return max(0, min(size, rows - rank * size))


def stream_bytes_per_device(n: int, C: int, *, sites: int, tokens: int, wrapper: str, world_size: int,
                            rank: int = 0, lane_itemsize: int = 4) -> dict[str, int]:
    """Bytes one device holds for the mHC sites of an MHCResidualStream (``sites`` connections, each phi
    [n*n + 2n, n*C], bias [n*n + 2n], alpha [3], float32), ``tokens`` tokens on this device (the per-device
    batch), recompute_block=None:

    - phi, bias, alpha: held between steps (the gradients after the step's reduction are the same size, Adam's
      two moments twice that): whole under DDP, rank ``rank``'s rows under FSDP2;
    - phi_in_step: phi as the step uses it, gathered whole on every device under either wrapper (the stream is
      one FSDP2 unit: every site's phi for the whole forward and backward);
    - lanes: the lanes the forward keeps for the backward, one [tokens, n, C] per site: not sharded."""
    if wrapper not in WRAPPERS:
        raise ValueError(f"wrapper: expected one of {WRAPPERS}, got {wrapper!r}")
    m = n * n + 2 * n

    def rows(count):
        return count if wrapper == "ddp" else shard_rows(count, world_size, rank)

    return {
        "phi": sites * rows(m) * n * C * 4,
        "bias": sites * rows(m) * 4,
        "alpha": sites * rows(3) * 4,
        "phi_in_step": sites * m * n * C * 4,
        "lanes": sites * tokens * n * C * lane_itemsize,
    }


def _size(nbytes: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if nbytes >= scale:
            return f"{nbytes / scale:.3g} {unit}"
    return f"{nbytes:.0f} B"


def memory_table(n: int, C: int, *, tokens: int, world_sizes: Sequence[int] = (2, 8), lane_itemsize: int = 2) -> str:
    """A markdown table of one site's bytes on rank 0 (stream_bytes_per_device): DDP, then FSDP2 on each of
    ``world_sizes`` ranks, ``tokens`` tokens a device."""
    columns = [("DDP", "ddp", 2)] + [(f"FSDP2, {w} ranks", "fsdp2", w) for w in world_sizes]
    values = [stream_bytes_per_device(n, C, sites=1, tokens=tokens, wrapper=wrapper, world_size=w,
                                      lane_itemsize=lane_itemsize) for _, wrapper, w in columns]
    m = n * n + 2 * n
    labels = {
        "phi": f"phi [{m}, {n * C}], float32, between steps",
        "bias": f"bias [{m}] and alpha [3], float32, between steps",
        "optimizer": "phi's gradient and Adam's two moments, at the optimizer step",
        "phi_in_step": "phi during the step (gathered)",
        "lanes": f"lanes kept for backward, {tokens} tokens x [{n}, {C}], {8 * lane_itemsize}-bit",
    }
    lines = ["| one site, rank 0 | " + " | ".join(c[0] for c in columns) + " |",
             "|---|" + "---|" * len(columns)]
    for key, label in labels.items():
        if key == "bias":
            cells = [v["bias"] + v["alpha"] for v in values]
        elif key == "optimizer":
            cells = [3 * v["phi"] for v in values]
        else:
            cells = [v[key] for v in values]
        lines.append(f"| {label} | " + " | ".join(_size(c) for c in cells) + " |")
    return "\n".join(lines)
