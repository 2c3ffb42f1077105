"""The instructor's workflow around grading: a lab handed out to a CSV roster with a header, submissions in the
wrong folder or the wrong student's folder, an unreadable one, the class graded, one submission regraded and
merged into the class report; the exit statuses of `grade` and `doctor`; the feedback each student gets; the
console report and report.csv; the wheel students install.

One module-scoped class of small lab 00 notebooks is graded twice (the class, then one regrade); everything else
runs without a kernel.
"""

from __future__ import annotations

import csv
import json
import os
import platform
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import nbformat
import pytest

from mhc_lab.classroom import doctor
from mhc_lab.classroom.cli import main
from mhc_lab.classroom.grading import _identity_warnings
from mhc_lab.classroom.hidden_checks import HIDDEN_DIR
from mhc_lab.classroom.notebook_build import LABS_DIR, ROOT, SOLUTIONS_DIR
from mhc_lab.classroom.report import feedback_text, format_report, reasons, write_csv
from mhc_lab.classroom.variants import RosterError, identify, read_roster, student_of
from test_grading import _edit

LAB = "00_setup.ipynb"
RIGHT, WRONG = "return nbytes / seconds / 1e9", "return nbytes / seconds / 2**30"
ROSTER = "Student ID,Name,Email\nalice,Alice A,alice@example.org\nbob,Bob B,bob@example.org\n" \
         "carol,Carol C,carol@example.org\ndave,Dave D,dave@example.org\n"


