"""The training benchmark's part 'deepseek_v4' (mhc_lab.bench.deepseek_v4) end to end on the CPU: a tiny random
DeepSeek-V4 from transformers in float32, one training step and the forward of it as transformers runs it and
under use_mhc_lab, recorded as a section that matches its schema; the two losses agree to float32 rounding. Also
what lab 08's section 7 prints from such a section (mhc_lab.course.deepseek_v4)."""

import json

import pytest
import torch

pytest.importorskip("transformers.models.deepseek_v4", reason="transformers with DeepSeek-V4 is not installed "
                    "(the optional extra: pip install 'mhc-lab[transformers]')")

from mhc_lab.bench import deepseek_v4 as dsv4  # noqa: E402
from mhc_lab.bench import training  # noqa: E402
from mhc_lab.measure.schemas import DEEPSEEK_V4_KINDS, DEEPSEEK_V4_PASSES, validate_recording  # noqa: E402


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    """training.main --parts deepseek_v4 on the CPU (its tiny default shape, two rounds), saved to a folder."""
    out = tmp_path_factory.mktemp("deepseek_v4")
    argv = ["--parts", "deepseek_v4", "--device", "cpu", "--deepseek-v4-rounds", "2", "--out", str(out)]
    assert training.main(argv) == 0
    return argv, json.loads((out / f"{training.RECORDING}.json").read_text())


def test_the_part_runs_on_the_cpu_and_its_section_matches_the_schema(recorded):
    argv, recording = recorded
    assert validate_recording(recording, training.RECORDING) == []
    assert list(recording["results"]) == ["deepseek_v4"]
    part = recording["results"]["deepseek_v4"]
    assert part["command"] == "python -m mhc_lab.bench training " + " ".join(argv) and "partial" not in part
    assert part["environment"]["gpu"] is None and part["device"] == "cpu"
    assert (part["timer"], part["loss"], part["backend"]) == (dsv4.TIMER, dsv4.LOSS, "auto")
    [shape] = part["shapes"]
    assert (shape["tokens"], shape["hidden"]) == dsv4.CPU_SHAPES[0]
    assert (shape["layers"], shape["n"], shape["dtype"], shape["rounds"]) == (dsv4.LAYERS, 4, "float32", 2)
    assert shape["config"]["layer_types"][:3] == ["sliding_attention", "compressed_sparse_attention",
                                                  "heavily_compressed_attention"]
    assert shape["config"]["mlp_layer_types"][0] == "hash_moe" and shape["errors"] == {}
    for kind in DEEPSEEK_V4_KINDS:
        assert set(shape["time_ms"][kind]) == set(DEEPSEEK_V4_PASSES)
        assert all(len(times) == 2 and min(times) > 0 for times in shape["rounds_ms"][kind].values())
    for name in DEEPSEEK_V4_PASSES:
        ratio = shape["patched_over_unpatched"][name]
        assert len(ratio["ratios"]) == 2 and ratio["least"] <= ratio["median"] <= ratio["most"]
    assert shape["peak_memory_mib"] is None and shape["allocated_before_mib"] is None
    assert "CPU" in shape["peak_memory_note"]


def test_patched_and_unpatched_losses_and_gradients_agree_in_float32(recorded):
    _, recording = recorded
    [shape] = recording["results"]["deepseek_v4"]["shapes"]
    loss = shape["loss"]
    assert loss["difference"] == loss["patched"] - loss["unpatched"]
    assert loss["rel_difference"] <= 1e-5, loss
    assert shape["grad_rel_diff"] <= 1e-5, shape["grad_rel_diff"]
    assert shape["worst_grad"]["rel_diff"] <= 1e-4, shape["worst_grad"]


def test_the_model_is_deepseek_v4_with_its_coefficients_away_from_their_start():
    config = dsv4.model_config(64, 4, 32)
    model = dsv4.random_model(config, seed=3)
    hc = model.model.layers[2].ffn_hc
    assert hc.fn.dtype == torch.float32 and hc.fn.shape == (24, 4 * 64)
    assert hc.base.abs().min() > 0 and len(set(hc.scale.tolist())) == 3
    table = model.model.layers[0].mlp.gate.tid2eid
    assert table.shape == (config.vocab_size, dsv4.EXPERTS_PER_TOKEN)
    assert all(len(set(row)) == len(row) for row in table.tolist()), "a token routed twice to one expert"
    assert len(set(table.flatten().tolist())) == dsv4.EXPERTS
    again = dsv4.random_model(config, seed=3)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), again.parameters()))


def test_peak_memory_is_read_around_each_pass(monkeypatch):
    """_memory on CUDA (its counters stood in for): the gradients dropped, the peak counter reset, the pass run,
    then what was allocated before it and the peak, in MiB."""
    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: calls.append("sync"))
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: calls.append("reset"))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 3 * 2**20)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 10 * 2**20)
    model = torch.nn.Linear(2, 2)
    model(torch.ones(1, 2)).sum().backward()
    before, peak = dsv4._memory(model, lambda fn: fn(), lambda: calls.append("pass"), torch.device("cuda"))
    assert (before, peak) == (3.0, 10.0) and model.weight.grad is None
    assert calls == ["sync", "reset", "pass", "sync"]


def test_the_part_refuses_what_it_cannot_run(monkeypatch, capsys, tmp_path):
    with pytest.raises(SystemExit):
        training.main(["--parts", "deepseek_v4", "--device", "cpu"])  # into the H200's recording
    assert "a run on the CPU is not recorded in mhc_lab/recorded/training_h200.json" in capsys.readouterr().err
    for shapes in ("32x60", "4x64", "32"):
        with pytest.raises(SystemExit):
            training.main(["--parts", "deepseek_v4", "--deepseek-v4-shapes", shapes, "--no-save"])
        assert "--deepseek-v4-shapes: expected" in capsys.readouterr().err
    assert training.main(["--parts", "deepseek_v4", "--device", "cuda", "--no-save"]) == 1
    assert "bench training needs a CUDA GPU" in capsys.readouterr().out
    monkeypatch.setattr(training.torch.cuda, "is_available", lambda: True)
    with pytest.raises(SystemExit):
        training.main(["--parts", "stack,deepseek_v4", "--device", "cpu", "--out", str(tmp_path)])
    assert "--device cpu: only part deepseek_v4 runs on a CPU" in capsys.readouterr().err


def test_lab_08_shows_a_recorded_section(recorded):
    from mhc_lab.course import deepseek_v4 as lab

    _, recording = recorded
    note = lab.timing_note({"training": recording})
    assert note.startswith("Timing needs a CUDA GPU") and "made by `python -m mhc_lab.bench training" in note
    table = lab.timing_table(recording["results"]["deepseek_v4"]["shapes"][0])
    assert [line.split()[0] for line in table.splitlines()[2:5]] == ["training", "forward", "forward"]
    assert "peak GiB" not in table and "loss: transformers" in table
    assert "holds no such part yet" in lab.timing_note({"training": {"results": {}}})
