"""Project-level promises: the conda environment matches pyproject, the README's commands are the ones CI and the
Makefile run (the layering has its own test, test_layering.py)."""

import re
import tomllib
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def _requirement_names(requirements):
    return {re.split(r"[<>=!~ \[]", r)[0].strip().lower(): r.replace(" ", "") for r in requirements}


def test_environment_yml_matches_pyproject():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    wanted = _requirement_names(project["dependencies"] + extras["test"] + extras["transformers"])
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    pip_section = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict) and "pip" in d)
    listed = _requirement_names([p for p in pip_section if not p.startswith("-e")])
    assert listed == wanted, "environment.yml and pyproject.toml disagree"
    assert "-e ." in pip_section
    python = next(d for d in env["dependencies"] if isinstance(d, str) and d.startswith("python"))
    assert python.replace("python", "") == project["requires-python"]


def test_readme_commands_are_what_ci_and_make_run():
    readme = (ROOT / "README.md").read_text()
    assert "make lab" in readme and "make test" in readme and "make course" in readme
    assert "make test" in (ROOT / ".ci" / "run").read_text()
    makefile = (ROOT / "Makefile").read_text()
    for target in ("lab", "test", "course"):
        assert re.search(rf"^{target}: install\b", makefile, re.M), f"make {target} must install first"


def _torch_requirement(requirements) -> str:
    return next(r.replace(" ", "") for r in requirements if re.split(r"[<>=!~ \[;]", r)[0].strip() == "torch")


def test_one_torch_pin_shared_by_the_makefile_pyproject_and_environment():
    pin = next(line.strip() for line in (ROOT / "constraints.txt").read_text().splitlines()
               if line.startswith("torch=="))
    version = pin.split("==")[1]
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^TORCH\s*\?=.*constraints\.txt", makefile, re.M), "the Makefile's TORCH must come from constraints.txt"
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    pip_section = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict) and "pip" in d)
    for where, requirement in (("pyproject.toml", _torch_requirement(project["dependencies"])),
                               ("environment.yml", _torch_requirement(pip_section))):
        assert f"<={version}" in requirement, f"{where}: torch requirement {requirement!r} does not end at {pin}"


def test_license_file_matches_pyproject():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["license"]["text"] == "Apache-2.0"
    assert "Apache License" in (ROOT / "LICENSE").read_text() and "Version 2.0" in (ROOT / "LICENSE").read_text()


def test_ci_requires_the_browser_test_and_make_test_does_not_elsewhere():
    assert "BROWSER=required" in (ROOT / ".ci" / "run").read_text()
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^BROWSER \?= optional", makefile, re.M)
    assert "MHC_LAB_BROWSER_TEST=$(BROWSER)" in makefile

