"""Grading against a learner who would rather not do the work: forging the result and killing the grader's worker,
hunting for the hidden checks (job files, the folders above, the environment) and deleting them, answering with
the library's own functions (imported, wrapped, taken from the check registry), replacing the checks and the
grader inside the kernel, replacing the kernel's side of the grading channel, relative, missing and empty
hidden-check folders, 100 MB of output, a notebook that never ends. Each one scores zero or is flagged; the
honest solution still scores full marks and the lab's stubs zero.

One `grade` run over a folder of small lab 00 notebooks (the smallest lab) with a private copy of the hidden
checks, one run through the command line with a relative --hidden, one with --no-hidden; the rest needs no kernel.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import nbformat
import pytest

from mhc_lab.classroom.cli import main
from mhc_lab.classroom.grading import format_report, grade_paths
from mhc_lab.classroom.grading_worker import OutputCaps
from mhc_lab.classroom.hidden_checks import HIDDEN_DIR, HiddenChecksError, read_hidden, sources_digest
from mhc_lab.classroom.notebook_build import LABS_DIR, SOLUTIONS_DIR
from test_grading import _edit

LAB = "00_setup.ipynb"
SETUP = "cfg = setup(SIZE, DEVICE, SEED)"
# Short limits: lab 00 grades in under 10 s alone (and in 100 s on two cores shared by ten busy processes); the
# endless notebook costs NOTEBOOK_TIMEOUT.
NOTEBOOK_TIMEOUT, CELL_TIMEOUT, CHECK_TIMEOUT = 240, 60, 20
HIDDEN_NAMES = {"every dtype, not only the floating ones", "zero, one and more than 2**32 elements"}

FAKE = [{"id": i, "title": "", "status": "passed", "score": 1.0, "checks": [], "message": ""}
        for i in ("0.1", "0.2", "0.3")]

MARKER = "<<mhc-lab-grade>>"  # how a result was once printed by the grader's cell in the learner's kernel

FORGE_AND_KILL = f"""
import json, os, pathlib, signal
fake = {{"status": "graded", "exercises": {json.dumps(FAKE)}}}
here = pathlib.Path.cwd()
job = here.parent / "job.json"
print("job.json beside the work folder:", job.exists())
if job.exists():  # how the result could be forged before: the path of the worker's result file is in job.json
    pathlib.Path(json.loads(job.read_text())["result"]).write_text(json.dumps(fake))
(here / "result.json").write_text(json.dumps(fake))
print({MARKER!r} + json.dumps({{"variant": {{}}, "exercises": fake["exercises"]}}))
for fd in (1, 2):  # straight to the descriptors the kernel inherited from the worker
    os.write(fd, ({MARKER!r} + json.dumps(fake) + "\\n").encode())
os.kill(os.getppid(), signal.SIGKILL)  # the worker, before it writes anything of its own
"""

HUNT = f"""
import json, os, pathlib, shutil
found = []
here = pathlib.Path.cwd()
print("work folder holds:", sorted(p.name for p in here.iterdir()))
for folder in [here, *here.parents]:
    for name in ("job.json", "result.json", "progress.json", "report.json", "executed"):
        if (folder / name).exists():
            found.append(str(folder / name))
    try:
        job = json.loads((folder / "job.json").read_text())
    except Exception:
        job = {{}}
    for key in ("hidden_dir", "hidden"):
        if isinstance(job.get(key), str) and os.path.isdir(job[key]):
            found.append(job[key])
            shutil.rmtree(job[key], ignore_errors=True)
    for path in folder.glob("*/lab0*.py"):  # a folder of hidden checks beside one of those above
        if "hidden" in path.parent.name:
            found.append(str(path))
            path.unlink()
for key, value in os.environ.items():
    if "hidden" in value.lower() and os.path.exists(value):
        found.append(f"{{key}}={{value}}")
    if key in ("PWD", "OLDPWD") and value != str(here):  # the grader's own folders, as the shell names them
        found.append(f"{{key}}={{value}}")
    if "pytest-of" in value:  # where this test keeps the hidden checks, the submissions and the report
        found.append(f"{{key}}={{value}}")
print("FOUND:", found)
print({MARKER!r} + json.dumps({{"variant": {{}}, "exercises": {json.dumps(FAKE)}}}))
os.write(1, ({MARKER!r} + json.dumps({json.dumps(FAKE)}) + "\\n").encode())
"""

# Each exercise of lab 00 answered by the library: imported under the lab's name, wrapped in a function of the
# learner's, and found through the check registry.
LIBRARY = {
    'check("0.1", bytes_moved_by_copy)':
        "from mhc_lab.measure.roofline import copy_bytes as bytes_moved_by_copy",
    'check("0.2", gigabytes_per_second)':
        "from mhc_lab.measure import timing\n"
        "def gigabytes_per_second(nbytes, seconds):\n    return timing.gigabytes_per_second(nbytes, seconds)",
    'check("0.3", matmul_intensity)':
        "from mhc_lab.course.checks import get_exercise\n"
        "matmul_intensity = getattr(get_exercise('0.3'), 'solution', None) or get_exercise('0.3').library_function()",
}

# The checks and the grader replaced inside the learner's kernel, before the stubs are checked: a verdict computed
# there would be a pass; the grader computes its verdicts in its own process.
PATCH_THE_GRADER = """
import mhc_lab.course.checks as checks
import mhc_lab.classroom.grading_worker as worker
import mhc_lab.classroom.hidden_checks as hidden_checks
always = lambda *args, **kwargs: ["passed"]
checks.run_check = always
for exercise in checks.all_exercises():
    exercise.checker = always
