"""MHCResidualStream trained data-parallel on two CPU processes (gloo), under DDP and FSDP2 (fully_shard), and
what each device holds (mhc_lab.measure.distributed, docs/distributed.md).

One spawn of two ranks runs every case below, one after another (starting a rank and importing the kernels costs
seconds on a busy CPU; the cases themselves take a fraction of that), and the measurement of memory per device.
Each case trains a fresh stream for a few SGD steps on its rank's part of each global batch and returns every
parameter whole; the test compares them with one process trained on the whole batches.

Why the two runs may differ, and by how much: the layers are per token (Linear, tanh) and the loss is a sum over
tokens divided by the global count (global_mean), so the two runs compute the same gradients in exact arithmetic.
In float32 they differ by rounding only: a rank sums a gradient over its tokens, the wrappers average the ranks'
sums, one process sums over all tokens in another order (and a matmul's blocking depends on its row count), each
a few ulps (float32's is 1.2e-7) of the terms summed. After three steps at lr 0.1 the runs differ by 1.8e-7 at
most here: atol 2e-6 and rtol 1e-5 leave a margin of ten. Training moves every parameter by more than 100 times
the tolerance (phi least, by 2e-3; others by up to 1.3), and a wrong loss scale (a rank's mean instead of the
global one: the ranks hold 10 and 6 tokens) is off by more than 100 times it, which the test also shows.
"""

from __future__ import annotations

import traceback
from pathlib import Path

import pytest
import torch
from torch import nn

from mhc_lab.measure.distributed import (
    data_parallel,
    full_parameters,
    global_mean,
    held_bytes,
    local_shape,
    memory_table,
    optimizer_state_bytes,
    saved_bytes,
    shard_rows,
    spawn,
    stream_bytes_per_device,
)

ROOT = Path(__file__).resolve().parents[1]
WORLD, N, C, LAYERS, STEPS, LR = 2, 4, 8, 3, 3, 0.1
SPLIT = (10, 6)  # tokens of each global batch on rank 0 and rank 1: unequal, so a rank's own mean would be wrong
ATOL, RTOL = 2e-6, 1e-5

# (wrapper, backend, recompute_block, layers as FSDP2 units of their own): every wrapper, backend and recompute
# setting with each of the others; a recompute block needs the stream to be one FSDP2 unit (refused otherwise)
CASES = [
    ("ddp", "reference", None, False),
    ("ddp", "kernels", None, False),
    ("ddp", "reference", 2, False),
    ("ddp", "kernels", 2, False),
    ("fsdp2", "reference", None, True),
    ("fsdp2", "kernels", None, True),
    ("fsdp2", "reference", 2, False),
    ("fsdp2", "kernels", 2, False),
]
REFUSED = ("fsdp2", "reference", 2, True)
MEMORY_TOKENS = 8  # tokens a rank in the memory measurement


class TokenLayer(nn.Module):
    """Per token: its gradients do not depend on how the batch is split."""

    def __init__(self, width):
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, h):
        return torch.tanh(self.lin(h))


def build(backend, recompute_block):
    from mhc_lab.ops import MHCResidualStream

    torch.manual_seed(0)
    stream = MHCResidualStream([TokenLayer(C) for _ in range(LAYERS)], N, C, backend=backend,
                               recompute_block=recompute_block)
    with torch.no_grad():  # away from the identity, so every coefficient's gradient is in play
        for site in stream.connections:
            site.phi.normal_(0, 0.1)
            site.bias.add_(torch.randn_like(site.bias) * 0.1)
    return stream


def global_batches():
    g = torch.Generator().manual_seed(1)
    tokens = sum(SPLIT)
    return [(torch.randn(tokens, C, generator=g), torch.randn(tokens, C, generator=g)) for _ in range(STEPS)]


