"""Hidden checks for lab 08 (used by `mhc-lab grade`, never shown in a lab): the copy floor for float32 lanes, one
token and huge blocks; the host's share for 0-d tensors, float32, equal times and a wide batch; the host per site for
integer times, a stack no slower than the plain one, a wait of exactly half the step, microsecond steps; the power
cap's rule for a zero threshold, equal times, 2-D and 0-d tensors; the lanes on the wire for integer arguments, one
token, compute a hair either side of the transfer, a huge micro-batch on a slow link; transformers' DeepSeek-V4
HyperConnection for bfloat16 lanes, one token, six lanes, a wide model and sharp coefficients."""

import torch

from mhc_lab.classroom.hidden_checks import hidden, same_as_reference
from mhc_lab.course.checks import CheckFailed, assert_close, call, randn, seeded
from mhc_lab.course.deepseek_v4 import hyper_connection
from mhc_lab.course.pipeline import boundary_exposed
from mhc_lab.course.step_time import copy_floor_overhead, host_per_site, host_share, instruction_bound


@hidden("8.1", "float32 lanes, one token, a 7168-wide block, a slow copy")
def _copy_floor(answer):
    cases = []
    for read_C, written_C, C, tokens, copy_gbps, block_ms, itemsize in [
            (38, 38, 4096, 16384, 4249.0, 37.4, 4), (1, 0, 7, 1, 1.5, 1e-3, 2), (9, 4, 7168, 1 << 20, 3000.0, 900.0, 2),
            (13, 13, 2560, 16384, 250.0, 16.3, 1)]:
        case = (f"C={C}, {tokens} tokens, {read_C}C read + {written_C}C written, itemsize {itemsize}, "
                f"{copy_gbps:g} GB/s, block {block_ms:g} ms")
        cases.append(same_as_reference(answer, copy_floor_overhead, read_C, written_C, C, tokens, copy_gbps, block_ms,
                                       itemsize, case=case, name="(extra_ms, overhead_pct)"))
    return cases


@hidden("8.2", "0-d tensors, float32, equal times, a wide batch")
def _host_share(answer):
    cases = []
    graph = 0.1 + randn(64, 33, seed=820).abs()
    for launched, graph_ms, label in [
            (torch.tensor(3.0, dtype=torch.float64), torch.tensor(2.0, dtype=torch.float64), "0-d, host-bound"),
            (torch.tensor(2.0, dtype=torch.float64), torch.tensor(2.5, dtype=torch.float64), "0-d, launched below"),
            (torch.full((4,), 1.5, dtype=torch.float32), torch.full((4,), 1.5, dtype=torch.float32),
             "float32, equal times"),
            (graph * (1 + 0.5 * randn(64, 33, seed=821).abs()), graph, "a 64 x 33 batch")]:
        cases.append(same_as_reference(answer, host_share, launched, graph_ms, case=label, name="host share"))
    return cases


@hidden("8.4", "a zero threshold, equal times, 2-D and 0-d tensors")
def _instruction_bound(answer):
    cases = []
    alone = 0.02 + randn(5, 6, seed=830).abs()
    for alone_ms, block_ms, threshold, label in [
            (alone, alone.clone(), 0.0, "equal times, threshold 0: nothing slowed"),
            (alone, alone * (1 + 0.1 * randn(5, 6, seed=831)), 0.0, "5 x 6 kernels, threshold 0"),
            (torch.tensor(0.5, dtype=torch.float64), torch.tensor(0.6, dtype=torch.float64), 0.1, "0-d, 20% slower"),
            (alone, alone * 1.2, 0.25, "all 20% slower, threshold 25%")]:
        got = call(answer, alone_ms.clone(), block_ms.clone(), threshold, case=label)
        want = instruction_bound(alone_ms, block_ms, threshold)
        if not isinstance(got, torch.Tensor) or got.dtype != torch.bool or got.shape != want.shape \
                or not torch.equal(got, want):
            raise CheckFailed(f"{label}: expected {want.tolist()}, got "
                              f"{got.tolist() if isinstance(got, torch.Tensor) else got!r}")
        cases.append(label)
    return cases