worker.grade_answer = lambda exercise_id, answer, **kw: {"id": exercise_id, "status": "passed", "score": 1.0,
                                                         "checks": [], "message": ""}
hidden_checks.generic_checks = lambda *args, **kwargs: []
check = lambda *args, **kwargs: print("passed")
"""

# The kernel's side of the grading channel replaced: every request answered with the library's values, the
# watch for library calls bypassed. The values are right, so the verdicts pass: the submission must be flagged.
REPLACE_THE_CHANNEL = """
import base64, io, pickle, torch
from IPython.display import publish_display_data
import mhc_lab.classroom.grading_kernel as channel
from mhc_lab.measure import roofline, timing
answers = {"bytes_moved_by_copy": roofline.copy_bytes, "gigabytes_per_second": timing.gigabytes_per_second,
           "matmul_intensity": roofline.matmul_intensity}
def serve(text):
    request = pickle.loads(base64.b64decode(text))
    target = request["target"]
    if request["kind"] == "describe":
        value = {channel.HANDLE: 1, "type": "function", "callable": True}
    else:
        name = target.name
        value = answers[name](*request["args"], **request["kwargs"])
    buffer = io.BytesIO()
    torch.save({"value": value, "library": [], "arguments": []}, buffer)
    publish_display_data({channel.RESULT_MIME: base64.b64encode(buffer.getvalue()).decode()})
channel.serve = serve
"""

# Run only when the grader calls (its channel's cell names `_mhc_lab_serve` in the notebook): 0.1 exits, 0.2 ends
# its kernel, 0.3 is the solution's. A crash or an exit in one exercise costs that exercise only.
EXITS = """
import os, sys
_bytes, _rate = bytes_moved_by_copy, gigabytes_per_second
def bytes_moved_by_copy(numel, dtype):
    if "_mhc_lab_serve" in globals():
        sys.exit(0)
    return _bytes(numel, dtype)
def gigabytes_per_second(nbytes, seconds):
    if "_mhc_lab_serve" in globals():
        os._exit(1)
    return _rate(nbytes, seconds)
"""

# A notebook that found the hidden checks (as if it had searched the disk) and sends their text back in its
# exceptions: while graded (0.1), and from a cell of its own. Its feedback must not carry them.
LEAK = """
import pathlib
_secret = "\\n".join(p.read_text() for p in sorted(pathlib.Path({folder!r}).glob("lab*.py")))
def bytes_moved_by_copy(numel, dtype):
    raise ValueError(_secret[_secret.index("@hidden"):])
raise RuntimeError(_secret[_secret.index("@hidden"):][:250])
"""

# A cell that asks for 16 GiB: the kernel's address space is limited (8 GiB by default), so the allocation
# fails in that cell and the grader goes on.
HUNGRY = """
import resource
print("address space limit:", resource.getrlimit(resource.RLIMIT_AS))
hoard = torch.empty(2**34, dtype=torch.uint8)
print("allocated 16 GiB")
"""

ENDLESS = """
print("reached the endless loop")
import signal, time
signal.signal(signal.SIGINT, signal.SIG_IGN)
while True:
    time.sleep(0.05)
