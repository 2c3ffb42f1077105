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
    wanted = _requirement_names(project["dependencies"] + project["optional-dependencies"]["test"])
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    pip_section = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict) and "pip" in d)
    listed = _requirement_names([p for p in pip_section if not p.startswith("-e")])
    assert listed == wanted, "environment.yml and pyproject.toml disagree"
    assert "-e ." in pip_section
    python = next(d for d in env["dependencies"] if isinstance(d, str) and d.startswith("python"))
    assert python.replace("python", "") == project["requires-python"]


def test_readme_commands_are_what_ci_and_make_run():
    readme = (ROOT / "README.md").read_text()
    assert "make course" in readme and "make test" in readme
    assert "make test" in (ROOT / ".ci" / "run").read_text()
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r"^course: install", makefile, re.M) and re.search(r"^test: install", makefile, re.M)