def train(model, rank=None, *, loss_scale=global_mean):
    """STEPS of SGD; rank None: the whole batches, else this rank's part of each."""
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    for h, target in global_batches():
        if rank is not None:
            h, target = h.split(SPLIT)[rank], target.split(SPLIT)[rank]
        loss = loss_scale((model(h) - target).square().sum(), target.numel())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return full_parameters(model)


def _case(case):
    wrapper, backend, recompute_block, layer_units = case
    stream = build(backend, recompute_block)
    model = data_parallel(stream, wrapper, units=list(stream.layers) if layer_units else ())
    return train(model, torch.distributed.get_rank())


def _memory(wrapper):
    stream = build("reference", None)
    model = data_parallel(stream, wrapper)
    h = torch.randn(MEMORY_TOKENS, C, generator=torch.Generator().manual_seed(torch.distributed.get_rank()))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    out, kept = saved_bytes(lambda: model(h), {"lanes": (N, C), "phi": (N * N + 2 * N, N * C)})
    global_mean(out.square().sum(), out.numel()).backward()
    optimizer.step()
    sites = model.module.connections if wrapper == "ddp" else model.connections
    return {"held": held_bytes(model), "kept": kept, "optimizer": optimizer_state_bytes(optimizer),
            "shapes": [{name: local_shape(p) for name, p in site.named_parameters()} for site in sites]}


def _all_cases():
    """Every case on this rank: its parameters, or its traceback (one failing case fails its own test only)."""
    results = {}
    for case in [*CASES, REFUSED]:
        try:
            results[case] = _case(case)
        except Exception:  # noqa: BLE001
            results[case] = traceback.format_exc()
    for wrapper in ("ddp", "fsdp2"):
        results[wrapper] = _memory(wrapper)
    return results


@pytest.fixture(scope="module")
def ranks():
    return spawn(_all_cases, WORLD, timeout=300, threads=1)


_ONE_PROCESS = {}


def one_process(backend, recompute_block):
    key = (backend, recompute_block)
    if key not in _ONE_PROCESS:
        _ONE_PROCESS[key] = train(build(backend, recompute_block))
    return _ONE_PROCESS[key]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[1]}-recompute_{c[2]}" + ("-layer_units" * c[3]))
def test_data_parallel_training_equals_one_process_on_the_whole_batch(ranks, case):
    _, backend, recompute_block, _ = case
    want = one_process(backend, recompute_block)
    start = {name: p.detach() for name, p in build(backend, recompute_block).named_parameters()}
    for rank, results in enumerate(ranks):
        got = results[case]
        assert not isinstance(got, str), f"rank {rank}:\n{got}"
        assert got.keys() == want.keys()
        for name in want:
            torch.testing.assert_close(got[name], want[name], atol=ATOL, rtol=RTOL,
                                       msg=lambda m, rank=rank, name=name: f"rank {rank}, {name}: {m}")
    assert all(torch.equal(ranks[0][case][k], ranks[1][case][k]) for k in want), "the ranks' models differ"
    moved = {k: float((want[k] - start[k]).abs().max()) for k in want}
    still = {k: v for k, v in moved.items() if v < 100 * ATOL}
    assert not still, f"training hardly moved {still}: the comparison would see nothing there"


def test_the_comparison_would_see_a_wrong_loss_scale():
    """Each rank's own mean (what a loop written for one process computes) averaged over the ranks weights the
    6-token rank's tokens more: run the two ranks' updates in this process, on the sums of their gradients."""
    want = one_process("reference", None)
    stream = build("reference", None)
    optimizer = torch.optim.SGD(stream.parameters(), lr=LR)
    for h, target in global_batches():
        optimizer.zero_grad()
        for part_h, part_t in zip(h.split(SPLIT), target.split(SPLIT)):
            ((stream(part_h) - part_t).square().mean() / WORLD).backward()
        optimizer.step()
    wrong = max(float((p.detach() - want[name]).abs().max()) for name, p in stream.named_parameters())
    assert wrong > 100 * ATOL, wrong