"""


def _with_cell(source: Path, code: str, target: Path) -> Path:
    nb = _edit(nbformat.read(source, as_version=4), SETUP, SETUP + "\n" + code.strip())
    nbformat.write(nb, target)
    return target


def _rows(report, folder):
    return {Path(r["submission"]).relative_to(folder).as_posix(): r for r in report["submissions"]}


@pytest.fixture(scope="module")
def private_hidden(tmp_path_factory):
    folder = tmp_path_factory.mktemp("private") / "hidden_checks"
    shutil.copytree(HIDDEN_DIR, folder, ignore=shutil.ignore_patterns("__pycache__"))
    return folder


@pytest.fixture(scope="module")
def attacked(tmp_path_factory, private_hidden):
    folder = tmp_path_factory.mktemp("attacks")
    digest = sources_digest(read_hidden(private_hidden))
    _with_cell(LABS_DIR / LAB, HUNT, folder / "a_hunt_00_setup.ipynb")
    _with_cell(LABS_DIR / LAB, FORGE_AND_KILL, folder / "b_forge_00_setup.ipynb")
    _with_cell(SOLUTIONS_DIR / LAB, 'print("x" * 100_000_000)', folder / "c_loud_00_setup.ipynb")
    _with_cell(SOLUTIONS_DIR / LAB, ENDLESS, folder / "d_endless_00_setup.ipynb")
    shutil.copy(LABS_DIR / LAB, folder / "e_stub_00_setup.ipynb")
    nb = nbformat.read(LABS_DIR / LAB, as_version=4)
    for check_cell, cheat in LIBRARY.items():
        nb = _edit(nb, check_cell, cheat + "\n" + check_cell)
    nbformat.write(nb, folder / "g_library_00_setup.ipynb")
    _with_cell(LABS_DIR / LAB, PATCH_THE_GRADER, folder / "h_patch_00_setup.ipynb")
    _with_cell(LABS_DIR / LAB, REPLACE_THE_CHANNEL, folder / "i_channel_00_setup.ipynb")
    shutil.copy(SOLUTIONS_DIR / LAB, folder / "f_honest_00_setup.ipynb")
    nb = _edit(nbformat.read(SOLUTIONS_DIR / LAB, as_version=4), 'check("0.3", matmul_intensity)',
               EXITS + '\ncheck("0.3", matmul_intensity)')
    nbformat.write(nb, folder / "j_exits_00_setup.ipynb")
    nb = _edit(nbformat.read(SOLUTIONS_DIR / LAB, as_version=4), 'check("0.2", gigabytes_per_second)',
               LEAK.format(folder=str(private_hidden)) + '\ncheck("0.2", gigabytes_per_second)')
    nbformat.write(nb, folder / "k_leak_00_setup.ipynb")
    _with_cell(SOLUTIONS_DIR / LAB, HUNGRY, folder / "l_hungry_00_setup.ipynb")
    out = tmp_path_factory.mktemp("graded")
    report = grade_paths([folder], allow_root=True, out_dir=out, timeout=NOTEBOOK_TIMEOUT, cell_timeout=CELL_TIMEOUT,
                         check_timeout=CHECK_TIMEOUT, hidden_dir=private_hidden, jobs=2, log=None)
    return {"report": report, "rows": _rows(report, folder), "out": out, "digest": digest}


def _executed(row) -> str:
    assert row["executed"] and Path(row["executed"]).exists(), row
    return Path(row["executed"]).read_text()


@pytest.mark.notebooks
def test_honest_solution_scores_full_marks_and_the_stub_zero(attacked):
    honest = attacked["rows"][f"f_honest_{LAB}"]
    assert honest["status"] == "graded" and honest["score"] == honest["max_score"] == 3, format_report(
        {"submissions": [honest]})
    assert not honest.get("flags") and not honest.get("warnings")
    assert HIDDEN_NAMES <= {c["name"] for e in honest["exercises"] for c in e["checks"]}
    stub = attacked["rows"][f"e_stub_{LAB}"]
    assert stub["status"] == "graded" and stub["score"] == 0
    assert all(e["status"] == "not done" for e in stub["exercises"])


@pytest.mark.notebooks
def test_answers_from_the_library_score_zero(attacked):
    row = attacked["rows"][f"g_library_{LAB}"]
    assert row["status"] == "graded" and row["score"] == 0, format_report({"submissions": [row]})
    assert [e["status"] for e in row["exercises"]] == ["uses the library"] * 3
    assert "calls `mhc_lab.measure.roofline.copy_bytes`, the library's own answer" in row["exercises"][0]["message"]
    assert "flagged for review" in " ".join(row.get("warnings", []))  # the registry, reached from the notebook


@pytest.mark.notebooks
def test_patching_the_checks_and_the_grader_in_the_kernel_changes_nothing(attacked):
    row = attacked["rows"][f"h_patch_{LAB}"]
    assert row["status"] == "graded" and row["score"] == 0, format_report({"submissions": [row]})
    assert all(e["status"] == "not done" for e in row["exercises"])
    assert "flagged for review" in " ".join(row.get("warnings", []))


@pytest.mark.notebooks
def test_replacing_the_kernel_side_of_the_channel_is_flagged(attacked):
    row = attacked["rows"][f"i_channel_{LAB}"]
    flags = row.get("flags") or []
    assert any("reaches into the grader" in f["what"] for f in flags), row
    assert any("intercepts the kernel's messages" in f["what"] for f in flags), row
    assert "flagged for review: cell 3" in " ".join(row.get("warnings", [])), row.get("warnings")
    assert "flagged for review" in format_report(attacked["report"])


@pytest.mark.notebooks
def test_a_forged_result_and_a_killed_worker_score_zero(attacked):
    row = attacked["rows"][f"b_forge_{LAB}"]
    assert row["status"] == "killed" and row["score"] == 0, row
    assert "SIGKILL" in row["detail"] and "cell 3" in row["detail"]
    assert all(e["score"] == 0 and e["status"] == "killed" for e in row["exercises"])
    nb = nbformat.reads(_executed(row), as_version=4)  # the notebook as far as it got is kept
    assert any("os.kill(os.getppid()" in c.source for c in nb.cells)


@pytest.mark.notebooks
def test_hunting_for_the_hidden_checks_finds_nothing_and_they_stay(attacked, private_hidden):
    row = attacked["rows"][f"a_hunt_{LAB}"]
    assert row["status"] == "graded" and row["score"] == 0, row  # the printed fake result counts for nothing
    text = _executed(row)
    hunt = [c for c in nbformat.reads(text, as_version=4).cells if "work folder holds" in c.source]
    assert "work folder holds: []" in text and "FOUND: []" in text, [c.get("outputs") for c in hunt]
    assert sources_digest(read_hidden(private_hidden)) == attacked["digest"]
    assert not [w for w in attacked["report"]["warnings"] if "(--allow-root)" not in w]  # that one: run as root
    assert str(private_hidden) not in "".join(Path(r["executed"]).read_text() for r in attacked["rows"].values()
                                              if r.get("executed") and "k_leak" not in r["submission"])  # it knows


@pytest.mark.notebooks
def test_100_megabytes_of_output_are_capped_and_flagged(attacked):
    row = attacked["rows"][f"c_loud_{LAB}"]
    assert row["status"] == "graded" and row["score"] == 3, row.get("detail")
    assert row["output_capped"] and row["output_capped"][0]["cap"] == "per-cell", row.get("output_capped")
    assert row["output_capped"][0]["produced_chars"] >= 100_000_000
    assert any("output capped" in w for w in row["warnings"])
    assert Path(row["executed"]).stat().st_size < 2_500_000
    assert "[output capped by the grader" in _executed(row)
    assert "output capped" in format_report(attacked["report"])


@pytest.mark.notebooks
def test_an_exit_or_a_dead_kernel_in_one_exercise_costs_that_exercise_only(attacked):
    row = attacked["rows"][f"j_exits_{LAB}"]
    assert row["status"] == "graded", row
    by_id = {e["id"]: e for e in row["exercises"]}
    assert by_id["0.1"]["score"] == 0 and "SystemExit" in by_id["0.1"]["message"], by_id["0.1"]
    assert by_id["0.2"]["status"] == "crashed" and by_id["0.2"]["score"] == 0, by_id["0.2"]
    assert "kernel died while `gigabytes_per_second`" in by_id["0.2"]["message"]
    assert by_id["0.3"]["score"] == 1 and row["score"] == 1, format_report({"submissions": [row]})


@pytest.mark.notebooks
def test_the_hidden_checks_raised_back_by_a_notebook_never_reach_its_feedback(attacked, private_hidden):
    from mhc_lab.classroom.report import SHINGLE, _code_pieces

    row = attacked["rows"][f"k_leak_{LAB}"]
    assert row["status"] == "graded" and row["score"] == 2, format_report({"submissions": [row]})
    feedback = "".join(Path(row["feedback"]).read_text().split())
    pieces = [piece for text in read_hidden(private_hidden).values() for piece in _code_pieces(text)]
    leaked = [piece[i:i + SHINGLE] for piece in pieces for i in range(0, len(piece) - SHINGLE + 1, 8)
              if piece[i:i + SHINGLE] in feedback]
    assert not leaked, leaked[:5]
    assert "left out: this text repeats the grader's hidden checks" in Path(row["feedback"]).read_text()
    assert "@hidden(" in json.dumps(row)  # the instructor's report keeps what the notebook raised


@pytest.mark.notebooks
def test_a_kernel_that_asks_for_too_much_memory_is_refused_and_the_rest_graded(attacked):
    row = attacked["rows"][f"l_hungry_{LAB}"]
    assert row["status"] == "graded" and row["score"] == 3, format_report({"submissions": [row]})
    cell = next(c for c in nbformat.reads(_executed(row), as_version=4).cells if "hoard" in c.source)
    printed = "".join(o.get("text", "") for o in cell.outputs)
    assert f"address space limit: ({8 * 2**30}, {8 * 2**30})" in printed and "allocated 16 GiB" not in printed
    assert any(e["ename"] in ("RuntimeError", "MemoryError") and "allocate" in e["evalue"]
               for e in row["cell_errors"]), row["cell_errors"]


@pytest.mark.notebooks
def test_a_notebook_that_never_ends_is_timed_out_and_its_partial_notebook_kept(attacked):
    row = attacked["rows"][f"d_endless_{LAB}"]
    assert row["status"] == "timed out" and row["score"] == 0, row
    assert "in cell 3" in row["detail"]
    nb = nbformat.reads(_executed(row), as_version=4)
    texts = ["".join(o.get("text", "") for o in c.get("outputs", [])) for c in nb.cells if c.cell_type == "code"]
    assert any("reached the endless loop" in t for t in texts), texts[:5]
    assert not any("The grader's cell ran here" in c.source for c in nb.cells)


# ---- hidden-check folders: relative, deleted mid-run, missing, empty, without the lab, --no-hidden --------------


@pytest.mark.notebooks
def test_relative_hidden_folder_is_used_and_a_deleted_one_still_grades_the_rest(tmp_path, monkeypatch, capsys):
    """Through the command line from another folder, with --hidden relative: a submission that knows where the
    hidden checks are (as if it had searched the disk) deletes them; the next one is graded with them all the same,
    the report warns, and the next run refuses the emptied folder."""
    hidden = tmp_path / "private_hidden"
    shutil.copytree(HIDDEN_DIR, hidden, ignore=shutil.ignore_patterns("__pycache__"))
    subs = tmp_path / "subs"
    subs.mkdir()
    _with_cell(LABS_DIR / LAB, f"import shutil\nshutil.rmtree({str(hidden)!r})", subs / "a_delete_00_setup.ipynb")
    shutil.copy(SOLUTIONS_DIR / LAB, subs / "b_honest_00_setup.ipynb")
    monkeypatch.chdir(tmp_path)
    code = main(["grade", "--allow-root", "subs", "--hidden", "private_hidden", "--out", "out", "--json", "report.json",
                 "--timeout", "120", "--cell-timeout", "30", "--check-timeout", str(CHECK_TIMEOUT)])
    assert code == 0
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["settings"]["hidden_checks"] == str(hidden)
    rows = _rows(report, subs)
    deleter, honest = rows[f"a_delete_{LAB}"], rows[f"b_honest_{LAB}"]
    assert deleter["score"] == 0 and not hidden.exists()
    assert honest["score"] == 3 and HIDDEN_NAMES <= {c["name"] for e in honest["exercises"] for c in e["checks"]}
    assert any("changed on disk while grading" in w for w in report["warnings"])
    captured = capsys.readouterr()
    assert "changed on disk while grading" in captured.out
    assert f"hidden checks: {hidden}" in captured.err  # the folder used, as the instructor typed it, made absolute
    assert main(["grade", "--allow-root", "subs", "--hidden", "private_hidden", "--out", "out"]) == 2
    assert f"hidden checks folder {hidden}" in capsys.readouterr().err


def test_missing_empty_or_unrelated_hidden_folders_are_errors(tmp_path, capsys):
    submission = tmp_path / LAB
    shutil.copy(SOLUTIONS_DIR / LAB, submission)
    out = tmp_path / "out"
    assert main(["grade", "--allow-root", str(submission), "--hidden", str(tmp_path / "nowhere"), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"hidden checks folder {tmp_path / 'nowhere'}" in err and "found nothing there" in err
    (tmp_path / "empty").mkdir()
    assert main(["grade", "--allow-root", str(submission), "--hidden", str(tmp_path / "empty"), "--out", str(out)]) == 2
    assert "expected lab*.py files, found none" in capsys.readouterr().err
    (tmp_path / "other").mkdir()
    shutil.copy(HIDDEN_DIR / "lab01.py", tmp_path / "other" / "lab01.py")
    assert main(["grade", "--allow-root", str(submission), "--hidden", str(tmp_path / "other"), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path / 'other'}: expected checks for lab {LAB}" in err and "--no-hidden" in err
    assert main(["grade", "--allow-root", str(submission), "--hidden", str(tmp_path / "other"), "--no-hidden"]) == 2
    assert not out.exists(), "nothing may run before the hidden checks are found good"
    with pytest.raises(HiddenChecksError, match="found nothing there"):
        grade_paths([submission], allow_root=True, out_dir=out, hidden_dir=tmp_path / "nowhere", log=None)


@pytest.mark.notebooks
def test_no_hidden_grades_with_the_visible_checks_only_and_says_so(tmp_path, capsys):
    shutil.copy(SOLUTIONS_DIR / LAB, tmp_path / LAB)
    code = main(["grade", "--allow-root", str(tmp_path / LAB), "--no-hidden", "--out", str(tmp_path / "out"), "--timeout", "120"])
    assert code == 0
    captured = capsys.readouterr()
    assert "visible checks only" in captured.out and "--no-hidden" in captured.err
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["settings"]["checks"] == "visible only (--no-hidden)" and report["settings"]["hidden_checks"] is None
    assert "the visible checks only" in Path(report["submissions"][0]["feedback"]).read_text()
    row = report["submissions"][0]
    assert row["score"] == 3 and all([c["name"] for c in e["checks"]] == ["visible check"] for e in row["exercises"])


# ---- output caps, without a kernel ---------------------------------------------------------------------------


def test_output_caps_per_cell_and_per_notebook():
    noted = []
    caps = OutputCaps(per_cell=100, per_notebook=250, on_cap=lambda index, record: noted.append((index, record)))
    cells = []
    for index in range(4):
        cell = nbformat.v4.new_code_cell("print('x' * 90)")
        for _ in range(3 if index == 0 else 1):  # cell 0 prints 270 characters, the others 90 each
            cell.outputs.append(nbformat.v4.new_output("stream", name="stdout", text="x" * 90))
            caps.admit(cell.outputs, index)
        caps.finish(cell, index)
        cells.append(cell)
    stored = [sum(len(o["text"]) for o in c.outputs if o["output_type"] == "stream") for c in cells]
    assert stored == [100, 90, 60, 0]
    assert [(i, r["cap"]) for i, r in noted] == [(0, "per-cell"), (2, "per-notebook"), (3, "per-notebook")]
    assert "per-cell cap of 100 characters" in cells[0].outputs[-1]["data"]["text/plain"]
    assert [o["output_type"] for o in cells[1].outputs] == ["stream"]
    caps.finish(cells[0], 0)  # finishing again changes nothing and adds no second note
    assert len(cells[0].outputs) == 3 and stored[0] == sum(len(o.get("text", "")) for o in cells[0].outputs)


# ---- the grading channel's answers, without a kernel -----------------------------------------------------------


def test_answers_travel_as_plain_data_or_handles():
    """What a learner's function returns reaches the grader as plain data (str and number subclasses made plain,
    so that torch.load(weights_only=True) opens them) or as a handle; nothing of the learner's types travels."""
    import io

    import numpy as np
    import torch

    from mhc_lab.classroom import grading_kernel

    class Sneaky(str):
        def __eq__(self, other):
            return True

    value = grading_kernel._encode((Sneaky("source"), np.float32(1.5), np.int64(3), [torch.ones(2)],
                                    {"k": torch.float32}, object()))
    buffer = io.BytesIO()
    torch.save(value, buffer)
    buffer.seek(0)
    text, number, count, tensors, mapping, handle = torch.load(buffer, weights_only=True)
    assert type(text) is str and text == "source" and text != "other"
    assert (type(number), number, type(count), count) == (float, 1.5, int, 3)
    assert torch.equal(tensors[0], torch.ones(2)) and mapping == {"k": torch.float32}
    assert handle[grading_kernel.HANDLE] >= 1 and handle["type"] == "object" and handle["callable"] is False


