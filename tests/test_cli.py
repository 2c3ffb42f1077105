"""The `mhc-lab` command line: doctor, run, build, refresh-solutions, grade and variants are there; doctor says what
runs live and what replays; variants are deterministic, differ between students, and grading re-runs each
submission with the variant its author was given."""

from __future__ import annotations

import json
import subprocess
import sys

import nbformat
import pytest
import torch

from mhc_lab.classroom import doctor
from mhc_lab.classroom.cli import main
from mhc_lab.classroom.notebook_build import notebook_parameters
from mhc_lab.classroom.notebook_build import LABS_DIR, ROOT, SOLUTIONS_DIR, solution_notebooks
from mhc_lab.classroom.variants import assign, make_handout, parse_choices, student_of

SOLUTIONS = solution_notebooks(SOLUTIONS_DIR)


def _cli(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "mhc_lab.classroom.cli", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)


def test_every_command_is_there():
    result = _cli("--help")
    assert result.returncode == 0
    for command in ("doctor", "run", "build", "refresh-solutions", "grade", "variants"):
        assert command in result.stdout
    for command in ("run", "grade", "variants"):
        assert _cli(command, "--help").returncode == 0
    assert "--size" in _cli("run", "--help").stdout


def test_doctor_says_what_runs_live_and_what_replays():
    result = _cli("doctor", "--cells")
    assert result.returncode == 0, result.stderr
    text = result.stdout
    assert "torch" in text and "tilelang" in text
    assert "TileLang known answer on the CPU (C target): OK, exact" in text
    if torch.cuda.is_available():
        assert "CUDA GPU:" in text and "TileLang known answer on the GPU (CUDA): OK" in text
    else:
        assert "no CUDA GPU" in text and "GPU results are replayed from recordings" in text
        assert "TileLang known answer on the GPU (CUDA): not run, no GPU here" in text
    for path in SOLUTIONS:
        assert path.name in text
    assert "runs live" in text


def test_doctor_reads_each_cell(tmp_path):
    assert doctor.classify_cell("recording = load_recording('x')\nshow(recording)") == "replay"
    assert doctor.classify_cell('print("shown from recorded H200 measurements")') == "live"
    assert doctor.classify_cell("if cfg.on_gpu:\n    go()\nelse:\n    print('cpu')") == "gpu branch"
    assert doctor.classify_cell("dtype = torch.bfloat16 if cfg.on_gpu else torch.float32") == "live"
    assert doctor.classify_cell("kernel = tilelang.compile(f, target='c')") == "tilelang"
    assert doctor.classify_cell("x = 1", tags=["gpu-replay"]) == "replay"
    plans = doctor.lab_plan(on_gpu=False)
    assert [p["lab"] for p in plans] == [p.name for p in SOLUTIONS]
    for plan in plans:
        replayed = [c for c in plan["cells"] if c["mode"] == "replay"]
        assert plan["verdict"] == ("replays part of its GPU results" if replayed else "runs live")


def test_doctor_counts_every_cell_that_shows_a_recording_as_a_replay():
    """A code cell whose stored output (run on a CPU) starts a recording's label, "RECORDED on", shows GPU
    results this machine did not measure: the doctor must say so for that cell."""
    for path in SOLUTIONS:
        nb = nbformat.read(path, as_version=4)
        for number, cell in enumerate(nb.cells, start=1):
            if cell.cell_type != "code":
                continue
            streams = [out for out in cell.get("outputs", []) if out.get("output_type") == "stream"]
            shown = "".join(out.get("text", "") for out in streams)
            if "RECORDED on" in shown:
                mode = doctor.classify_cell(cell.source, cell.metadata.get("tags", ()))
                assert mode == "replay", f"{path.name} cell {number}: {mode}"


def test_doctor_json():
    info = json.loads(_cli("doctor", "--json", "--no-tilelang").stdout)
    assert info["versions"]["torch"] == torch.__version__
    assert {p["lab"] for p in info["labs"]} == {p.name for p in SOLUTIONS}


