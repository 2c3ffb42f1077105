"""The GPU benchmarks (mhc_lab.bench), checked on the CPU: their command lines, and their parts run on tiny shapes
with stand-ins where the code needs a GPU (the timer, CUDA graphs, torch.cuda's memory counters, tensors made
on "cuda", the CUDA-only kernels), the C target running our kernels where it can.

- The suites' parsers: the parts they list, the parts and block kinds they refuse, `--help`, and the command
  lines `python -m mhc_lab.bench warm` runs.
- Each part times what it names: forward's sites and kernels, training's site implementations, block kinds,
  block kernel breakdown and host part.
- The block benchmark's kinds run forward and backward and time the same block; interleaved rounds, the
  overhead per round, the CUDA-graph replay and its check against the launched step; the copy floor's bytes.
"""

import contextlib
import gc
import importlib
import json
import shlex
import subprocess
import sys
import types
import weakref
from pathlib import Path

import pytest
import torch
from torch import nn

import mhc_lab.bench as bench_suites
from mhc_lab.bench import block as bb
from mhc_lab.bench import (
    common,
    copy_floor,
    forward,
    host,
    kernels,
    site,
    training,
    warm,
)
from mhc_lab.bench.common import N, interleaved_rounds, overheads, round_ratios

ROOT = Path(__file__).resolve().parents[1]
BASELINES = {"eager", "compile", "tilekernels"}  # what the suites' --skip takes


# ------------------------------------------------------------------------------------------------ stand-ins


class _TorchOnCpu:
    """torch as a benchmark module's global name sees it on a machine without a GPU: tensors asked of "cuda" made
    on the CPU, torch.cuda's calls as stand-ins, everything else torch's own (only that module is affected)."""

    def __init__(self, **overrides):
        self.__dict__.update(overrides)

    def __getattr__(self, name):
        return getattr(torch, name)


def _on_cpu(make):
    def made(*args, device=None, **kwargs):  # "cuda" or the CPU: the CPU
        return make(*args, **kwargs)

    return made


def _cpu_cuda(**overrides):
    """The torch.cuda calls the benchmarks make, as stand-ins: 1 GiB of peak memory per step."""
    return types.SimpleNamespace(**{"synchronize": lambda: None, "empty_cache": lambda: None,
                                    "reset_peak_memory_stats": lambda: None, "memory_allocated": lambda: 0,
                                    "max_memory_allocated": lambda: 2**30, **overrides})


def _cpu_torch(**overrides):
    return _TorchOnCpu(**{"cuda": _cpu_cuda(), "empty": _on_cpu(torch.empty), "randn": _on_cpu(torch.randn),
                          "rand": _on_cpu(torch.rand), "Generator": _on_cpu(torch.Generator), **overrides})


def _spy(ran: list, label, fn):
    def spied(*args, **kwargs):
        ran.append(label)
        return fn(*args, **kwargs)

    return spied


def _blocks_on_cpu(monkeypatch, compiled=None):
    """block_step and bench_block on the CPU: Block.cuda() leaves the block where it is, torch.compile (for
    mhc_compiled) is recorded and returns the block itself, TileKernels is missing, and the layers' RMSNorm is
    one without in-place operations (torch.nn.RMSNorm adds its eps in place on the CPU, not on CUDA, and
    selective checkpointing, mhc_ours_recompute, refuses layers that do)."""
    from mhc_lab.course.training_lab import RMSNorm

    def compile_(fn, **kwargs):
        if compiled is not None:
            compiled.append(fn)
        return fn

    def no_tilekernels():
        raise ModuleNotFoundError("No module named 'tile_kernels'")

    monkeypatch.setattr(bb, "torch", _cpu_torch(compile=compile_))
    monkeypatch.setattr(bb.Block, "cuda", lambda self: self)
    monkeypatch.setattr(bb, "tilekernels_ops", no_tilekernels)
    monkeypatch.setattr(nn, "RMSNorm", RMSNorm)


def _relative(a, b) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


# ------------------------------------------------------------------------------------------ command lines