@hidden("8.3", "integer times, a stack no slower than the plain one, a wait of exactly half, microsecond steps")
def _host_per_site(answer):
    cases = []
    for args, label in [
            ((31, 6, 10, 4, 4), "integer times: 19 ms of host time over 4 sites"),
            ((5.0, 2.0, 5.0, 2.0, 8), "the same figures as the plain step: no host time added, host-bound"),
            ((4.0, 2.0, 3.0, 1.5, 2), "a GPU that waits exactly half of the launched step: not host-bound"),
            ((7.25, 7.25, 7.0, 7.0, 61), "a launched step equal to its GPU time, 61 sites"),
            ((0.012, 0.003, 0.008, 0.0025, 1), "microsecond steps, one site")]:
        got = call(answer, *args, case=label)
        want_host, want_bound = host_per_site(*args)
        if not isinstance(got, (tuple, list)) or len(got) != 2:
            raise CheckFailed(f"{label}: expected a tuple (host_ms, host_bound), got {type(got).__name__}")
        try:
            host = float(got[0])
        except (TypeError, ValueError):
            raise CheckFailed(f"{label}: expected host_ms to be a number, got {type(got[0]).__name__}") from None
        if abs(host - want_host) > 1e-12 + 1e-9 * abs(want_host):
            raise CheckFailed(f"{label}: expected host_ms = {want_host:.6g}, got {host:.6g}")
        if not isinstance(got[1], bool) and type(got[1]).__name__ != "bool_" or bool(got[1]) != want_bound:
            raise CheckFailed(f"{label}: expected host_bound = {want_bound}, got {got[1]!r}")
        cases.append(label)
    return cases


@hidden("8.5", "integer arguments, one token, compute a hair either side of the transfer, a huge micro-batch")
def _boundary_exposed(answer):
    cases = []
    for args, label in [
            ((1, 8, 1000, 1000, 1, 1), "integer arguments: 1 ms of transfer, 1 ms of compute, nothing exposed"),
            ((0.0, 1.0, 1, 1, 1, 1), "one token, one element, no compute"),
            ((0.16 * (1 - 1e-3), 400.0, 1000, 1000, 4, 2), "compute a hair shorter than the transfer"),
            ((0.16 * (1 + 1e-3), 400.0, 1000, 1000, 4, 2), "compute a hair longer than the transfer"),
            ((250.0, 10.0, 1 << 20, 7168, 16, 4), "a huge micro-batch, 16 lanes, on a slow link")]:
        got = call(answer, *args, case=label)
        want = boundary_exposed(*args)
        if not isinstance(got, (tuple, list)) or len(got) != 2:
            raise CheckFailed(f"{label}: expected a tuple (transfer_ms, exposed_ms), got {type(got).__name__}")
        for name, g, w in zip(("transfer_ms", "exposed_ms"), got, want):
            try:
                g = float(g)
            except (TypeError, ValueError):
                raise CheckFailed(f"{label}: expected {name} to be a number, got {type(g).__name__}") from None
            if abs(g - w) > 1e-12 * (1 + abs(want[0])) + 1e-9 * abs(w):
                raise CheckFailed(f"{label}: expected {name} = {w:.9g}, got {g:.9g}")
        cases.append(label)
    return cases


@hidden("8.6", "bfloat16 lanes, one token, six lanes, a wide model, sharp coefficients")
def _hyper_connection(answer):
    cases = []
    for k, (n, C, batch, tokens, dtype, spread, label) in enumerate([
            (4, 64, 2, 3, torch.bfloat16, 1.0, "bfloat16 lanes (the coefficients still float32)"),
            (4, 32, 1, 1, torch.float32, 1.0, "one token"),
            (6, 24, 1, 4, torch.float32, 1.0, "six lanes"),
            (4, 1024, 1, 2, torch.float32, 1.0, "a wide model, C = 1024"),
            (4, 48, 2, 2, torch.float32, 4.0, "sharp coefficients: H_res near a permutation")]):
        g = seeded(8660 + k)
        hc = hyper_connection(n, C, g, spread=spread)
        x = torch.randn(batch, tokens, n, C, generator=g).to(dtype)
        got = call(answer, hc.fn.detach().clone(), hc.base.detach().clone(), hc.scale.detach().clone(), x.clone(),
                   case=label)
        if not isinstance(got, (tuple, list)) or len(got) != 3:
            raise CheckFailed(f"{label}: expected a tuple of three tensors (post, comb, collapsed), got "
                              f"{type(got).__name__}")
        with torch.no_grad():
            want = hc(x)
        for name, g_, w in zip(("post", "comb", "collapsed"), got, want):
            assert_close(g_, w, case=label, name=name)
        cases.append(label)
    return cases