def test_fsdp2_layer_units_inside_a_recompute_block_are_refused_with_a_reason(ranks):
    for results in ranks:
        assert isinstance(results[REFUSED], str)
        assert "InputError: recompute_block: FSDP2 gathers a layer's parameters" in results[REFUSED]


def test_memory_per_device_phi_shards_under_fsdp2_and_the_lanes_do_not(ranks):
    m = N * N + 2 * N
    alone = build("reference", None)
    whole = {name: nbytes for name, nbytes in held_bytes(alone).items()}
    for rank, results in enumerate(ranks):
        for wrapper in ("ddp", "fsdp2"):
            got = results[wrapper]
            want = stream_bytes_per_device(N, C, sites=LAYERS, tokens=MEMORY_TOKENS, wrapper=wrapper,
                                           world_size=WORLD, rank=rank)
            held = {name.removeprefix("module."): nbytes for name, nbytes in got["held"].items()}
            for kind in ("phi", "bias", "alpha"):
                measured = sum(b for name, b in held.items() if name.startswith("connections.") and
                               name.endswith("." + kind))
                assert measured == want[kind], (rank, wrapper, kind, measured, want[kind])
            # each rank's shard of phi: its rows, every column (FSDP2 cuts dim 0 as torch.chunk does)
            rows = m if wrapper == "ddp" else shard_rows(m, WORLD, rank)
            assert all(s["phi"] == (rows, N * C) for s in got["shapes"]), got["shapes"]
            # Adam's two moments: twice what the rank holds of every parameter
            assert got["optimizer"] == 2 * sum(held.values())
            # phi whole during the step, and the lanes (one [tokens, n, C] a site) the same under both wrappers
            assert got["kept"] == {"lanes": want["lanes"], "phi": want["phi_in_step"]}, (wrapper, got["kept"])
        # what FSDP2 saves on this rank is phi's, bias's and alpha's other rows; DDP holds them whole
        fsdp2, ddp = results["fsdp2"]["held"], results["ddp"]["held"]
        assert sum(ddp.values()) == sum(whole.values())
        assert sum(fsdp2.values()) < sum(ddp.values())
    # the shards add up to the whole
    for name, nbytes in whole.items():
        assert sum(results["fsdp2"]["held"][name] for results in ranks) == nbytes, name
    # one process on one rank's tokens keeps the same lanes; on both ranks' tokens, twice as many
    h = torch.randn(MEMORY_TOKENS, C)
    for tokens in (MEMORY_TOKENS, WORLD * MEMORY_TOKENS):
        batch = h.repeat(tokens // MEMORY_TOKENS, 1)
        _, kept = saved_bytes(lambda batch=batch: alone(batch), {"lanes": (N, C)})
        assert kept["lanes"] == tokens // MEMORY_TOKENS * ranks[0]["ddp"]["kept"]["lanes"]
        assert kept["lanes"] == LAYERS * tokens * N * C * 4


def test_docs_hold_the_computed_memory_table():
    text = (ROOT / "docs" / "distributed.md").read_text()
    assert memory_table(4, 4096, tokens=4096) in text


def _fails_on_rank_one():
    if torch.distributed.get_rank() == 1:
        raise ValueError("rank one's own error")
    return "done"


def _hangs_on_rank_one():
    if torch.distributed.get_rank() == 1:
        import time

        time.sleep(600)
    return "done"


def test_spawn_reports_a_failing_rank_and_ends_a_hang():
    with pytest.raises(RuntimeError, match=r"rank 1 of 2 failed:(.|\n)*ValueError: rank one's own error"):
        spawn(_fails_on_rank_one, 2, timeout=120, threads=1)
    with pytest.raises(TimeoutError, match="ranks \\[1\\] had not finished|ranks \\[0, 1\\] had not finished"):
        spawn(_hangs_on_rank_one, 2, timeout=5, threads=1)