def test_variants_are_deterministic_and_differ(tmp_path):
    students = ["alice", "bob", "carol", "dave"]
    seeds = {s: assign(s, "00_setup.ipynb")["SEED"] for s in students}
    assert len(set(seeds.values())) == len(students)
    assert seeds == {s: assign(s, "00_setup.ipynb")["SEED"] for s in students}
    assert assign("alice", "00_setup.ipynb", secret="x") != assign("alice", "00_setup.ipynb")
    assert assign("alice", "00_setup.ipynb") != assign("alice", "01_residual.ipynb")
    assert parse_choices(["n=2,4,8", "name=a"]) == {"n": [2, 4, 8], "name": ["a"]}
    assert student_of(tmp_path / "bob" / "00_setup.ipynb", students) == "bob"
    assert student_of(tmp_path / "alice_00_setup.ipynb", students) == "alice"
    assert student_of(tmp_path / "zoe_00_setup.ipynb", students) is None

    code = main(["variants", str(LABS_DIR / "00_setup.ipynb"), "--students", *students, "--out", str(tmp_path)])
    assert code == 0
    manifest = json.loads((tmp_path / "variants.json").read_text())["labs"]["00_setup.ipynb"]
    for student in students:
        nb = nbformat.read(tmp_path / student / "00_setup.ipynb", as_version=4)
        assert notebook_parameters(nb)["SEED"] == seeds[student] == manifest["students"][student]["parameters"]["SEED"]
        assert nb.metadata["mhc_lab"]["student"] == student
    with pytest.raises(ValueError, match="has no parameter n"):
        make_handout(LABS_DIR / "00_setup.ipynb", students, tmp_path / "x", choices={"n": [2, 4]})


@pytest.mark.notebooks
def test_grade_reruns_a_submission_with_its_assigned_variant(tmp_path, capsys):
    """A student who changes SEED in the handout is graded on the SEED they were given."""
    handout = tmp_path / "handout"
    make_handout(SOLUTIONS_DIR / "00_setup.ipynb", ["alice"], handout)
    assigned = json.loads((handout / "variants.json").read_text())["labs"]["00_setup.ipynb"]
    seed = assigned["students"]["alice"]["parameters"]["SEED"]
    nb = nbformat.read(handout / "alice" / "00_setup.ipynb", as_version=4)
    for cell in nb.cells:
        if "injected-parameters" in cell.metadata.get("tags", []):
            cell.source = cell.source.replace(f"SEED = {seed}", "SEED = 1")
    submissions = tmp_path / "submissions" / "alice"
    submissions.mkdir(parents=True)
    nbformat.write(nb, submissions / "00_setup.ipynb")
    report_path = tmp_path / "report.json"
    code = main(["grade", "--allow-root", str(tmp_path / "submissions"), "--variants", str(handout / "variants.json"),
                 "--out", str(tmp_path / "out"), "--json", str(report_path), "--timeout", "300"])
    assert code == 0
    out = capsys.readouterr().out
    assert "3/3" in out and f"variant: SEED={seed}" in out
    row = json.loads(report_path.read_text())["submissions"][0]
    assert row["student"] == "alice" and row["variant"]["SEED"] == seed and row["score"] == 3


def test_grade_and_variants_take_relative_paths(tmp_path, monkeypatch):
    """Paths on the command line are made absolute before anything runs."""
    help_text = _cli("grade", "--help").stdout
    for option in ("--hidden", "--no-hidden", "--max-cell-output", "--max-output"):
        assert option in help_text
    monkeypatch.chdir(tmp_path)
    (tmp_path / "roster.txt").write_text("alice\nbob\n")
    lab = LABS_DIR / "00_setup.ipynb"
    assert main(["variants", str(lab), "--roster", "roster.txt", "--out", "handout"]) == 0
    manifest = json.loads((tmp_path / "handout" / "variants.json").read_text())
    assert set(manifest["labs"]["00_setup.ipynb"]["students"]) == {"alice", "bob"}
    assert main(["grade", "--allow-root", "nowhere", "--out", "out"]) == 2  # named in the error, and nothing written
    assert not (tmp_path / "out").exists()



def test_doctor_names_a_failed_build_of_the_cpp_ops():
    """On a GPU whose site ops (C++) did not build, the doctor says so, why, and how to mend it."""
    info = {"versions": {name: "1" for name in doctor.NEEDED}, "cuda": True, "gpu": "GPU", "compute_capability": "9.0",
            "cpu_threads": 2, "platform": "Linux", "native": "building mhc_lab's C++ site ops failed: no ninja"}
    found = doctor.problems(info)
    assert len(found) == 1 and "no ninja" in found[0]["what"] and "pip install ninja" in found[0]["fix"], found
    info["problems"], info["ready"] = found, False
    assert "the site's CUDA ops in C++ (mhc_lab/ops/native.cpp): FAILED: building" in doctor.format_report(info)
    info["native"] = ""
    assert doctor.problems(info) == [] and "native.cpp): built" in doctor.format_report(info)
