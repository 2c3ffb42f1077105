"""Recorded measurements: JSON files in mhc_lab/recorded, tagged with where and when they were made.

Every recording is ``{"name", "environment", "command", "results"}`` (mhc_lab.measure.schemas documents each
one). The forward and training recordings are made of sections, one per part of their benchmark; a run of some
parts replaces those sections and keeps the others, each section with the environment and command of its run.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path

from mhc_lab.measure.timing import environment_tags

RECORDED_DIR = Path(__file__).resolve().parent.parent / "recorded"


def bench_command(suite: str, argv) -> str:
    """The command line that runs a benchmark suite with these arguments."""
    return " ".join(["python -m mhc_lab.bench", suite, *(shlex.quote(a) for a in argv)])


def _write(path: Path, payload: dict) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2) + "\n")
    return path


def save_recording(name: str, results, *, command: str, directory: Path | str | None = None) -> Path:
    """Write ``results`` with this machine's environment tags and the command that made them to
    ``<directory>/<name>.json`` (default: the package's recorded folder)."""
    directory = Path(directory) if directory is not None else RECORDED_DIR
    payload = {"name": name, "environment": environment_tags(), "command": command, "results": results}
    return _write(directory / f"{name}.json", payload)


def save_sections(name: str, sections: dict, *, command: str, full_command: str, order: tuple,
                  directory: Path | str | None = None, environment: dict | None = None) -> Path:
    """Replace ``sections`` (part -> its results) in the recording ``name``, keeping its other sections; each
    section gets this run's environment and ``command``. The file's command is ``command`` where this run made
    every section it holds, else ``full_command`` (the suite's, which makes them all). ``order``: the parts in
    the order the file lists them."""
    directory = Path(directory) if directory is not None else RECORDED_DIR
    path = directory / f"{name}.json"
    kept = json.loads(path.read_text()).get("results", {}) if path.exists() else {}
    environment = environment or environment_tags()
    for key, value in sections.items():
        kept[key] = {"environment": environment, "command": command, **value}
    results = {k: kept[k] for k in sorted(kept, key=lambda k: order.index(k) if k in order else len(order))}
    whole = command if set(results) <= set(sections) else full_command
    return _write(path, {"name": name, "environment": environment, "command": whole, "results": results})


def load_recording(name: str, *, directory: Path | str | None = None) -> dict:
    """A recorded measurement, as saved by :func:`save_recording`; a clear error if there is none yet."""
    directory = Path(directory) if directory is not None else RECORDED_DIR
    path = directory / f"{name}.json"
    if not path.exists():
        known = sorted(p.stem for p in directory.glob("*.json"))
        raise FileNotFoundError(f"no recording named {name!r} in {directory}; recorded: {known}")
    return json.loads(path.read_text())


def recorded_or_none(name: str, *, directory: Path | str | None = None) -> dict | None:
    """The recording ``name`` (from mhc_lab/recorded/ unless ``directory``), or None when there is none (yet)."""
    try:
        return load_recording(name, directory=directory)
    except FileNotFoundError:
        return None


def recorded_section(name: str, section: str) -> dict | None:
    """One section of a recording made of sections, or None where the recording or the section is missing."""
    recording = recorded_or_none(name)
    return ((recording or {}).get("results") or {}).get(section)


def recording_label(recording: dict) -> str:
    """'RECORDED on <GPU>, <date> (not this machine): <versions>': the line every replayed result carries. A
    section of a recording (a dict with its own environment) is labelled with its own run's tags."""
    env = recording.get("environment") or {}
    device = env.get("gpu") or env.get("cpu") or "an unknown device"
    return (f"RECORDED on {device}, {env.get('date', '?')} (not this machine): torch {env.get('torch')}, "
            f"TileLang {env.get('tilelang')}, Triton {env.get('triton')}, CUDA {env.get('cuda')}, "
            f"driver {env.get('driver')}")