# ---- steering the expected value: the learner's function writes into the check's inputs ------------------------


def _zero_everything(value, depth=0) -> int:
    """Zero, in place, every tensor in ``value`` (lists, tuples, dicts, objects' attributes); returns how many."""
    import torch

    if isinstance(value, torch.Tensor):
        with torch.no_grad():
            value.zero_()
        return 1
    if depth > 6 or value is None or isinstance(value, (bool, int, float, str)):
        return 0
    if isinstance(value, (list, tuple)):
        return sum(_zero_everything(v, depth + 1) for v in value)
    if isinstance(value, dict):
        return sum(_zero_everything(v, depth + 1) for v in value.values())
    if isinstance(getattr(value, "__dict__", None), dict) and not isinstance(value, type):
        return sum(_zero_everything(v, depth + 1) for v in vars(value).values())
    return 0


def _steering(exercise):
    """The attack of a learner who read the checks: zero every input tensor in place, then answer correctly *for
    the zeroed inputs* (the library's equation under its own code object): a check that computes its expected
    value from the same tensors after the call would agree."""
    from test_checks import own_copy

    equation = own_copy(exercise.library_function())
    zeroed = [0]

    def answer(*args, **kwargs):
        zeroed[0] += _zero_everything((args, kwargs))
        return equation(*args, **kwargs)

    return answer, zeroed