def _cli(*args, cwd=ROOT, env=None, timeout=300):
    return subprocess.run([sys.executable, "-m", "mhc_lab.classroom.cli", *map(str, args)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


# ---- rosters and identity (no kernel) -------------------------------------------------------------------------


def test_a_csv_roster_header_is_not_a_student(tmp_path, capsys):
    roster = tmp_path / "roster.csv"
    roster.write_text(ROSTER)
    notes = []
    assert read_roster(roster, notes=notes) == ["alice", "bob", "carol", "dave"]
    assert "line 1: 'Student ID,Name,Email' read as a header row" in notes[0]
    (tmp_path / "plain.txt").write_text("# section A\nalice\n\nbob  # late joiner\n")
    assert read_roster(tmp_path / "plain.txt") == ["alice", "bob"]
    (tmp_path / "ids.csv").write_text("id,name\nzoe,Zoe\n")
    assert read_roster(tmp_path / "ids.csv") == ["zoe"]
    assert read_roster(tmp_path / "ids.csv", header=False) == ["id", "zoe"]

    assert main(["variants", str(LABS_DIR / LAB), "--roster", str(roster), "--out", str(tmp_path / "handout")]) == 0
    manifest = json.loads((tmp_path / "handout" / "variants.json").read_text())
    assert list(manifest["labs"][LAB]["students"]) == ["alice", "bob", "carol", "dave"]
    assert not (tmp_path / "handout" / "Student ID").exists()
    assert "read as a header row, not a student" in capsys.readouterr().err
    # told it has no header, the header is a student with an id that cannot name a folder: a clear error
    assert main(["variants", str(LABS_DIR / LAB), "--roster", str(roster), "--roster-header", "no",
                 "--out", str(tmp_path / "h2")]) == 2
    err = capsys.readouterr().err
    assert f"roster {roster}, line 1" in err and "got 'Student ID'" in err and "Traceback" not in err


def test_a_roster_naming_a_student_twice_is_refused(tmp_path, capsys):
    roster = tmp_path / "roster.txt"
    roster.write_text("alice\nbob\nalice\n")
    with pytest.raises(RosterError, match=r"student 'alice' is named twice \(lines 1 and 3\)"):
        read_roster(roster)
    assert main(["variants", str(LABS_DIR / LAB), "--roster", str(roster), "--out", str(tmp_path / "h")]) == 2
    assert "named twice" in capsys.readouterr().err and not (tmp_path / "h").exists()
    assert main(["variants", str(LABS_DIR / LAB), "--students", "ann", "ann", "--out", str(tmp_path / "h")]) == 2
    assert "got ann twice" in capsys.readouterr().err


def test_identity_comes_from_the_path_and_is_checked_against_the_handout(tmp_path):
    students = ["alice", "bob", "carol"]

    def handed_to(student):
        nb = nbformat.v4.new_notebook()
        nb.metadata["mhc_lab"] = {"lab": LAB, "student": student}
        return nb

    who = identify(tmp_path / "subs" / "alice" / LAB, students, handed_to("alice"), tmp_path)
    assert who == {"student": "alice", "made_for": "alice", "warnings": []}
    who = identify(tmp_path / "subs" / "mallory" / LAB, students, handed_to("carol"), tmp_path)
    assert who["student"] is None and who["made_for"] == "carol"
    assert "not on the roster" in who["warnings"][0] and "handed out to carol" in who["warnings"][0]
    who = identify(tmp_path / "subs" / "bob" / LAB, students, handed_to("carol"), tmp_path)
    assert who["student"] == "bob" and "mismatched id" in who["warnings"][0] and "carol" in who["warnings"][0]
    # only the folders below the one graded name a student: not the instructor's own folders above it
    assert student_of(Path("/home/bob/course/subs/x") / LAB, students, Path("/home/bob/course")) is None
    assert student_of(Path("/home/bob/course/subs/carol_00_setup.ipynb"), students, Path("/home/bob/course")) == "carol"
    rows = [{"submission": "a", "student": "alice", "lab": LAB}, {"submission": "b", "student": "alice", "lab": LAB},
            {"submission": "c", "student": None, "lab": LAB}]
    warnings = _identity_warnings(rows, {LAB: students})
    assert any(w.startswith("duplicate: alice has 2 submissions of 00_setup.ipynb (a, b)") for w in warnings)
    assert any(w.endswith("from 2 students on the roster: bob, carol") for w in warnings)


# ---- exit statuses of `grade` (no kernel) ---------------------------------------------------------------------


def test_grade_that_cannot_do_its_job_says_why_and_exits_2(tmp_path, monkeypatch, capsys):
    submission = tmp_path / LAB
    shutil.copy(SOLUTIONS_DIR / LAB, submission)
    (tmp_path / "empty").mkdir()
    (tmp_path / "not_a_manifest.json").write_text("[1, 2]")
    out = tmp_path / "out"
    monkeypatch.chdir(tmp_path)
    cases = [
        (["grade", "nowhere"], "submission " + str(tmp_path / "nowhere")),
        (["grade", "empty"], "found none"),
        (["grade", LAB, "--hidden", "missing_hidden"], f"hidden checks folder {tmp_path / 'missing_hidden'}"),
        (["grade", LAB, "--hidden", "empty"], "expected lab*.py files, found none"),
        (["grade", LAB, "--jobs", "0"], "--jobs: expected a positive number, got 0"),
        (["grade", LAB, "--param", "n=2"], "--param n: no lab being graded declares n"),
        (["grade", LAB, "--param", "oops"], "expected NAME=VALUE"),
        (["grade", LAB, "--variants", "not_a_manifest.json"], "expected the variants.json"),
        (["grade", LAB, "--roster", "nobody.txt"], "roster " + str(tmp_path / "nobody.txt")),
    ]
    for args, said in cases:
        assert main([*args, "--out", str(out)]) == 2, args
        err = capsys.readouterr().err
        assert err.startswith("error: ") and said in err, (args, err)
        assert not out.exists(), f"{args}: nothing may run or be written"
    assert "00_setup.ipynb: DEVICE, SEED, SIZE" in _cli("grade", "--allow-root", LAB, "--param", "n=2", "--out", out,
                                                         cwd=tmp_path).stderr
    out.mkdir()
    (out / "report.json").write_text("{not json")
    result = _cli("grade", "--allow-root", LAB, "--out", out, cwd=tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert f"{out / 'report.json'}: expected the report.json of an earlier `mhc-lab grade` run" in result.stderr
    assert "--fresh" in result.stderr
    result = _cli("grade", "--help")
    assert "exit status: 0 every submission was graded" in " ".join(result.stdout.split())


def test_grade_exits_1_when_a_submission_could_not_be_graded_and_fresh_starts_over(tmp_path, capsys):
    (tmp_path / "notes.ipynb").write_text("not a notebook")
    out = tmp_path / "out"
    (out / "executed").mkdir(parents=True)
    (out / "executed" / "stale.ipynb").write_text("{}")
    (out / "report.json").write_text(json.dumps({"submissions": [
        {"submission": "/elsewhere/a.ipynb", "status": "graded", "lab": LAB, "score": 3, "max_score": 3,
         "exercises": [], "executed": str(out / "executed" / "stale.ipynb")}]}))
    assert main(["grade", "--allow-root", str(tmp_path / "notes.ipynb"), "--no-hidden", "--out", str(out), "--fresh"]) == 1
    captured = capsys.readouterr()
    assert "not graded: 1 submission (exit status 1)" in captured.err and "unreadable" in captured.out
    report = json.loads((out / "report.json").read_text())
    assert [r["submission"] for r in report["submissions"]] == [str(tmp_path / "notes.ipynb")]
    assert not (out / "executed" / "stale.ipynb").exists()
    feedback = (out / "feedback" / "notes.md").read_text()
    assert "Not graded (unreadable)" in feedback and str(tmp_path) not in feedback


# ---- the console report, report.csv and the feedback file (no kernel) -----------------------------------------


def _row(message: str, hidden: Path) -> dict:
    checks = [{"name": "visible check", "kind": "visible", "passed": True, "message": "passed 4 cases"},
              {"name": "fresh inputs", "kind": "hidden", "passed": False, "message": message}]
    return {"submission": "/home/teacher/course/subs/alice/03_mhc.ipynb", "student": "alice", "lab": "03_mhc.ipynb",
            "status": "graded", "score": 1.5, "max_score": 2, "graded_at": "2027-01-01T00:00:00+00:00",
            "variant": {"SEED": 5},
            "exercises": [
                {"id": "3.1", "title": "mix the lanes", "status": "passed", "score": 1.0, "message": "",
                 "checks": [{"name": "visible check", "kind": "visible", "passed": True, "message": "passed 3 cases"}]},
                {"id": "3.2", "title": "Sinkhorn", "status": "partial", "score": 0.5,
                 "message": f"fresh inputs: {message}", "checks": checks}],
            "cell_errors": [{"cell": 7, "source": "x = load()", "ename": "FileNotFoundError",
                             "evalue": f"[Errno 2] No such file: '{hidden}/lab03.py' and "
                                       "'/home/teacher/course/data/x.pt'"}]}


def test_console_report_shows_a_long_failure_message_whole():
    message = ("logits of shape (3, 5, 4, 4), entry [2, 1, 3, 0]: " + "got 0.1234 where 0.5678 was expected; " * 12
               + "THE USEFUL END: your columns sum to 1 but your rows do not (normalise both, alternately)")
    text = format_report({"submissions": [_row(message, Path("/private/hidden"))]})
    assert " ".join(message.split()) in " ".join(text.split()), text
    assert max(len(line) for line in text.splitlines()) <= 120
    assert "..." not in text


def test_csv_has_one_row_per_submission_with_its_reasons(tmp_path):
    row = _row("rows do not sum to 1", Path("/private/hidden"))
    crashed = {"submission": "/s/bob.ipynb", "lab": "03_mhc.ipynb", "status": "crashed", "score": 0, "max_score": 2,
               "detail": "the kernel died in cell 4 (`import os`)", "exercises": [], "warnings": ["mismatched id"]}
    write_csv({"submissions": [row, crashed]}, tmp_path / "report.csv")
    with open(tmp_path / "report.csv") as handle:
        rows = list(csv.DictReader(handle))
    assert len(rows) == 2 and rows[0]["3.2"] == "0.5"
    assert rows[0]["reasons"] == "3.2: fresh inputs: rows do not sum to 1" == reasons(row)
    assert rows[1]["reasons"] == "crashed: the kernel died in cell 4 (`import os`)"
    assert rows[1]["warnings"] == "mismatched id"


def test_feedback_has_every_check_and_nothing_of_the_graders_machine():
    hidden = Path("/srv/private/hidden_checks")
    message = f"AssertionError: see {hidden}/lab03.py, {ROOT}/mhc_lab/course/checks.py <<mhc-lab-grade>>"
    text = feedback_text(_row(message, hidden), private=[hidden])
    assert text.startswith("# Feedback: 03_mhc.ipynb")
    assert "- total: **1.5 / 2**" in text and "- student: alice" in text
    assert "## Exercise 3.2: Sinkhorn" in text and "score 0.5 / 1, partial" in text
    assert "- passed: visible check: passed 4 cases" in text and "- FAILED: fresh inputs: AssertionError: see" in text
    assert "lab03.py" in text and "checks.py" in text and "x.pt" in text  # file names kept, folders left out
    assert "- cell 7 (`x = load()`): FileNotFoundError" in text
    for internal in (str(hidden), str(ROOT), "/home/teacher", "<<mhc-lab-grade>>", "/private"):
        assert internal not in text, internal


# ---- doctor (no kernel) ---------------------------------------------------------------------------------------


def test_doctor_without_a_compiler_names_it_gives_the_fix_and_exits_1(monkeypatch, capsys):
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setattr(doctor, "find_compiler", lambda: None)
    assert main(["doctor", "--no-tilelang"]) == 1
    text = capsys.readouterr().out
    assert "C++ compiler (TileLang's C target): FAILED: no C++ compiler" in text
    assert "NOT READY: 1 problem (exit status 1)" in text and f"fix: {doctor.compiler_fix()}" in text
    if platform.system() == "Linux":
        assert "sudo apt install g++" in text
    lab00 = next(line for line in text.splitlines() if line.strip().startswith(LAB))
    assert "runs live" not in lab00.split(":")[0] and "CANNOT RUN its TileLang cells here" in lab00
    assert main(["doctor", "--no-tilelang", "--json"]) == 1
    info = json.loads(capsys.readouterr().out)
    assert info["ready"] is False and info["problems"][0]["fix"] == doctor.compiler_fix()


def test_doctor_with_no_compiler_on_the_path_exits_1_and_with_one_0(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("CXX", "CC")}
    bare = tmp_path / "bin"
    bare.mkdir()
    result = _cli("doctor", "--no-tilelang", cwd=tmp_path, env={**env, "PATH": str(bare)})
    assert result.returncode == 1, result.stdout + result.stderr
    assert "none of g++, clang++, c++ is on the PATH" in result.stdout and "fix: install one" in result.stdout
    assert "Traceback" not in result.stderr
    compiler = doctor.compiler_check()
    if compiler["ok"]:  # this machine has one: the doctor finds it, builds with it and lists no compiler problem
        result = _cli("doctor", "--no-tilelang", "--json", cwd=tmp_path, env=env)
        info = json.loads(result.stdout)
        assert info["compiler"]["ok"] and not any("compiler" in p["what"] for p in info["problems"])
        assert result.returncode == (0 if info["ready"] else 1)


# ---- the wheel students install -------------------------------------------------------------------------------


def test_the_student_wheel_holds_the_package_alone_and_runs_a_check_outside_the_repository(tmp_path):
    makefile = (ROOT / "Makefile").read_text()  # `make wheel` builds it the way this test does, from a copy
    recipe = makefile[makefile.index("\nwheel: "):].split("\n\n")[0]
    assert "cp -R pyproject.toml README.md LICENSE mhc_lab build/wheel-src/" in recipe
    assert "pip wheel --no-deps --no-build-isolation" in recipe and "build/dist" in recipe
    source = tmp_path / "source"  # the repository's files, solutions and tests included, beside the package
    source.mkdir()
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info", ".ipynb_checkpoints")
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, source / name)
    for name in ("mhc_lab", "solutions", "labs", "tests"):
        shutil.copytree(ROOT / name, source / name, ignore=ignore)
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                            str(tmp_path / "dist"), str(source)], capture_output=True, text=True, timeout=600)
    assert built.returncode == 0, built.stderr[-2000:]
    [wheel] = list((tmp_path / "dist").glob("mhc_lab-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    assert {n.split("/")[0] for n in names} == {"mhc_lab", wheel.name.split("-py")[0] + ".dist-info"}
    assert not [n for n in names if n.endswith(".ipynb") or "/hidden/" in n or n.startswith(("solutions", "tests"))]
    hidden_lines = {line for path in HIDDEN_DIR.glob("lab*.py") for line in path.read_text().splitlines()
                    if line.startswith("@hidden(")}
    with zipfile.ZipFile(wheel) as archive:
        text = "\n".join(archive.read(n).decode(errors="replace") for n in names if n.endswith(".py"))
    assert hidden_lines and not [line for line in hidden_lines if line in text], "a hidden check is in the wheel"

    target = tmp_path / "site"
    installed = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target),
                                str(wheel)], capture_output=True, text=True, timeout=600)
    assert installed.returncode == 0, installed.stderr[-2000:]
    elsewhere = tmp_path / "student"
    elsewhere.mkdir()
    code = ("import mhc_lab, mhc_lab.course.checks as checks\n"
            "from mhc_lab.course.setup import setup\n"
            "print(mhc_lab.__file__)\n"
            "print(checks.run_check('0.2', lambda nbytes, seconds: nbytes / seconds / 1e9))\n")
    ran = subprocess.run([sys.executable, "-c", code], cwd=elsewhere, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PYTHONPATH": str(target)})
    assert ran.returncode == 0, ran.stderr[-2000:]
    assert ran.stdout.splitlines()[0] == str(target / "mhc_lab" / "__init__.py")
    assert "nbytes=8e+09, seconds=2" in ran.stdout


# ---- the class, graded, then one submission regraded and merged ------------------------------------------------


@pytest.fixture(scope="module")
def classroom(tmp_path_factory):
    """A roster with a header, a handout of lab 00; alice hands in a wrong 0.2, bob hands in carol's notebook,
    dave's notebook turns up in a folder named mallory, and a file that is no notebook. Graded from the command
    line with a relative --hidden; then alice fixes 0.2 and only her notebook is regraded into the same --out."""
    base = tmp_path_factory.mktemp("classroom")
    (base / "roster.csv").write_text(ROSTER)
    shutil.copytree(HIDDEN_DIR, base / "private_hidden", ignore=shutil.ignore_patterns("__pycache__"))
    handout = base / "handout"
    assert main(["variants", str(SOLUTIONS_DIR / LAB), "--roster", str(base / "roster.csv"), "--out", str(handout),
                 "--secret", "term"]) == 0
    subs = base / "subs"
    for folder, student in (("alice", "alice"), ("bob", "carol"), ("mallory", "dave")):
        (subs / folder).mkdir(parents=True)
        shutil.copy(handout / student / LAB, subs / folder / LAB)
    alice = subs / "alice" / LAB
    nbformat.write(_edit(nbformat.read(alice, as_version=4), RIGHT, WRONG), alice)
    (subs / "zz_notes.ipynb").write_text("my notes, not a notebook")
    cwd = os.getcwd()
    os.chdir(base)
    try:
        first = main(["grade", "--allow-root", "subs", "--variants", "handout/variants.json", "--hidden", "private_hidden",
                      "--out", "out", "--jobs", "2", "--timeout", "300", "--cell-timeout", "60"])
        report = json.loads((base / "out" / "report.json").read_text())
        feedback = {path.name: path.read_text() for path in (base / "out" / "feedback").glob("*.md")}
        nbformat.write(_edit(nbformat.read(alice, as_version=4), WRONG, RIGHT), alice)
        second = main(["grade", "--allow-root", "subs/alice/00_setup.ipynb", "--variants", "handout/variants.json",
                       "--no-hidden", "--out", "out", "--timeout", "300", "--cell-timeout", "60"])
    finally:
        os.chdir(cwd)
    merged = json.loads((base / "out" / "report.json").read_text())
    seeds = {s: e["parameters"]["SEED"] for s, e in
             json.loads((handout / "variants.json").read_text())["labs"][LAB]["students"].items()}
    return {"base": base, "subs": subs, "first": first, "second": second, "report": report, "merged": merged,
            "seeds": seeds, "feedback": feedback}


def _rows(report, subs):
    return {Path(r["submission"]).relative_to(subs).as_posix(): r for r in report["submissions"]}


@pytest.mark.notebooks
def test_class_grading_flags_unknown_and_mismatched_ids_and_exits_1_for_the_unreadable(classroom):
    report, subs = classroom["report"], classroom["subs"]
    assert classroom["first"] == 1  # the file that is no notebook could not be graded
    rows = _rows(report, subs)
    assert set(rows) == {"alice/00_setup.ipynb", "bob/00_setup.ipynb", "mallory/00_setup.ipynb", "zz_notes.ipynb"}
    assert report["settings"]["hidden_checks"] == str(classroom["base"] / "private_hidden")
    assert rows["zz_notes.ipynb"]["status"] == "unreadable"
    alice, bob, mallory = rows["alice/00_setup.ipynb"], rows["bob/00_setup.ipynb"], rows["mallory/00_setup.ipynb"]
    assert alice["student"] == "alice" and alice["status"] == "graded" and alice["score"] < 3
    assert bob["student"] == "bob" and bob["made_for"] == "carol" and bob["score"] == 3
    assert bob["variant"]["SEED"] == classroom["seeds"]["bob"]  # graded on bob's own variant
    assert any(w.startswith("mismatched id") for w in bob["warnings"])
    assert mallory["student"] is None and mallory["made_for"] == "dave"
    assert any(w.startswith("not on the roster") and "handed out to dave" in w for w in mallory["warnings"])
    assert "not on the roster" not in json.dumps(alice)
    assert any("no submission of 00_setup.ipynb from 2 students on the roster: carol, dave" in w
               for w in report["warnings"])


@pytest.mark.notebooks
def test_feedback_file_for_each_student(classroom):
    row = _rows(classroom["report"], classroom["subs"])["alice/00_setup.ipynb"]
    path = Path(row["feedback"])
    assert path == classroom["base"] / "out" / "feedback" / "alice__00_setup.md"
    text = classroom["feedback"][path.name]  # as the class run wrote it (the regrade rewrites it)
    assert text.startswith("# Feedback: 00_setup.ipynb") and "- student: alice" in text
    assert f"- total: **{row['score']:g} / 3**" in text
    for exercise in row["exercises"]:
        assert f"## Exercise {exercise['id']}: {exercise['title']}" in text
        for check in exercise["checks"]:
            assert f"- {'passed' if check['passed'] else 'FAILED'}: {check['name']}: " in text, check
    assert "- FAILED: visible check: " in text and "2**30" in text
    for internal in (str(classroom["base"]), str(ROOT), "<<mhc-lab-grade>>", '{"'):
        assert internal not in text, internal
    assert set(classroom["feedback"]) == {Path(r["feedback"]).name for r in classroom["report"]["submissions"]}


@pytest.mark.notebooks
def test_a_regrade_is_merged_into_the_class_report(classroom):
    before, merged, subs = classroom["report"], classroom["merged"], classroom["subs"]
    assert classroom["second"] == 0
    old, new = _rows(before, subs), _rows(merged, subs)
    assert list(new) == list(old)  # every submission still there, in its place
    alice = new["alice/00_setup.ipynb"]
    assert alice["score"] == 3 and alice["graded_at"] == merged["graded_at"] != before["graded_at"]
    assert alice["executed"] == old["alice/00_setup.ipynb"]["executed"]  # its own notebook, not another's
    for name in ("bob/00_setup.ipynb", "mallory/00_setup.ipynb", "zz_notes.ipynb"):
        assert new[name] == {**old[name], "graded_at": before["graded_at"]}
    assert [run["graded_at"] for run in merged["runs"]] == [before["graded_at"], merged["graded_at"]]
    assert merged["runs"][-1]["replaced"] == [str(subs / "alice" / LAB)]
    assert any("graded with other settings" in w and "--no-hidden" in w for w in merged["warnings"])
    with open(classroom["base"] / "out" / "report.csv") as handle:
        table = {Path(r["submission"]).relative_to(subs).as_posix(): r for r in csv.DictReader(handle)}
    assert set(table) == set(new) and float(table["alice/00_setup.ipynb"]["score"]) == 3
    assert table["alice/00_setup.ipynb"]["reasons"] == ""
    assert "FAILED" not in Path(alice["feedback"]).read_text()
