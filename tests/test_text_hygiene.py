"""Where a learner or a maintainer reads (README, docs, labs, solutions, the library's code and recordings), the
project describes its current design: no run letters ("run AZ"), no internal version numbers ("version 33") and
no flags of variants that no longer exist."""

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# "run AZ", "runs CE-CJ", "run CD's", "(runs BA and BB)": a run named by one or two capital letters
RUN_LETTERS = re.compile(r"\bruns? [A-Z]{1,2}\b(?!-\w*[a-z])|\bruns [A-Z]{1,2}(?:-| to | and |, )[A-Z]{1,2}\b")
INTERNAL_VERSION = re.compile(r"\b(?:kernel )?versions? \d+\b(?!\.\d)")
DELETED_FLAGS = re.compile(
    r"\b(?:g_once|held_terms|dx_products|ctas_per_sm|swizzle_epilogue|trim_lo|overlap_dx|leave_out|"
    r"joined_backward|JOIN_SITES_BACKWARD|CHAIN_ON_CUDA|POST_GRADIENT_TO_PRE|COEFFICIENT_PHASES|LANE_TUNING|"
    r"POST_PROJECT_TUNING|lane_tuning|post_project_tuning|chaining_on_cuda|coefficient_phases|apply_phases|"
    r"uniform_branches|warp_uniform|weight_grads_beside|block_zeroed|behind_gemms|lookback|pre_cluster)\b")
# files a version number belongs in: the license text, pinned requirements
VERSION_ALLOWED = {"LICENSE"}
# the tried-and-lost table names what was deleted, by design
FLAGS_ALLOWED = {"docs/kernels.md"}


def _readable_files():
    for pattern in ("README.md", "docs/*.md", "mhc_lab/**/*.py", "mhc_lab/recorded/*.json", "labs/*.ipynb",
                    "solutions/*.ipynb", "tests/**/*.py"):
        yield from sorted(ROOT.glob(pattern))


def _text(path: Path) -> str:
    if path.suffix == ".ipynb":  # sources and stored outputs: what a learner reads
        nb = json.loads(path.read_text())
        parts = []
        for cell in nb["cells"]:
            parts.append("".join(cell["source"]))
            for out in cell.get("outputs", []):
                parts.append("".join(out.get("text", "")))
                parts.append("".join(out.get("data", {}).get("text/plain", "")))
                parts.append("".join(out.get("data", {}).get("text/markdown", "")))
        return "\n".join(parts)
    return path.read_text()


FILES = [p for p in _readable_files() if p.name != Path(__file__).name]


@pytest.mark.parametrize("path", FILES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_run_letters_versions_or_deleted_flags(path):
    rel = str(path.relative_to(ROOT))
    text = _text(path)
    found = [m.group(0) for m in RUN_LETTERS.finditer(text)]
    if rel not in VERSION_ALLOWED:
        found += [m.group(0) for m in INTERNAL_VERSION.finditer(text)]
    if rel not in FLAGS_ALLOWED:
        found += [m.group(0) for m in DELETED_FLAGS.finditer(text)]
    assert not found, f"{rel}: {sorted(set(found))[:12]}"