STEERABLE = [e for e in __import__("mhc_lab.course.checks", fromlist=["all_exercises"]).all_exercises()
             if e.library and not e.id.startswith(("5.1", "5.2", "5.3", "6.1", "6.2"))]


@pytest.mark.parametrize("exercise", STEERABLE, ids=lambda e: e.id)
def test_zeroing_the_inputs_in_place_passes_no_check(exercise):
    """A check that computed its expected value from the same tensors after calling the learner would pass this
    answer. Every check hands the learner private copies (checks.call), so whatever the learner's function writes
    into its inputs moves no expected value; and writing into them fails."""
    from mhc_lab.course.checks import CheckFailed, run_check

    answer, zeroed = _steering(exercise)
    try:
        run_check(exercise.id, answer)
    except CheckFailed as failure:
        assert zeroed[0], f"{exercise.id} failed before the attack zeroed anything: {failure}"
        return
    assert not zeroed[0], f"exercise {exercise.id}: zeroing its {zeroed[0]} input tensors in place passed the check"


def test_a_check_never_hands_the_learner_its_own_tensors():
    """checks.call: the learner's function gets copies (layers and models included); the caller's tensors are
    left as they were, and the change is named."""
    import torch

    from mhc_lab.course.checks import CheckFailed, TanhLayer, call

    x, layer = torch.ones(3), TanhLayer(torch.eye(3), torch.zeros(3))
    seen = []

    def writes(x, layer, scale=None):
        seen.append((x, layer))
        layer.weight.zero_()
        return x.mul_(0)

    with pytest.raises(CheckFailed, match=r"changed its input argument 1, argument 2\.weight in place"):
        call(writes, x, layer, scale=torch.ones(1), case="three ones")
    assert torch.equal(x, torch.ones(3)) and torch.equal(layer.weight, torch.eye(3))
    assert seen[0][0] is not x and seen[0][1] is not layer
    with pytest.raises(CheckFailed, match=r"changed its input `scale` in place"):
        call(lambda x, scale: scale.add_(1), x, scale=torch.ones(1), case="a scale")
    leaf = torch.ones(2, requires_grad=True)
    assert call(lambda t: t.requires_grad, leaf, case="a leaf") is True