@pytest.mark.parametrize("suite", ["forward", "training"])
def test_help_works_and_lists_the_suites_parts(suite):
    """`python -m mhc_lab.bench forward --help` and `... training --help` print the usage and the parts, status 0;
    the module's docstring describes every part."""
    module = importlib.import_module(bench_suites.SUITES[suite])
    done = subprocess.run([sys.executable, "-m", "mhc_lab.bench", suite, "--help"], check=False, cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    text = " ".join(done.stdout.split())  # argparse wraps its lines
    assert text.startswith(f"usage: python -m mhc_lab.bench {suite}")
    assert f"among {', '.join(module.PARTS)}" in text
    for part in module.PARTS:
        assert f"\n- {part}" in module.__doc__, part


def test_bench_without_a_known_suite_says_which_it_has(capsys):
    assert bench_suites.main([]) == 2
    assert bench_suites.main(["trainig"]) == 2
    out = capsys.readouterr().out
    assert f"expected a suite: one of {', '.join(bench_suites.SUITES)} or all; got ['trainig']" in out


@pytest.mark.parametrize("parts", ["site,blocks", "overlap", "site,sweep", "sites", ""])
def test_training_benchmark_refuses_a_part_it_does_not_have(capsys, parts):
    with pytest.raises(SystemExit) as refused:
        training.main(["--parts", parts])
    assert refused.value.code == 2
    err = capsys.readouterr().err
    assert (f"--parts: expected parts among site, block, block_kernels, host, portable, stack, peers, deepseek_v4, got "
            f"{parts!r}") in err


@pytest.mark.parametrize("parts", ["sites,zeros", "site", ""])
def test_forward_benchmark_refuses_a_part_it_does_not_have(capsys, parts):
    with pytest.raises(SystemExit) as refused:
        forward.main(["--parts", parts])
    assert refused.value.code == 2
    assert f"--parts: expected parts among sites, reference, got {parts!r}" in capsys.readouterr().err


@pytest.mark.parametrize("kinds", ["residual", "mhc_ours,mhc_ours_chained", "mhc_reference", ""])
def test_training_benchmark_refuses_a_block_kind_it_does_not_have(capsys, kinds):
    """--block-kernels-kinds: each kind is profiled beside the plain block, so the plain residual is not one of
    them; the reference's block is timed as mhc_compiled only."""
    with pytest.raises(SystemExit):
        training.main(["--parts", "block_kernels", "--block-kernels-kinds", kinds])
    err = capsys.readouterr().err
    assert (f"--block-kernels-kinds: expected kinds among copy_floor, mhc_ours, mhc_ours_recompute, "
            f"mhc_tilekernels, mhc_compiled, got {kinds!r}") in err
    with pytest.raises(ValueError, match=r"kind: expected one of residual, copy_floor, .*, got 'mhc_reference'"):
        bb.block_step(128, "mhc_reference")


@pytest.mark.parametrize("flag", ["--graph-rounds", "--block-rounds"])
def test_training_benchmark_refuses_fewer_than_one_round(capsys, flag):
    with pytest.raises(SystemExit):
        training.main([flag, "0"])
    assert f"{flag}: expected an integer >= 1, got 0" in capsys.readouterr().err


def test_benchmarks_take_their_flags_and_stop_without_a_gpu(monkeypatch, capsys):
    """Every part and kind and each flag parse, and the benchmarks then stop where there is no GPU (status 1,
    saying so) without measuring or recording anything."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert training.main(["--parts", ",".join(training.PARTS), "--shapes", "64x256,128x512", "--widths", "256",
                          "--skip", "eager,compile", "--graph-rounds", "2", "--block-rounds", "3",
                          "--block-kernels-kinds", ",".join(bb.BLOCK_KINDS[1:]), "--name", "t", "--out", "x",
                          "--no-save"]) == 1
    assert forward.main(["--parts", ",".join(forward.PARTS), "--shapes", "64x256", "--skip", "tilekernels",
                         "--out-dir", "x", "--no-save"]) == 1
    assert training.main([]) == 1 and forward.main([]) == 1  # the defaults
    out = capsys.readouterr().out
    assert "bench training needs a CUDA GPU" in out and "bench forward needs a CUDA GPU" in out
    args = training.build_parser().parse_args([])
    assert training._check(training.build_parser(), args) == list(training.DEFAULT_PARTS)
    assert common.parse_shapes(args.shapes) == list(common.SHAPES)


@pytest.mark.parametrize("widths", [warm.WIDTHS, (256,)])
def test_warm_command_lines_are_accepted_by_the_suites(monkeypatch, capsys, widths):
    """Each line `python -m mhc_lab.bench warm` runs gets through its suite's parser and checks to the GPU check
    (status 1 here, where a refused line would exit 2), saves nothing, skips only baselines the suites know,
    and the lines compile both suites' kernels at every width."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    lines = warm.commands(widths)
    assert sorted((line[0], line[line.index("--shapes") + 1]) for line in lines) == sorted(
        (suite, f"{warm.SMALL_TOKENS}x{C}") for suite in ("forward", "training") for C in widths)
    for line in lines:
        assert bench_suites.main(line) == 1, line
        assert "--no-save" in line
        skipped = set(line[line.index("--skip") + 1].split(","))
        assert skipped <= BASELINES, line
    assert capsys.readouterr().out.count("needs a CUDA GPU") == len(lines)
    assert warm.main(["--widths", "256"]) == 1  # without a GPU it compiles nothing


def test_warm_covers_the_widths_the_timed_runs_use():
    """warm's default widths are every width the default timed runs use: the site shapes' and the blocks'."""
    assert {C for _, C in common.SHAPES} | set(training.BLOCK_WIDTHS) <= set(warm.WIDTHS)


def test_warm_runs_every_process_and_names_the_failed_ones_last(tmp_path, capsys):
    """run_processes runs each process with its log, two at a time here, and ends its output with the failed ones,
    so that an output cut to its last lines still names every failure."""
    todo = [(f"p{k}", ["-c", f"import sys; print('process {k}'); sys.exit({k % 2})"], f"process {k}")
            for k in range(5)]
    failed = warm.run_processes(todo, 2, str(tmp_path))
    assert failed == ["process 1", "process 3"]
    logs = sorted(p.name for p in tmp_path.iterdir())
    assert logs == [f"{k:02d}-p{k}.log" for k in range(5)]
    assert (tmp_path / "03-p3.log").read_text().strip() == "process 3"
    lines = capsys.readouterr().out.splitlines()
    assert lines[-3].endswith(": 3 passed, 2 failed") and lines[-2:] == ["  failed: process 1", "  failed: process 3"]
    assert sum(line.startswith("ok: process") for line in lines) == 3


def test_warm_reports_the_end_of_a_failed_log(tmp_path):
    log = tmp_path / "00-training.log"
    log.write_text("".join(f"line {k}\n" for k in range(50)))
    report = warm.failure_report(str(log), lines=3).splitlines()
    assert report == ["    | line 47", "    | line 48", "    | line 49"]
    log.write_text("")
    assert warm.failure_report(str(log)) == "    | (empty log)"


# ------------------------------------------------------------------------------ rounds and CUDA graphs


def test_interleaved_rounds_time_every_implementation_in_turn_and_ratio_per_round():
    """Each round times every implementation once, in turn (a drift over the run reaches all alike); the ratio of
    two is taken round by round, and each kind's overhead over the plain residual per round."""
    order, seconds = [], {"ours_chained": iter([1.0e-3, 1.2e-3, 0.9e-3]), "tilekernels": iter([2e-3, 2e-3, 2e-3])}

    def bench(fn):
        order.append(fn())
        return next(seconds[order[-1]])

    replays = {name: (lambda name=name: name) for name in ("ours_chained", "tilekernels")}
    rounds = interleaved_rounds(replays, bench, 3)
    assert order == ["ours_chained", "tilekernels"] * 3
    assert rounds == {"ours_chained": pytest.approx([1.0, 1.2, 0.9]), "tilekernels": pytest.approx([2.0, 2.0, 2.0])}
    ratio = round_ratios(rounds["ours_chained"], rounds["tilekernels"])
    assert ratio["ratios"] == pytest.approx([0.5, 0.6, 0.45])
    assert (ratio["median"], ratio["least"], ratio["most"]) == pytest.approx((0.5, 0.45, 0.6))
    assert round_ratios([1.0, 3.0], [2.0, 2.0])["median"] == pytest.approx(1.0)
    assert round_ratios([1.0], None) == {} and round_ratios(None, [1.0]) == {} and round_ratios([], [1.0]) == {}
    for bad in (0, -1, 2.0):
        with pytest.raises(ValueError, match=rf"expected rounds >= 1, got {bad!r}"):
            interleaved_rounds(replays, bench, bad)
    assert interleaved_rounds({}, bench, 2) == {}

    o = overheads({"residual": [10.0, 11.0, 12.0], "mhc_ours": [11.0, 11.55, 13.2], "copy_floor": [10.0, 11.0, 12.0]})
    assert set(o) == {"mhc_ours", "copy_floor"}  # the plain residual is the base
    assert (o["mhc_ours"]["median"], o["mhc_ours"]["least"], o["mhc_ours"]["most"]) == pytest.approx((10, 5, 10))
    assert o["copy_floor"] == pytest.approx({"median": 0.0, "least": 0.0, "most": 0.0})
    assert overheads({"mhc_ours": [1.0]}) == {}  # no base, no overhead


def test_graph_replay_keeps_the_steps_tensors_alive(monkeypatch):
    """common.graph_replay (stand-in streams and graph): the step runs three times on a side stream, once under
    capture, and the replay it returns replays the graph and holds the step, so that the tensors the graph
    reads (held by the step's closure) outlive the step's other references."""
    events = []

    class Graph:
        def replay(self):
            events.append("replay")

    @contextlib.contextmanager
    def capture(graph):
        events.append("capture")
        yield

    @contextlib.contextmanager
    def on(stream):
        events.append("side stream")
        yield

    class Stream:
        def wait_stream(self, other):
            pass

    cuda = _cpu_cuda(Stream=Stream, current_stream=Stream, stream=on, CUDAGraph=Graph, graph=capture)
    monkeypatch.setattr(common, "torch", _cpu_torch(cuda=cuda))

    class Weights:  # what a block's step holds
        pass

    def make():
        weights = Weights()
        return (lambda: events.append("step") if weights else None), weakref.ref(weights)

    step, held = make()
    replay = common.graph_replay(step)
    assert replay.step is step
    del step
    gc.collect()
    assert held() is not None
    assert events == ["side stream"] + ["step"] * 3 + ["capture", "step"]
    replay()
    assert events[-1] == "replay"
    del replay
    gc.collect()
    assert held() is None


# ------------------------------------------------------------------------------------------- copy floor


def test_copy_floor_moves_the_chained_sites_extra_bytes_and_leaves_the_block_as_the_residual(monkeypatch):
    """The copy floor's plan counts 76C per token for two chained sites at n = 4 (the chained sites' bytes less
    the residual's 12C), derived from bytes_model at other n too; its block gives the plain residual's output and
    gradients bit for bit, and each pass copies the plan's elements (k C / 2 copied: k C read + written)."""
    plan = copy_floor.copy_floor_plan(4)
    assert plan[0]["pre"] == {"forward": [4, 5], "backward": [5, 13]}
    assert plan[1]["pre"] == {"forward": [5], "backward": [5, 13]}
    assert all(p["post"] == {"forward": [6], "backward": [7]} for p in plan)
    assert sum(copy_floor.copy_floor_counts(plan)) == 76
    # per site: pre apply n + 1, post + projection 2n + 1, post backward without dx 2n + 2, dpre_reduce n + 1,
    # kernel 2 3n + 1, less the residual's 3 + 3: 9n; and the first site's projection, n
    for n in (1, 2, 8):
        assert sum(copy_floor.copy_floor_counts(copy_floor.copy_floor_plan(n))) == 19 * n
    assert copy_floor.copy_floor_counts(copy_floor.copy_floor_plan(4, sites=1)) == [4, 5, 5, 13, 6, 7]
    assert copy_floor.residual_elements() == {"forward add (h, f -> h + f)": (2, 1),
                                              "backward add (g, dh from F -> dh)": (2, 1)}

    torch.manual_seed(0)
    residual = bb.Block(32, 2, "residual")
    floor = bb.Block(32, 2, "copy_floor")
    floor.load_state_dict(residual.state_dict())
    copied = []
    original = torch.Tensor.copy_

    def counting_copy(dst, src, *args, **kwargs):
        assert dst.numel() == src.numel() and dst.data_ptr() != src.data_ptr()
        copied.append(src.numel())
        return original(dst, src, *args, **kwargs)

    h = torch.randn(2, 5, 32, dtype=torch.bfloat16)
    g = torch.randn(2, 5, 32, dtype=torch.bfloat16)
    runs = []
    for block, count in ((residual, False), (floor, True)):
        x = h.clone().requires_grad_(True)
        with monkeypatch.context() as m:
            if count:
                m.setattr(torch.Tensor, "copy_", counting_copy)
            out = block(x)
            out.backward(g)
        runs.append((out, x.grad, [p.grad for p in block.parameters()]))
    assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1])
    assert all(torch.equal(a, b) for a, b in zip(runs[0][2], runs[1][2]))
    assert sorted(copied) == sorted(k * h.numel() // 2 for k in copy_floor.copy_floor_counts(plan))


def test_copy_floor_refuses_an_odd_size_and_remakes_its_buffers_for_another():
    floor = copy_floor.CopyFloor(copy_floor.copy_floor_plan(4))
    assert floor.largest == 13
    h = torch.zeros(3, 8)
    pairs = floor.copies(h, [4, 13])
    assert [dst.numel() for dst, _ in pairs] == [4 * 12, 13 * 12] and floor.buffers[0].numel() == 13 * 12
    first = floor.buffers
    floor.copies(torch.zeros(3, 8), [5])
    assert floor.buffers is first  # the same size: the same buffers
    floor.copies(torch.zeros(5, 8), [5])
    assert floor.buffers[0].numel() == 13 * 20
    with pytest.raises(ValueError, match="tokens x C must be even to halve into read \\+ written, got 15"):
        floor.copies(torch.zeros(3, 5), [4])


# ------------------------------------------------------------------------------------------------ block


@pytest.mark.parametrize("layers", [True, False], ids=["block", "connections_alone"])
@pytest.mark.parametrize("kind", [k for k in bb.BLOCK_KINDS if k != "mhc_tilekernels"])
def test_block_step_runs_forward_and_backward_on_the_cpu(monkeypatch, kind, layers):
    """Each kind's training step, tiny (width 128, one head, 8 tokens) on the CPU, our kernels through the C target:
    forward and backward give a finite input gradient and one for every parameter, written afresh each step
    (not added to the last step's); without layers, the connections alone."""
    compiled = []
    _blocks_on_cpu(monkeypatch, compiled)
    step = bb.block_step(128, kind, batch=1, seq=8, layers=layers)
    h, g = step.inputs
    assert h.shape == ((1, 8, 128) if kind in ("residual", "copy_floor") else (1, 8, N, 128)) == g.shape
    assert compiled == ([step.block] if kind == "mhc_compiled" else [])
    if not layers:
        assert all(isinstance(layer, nn.Identity) for layer in step.block.layers)
    step()
    first = [h.grad.clone()] + [p.grad.clone() for p in step.block.parameters()]
    assert len(first) == 1 + sum(1 for _ in step.block.parameters())
    assert all(torch.isfinite(t.float()).all() for t in first) and first[0].float().abs().sum() > 0
    step()
    assert all(torch.equal(a, b) for a, b in zip(first, [h.grad] + [p.grad for p in step.block.parameters()]))


def test_block_kinds_time_the_same_block(monkeypatch):
    """What the kinds compare is one block: the copy floor's step gives the plain residual's gradients, ours with
    the mHC ops recomputed in backward gives ours bit for bit (and runs the block under selective checkpointing), and the
    reference's block that torch.compile gets (mhc_compiled), given ours' parameters and inputs, gives ours' output
    and gradients to bf16 rounding."""
    from torch.utils import checkpoint

    from mhc_lab.ops import recompute_policy
    from mhc_lab.reference import ManifoldHyperConnection

    _blocks_on_cpu(monkeypatch)

    checkpointed = []
    real_checkpoint = checkpoint.checkpoint

    def spied_checkpoint(fn, *args, **kwargs):
        checkpointed.append((fn, getattr(kwargs.get("context_fn"), "args", None)))
        return real_checkpoint(fn, *args, **kwargs)

    monkeypatch.setattr(checkpoint, "checkpoint", spied_checkpoint)

    def grads(step):
        step()
        return [step.inputs[0].grad] + [p.grad for p in step.block.parameters()]

    residual, floor = (bb.block_step(128, kind, batch=2, seq=8) for kind in ("residual", "copy_floor"))
    assert all(torch.equal(a, b) for a, b in zip(grads(residual), grads(floor)))

    ours, recomputed = (bb.block_step(128, kind, batch=2, seq=8) for kind in ("mhc_ours", "mhc_ours_recompute"))
    assert not checkpointed
    want = grads(ours)
    got = grads(recomputed)
    assert checkpointed == [(recomputed.block, (recompute_policy,))]
    assert all(torch.equal(a, b) for a, b in zip(got, want))

    reference = bb.block_step(128, "mhc_compiled", batch=2, seq=8)
    assert all(isinstance(s, ManifoldHyperConnection) for s in reference.block.sites)
    reference.block.load_state_dict(ours.block.state_dict())
    for mine, theirs in zip(reference.inputs, ours.inputs):
        with torch.no_grad():
            mine.copy_(theirs)
    with torch.no_grad():
        assert _relative(reference.block(reference.inputs[0]), ours.block(ours.inputs[0])) < 1e-2
    for a, b in zip(grads(reference), want):
        assert _relative(a, b) < 3e-2


def _stand_in_steps(monkeypatch, broken=(), failing=()):
    """block_step and graph_replay stand-ins for bench_block: each kind's step sets its input's gradient to 2g (a
    replay of a ``broken`` kind to 0, as a graph that read freed memory would), and returns the kind's name, or
    ("graph", name) as a replay; a ``failing`` kind's block cannot be built."""
    launched = []

    def block_step(width, kind, batch, seq):
        if kind in failing:
            raise RuntimeError(f"{kind} cannot be built")
        h = torch.randn(4, 8, requires_grad=True)
        g = torch.randn(4, 8)

        def step():
            launched.append(kind)
            h.grad = 2 * g
            return kind

        step.block, step.inputs, step.kind = nn.Linear(8, 8), (h, g), kind
        return step

    def graph_replay(step):
        h, g = step.inputs

        def replay():
            h.grad = 0 * g if step.kind in broken else 2 * g
            return ("graph", step.kind)

        replay.step = step
        return replay

    monkeypatch.setattr(bb, "block_step", block_step)
    monkeypatch.setattr(bb, "graph_replay", graph_replay)
    monkeypatch.setattr(bb, "torch", _cpu_torch())
    return launched


def test_block_rounds_take_each_kinds_overhead_per_round_launched_and_as_graphs(monkeypatch):
    """bench_block (stand-in steps, graphs and timer): each kind's step runs twice launched for its peak memory,
    then every kind is timed once per round in turn, launched and then as graphs, with the timer's longer
    warm-up; the overhead over the plain residual is taken per round, its median, least and most."""
    monkeypatch.setattr(bb, "BLOCK_KINDS", ("residual", "copy_floor", "mhc_ours"))
    launched = _stand_in_steps(monkeypatch)
    seconds = {"residual": iter([10e-3, 11e-3, 12e-3]), "copy_floor": iter([10.5e-3, 11e-3, 12.6e-3]),
               "mhc_ours": iter([11e-3, 11.55e-3, 13.2e-3]), ("graph", "residual"): iter([9e-3, 10e-3, 10e-3]),
               ("graph", "copy_floor"): iter([9e-3, 10e-3, 10e-3]), ("graph", "mhc_ours"): iter([9.9e-3, 10.5e-3,
                                                                                                   11e-3])}
    order, warmups = [], set()

    def bench(fn, warmup_ms=25, rep_ms=100):
        warmups.add((warmup_ms, rep_ms))
        order.append(fn())
        return next(seconds[order[-1]])

    lines = []
    out = bb.bench_block(256, bench, batch=2, seq=8, rounds=3, log=lines.append)
    kinds = ["residual", "copy_floor", "mhc_ours"]
    assert launched == [k for k in kinds for _ in range(2)] + kinds * 3
    assert order == kinds * 3 + [("graph", k) for k in kinds] * 3 and warmups == {(100, 500)}
    assert (out["C"], out["tokens"], out["batch"], out["seq"], out["heads"]) == (256, 16, 2, 8, 2)
    assert out["peak_gib"] == {k: 1.0 for k in kinds} and out["errors"] == {}
    launched_rounds = out["launched"]["rounds_ms"]
    assert launched_rounds["residual"] == pytest.approx([10.0, 11.0, 12.0])
    o = out["launched"]["overhead_pct"]
    assert set(o) == {"copy_floor", "mhc_ours"}
    assert (o["mhc_ours"]["median"], o["mhc_ours"]["least"], o["mhc_ours"]["most"]) == pytest.approx((10, 5, 10))
    assert (o["copy_floor"]["median"], o["copy_floor"]["least"], o["copy_floor"]["most"]) == pytest.approx((5, 0, 5))
    o = out["graph"]["overhead_pct"]
    assert (o["mhc_ours"]["median"], o["mhc_ours"]["least"], o["mhc_ours"]["most"]) == pytest.approx((10, 5, 10))
    assert out["graph"]["rel_diff"] == {k: 0.0 for k in kinds}
    assert any("mhc_ours" in line and "median +10.0% over the plain residual" in line for line in lines)


def test_block_graphs_are_checked_against_the_launched_step_and_refused_when_off(monkeypatch):
    """After the graphs' timing each replay's input gradient is compared with the launched step's: a kind whose
    replay computes something else (copy_floor's here) is refused with the difference and left out of the graph
    rounds and overheads. torch.compile's block is timed launched only; a kind that fails to build, or a baseline
    skipped, is not timed at all."""
    monkeypatch.setattr(bb, "BLOCK_KINDS", ("residual", "copy_floor", "mhc_ours", "mhc_tilekernels", "mhc_compiled"))
    launched = _stand_in_steps(monkeypatch, broken=("copy_floor",), failing=("mhc_tilekernels",))
    timed = []

    def bench(fn, warmup_ms=25, rep_ms=100):
        timed.append(fn())
        return 10e-3

    out = bb.bench_block(256, bench, rounds=2, log=lambda line: None)
    graphed = ["residual", "copy_floor", "mhc_ours"]
    assert timed == ["residual", "copy_floor", "mhc_ours", "mhc_compiled"] * 2 + [("graph", k) for k in graphed] * 2
    assert out["graph"]["rel_diff"] == {"residual": 0.0, "copy_floor": 1.0, "mhc_ours": 0.0}
    assert set(out["graph"]["rounds_ms"]) == {"residual", "mhc_ours"}
    assert set(out["graph"]["overhead_pct"]) == {"mhc_ours"}
    assert set(out["launched"]["overhead_pct"]) == {"copy_floor", "mhc_ours", "mhc_compiled"}
    assert out["errors"]["copy_floor.graph"] == ("refused: the replay's input gradient is 1.00e+00 (relative) off the "
                                                 "launched step's, where 0.01 was allowed")
    assert "not captured as a CUDA graph" in out["errors"]["mhc_compiled.graph"]
    assert "mhc_tilekernels cannot be built" in out["errors"]["mhc_tilekernels"]
    assert set(out["errors"]) == {"copy_floor.graph", "mhc_compiled.graph", "mhc_tilekernels"}
    assert out["peak_gib"] == {"residual": 1.0, "copy_floor": 1.0, "mhc_ours": 1.0, "mhc_compiled": 1.0}

    launched.clear()
    out = bb.bench_block(256, bench, rounds=1, skip={"compile", "tilekernels"}, log=lambda line: None)
    assert set(launched) == {"residual", "copy_floor", "mhc_ours"} and "mhc_tilekernels" not in out["errors"]
    assert set(out["launched"]["rounds_ms"]) == {"residual", "copy_floor", "mhc_ours"}


def test_block_benchmark_times_every_kind_on_the_cpu(monkeypatch):
    """bench_block with the real steps, tiny on the CPU (our kernels through the C target; graphs replaced by the
    step itself, TileKernels missing): every other kind is measured launched, and all but torch.compile's as
    graphs, their replays' gradients equal to the launched steps'."""
    _blocks_on_cpu(monkeypatch)

    def replay_of(step):
        for _ in range(4):  # three warm-ups and the capture
            step()

        def replay():
            step()

        replay.step = step
        return replay

    monkeypatch.setattr(bb, "graph_replay", replay_of)
    times = iter(range(1, 1000))

    def bench(fn, warmup_ms=25, rep_ms=100):
        fn()
        return next(times) * 1e-3

    out = bb.bench_block(128, bench, batch=1, seq=8, rounds=2, log=lambda line: None)
    measured = [k for k in bb.BLOCK_KINDS if k != "mhc_tilekernels"]
    assert list(out["peak_gib"]) == measured
    assert "tile_kernels" in out["errors"].pop("mhc_tilekernels")
    assert set(out["errors"]) == {"mhc_compiled.graph"}
    assert {k: len(v) for k, v in out["launched"]["rounds_ms"].items()} == {k: 2 for k in measured}
    graphed = [k for k in measured if k not in bb.NOT_GRAPHED]
    assert {k: len(v) for k, v in out["graph"]["rounds_ms"].items()} == {k: 2 for k in graphed}
    assert set(out["graph"]["rel_diff"]) == set(graphed)
    assert all(d <= bb.GRAPH_TOLERANCE for d in out["graph"]["rel_diff"].values())
    assert set(out["launched"]["overhead_pct"]) == set(measured) - {"residual"}


# --------------------------------------------------------------------------------- what each part times


def _gpu_stand_ins(monkeypatch, module):
    """A suite's main on the CPU: a GPU said to be there, a stand-in timer and copy bandwidth."""
    monkeypatch.setattr(module, "torch", _cpu_torch(cuda=_cpu_cuda(is_available=lambda: True)))
    monkeypatch.setattr(module, "gpu_timer", lambda: (lambda fn, warmup_ms=25, rep_ms=100: 1e-3, "stand-in timer"))
    monkeypatch.setattr(module, "copy_bandwidth", lambda bench: 4000.0)


def test_training_main_runs_the_parts_it_is_given_with_their_flags_and_saves_as_it_goes(monkeypatch, tmp_path):
    """training.main (stand-ins for the GPU and each part's function): the parts given run, in the suite's order,
    each shape or width with its flags, every block_kernels kind per width; the recording is saved after each
    step, marked partial until the run ends, with the command that made it."""
    _gpu_stand_ins(monkeypatch, training)
    calls, saved = [], tmp_path / "t.json"

    def seen_so_far():
        return json.loads(saved.read_text())["results"] if saved.exists() else {}

    def bench_site(tokens, C, bench, *, skip, graph_rounds):
        calls.append(("site", tokens, C, skip, graph_rounds, seen_so_far()))
        return {"tokens": tokens, "C": C}

    def bench_block_kernels(width, bench, *, kind):
        calls.append(("block_kernels", width, kind))
        return {"C": width, "kind": kind}

    monkeypatch.setattr(training, "bench_site", bench_site)
    monkeypatch.setattr(training, "bench_block_kernels", bench_block_kernels)
    for name in ("bench_block", "bench_host"):
        monkeypatch.setattr(training, name, lambda *a, **k: pytest.fail("a part not given ran"))
    argv = ["--parts", "block_kernels,site", "--shapes", "64x256,32x512", "--widths", "256,512", "--skip",
            "eager", "--graph-rounds", "2", "--block-kernels-kinds", "mhc_ours,copy_floor", "--name", "t", "--out",
            str(tmp_path)]
    assert training.main(argv) == 0
    assert [c[:5] for c in calls] == [("site", 64, 256, {"eager"}, 2), ("site", 32, 512, {"eager"}, 2),
                                      ("block_kernels", 256, "mhc_ours"), ("block_kernels", 256, "copy_floor"),
                                      ("block_kernels", 512, "mhc_ours"), ("block_kernels", 512, "copy_floor")]
    assert calls[0][5] == {} and calls[1][5]["site"]["partial"] is True
    assert calls[1][5]["site"]["shapes"] == [{"tokens": 64, "C": 256}]
    recording = json.loads(saved.read_text())
    assert list(recording["results"]) == ["site", "block_kernels"]
    assert recording["command"] == "python -m mhc_lab.bench training " + shlex.join(argv)
    site_part, kernels_part = recording["results"]["site"], recording["results"]["block_kernels"]
    assert "partial" not in site_part and "partial" not in kernels_part
    assert (site_part["timer"], site_part["copy_gbps"], len(site_part["shapes"])) == ("stand-in timer", 4000.0, 2)
    assert [(w["C"], w["kind"]) for w in kernels_part["widths"]] == [
        (256, "mhc_ours"), (256, "copy_floor"), (512, "mhc_ours"), (512, "copy_floor")]


def test_forward_main_runs_the_parts_it_is_given_for_each_shape(monkeypatch, tmp_path, capsys):
    """forward.main (stand-ins for the GPU and the parts): both parts by default, shape by shape, with --skip; the
    summary lists every part's sites; --no-save writes nothing."""
    _gpu_stand_ins(monkeypatch, forward)
    monkeypatch.setattr(forward, "l2_read_bandwidth", lambda: 9000.0)
    calls = []

    def part(name):
        def run(tokens, C, bench, *, skip):
            calls.append((name, tokens, C, skip))
            return {"tokens": tokens, "C": C, "min_bytes": forward.site_bytes(tokens, C), "time_ms": {"ours": 0.5},
                    "rel_err": {"ours": 1e-3}}

        return run

    monkeypatch.setattr(forward, "bench_sites", part("sites"))
    monkeypatch.setattr(forward, "bench_reference", part("reference"))
    assert forward.main(["--shapes", "64x256,32x512", "--skip", "compile", "--out", str(tmp_path)]) == 0
    assert calls == [("sites", 64, 256, {"compile"}), ("reference", 64, 256, {"compile"}),
                     ("sites", 32, 512, {"compile"}), ("reference", 32, 512, {"compile"})]
    results = json.loads((tmp_path / f"{forward.RECORDING}.json").read_text())["results"]
    assert list(results) == ["sites", "reference"] and results["sites"]["l2_read_gbps"] == 9000.0
    summary = [line.split() for line in capsys.readouterr().out.splitlines() if " ours " in line]
    assert [row[:3] for row in summary] == [["64x256", "ours", "0.500"], ["32x512", "ours", "0.500"]] * 2  # each part
    calls.clear()
    assert forward.main(["--parts", "reference", "--shapes", "64x256", "--no-save", "--name", "n"]) == 0
    assert calls == [("reference", 64, 256, set())] and not (tmp_path / "n.json").exists()


def test_block_kernels_part_profiles_the_plain_block_the_kind_and_its_connections_alone(monkeypatch):
    """bench_block_kernels (stand-in steps, profiler and timer): each row is the step it names (the plain block,
    the kind's, the kind's connections alone), its wall time the timer's, its kernels the profiler's; the
    comparisons set the kind's block against the plain one, and its own kernels against the connections alone."""
    built, ran = [], []

    def block_step(width, kind, batch, seq, layers=True):
        built.append((width, kind, batch, seq, layers))
        return lambda: ran.append((kind, layers))

    profiled = {("residual", True): {"gemm": (10.0, 4.0), "add": (0.5, 2.0)},
                ("mhc_ours", True): {"gemm": (10.4, 4.0), "add": (0.5, 2.0), "mhc": (1.0, 3.0)},
                ("mhc_ours", False): {"mhc": (0.8, 3.0), "add": (0.1, 1.0)}}
    wall = {("residual", True): 12.0, ("mhc_ours", True): 13.0, ("mhc_ours", False): 1.5}

    def kernel_times(step, repeat=5):
        step()
        return profiled[ran[-1]]

    def bench(fn, warmup_ms=25, rep_ms=100):
        fn()
        return wall[ran[-1]] * 1e-3

    monkeypatch.setattr(kernels, "block_step", block_step)
    monkeypatch.setattr(kernels, "kernel_times", kernel_times)
    monkeypatch.setattr(kernels, "torch", _cpu_torch())
    out = kernels.bench_block_kernels(64, bench, batch=2, seq=8, kind="mhc_ours", log=lambda line: None)
    assert built == [(64, "residual", 2, 8, True), (64, "mhc_ours", 2, 8, True), (64, "mhc_ours", 2, 8, False)]
    assert (out["C"], out["tokens"], out["kind"]) == (64, 16, "mhc_ours")
    for key, who in (("residual_block", ("residual", True)), ("kind_block", ("mhc_ours", True)),
                     ("kind_without_layers", ("mhc_ours", False))):
        row = out[key]
        busy = sum(ms for ms, _ in profiled[who].values())
        assert row["wall_ms"] == pytest.approx(wall[who]) and row["kernel_ms"] == pytest.approx(busy)
        assert row["idle_ms"] == pytest.approx(wall[who] - busy)
        assert row["launches"] == sum(count for _, count in profiled[who].values())
        assert row["kernels"] == {k: {"ms": ms, "launches": count} for k, (ms, count) in profiled[who].items()}
    c = out["comparison"]
    assert (c["shared_base_ms"], c["shared_other_ms"], c["only_other_ms"]) == pytest.approx((10.5, 10.9, 1.0))
    a = out["own_against_alone"]
    assert (a["shared_base_ms"], a["shared_other_ms"]) == pytest.approx((0.8, 1.0))  # mhc alone, then in the block


def _ops_spied(monkeypatch, ran):
    """mhc_lab.ops' site functions, recording their names when called (the benchmarks import them at call time)."""
    from mhc_lab import ops

    for name in ("mhc_pre", "mhc_post", "mhc_site", "mhc_site_chained", "run_sites", "mhc_pre_fused",
                 "mhc_post_fused"):
        monkeypatch.setattr(ops, name, _spy(ran, name, getattr(ops, name)))


def test_site_benchmark_times_each_implementation_it_names(monkeypatch):
    """bench_site on the CPU (our ops through the C target, stand-ins for the timer, the CUDA graphs, TileKernels
    and torch.compile): every implementation it names is timed launched on a call of that implementation and
    nothing else, the graphed ones as replays of that call too, then in interleaved rounds with the chained
    site's ratio to TileKernels per round; every gradient is close to the reference's."""
    ran = []
    _ops_spied(monkeypatch, ran)
    reference = common.reference_site
    monkeypatch.setattr(site, "reference_site", _spy(ran, "reference", reference))
    monkeypatch.setattr(site, "tilekernels_ops", lambda: None)
    monkeypatch.setattr(site, "tilekernels_site", _spy(ran, "tilekernels", reference))
    compiled = []

    def compile_(fn, **kwargs):
        compiled.append(fn)
        return _spy(ran, "compiled", fn)

    monkeypatch.setattr(site, "torch", _cpu_torch(compile=compile_))
    monkeypatch.setattr(common, "torch", _cpu_torch())  # site_inputs

    def replay_of(step):
        def replay():
            return step()

        replay.step, replay.graphed = step, True
        return replay

    monkeypatch.setattr(site, "graph_replay", replay_of)
    timed = []

    def bench(fn, warmup_ms=25, rep_ms=100):
        ran.clear()
        fn()
        timed.append((getattr(fn, "graphed", False), sorted(ran)))
        return len(timed) * 1e-3  # call k of the timer reads k ms

    out = site.bench_site(8, 16, bench, graph_rounds=3, log=lambda line: None)
    ops = {"ours_separate": ["mhc_post", "mhc_pre"], "ours_linked": ["mhc_site"], "ours_chained": ["mhc_site_chained"],
           "tilekernels": ["tilekernels"], "compiled": ["compiled", "reference"], "eager": ["reference"]}
    assert compiled == [site.reference_site] and out["errors"] == {}
    assert list(out["launched_ms"]) == list(ops)
    for name, ms in out["launched_ms"].items():
        assert timed[round(ms) - 1] == (False, ops[name]), name
    assert list(out["graph_ms"]) == list(site.GRAPHED)
    for name, ms in out["graph_ms"].items():
        assert timed[round(ms) - 1] == (True, ops[name]), name
    rounds = out["graph_rounds_ms"]
    assert list(rounds) == list(site.GRAPHED) and all(len(v) == 3 for v in rounds.values())
    calls = sorted((round(ms), name) for name, times in rounds.items() for ms in times)
    assert [name for _, name in calls] == list(site.GRAPHED) * 3  # in turn, round after round
    assert [k for k, _ in calls] == list(range(calls[0][0], calls[0][0] + 12))
    assert all(timed[k - 1] == (True, ops[name]) for k, name in calls)
    ratio = out["chained_vs_tilekernels_graph_rounds"]
    assert ratio["ratios"] == pytest.approx([a / b for a, b in zip(rounds["ours_chained"], rounds["tilekernels"])])
    for name, errs in out["rel_err"].items():
        assert set(errs) == set(site.GRADIENTS)
        assert all(v < (2e-2 if name.startswith("ours") else 1e-12) for v in errs.values()), (name, errs)
    assert out["elements_per_token"] == site.site_elements(N, post_grad=False)  # the post's dx written on the CPU
    assert out["bytes"]["ours_chained"] == 8 * out["elements_per_token"]["ours_chained"] * 16 * 2

    out = site.bench_site(8, 16, bench, skip=BASELINES, graph_rounds=1, log=lambda line: None)
    assert list(out["launched_ms"]) == ["ours_separate", "ours_linked", "ours_chained"]
    assert "chained_vs_tilekernels_graph_rounds" not in out


def test_site_benchmark_records_a_missing_tilekernels_and_a_failing_implementation(monkeypatch):
    """Without TileKernels the site part says why it is missing; an implementation that fails is recorded with its
    error and the others are still timed."""
    def missing():
        raise ModuleNotFoundError("No module named 'tile_kernels'")

    monkeypatch.setattr(site, "tilekernels_ops", missing)
    impls, errors = site.site_implementations({"compile"})
    assert list(impls) == ["ours_separate", "ours_linked", "ours_chained", "eager"]
    assert "tile_kernels" in errors["tilekernels"]

    def failing_site(x, phi, bias, alpha):
        raise RuntimeError("kernel failed")

    monkeypatch.setattr(site, "site_implementations", lambda skip: ({"eager": common.reference_site,
                                                                     "ours_linked": failing_site}, {}))
    monkeypatch.setattr(site, "torch", _cpu_torch())
    monkeypatch.setattr(common, "torch", _cpu_torch())
    monkeypatch.setattr(site, "graph_replay", lambda step: step)
    lines = []
    out = site.bench_site(8, 16, lambda fn, **kw: (fn(), 1e-3)[1], graph_rounds=1, log=lines.append)
    assert list(out["launched_ms"]) == ["eager"] and "kernel failed" in out["errors"]["ours_linked"]
    assert any("ours_linked" in line and "FAILED" in line for line in lines)


def _forward_kernel_stand_ins(monkeypatch, ran, *, forget_projection=False):
    """The CUDA-only kernels of forward's sites part as CPU stand-ins with the same arguments, recording
    (kernel, splits) when called: the phi split and the projection pass in torch, the apply pass through the C
    target, the post + next projection as our post then the projection (zeros for the projection when
    ``forget_projection``, as a broken kernel would)."""
    from mhc_lab.kernels import post_project, pre_cuda, pre_split
    from mhc_lab.kernels._target import is_gpu
    from mhc_lab.kernels._coefficients import mixes_width
    from mhc_lab.ops.forward import mhc_post_fused  # not the spied one of mhc_lab.ops

    real_apply = pre_split.apply_kernel

    def project_into(x_flat, phi_hl, partial):
        M = mixes_width(N)
        xf = x_flat.float()
        partial.zero_()
        partial[0, :, :M] = xf @ (phi_hl[:M].float() + phi_hl[M : 2 * M].float()).t()
        partial[0, :, M] = xf.square().sum(-1)

    def phi_split_kernel(n, C, target="cuda"):
        assert n == N and is_gpu(target)

        def phi_split(phi, phi_hl):
            ran.append(("phi_split", None))
            M, hi = mixes_width(n), phi.bfloat16()
            phi_hl.zero_()
            phi_hl[:M], phi_hl[M : 2 * M] = hi, (phi - hi.float()).bfloat16()

        return phi_split

    def project_kernel(n, C, dtype="bfloat16", target="cuda", *, splits=pre_split.PROJECTION_SPLITS):
        assert (n, dtype) == (N, "bfloat16") and is_gpu(target)

        def project(x_flat, phi_hl, partial):
            ran.append(("project", splits))
            assert partial.shape[0] == splits and x_flat.shape[1] == n * C
            project_into(x_flat, phi_hl, partial)

        return project

    def apply_kernel(n, C, dtype="bfloat16", target="cuda", *, splits=pre_split.PROJECTION_SPLITS):
        assert (n, dtype) == (N, "bfloat16") and is_gpu(target)
        on_c = real_apply(n, C, "float32", "c", splits=splits)

        def apply(x, partial, bias, alpha, y, pre, post, res):
            ran.append(("apply", splits))
            assert partial.shape[0] == splits
            y32 = torch.empty(y.shape)
            on_c(x.float(), partial, bias, alpha, y32, pre, post, res)
            y.copy_(y32)

        return apply

    def post_project_kernel(n, C, dtype="bfloat16", target="cuda", *, splits=pre_split.PROJECTION_SPLITS):
        assert (n, dtype) == (N, "bfloat16") and is_gpu(target)

        def fused(x, f, post, res, phi_next, out, partial):
            ran.append(("post_project", splits))
            assert partial.shape[0] == splits
            out.copy_(mhc_post_fused(x, f, post, res))
            if forget_projection:
                partial.zero_()
            else:
                project_into(out.view(out.shape[0], -1), phi_next, partial)

        return fused

    for module in (pre_split, pre_cuda):
        monkeypatch.setattr(module, "apply_kernel", apply_kernel)
    monkeypatch.setattr(pre_split, "phi_split_kernel", phi_split_kernel)
    monkeypatch.setattr(pre_split, "project_kernel", project_kernel)
    monkeypatch.setattr(post_project, "post_project_kernel", post_project_kernel)


@pytest.mark.parametrize("broken", [False, True], ids=["right_kernels", "post_without_projection"])
def test_forward_benchmark_times_every_kernel_it_names(monkeypatch, broken):
    """bench_sites on the CPU (the CUDA-only kernels as stand-ins with their arguments, our fused pre and post
    through the C target, a stand-in timer and TileKernels): each site and kernel it names is timed on a call of
    exactly that site or kernel, the chained site on its apply pass then its post + next projection with the
    chain's splits; its error checks hold for right kernels and catch a post that leaves out the projection."""
    from mhc_lab.kernels.pre_split import PROJECTION_SPLITS
    from mhc_lab.ops.dispatch import CHAIN_SPLITS

    ran = []
    _ops_spied(monkeypatch, ran)
    _forward_kernel_stand_ins(monkeypatch, ran, forget_projection=broken)
    monkeypatch.setattr(forward, "tilekernels_site", _spy(ran, ("tilekernels", None), common.reference_site))
    monkeypatch.setattr(forward, "torch", _cpu_torch())
    monkeypatch.setattr(common, "torch", _cpu_torch())
    timed = []

    def bench(fn, warmup_ms=25, rep_ms=100):
        ran.clear()
        fn()
        timed.append([r if isinstance(r, tuple) else (r, None) for r in ran])
        return len(timed) * 1e-3  # call k of the timer reads k ms

    out = forward.bench_sites(8, 16, bench, log=lambda line: None)
    assert out["errors"] == {}
    expected = {
        "ours": [("mhc_pre_fused", None), ("mhc_post_fused", None)], "tilekernels": [("tilekernels", None)],
        "ours_chained": [("apply", CHAIN_SPLITS), ("post_project", CHAIN_SPLITS)],
        "chained.apply": [("apply", CHAIN_SPLITS)], "chained.post_project": [("post_project", CHAIN_SPLITS)],
        "pre": [("mhc_pre_fused", None)], "post": [("mhc_post_fused", None)], "pre.phi_split": [("phi_split", None)],
        "pre.project": [("project", PROJECTION_SPLITS)], "pre.apply": [("apply", PROJECTION_SPLITS)]}
    named = {**out["time_ms"], **out["kernel_ms"]}
    assert set(named) == set(expected) and len(timed) == len(expected)
    for name, ms in named.items():
        assert timed[round(ms) - 1] == expected[name], name
    assert set(out["rel_err"]) == {"ours", "tilekernels", "ours_chained"} and out["rel_err"]["tilekernels"] == 0
    assert all(v < 1e-2 for v in out["rel_err"].values()), out["rel_err"]  # the lanes are right either way
    errs = out["kernel_rel_err"]
    assert errs["post"] < 1e-2 and max(errs["pre"].values()) < 1e-2
    assert errs["chained.partial"] == pytest.approx(1.0) if broken else errs["chained.partial"] < 1e-2
    assert out["min_bytes"] == forward.site_bytes(8, 16) == 8 * 14 * 16 * 2
    out = forward.bench_sites(8, 16, bench, skip={"tilekernels"}, log=lambda line: None)
    assert list(out["time_ms"]) == ["ours", "ours_chained"]


def test_forward_reference_part_times_eager_and_compiled_and_the_summary_reads_them(monkeypatch):
    """bench_reference (stand-ins for the timer and torch.compile): "eager" times the reference, "compile" its
    compiled form; the summary gives GB/s on the least bytes and the share of the copy's."""
    ran = []
    monkeypatch.setattr(forward, "reference_site", _spy(ran, "eager", common.reference_site))
    monkeypatch.setattr(forward, "torch", _cpu_torch(compile=lambda fn, dynamic=None: _spy(ran, "compiled", fn)))
    monkeypatch.setattr(common, "torch", _cpu_torch())
    timed = []

    def bench(fn, warmup_ms=25, rep_ms=100):
        ran.clear()
        fn()
        timed.append(list(ran))
        return 2e-3

    out = forward.bench_reference(8, 16, bench, log=lambda line: None)
    assert timed == [["eager"], ["compiled", "eager"]] and list(out["time_ms"]) == ["eager", "compile"]
    assert out["rel_err"] == {"eager": 0.0, "compile": 0.0} and out["errors"] == {}
    assert forward.bench_reference(8, 16, bench, skip={"eager", "compile"}, log=lambda line: None)["time_ms"] == {}

    section = {"copy_gbps": 1.0, "shapes": [{**out, "min_bytes": 4e6}]}  # 4 MB in 2 ms: 2 GB/s, 200% of copy
    lines = forward.summarize({"reference": section}).splitlines()
    assert lines[0].split() == ["shape", "impl", "ms", "GB/s(14C)", "%copy", "rel", "err"]
    assert lines[1].split() == ["8x16", "eager", "2.000", "2", "200.0", "0.0e+00"]


def test_host_part_times_a_chain_of_sites_per_site(monkeypatch):
    """bench_host on the CPU (stand-in graph, profiler and CUDA synchronisation): the step it times, launched, as
    a graph, under the profiler and under cProfile, is run_sites over its chain; every figure is per site; its
    Python functions are listed by own time, the most first."""
    ran = []
    _ops_spied(monkeypatch, ran)
    monkeypatch.setattr(common, "torch", _cpu_torch())
    monkeypatch.setattr(host, "torch", _cpu_torch())
    replayed = []

    def replay_of(step):
        def replay():
            replayed.append(step)
            return step()

        return replay

    def kernel_times(step, repeat=5):
        ran.clear()
        step()
        assert ran == ["run_sites"]
        return {"pre": (0.01, 2.0), "post": (0.02, 1.0)}

    monkeypatch.setattr(host, "graph_replay", replay_of)
    monkeypatch.setattr(host, "kernel_times", kernel_times)
    ran.clear()
    out = host.bench_host(8, 16, sites=3, steps=3, top=5, log=lambda line: None)["site"]
    assert set(ran) == {"run_sites"} and len(replayed) == 3 + 3
    assert (out["tokens"], out["C"], out["sites"], out["kernels_per_site"]) == (8, 16, 3, 1.0)
    assert out["kernel_ms"] == pytest.approx(0.01) and out["launched_ms"] > 0 and out["graph_ms"] > 0
    rows = out["host_us_by_function"]
    assert 0 < len(rows) <= 5 and [r["us"] for r in rows] == sorted((r["us"] for r in rows), reverse=True)
    assert {"us", "calls", "function"} == set(rows[0])
    events = out["host_us_by_event"]
    _check_host_events(events, 5)


def _check_host_events(events, top):
    """torch.profiler's host events of a CPU step: the most own time first, inside >= own, the step's ATen ops
    among them; native.cpp's events (none without a GPU) only where named so."""
    rows = events["by_own_time"]
    assert 0 < len(rows) <= top and [r["own_us"] for r in rows] == sorted((r["own_us"] for r in rows), reverse=True)
    assert all(r["us"] >= r["own_us"] >= 0 and r["calls"] > 0 for r in rows)
    assert any(r["event"].startswith("aten::") for r in rows)
    assert all(r["event"].startswith("mhc_lab") for r in events["native"])



# ------------------------------------------------------------------------------------------------ stack

from mhc_lab.bench import stack as bs

STACK_RAN = {  # what a step of each kind runs, 2 layers: its stack's forward, and its sites' pre (or TileKernels')
    "residual": ("forward:residual",),
    "mhc_kernels": ("forward:mhc_kernels", "pre:kernels", "pre:kernels"),
    "mhc_reference": ("forward:mhc_reference", "pre:reference", "pre:reference"),
    "mhc_tilekernels": ("forward:mhc_tilekernels", "tk_post", "tk_post", "tk_pre", "tk_pre"),
}


def _tilekernels_from_the_reference(ran: list):
    """TileKernels' mhc_pre and mhc_post as stand-ins with its arguments, computed by mhc_lab.reference."""
    from mhc_lab.reference import mhc_coefficients, mhc_post, mhc_pre

    def tk_pre(x, phi, alpha, bias, *, post_mult_value, sinkhorn_repeat):
        ran.append("tk_pre")
        assert (post_mult_value, sinkhorn_repeat) == (2.0, 20) and x.dim() == 4 and x.shape[0] == 1
        pre, post, res = mhc_coefficients(x, phi, bias, alpha)
        return mhc_pre(x, pre).to(x.dtype), (post, res)

    def tk_post(f, x, post_mix, comb_mix):
        ran.append("tk_post")
        return mhc_post(x, f, post_mix, comb_mix).to(x.dtype)

    return tk_pre, tk_post


def _stacks_on_cpu(monkeypatch, ran: list, *, tilekernels: bool = True):
    """stack_step and bench_stack on the CPU: tensors asked of "cuda" made on the CPU, Stack.cuda() leaving the
    stack where it is, our kernels through the C target, TileKernels from the reference (or missing); every
    stack's forward records its kind, every site's pre its backend."""
    from mhc_lab.ops import modules

    monkeypatch.setattr(bs, "torch", _cpu_torch())
    monkeypatch.setattr(common, "torch", _cpu_torch())
    monkeypatch.setattr(host, "torch", _cpu_torch())  # the host profile synchronises there
    monkeypatch.setattr(bs.Stack, "cuda", lambda self: self)
    if tilekernels:
        monkeypatch.setattr(bs, "tilekernels_ops", lambda: _tilekernels_from_the_reference(ran))
    else:
        def missing():
            raise ModuleNotFoundError("No module named 'tile_kernels'")

        monkeypatch.setattr(bs, "tilekernels_ops", missing)
    forward = bs.Stack.forward

    def spied_forward(self, h):
        ran.append(f"forward:{self.kind}")
        return forward(self, h)

    monkeypatch.setattr(bs.Stack, "forward", spied_forward)
    pre_forward = modules.run_pre_forward

    def spied_pre(x, phi, bias, alpha, backend, *rest, **options):
        ran.append(f"pre:{backend}")
        return pre_forward(x, phi, bias, alpha, backend, *rest, **options)

    monkeypatch.setattr(modules, "run_pre_forward", spied_pre)
    step_for = modules.post_then_pre

    def spied_step_for(x, backend, next_backend, project):  # the post of one site, then the pre of the next
        step = step_for(x, backend, next_backend, project)

        def spied_step(*args):
            ran.append(f"pre:{next_backend}")
            return step(*args)

        return spied_step

    monkeypatch.setattr(modules, "post_then_pre", spied_step_for)


def _stack_section(shapes: list) -> dict:
    """The section training.main writes around bench_stack's shapes."""
    from mhc_lab.measure import environment_tags

    return {"environment": environment_tags(), "command": "python -m mhc_lab.bench training --parts stack",
            "timer": "stand-in timer", "n": N, "dtype": "bfloat16", "copy_gbps": 4000.0,
            "launched_timer": bs.LAUNCHED_TIMER, "loss": bs.LOSS, "shapes": json.loads(json.dumps(shapes))}


def test_stack_kinds_train_the_same_stack_on_the_cpu(monkeypatch):
    """Each kind's training step, tiny on the CPU: the plain residual and the three mHC kinds share their layers'
    weights and inputs; the mHC kinds (ours with the kernels through the C target, ours on the reference, and
    TileKernels' ops as reference stand-ins) share their sites' parameters and give the same loss and input
    gradient; every step writes its gradients afresh; a kind the part does not have is refused."""
    ran = []
    _stacks_on_cpu(monkeypatch, ran)
    steps = {kind: bs.stack_step(64, 8, kind, layers=2) for kind in bs.STACK_KINDS}
    residual = steps["residual"].stack.layers.state_dict()
    for kind in bs.STACK_KINDS[1:]:
        stream = steps[kind].stack.stream
        assert all(torch.equal(a, b) for a, b in zip(stream.layers.state_dict().values(), residual.values())), kind
        assert all(p.dtype == torch.bfloat16 for p in stream.layers.parameters())
        for mine, theirs in zip(stream.connections.parameters(), steps["mhc_kernels"].stack.stream.connections
                                .parameters()):
            assert torch.equal(mine, theirs), kind
        assert all(torch.equal(a, b) for a, b in zip(steps[kind].inputs, steps["residual"].inputs))
    assert [c.backend for c in steps["mhc_reference"].stack.stream.connections] == ["reference"] * 2
    assert [c.backend for c in steps["mhc_kernels"].stack.stream.connections] == ["kernels"] * 2
    losses, grads = {}, {}
    for kind, step in steps.items():
        ran.clear()
        step()
        assert tuple(sorted(ran)) == STACK_RAN[kind], kind
        h = step.inputs[0]
        first = [h.grad.clone()] + [p.grad.clone() for p in step.stack.parameters()]
        assert all(torch.isfinite(t.float()).all() for t in first) and first[0].float().abs().sum() > 0
        step()
        assert all(torch.equal(a, b) for a, b in zip(first, [h.grad] + [p.grad for p in step.stack.parameters()]))
        losses[kind], grads[kind] = float(step.loss().detach()), first[0]
    for kind in ("mhc_reference", "mhc_tilekernels"):
        assert losses[kind] == pytest.approx(losses["mhc_kernels"], rel=2e-2), kind
        assert _relative(grads[kind], grads["mhc_kernels"]) < 3e-2, kind
    assert _relative(grads["residual"], grads["mhc_kernels"]) > 1e-1  # the connections change the function
    with pytest.raises(ValueError, match=r"kind: expected one of residual, mhc_kernels, .*, got 'mhc_ours'"):
        bs.stack_step(64, 8, "mhc_ours")


def _stack_timers(monkeypatch, ran: list, *, failing_capture=(), broken_replay=()):
    """Stand-ins for bench_stack's clocks, each running the callable it is given once and recording what ran:
    the wall clock (launched), the profiler and the graphs' timer; call k of any of them reads k ms (the wall
    clock 1000 k ms: a step longer than a launched timing's aim, so 5 steps per timing). A
    ``failing_capture`` kind's graph cannot be captured; a ``broken_replay`` kind's replay zeroes its input's
    gradient, as a graph that read freed memory would. Returns (calls, bench)."""
    calls = []

    def ran_now(fn):
        ran.clear()
        fn()
        return tuple(sorted(ran))

    def wall_ms(step, repeat):
        calls.append(("launched", repeat, ran_now(step)))
        return 1000.0 * len(calls)

    def kernel_times(step, repeat=5):
        calls.append(("profiled", ran_now(step)))
        k = len(calls)
        return {f"kernel {k}": (float(k), 2.0 * k)}

    def graph_replay(step):
        for _ in range(4):  # three warm-ups and the capture
            step()
        kind = step.stack.kind
        if kind in failing_capture:
            raise RuntimeError(f"{kind}: operation not permitted when stream is capturing")

        def replay():
            step()
            if kind in broken_replay:
                step.inputs[0].grad.zero_()

        replay.step, replay.graphed = step, True
        return replay

    def bench(fn, warmup_ms=25, rep_ms=100):
        assert getattr(fn, "graphed", False) and (warmup_ms, rep_ms) == (100, 500)
        calls.append(("graph", ran_now(fn)))
        return len(calls) * 1e-3

    monkeypatch.setattr(bs, "wall_ms", wall_ms)
    monkeypatch.setattr(bs, "kernel_times", kernel_times)
    monkeypatch.setattr(bs, "graph_replay", graph_replay)
    return calls, bench


def _spy_on_host_profile(monkeypatch, ran: list) -> list:
    """bench_stack's host_profile, each call recording (steps, what ran) in the list returned."""
    real_profile, profiled = bs.host_profile, []

    def host_profile(step, steps, **kwargs):
        ran.clear()
        result = real_profile(step, steps, **kwargs)
        profiled.append((steps, set(ran)))
        return result

    monkeypatch.setattr(bs, "host_profile", host_profile)
    return profiled


def test_stack_benchmark_times_each_kind_on_calls_of_its_own_step(monkeypatch):
    """bench_stack on the CPU (our kernels through the C target, TileKernels' ops from the reference, stand-ins
    for the wall clock, the profiler, the graphs and their timer): every figure of a kind comes from a call that
    ran that kind's step and nothing else: its launched rounds (in turn, round after round, with its steps per
    timing), its GPU time and kernels, its graph rounds; the ratios to the plain residual are taken per round;
    the host profile runs the fused stream alone; the section validates against its schema."""
    from mhc_lab.measure.schemas import TRAINING_STACK, validate

    ran = []
    _stacks_on_cpu(monkeypatch, ran)
    calls, bench = _stack_timers(monkeypatch, ran)
    profiled = _spy_on_host_profile(monkeypatch, ran)
    lines = []
    out = bs.bench_stack(64, 8, bench, layers=2, rounds=3, log=lines.append)
    kinds = list(bs.STACK_KINDS)
    assert out["errors"] == {}
    assert (out["tokens"], out["C"], out["n"], out["layers"], out["hidden"]) == (8, 64, N, 2, 256)
    for kind in kinds:
        assert calls[round(out["gpu_ms"][kind]) - 1] == ("profiled", STACK_RAN[kind]), kind
        assert out["kernels_per_step"][kind] == 2 * out["gpu_ms"][kind]
        k = round(out["gpu_ms"][kind])
        assert out["kernels"][kind] == {f"kernel {k}": {"ms": k, "launches": 2 * k}}
        assert len(out["launched_rounds_ms"][kind]) == 3 and len(out["graph_rounds_ms"][kind]) == 3
        for ms in out["launched_rounds_ms"][kind]:
            assert calls[round(ms / 1000) - 1] == ("launched", 5, STACK_RAN[kind]), kind
        for ms in out["graph_rounds_ms"][kind]:
            assert calls[round(ms) - 1] == ("graph", STACK_RAN[kind]), kind
        assert out["launched_ms"][kind] == out["launched_rounds_ms"][kind][1]  # the median of rising times
        assert out["graph_ms"][kind] == pytest.approx(out["graph_rounds_ms"][kind][1])
        assert out["graph_rel_diff"][kind] <= bb.GRAPH_TOLERANCE
        assert out["steps_per_timing"][kind] == 5
    timed = [c for c in calls if c[0] == "launched" and c[1] >= 5]
    assert [c[2] for c in timed] == [STACK_RAN[k] for k in kinds] * 3  # in turn, round after round
    assert [c[1] for c in calls if c[0] == "graph"] == [STACK_RAN[k] for k in kinds] * 3
    assert profiled == [(out["steps_per_timing"]["mhc_kernels"], {"forward:mhc_kernels", "pre:kernels"})]
    host = out["host"]
    assert host["steps"] == out["steps_per_timing"]["mhc_kernels"] and host["forward_ms"] > 0
    assert host["backward_ms"] > 0 and host["own_us"] > 0
    for order, key in (("by_own_time", "us"), ("by_cumulative_time", "cumulative_us")):
        rows = host[order]
        assert 0 < len(rows) <= bs.TOP and [r[key] for r in rows] == sorted((r[key] for r in rows), reverse=True)
    assert any("mhc_lab/ops/modules.py" in r["function"] for r in host["by_cumulative_time"])
    _check_host_events(host["events"], bs.TOP)

    ratios = out["over_residual"]
    assert set(ratios["launched"]) == set(ratios["graph"]) == set(kinds[1:]) == set(out["per_site_over_residual"])
    for kind in kinds[1:]:
        assert ratios["launched"][kind]["ratios"] == pytest.approx(
            [a / b for a, b in zip(out["launched_rounds_ms"][kind], out["launched_rounds_ms"]["residual"])])
        assert ratios["graph"][kind]["ratios"] == pytest.approx(
            [a / b for a, b in zip(out["graph_rounds_ms"][kind], out["graph_rounds_ms"]["residual"])])
        assert ratios["gpu"][kind] == pytest.approx(out["gpu_ms"][kind] / out["gpu_ms"]["residual"])
        assert ratios["kernels"][kind] == pytest.approx(2 * out["gpu_ms"][kind] / (2 * out["gpu_ms"]["residual"]))
        site_row = out["per_site_over_residual"][kind]
        assert site_row["launched_ms"] == pytest.approx((out["launched_ms"][kind] - out["launched_ms"]["residual"]) / 2)
        assert site_row["kernels"] == pytest.approx(
            (out["kernels_per_step"][kind] - out["kernels_per_step"]["residual"]) / 2)
        assert site_row["graph_ms"] == pytest.approx((out["graph_ms"][kind] - out["graph_ms"]["residual"]) / 2)
    assert any("mhc_kernels" in line and "per site over the residual" in line for line in lines)

    section = _stack_section([out])
    assert validate(section, TRAINING_STACK) == []
    del section["shapes"][0]["gpu_ms"]
    section["shapes"][0]["launched_ms"]["mhc_ours"] = 1.0
    errors = validate(section, TRAINING_STACK)
    assert "shapes[0]: missing key 'gpu_ms'" in errors and any("unknown key 'mhc_ours'" in e for e in errors)


def test_stack_benchmark_records_a_missing_tilekernels_and_a_failed_graph_and_measures_the_rest(monkeypatch):
    """Without TileKernels the stack part records why (the import error) and measures the other kinds; a graph
    that cannot be captured is recorded and its kind still timed launched; a replay whose input gradient is off
    the launched step's is refused; the section still validates; a set of kinds without the plain residual, or
    with one the part does not have, is refused."""
    from mhc_lab.measure.schemas import TRAINING_STACK, validate

    ran = []
    _stacks_on_cpu(monkeypatch, ran, tilekernels=False)
    calls, bench = _stack_timers(monkeypatch, ran, failing_capture=("mhc_reference",), broken_replay=("mhc_kernels",))
    lines = []
    out = bs.bench_stack(64, 8, bench, layers=2, rounds=2, log=lines.append)
    measured = ["residual", "mhc_kernels", "mhc_reference"]
    assert set(out["errors"]) == {"mhc_tilekernels", "mhc_reference.graph", "mhc_kernels.graph"}
    assert "No module named 'tile_kernels'" in out["errors"]["mhc_tilekernels"]
    assert "operation not permitted when stream is capturing" in out["errors"]["mhc_reference.graph"]
    assert out["errors"]["mhc_kernels.graph"].startswith("refused: the replay's input gradient is 1.00e+00")
    assert any("mhc_tilekernels" in line and "FAILED" in line and "tile_kernels" in line for line in lines)
    for figure in ("launched_ms", "launched_rounds_ms", "gpu_ms", "kernels_per_step", "steps_per_timing"):
        assert list(out[figure]) == measured, figure
    assert all(calls[round(ms / 1000) - 1][2] == STACK_RAN[kind] for kind in measured
               for ms in out["launched_rounds_ms"][kind])
    assert list(out["graph_ms"]) == ["residual"] and list(out["graph_rounds_ms"]) == ["residual"]
    assert set(out["graph_rel_diff"]) == {"residual", "mhc_kernels"} and out["graph_rel_diff"]["mhc_kernels"] == 1.0
    assert set(out["over_residual"]["launched"]) == {"mhc_kernels", "mhc_reference"}
    assert out["over_residual"]["graph"] == {}
    assert all("graph_ms" not in row for row in out["per_site_over_residual"].values())
    assert "host" in out
    assert validate(_stack_section([out]), TRAINING_STACK) == []

    for kinds in (("mhc_kernels", "mhc_reference"), ("residual", "mhc_ours")):
        with pytest.raises(ValueError, match=r"kinds: expected kinds among residual, mhc_kernels, mhc_reference, "
                                             r"mhc_tilekernels, residual_compiled, .*mhc_reference_reduce_overhead, "
                                             r"the plain residual among them"):
            bs.bench_stack(64, 8, bench, kinds=kinds, log=lambda line: None)
    out = bs.bench_stack(64, 8, bench, layers=2, rounds=1, kinds=("residual", "mhc_reference"), log=lambda line: None)
    assert list(out["launched_ms"]) == ["residual", "mhc_reference"] and "host" not in out


def test_training_main_runs_the_stack_part_with_its_flags(monkeypatch, tmp_path):
    """training.main --parts stack (stand-ins for the GPU and bench_stack): the stack part alone runs, shape by
    shape, with its layers, rounds and kinds, TileKernels left out by --skip tilekernels; its section holds the
    run's setup, the launched timer and the loss, and is saved under 'stack'."""
    _gpu_stand_ins(monkeypatch, training)
    calls = []

    def bench_stack(width, tokens, bench, *, layers, kinds, rounds):
        calls.append((tokens, width, layers, list(kinds), rounds))
        return {"tokens": tokens, "C": width, "layers": layers, "run": len(calls)}

    monkeypatch.setattr(training, "bench_stack", bench_stack)
    for name in ("bench_site", "bench_block", "bench_block_kernels", "bench_host", "bench_portable"):
        monkeypatch.setattr(training, name, lambda *a, **k: pytest.fail("a part not given ran"))
    argv = ["--parts", "stack", "--stack-shapes", "64x256,32x512", "--stack-layers", "3", "--stack-rounds", "2",
            "--skip", "tilekernels", "--name", "t", "--out", str(tmp_path)]
    assert training.main(argv) == 0
    kinds = ["residual", "mhc_kernels", "mhc_reference"]
    assert calls == [(64, 256, 3, kinds, 2), (32, 512, 3, kinds, 2)]
    recording = json.loads((tmp_path / "t.json").read_text())
    assert list(recording["results"]) == ["stack"]
    part = recording["results"]["stack"]
    assert (part["timer"], part["copy_gbps"], part["n"], part["dtype"]) == ("stand-in timer", 4000.0, N, "bfloat16")
    assert (part["launched_timer"], part["loss"]) == (bs.LAUNCHED_TIMER, bs.LOSS)
    made = {"environment": part["environment"], "command": part["command"]}
    assert part["shapes"] == [{"tokens": 64, "C": 256, "layers": 3, "run": 1, **made},
                              {"tokens": 32, "C": 512, "layers": 3, "run": 2, **made}] and "partial" not in part
    # a later run replaces the shapes it measures and keeps the others, each with the command that made it
    again = ["--parts", "stack", "--stack-shapes", "32x512,16x128", "--stack-layers", "3", "--name", "t", "--out",
             str(tmp_path)]
    assert training.main(again) == 0
    part = json.loads((tmp_path / "t.json").read_text())["results"]["stack"]
    assert [(s["tokens"], s["C"], s["run"]) for s in part["shapes"]] == [(16, 128, 4), (64, 256, 1), (32, 512, 3)]
    assert part["shapes"][1]["command"] == made["command"] and "--stack-shapes 64x256,32x512" in made["command"]
    assert "--stack-shapes 32x512,16x128" in part["shapes"][0]["command"] == part["shapes"][2]["command"]
    calls.clear()
    assert training.main(["--parts", "stack", "--stack-kinds", "residual,mhc_tilekernels", "--no-save"]) == 0
    assert calls == [(t, c, 8, ["residual", "mhc_tilekernels"], 3) for t, c in bs.STACK_SHAPES]
    assert training.DEFAULT_PARTS == ("site", "block", "block_kernels")  # not a default part


def test_training_benchmark_takes_the_stack_part_and_its_default_shapes(monkeypatch, capsys):
    """--parts stack gets through the parser and its checks (to the GPU check here); its default shapes are the
    issue's, 4096 x 768 and 8192 x 2048."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert training.main(["--parts", "stack"]) == 1
    assert training.main(["--parts", "stack", "--stack-shapes", "16384x2560,16384x4096"]) == 1
    assert "bench training needs a CUDA GPU" in capsys.readouterr().out
    args = training.build_parser().parse_args(["--parts", "stack"])
    assert training._check(training.build_parser(), args) == ["stack"]
    assert common.parse_shapes(args.stack_shapes) == [(4096, 768), (8192, 2048)] == list(bs.STACK_SHAPES)


@pytest.mark.parametrize("shapes", ["4096x", "768", "4096x768x2", "0x768", "4096x-768", "ax768", "4096x768,", "",
                                    "4096*768"])
def test_training_benchmark_refuses_a_bad_stack_shape(capsys, shapes):
    with pytest.raises(SystemExit) as refused:
        training.main(["--parts", "stack", "--stack-shapes", shapes])
    assert refused.value.code == 2
    assert (f"--stack-shapes: expected TOKENSxC pairs of positive integers separated by commas (e.g. "
            f"4096x768,8192x2048), got {shapes!r}") in " ".join(capsys.readouterr().err.split())
    with pytest.raises(ValueError, match="expected TOKENSxC pairs"):
        common.parse_shapes(shapes)


@pytest.mark.parametrize("argv, message", [
    (["--stack-kinds", "mhc_kernels,mhc_reference"], ("--stack-kinds: expected kinds among residual, mhc_kernels, "
                                                       "mhc_reference, mhc_tilekernels, residual_compiled, ")),
    (["--stack-kinds", "residual,mhc_ours"], "--stack-kinds: expected kinds among residual"),
    (["--stack-rounds", "0"], "--stack-rounds: expected an integer >= 1, got 0"),
    (["--stack-layers", "0"], "--stack-layers: expected an integer >= 1, got 0"),
])
def test_training_benchmark_refuses_bad_stack_flags(capsys, argv, message):
    with pytest.raises(SystemExit) as refused:
        training.main(["--parts", "stack", *argv])
    assert refused.value.code == 2
    assert message in " ".join(capsys.readouterr().err.split())


def test_stack_benchmark_records_a_failed_host_profile_and_keeps_the_timings(monkeypatch):
    """A host profile that fails (cProfile, say) is recorded under 'mhc_kernels.host'; the fused stream's timings
    and the section stand."""
    from mhc_lab.measure.schemas import TRAINING_STACK, validate

    ran = []
    _stacks_on_cpu(monkeypatch, ran)
    _, bench = _stack_timers(monkeypatch, ran)

    def host_profile(step, steps, **kwargs):
        raise ValueError("Another profiling tool is already active")

    monkeypatch.setattr(bs, "host_profile", host_profile)
    out = bs.bench_stack(64, 8, bench, layers=2, rounds=1, kinds=("residual", "mhc_kernels"), log=lambda line: None)
    assert out["errors"] == {"mhc_kernels.host": "ValueError('Another profiling tool is already active')"}
    assert "host" not in out and list(out["launched_ms"]) == list(out["graph_ms"]) == ["residual", "mhc_kernels"]
    assert validate(_stack_section([out]), TRAINING_STACK) == []


def test_stack_benchmark_profiles_the_host_of_the_compiled_stream_apart(monkeypatch):
    """Where the fused stream is measured under torch.compile too, its host profile is recorded under
    'host_compiled', from the compiled kind's own steps (a stand-in torch.compile marks them), beside the eager
    stream's under 'host'; each compiled kind gets torch.compile's mode; the section validates against its
    schema."""
    from mhc_lab.measure.schemas import TRAINING_STACK, validate

    ran, compiled_with = [], {}
    _stacks_on_cpu(monkeypatch, ran)
    _, bench = _stack_timers(monkeypatch, ran)

    def compile(model, **kwargs):
        compiled_with[model.kind] = compiled_with.get(model.kind, []) + [kwargs]

        def compiled(*args):
            ran.append(f"compiled:{kwargs.get('mode', 'default')}")
            return model(*args)
        return compiled

    monkeypatch.setattr(bs.torch, "compile", compile)
    profiled = _spy_on_host_profile(monkeypatch, ran)
    out = bs.bench_stack(64, 8, bench, layers=2, rounds=1, log=lambda line: None,
                         kinds=("residual", "mhc_kernels", "residual_compiled", "mhc_kernels_compiled"))
    assert out["errors"] == {}
    assert profiled == [(out["steps_per_timing"]["mhc_kernels"], {"forward:mhc_kernels", "pre:kernels"}),
                        (out["steps_per_timing"]["mhc_kernels_compiled"],
                         {"compiled:default", "forward:mhc_kernels", "pre:kernels"})]
    for key in ("host", "host_compiled"):
        assert out[key]["steps"] == out["steps_per_timing"][bs.HOST_PROFILES[key]] and out[key]["own_us"] > 0
    assert validate(_stack_section([out]), TRAINING_STACK) == []
    assert compiled_with == {"residual": [{"mode": "default"}], "mhc_kernels": [{"mode": "default"}]}
    compiled_with.clear()
    bs.stack_step(64, 8, "mhc_kernels_reduce_overhead", layers=2)
    assert compiled_with == {"mhc_kernels": [{"mode": "reduce-overhead"}]}


def test_compiled_stack_kinds_name_their_mode_and_are_compared_with_the_plain_residual_run_alike():
    assert bs.compile_mode("mhc_kernels_reduce_overhead") == ("mhc_kernels", "reduce-overhead")
    assert bs.compile_mode("residual_compiled") == ("residual", "default")
    assert bs.compile_mode("mhc_tilekernels") == ("mhc_tilekernels", None)
    assert bs.compile_mode("mhc_tilekernels_compiled") == ("mhc_tilekernels_compiled", None)  # not a kind
    assert set(bs.COMPILED_KINDS) <= set(bs.ALL_KINDS) and not set(bs.COMPILED_KINDS) & set(bs.STACK_KINDS)
    measured = {"residual": 1.0, "residual_compiled": 1.0, "mhc_kernels_compiled": 2.0}
    assert bs.plain_of("mhc_kernels_compiled", measured) == "residual_compiled"
    assert bs.plain_of("mhc_kernels_reduce_overhead", measured) == "residual"  # its own plain kind not measured
    assert bs.plain_of("mhc_kernels", measured) == "residual"
