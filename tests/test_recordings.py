"""Every recording in mhc_lab/recorded matches its schema (mhc_lab.measure.schemas), and every command a schema
or a recording names is one the package's parsers accept."""

import importlib
import json
import shlex

import pytest

from mhc_lab.bench import MEASURING, SUITES
from mhc_lab.measure import RECORDED_DIR, load_recording, save_recording, save_sections
from mhc_lab.measure.schemas import SCHEMAS, describe, number, obj, recording_spec, table, text, validate, \
    validate_recording

RECORDINGS = sorted(p.stem for p in RECORDED_DIR.glob("*.json"))


def _accepted(command: str) -> None:
    """Parse ``command`` with the parser of the program it names; fail with the reason where it is refused."""
    words = shlex.split(command)
    assert words[:2] == ["python", "-m"], f"{command!r}: expected 'python -m ...'"
    if words[2] == "mhc_lab.bench":
        assert words[3] in SUITES, f"{command!r}: no suite {words[3]!r} (suites: {', '.join(SUITES)})"
        parser = importlib.import_module(SUITES[words[3]]).build_parser()
        rest = words[4:]
    elif words[2] == "mhc_lab.classroom.cli":
        from mhc_lab.classroom.cli import _parser

        parser, rest = _parser(), words[3:]
    else:
        raise AssertionError(f"{command!r}: not a command of this package")
    try:
        parser.parse_args(rest)
    except SystemExit as refused:
        raise AssertionError(f"{command!r}: its parser refuses {rest}") from refused


def test_every_recording_has_a_schema_and_every_schema_a_recording():
    assert set(RECORDINGS) == set(SCHEMAS)


@pytest.mark.parametrize("name", RECORDINGS)
def test_recording_matches_its_schema(name):
    errors = validate_recording(load_recording(name), name)
    assert not errors, "\n".join(errors[:20])


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_schema_command_is_accepted(name):
    _accepted(SCHEMAS[name].command)


@pytest.mark.parametrize("name", RECORDINGS)
def test_recorded_commands_are_accepted(name):
    recording = load_recording(name)
    _accepted(recording["command"])
    for section in SCHEMAS[name].sections:
        if section in recording["results"]:
            _accepted(recording["results"][section]["command"])


@pytest.mark.parametrize("name", [n for n, s in SCHEMAS.items() if s.sections])
def test_sections_are_the_parts_of_their_suite(name):
    suite = SCHEMAS[name].command.split()[3]
    module = importlib.import_module(SUITES[suite])
    assert tuple(SCHEMAS[name].sections) == tuple(module.PARTS)


def test_all_measures_the_suites_that_have_recordings():
    suites = {s.command.split()[3] for s in SCHEMAS.values() if s.command.startswith("python -m mhc_lab.bench")}
    assert set(MEASURING) == suites


def test_validate_names_missing_unknown_and_mistyped_keys():
    spec = obj("x", required={"a": number("a"), "b": table("b", text("t"), ("k",))}, optional={"c": number("c")})
    assert validate({"a": 1.0, "b": {"k": "v"}}, spec) == []
    errors = validate({"b": {"k": 1, "z": "v"}, "d": 0}, spec)
    assert "(top): missing key 'a'" in errors and "(top): unknown key 'd'" in errors
    assert "b.k: expected text, got int" in errors
    assert any("unknown key 'z'" in e for e in errors)
    assert validate({"a": True, "b": {}}, spec) == ["a: expected a number, got bool"]


def test_every_schema_documents_every_key():
    for schema in SCHEMAS.values():
        text_ = describe(recording_spec(schema))
        assert ". ." not in text_ and "None" not in text_


def test_save_sections_replaces_its_own_and_keeps_the_others(tmp_path):
    common = dict(full_command="python -m mhc_lab.bench training", order=("site", "block"), directory=tmp_path)
    save_sections("t", {"site": {"x": 1}}, command="python -m mhc_lab.bench training --parts site", **common)
    one = json.loads((tmp_path / "t.json").read_text())
    assert one["command"] == "python -m mhc_lab.bench training --parts site"  # it made every section it holds
    save_sections("t", {"block": {"y": 2}}, command="python -m mhc_lab.bench training --parts block", **common)
    both = json.loads((tmp_path / "t.json").read_text())
    assert list(both["results"]) == ["site", "block"] and both["results"]["site"]["x"] == 1
    assert both["results"]["site"]["command"].endswith("--parts site")
    assert both["results"]["block"]["environment"]["date"] and both["command"] == common["full_command"]


def test_save_recording_writes_name_environment_command_results(tmp_path):
    path = save_recording("r", {"a": 1}, command="python -m mhc_lab.bench tilelang", directory=tmp_path)
    saved = json.loads(path.read_text())
    assert list(saved) == ["name", "environment", "command", "results"] and saved["results"] == {"a": 1}