# ---- running as root: the kernels as users of their own, or no grading without --allow-root --------------------


def test_as_root_without_a_user_to_drop_to_grading_refuses_unless_allowed(tmp_path, monkeypatch, capsys):
    """As root, a notebook that runs as root can read the worker's pipe (its token) and forge its result, and a
    classmate's with --jobs 2. Where no unprivileged user can run the course's Python, grade refuses."""
    from mhc_lab.classroom import grading, sandbox

    monkeypatch.setattr(grading.os, "geteuid", lambda: 0)
    monkeypatch.setattr(sandbox, "can_drop_to_another_user", lambda env=None: "Permission denied: python")
    shutil.copy(SOLUTIONS_DIR / LAB, tmp_path / LAB)
    assert main(["grade", str(tmp_path / LAB), "--no-hidden", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "running as root" in err and "--allow-root" in err and "Permission denied: python" in err
    assert not (tmp_path / "out").exists()
    box, who, warnings = grading.kernel_box(2**30, allow_root=True)
    assert box == {"memory": 2**30, "drop": False} and who == "root (--allow-root)"
    assert "forge its result or a classmate's" in warnings[0]
    monkeypatch.setattr(sandbox, "can_drop_to_another_user", lambda env=None: None)
    box, who, warnings = grading.kernel_box(None, allow_root=False)
    assert box == {"memory": None, "drop": True} and not warnings and "a user of their own" in who


@pytest.mark.skipif(not hasattr(__import__("os"), "geteuid") or __import__("os").geteuid() != 0,
                    reason="dropping to another user needs root")
def test_the_box_runs_the_kernel_as_a_user_of_its_own_with_limits():
    """What the kernel spec's command does before it becomes the kernel, shown on a shell instead: another user
    id and group, no other groups, the limits set, and a file closed to others unreadable."""
    import os
    import subprocess
    import sys
    import tempfile

    from mhc_lab.classroom import sandbox

    tmp_path = Path(tempfile.mkdtemp(prefix="mhc-box-"))  # under /tmp, as the worker's folder is

    secret = tmp_path / "secret.py"
    secret.write_text("the hidden checks")
    secret.chmod(0o600)
    connection = tmp_path / "kernel.json"
    connection.write_text("{}")
    connection.chmod(0o600)
    os.chmod(tmp_path, 0o711)
    uid = sandbox.kernel_uid()
    script = f"id -u; id -g; id -G; ulimit -v; ulimit -f; pwd; cat {connection} && echo readable; cat {secret} || echo closed"
    done = subprocess.run([sys.executable, "-m", "mhc_lab.classroom.sandbox", "--memory", str(2**30), "--uid",
                           str(uid), "--", "/bin/sh", "-c", script, "-f", str(connection)],
                          cwd=tmp_path, capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    lines = done.stdout.split()
    assert lines[:3] == [str(uid), str(uid), str(uid)], (done.stdout, done.stderr)
    assert lines[3] == str(2**30 // 1024) and lines[4] == str(sandbox.FILE_SIZE // 512)
    assert lines[5] == str(tmp_path / f"work-{uid}")
    assert lines[6:] == ["{}readable", "closed"] and "the hidden checks" not in done.stdout, done.stdout
    sandbox.end_processes_of(uid)
    shutil.rmtree(tmp_path)


# ---- the library's answers, however reached, while their exercise is graded (lab 03) -----------------------------

# Each cheat reaches the library's answer another way: from a thread started before grading with the watch on
# calls switched off (3.2, through sinkhorn_log_domain, which equals the paper's version), through the dispatcher
# sinkhorn() with the watch switched off (3.3), rebuilt from the code object (3.4), traced by torch.jit (3.6).
# 3.1 and 3.5 stay the solution's own (3.5 calls the library's sinkhorn, as its hint says: still allowed).
LIBRARY_TRICKS = """
import importlib, queue, sys, threading, types, torch
from mhc_lab.reference import sinkhorn_log_domain as _sld, sinkhorn as _sk, mhc_post as _mp
_skmod = importlib.import_module("mhc_lab.reference.sinkhorn")
_jobs, _done = queue.Queue(), queue.Queue()
def _helper():
    sys.setprofile(None); threading.setprofile(None)
    while True:
        args, kwargs = _jobs.get()
        try:
            _done.put(_sld(*args, **kwargs))
        except BaseException as error:
            _done.put(error)
threading.Thread(target=_helper, daemon=True).start()
def sinkhorn_paper_mine(logits, iterations=20):
    _jobs.put(((logits,), {"iterations": iterations}))
    out = _done.get()
    if isinstance(out, BaseException):
        raise out
    return out
def sinkhorn_v4_mine(logits, iterations=20, eps=1e-6):
    sys.setprofile(None); threading.setprofile(None)
    return _sk(logits, variant="deepseek_v4", iterations=iterations, eps=eps)
def sinkhorn_log_mine(logits, iterations=20):
    rebuilt = types.FunctionType(_skmod.sinkhorn_log_domain.__code__, _skmod.__dict__)
    return rebuilt(logits, iterations)
def mhc_post_mine(x, layer_out, post, res):
    return torch.jit.trace(_mp, (x, layer_out, post, res), check_trace=False)(x, layer_out, post, res)
"""


@pytest.mark.notebooks
def test_the_library_answers_are_withheld_however_they_are_reached(tmp_path, private_hidden):
    lab = "03_mhc.ipynb"
    nb = _edit(nbformat.read(SOLUTIONS_DIR / lab, as_version=4), 'check("3.6", mhc_post_mine)',
               LIBRARY_TRICKS + '\ncheck("3.6", mhc_post_mine)')
    nbformat.write(nb, tmp_path / f"tricks_{lab}")
    report = grade_paths([tmp_path / f"tricks_{lab}"], allow_root=True, out_dir=tmp_path / "out", timeout=600,
                         cell_timeout=300, check_timeout=60, hidden_dir=private_hidden, log=None)
    row = report["submissions"][0]
    by_id = {e["id"]: e for e in row["exercises"]}
    shown = format_report(report)
    assert row["status"] == "graded" and row["score"] == 2, shown
    assert by_id["3.1"]["score"] == by_id["3.5"]["score"] == 1, shown
    for exercise, name in [("3.2", "sinkhorn_log_domain"), ("3.3", "sinkhorn.sinkhorn"),
                           ("3.4", "sinkhorn_log_domain"), ("3.6", "mhc_post")]:
        assert by_id[exercise]["status"] == "uses the library", (exercise, by_id[exercise]["message"])
        assert f"{name} is withheld while exercise {exercise} is graded" in json.dumps(by_id[exercise]), exercise


def test_code_review_names_lookups_built_at_run_time():
    """Advisory flags (they do not score): the ways to reach a library function that a lab never asks for."""
    from mhc_lab.classroom.code_review import suspicious_cells

    cells = {
        "import pkgutil\nf = pkgutil.resolve_name('mhc_lab.reference:sinkhorn_' + 'paper')": "built at run time",
        "import mhc_lab.reference as r\nf = getattr(r, 'sinkhorn_' + 'paper')": "built at run time",
        "f = vars(ref)['sinkhorn_paper']": "built at run time",
        "import inspect\nexec(inspect.getsource(ref.sinkhorn_paper))": "source files",
        "import sys\nsys.path.insert(0, '/opt/course')": "source files",
        "import gc\nfns = [o for o in gc.get_objects() if callable(o)]": "withholding",
        "traced = torch.jit.trace(mhc_post, (x, f, post, res))": "torch.jit",
    }
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(code) for code in cells])
    found = suspicious_cells(nb)
    for number, (code, what) in enumerate(cells.items(), start=1):
        assert any(f["cell"] == number and what in f["what"] for f in found), (code, found)
    honest = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(
        "def sinkhorn_paper_mine(logits, iterations=20):\n    m = logits.exp()\n    return m / m.sum(-1, keepdim=True)")])
    assert not suspicious_cells(honest)


def test_each_variant_is_graded_on_fresh_inputs_of_its_own():
    """The generic hidden check re-runs the visible check on fresh random inputs drawn for the notebook's own
    variant (its SEED): two learners' graded answers are computed on other inputs."""
    from mhc_lab.classroom.hidden_checks import generic_checks, recorder
    from mhc_lab.course.checks import get_exercise, set_variant, variant
    from test_checks import own_copy

    exercise = get_exercise("3.2")
    saved = variant()
    seen = {}
    try:
        for seed in (0, 1, 2):
            set_variant(SEED=seed)
            answer, calls = recorder(own_copy(exercise.library_function()))
            fresh = next(c for c in generic_checks(exercise, answer, []) if "fresh" in c.name)
            calls.clear()
            fresh.run(answer)
            seen[seed] = calls[0][0][0]
    finally:
        set_variant(**saved)
    assert not torch_equal(seen[0], seen[1]) and not torch_equal(seen[1], seen[2])


def torch_equal(a, b) -> bool:
    import torch

    return a.shape == b.shape and bool(torch.equal(a, b))


# ---- the search for the library's answer-equivalents -------------------------------------------------------------

# The modules that compute what exercises ask for (not the ones that train, time or draw).
SEARCHED = ("mhc_lab.reference", "mhc_lab.course.birkhoff", "mhc_lab.course.depth_probe", "mhc_lab.course.gain_probe",
            "mhc_lab.course.forward_lab", "mhc_lab.course.training_lab", "mhc_lab.measure.bytes_model",
            "mhc_lab.measure.roofline", "mhc_lab.measure.profiling")


def _public_functions():
    """Every public function the library defines in the SEARCHED modules (and the modules below them)."""
    import importlib
    import inspect
    import pkgutil

    found = {}
    for root in SEARCHED:
        try:
            package = importlib.import_module(root)
        except Exception:
            continue
        names = [root] + [m.name for m in pkgutil.walk_packages(getattr(package, "__path__", []), root + ".")]
        for name in names:
            try:
                module = importlib.import_module(name)
            except Exception:
                continue
            for attribute, value in vars(module).items():
                if (not attribute.startswith("_") and inspect.isfunction(value)
                        and value.__module__ == module.__name__):
                    found[f"{module.__name__}.{attribute}"] = value
    return found


def _same_answer(got, want) -> bool:
    import torch

    if isinstance(want, torch.Tensor):
        return (isinstance(got, torch.Tensor) and got.shape == want.shape and got.dtype == want.dtype
                and bool(torch.allclose(got.double(), want.double(), rtol=1e-6, atol=1e-9, equal_nan=True)))
    if isinstance(want, (tuple, list)) and not isinstance(want, str):
        return (isinstance(got, (tuple, list)) and len(got) == len(want)
                and all(_same_answer(g, w) for g, w in zip(got, want)))
    if isinstance(want, (int, float)) and not isinstance(want, bool):
        return isinstance(got, (int, float)) and abs(float(got) - float(want)) <= 1e-9 * max(1.0, abs(float(want)))
    return False


def _expire(signum, frame):
    raise TimeoutError


def _within(seconds: float, fn) -> bool:
    """fn() is true within ``seconds`` (anything it raises, Withheld and a timeout included: false)."""
    import signal

    try:
        try:
            signal.setitimer(signal.ITIMER_REAL, seconds)
            return bool(fn())
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
    except BaseException:
        return False


def test_every_answer_equivalent_in_the_library_is_withheld_while_its_exercise_is_graded():
    """Search: each public library function that, called on an exercise's check inputs (its positional arguments
    in six orders), returns the reference's answer on every input tried, must be withheld while that exercise is
    graded: listed in withheld.ANSWERS, or calling one that is."""
    import inspect
    import itertools
    import signal

    from mhc_lab.classroom import withheld
    from mhc_lab.classroom.hidden_checks import _clone, recorder
    from mhc_lab.course.checks import all_exercises
    from test_checks import own_copy

    candidates = _public_functions()
    withheld.record(candidates)

    previous = signal.signal(signal.SIGALRM, _expire)
    reachable = []
    try:
        for exercise in all_exercises():
            if not exercise.library or exercise.id.startswith(("5.", "6.1", "6.2")):
                continue  # tile-program factories: their answers are programs, not values
            answer, calls = recorder(own_copy(exercise.library_function()))
            try:
                exercise.checker(answer)
            except Exception:
                continue
            calls = calls[:2]
            wanted = [own_copy(exercise.library_function())(*_clone(a), **_clone(k)) for a, k in calls]
            names = set(withheld.withheld_names(exercise.id, exercise.library))
            for dotted, function in candidates.items():
                if dotted in names:
                    continue
                try:
                    inspect.signature(function).bind(*calls[0][0], **calls[0][1])
                except (TypeError, ValueError):
                    continue
                orders = list(itertools.permutations(range(len(calls[0][0]))))[:6]
                for order in orders:
                    def same(function=function, order=order):
                        return all(_same_answer(function(*[_clone(a)[i] for i in order], **_clone(k)), want)
                                   for (a, k), want in zip(calls, wanted))

                    if not _within(1, same):
                        continue

                    def reached(function=function, order=order, a=calls[0][0], k=calls[0][1]):
                        with withheld.withholding(sorted(names), exercise.id):
                            function(*[_clone(a)[i] for i in order], **_clone(k))
                        return True

                    if _within(10, reached):
                        reachable.append(f"{exercise.id}: {dotted} (arguments in order {order})")
                    break
    finally:
        signal.signal(signal.SIGALRM, previous)
        withheld._give_back()
    assert not reachable, "answer-equivalents a graded run can still reach:\n" + "\n".join(reachable)
