"""The front door: the README a newcomer reads first, its two commands, its links, its results table, and the
glossary the labs link to (docs/glossary.md)."""

import json
import re
import shutil
import subprocess
import unicodedata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
GLOSSARY = ROOT / "docs" / "glossary.md"
FIRST_LAB = "labs/00_setup.ipynb"

# The terms issue 47 asks for, as their headings' anchors (labs link to ../docs/glossary.md#anchor).
GLOSSARY_ANCHORS = ("tma", "swizzle", "split-k", "tf32", "warpgroup", "epilogue", "uniform-registers", "gemm",
                    "cuda-graph", "copy-floor", "roofline", "launched-vs-graph-timing", "eager", "torchcompile",
                    "recompute", "sinkhorn", "birkhoff-polytope", "doubly-stochastic", "bf16", "hbm", "sm",
                    "kernel-fusion", "tile", "lane", "site", "chained-sites")
NOTATION_SYMBOLS = ("n", "C", "T", "L, l", "x", "F", "y", "f", "eps", "r", "phi", "mixes", "alpha", "b", "H̃",
                    "H_pre", "H_post", "H_res", "g")


def _section(markdown: str, heading: str) -> str:
    """The text under a heading, up to the next heading of the same or a higher level."""
    level = len(heading) - len(heading.lstrip("#"))
    match = re.search(rf"^{re.escape(heading)}\s*$(.*?)(?=^#{{1,{level}}} |\Z)", markdown, re.M | re.S)
    assert match, f"no section {heading!r}"
    return match.group(1)


def two_commands(readme: str) -> list[str]:
    """The commands of the first shell block under "## Two commands", comments dropped."""
    block = re.search(r"```bash\n(.*?)```", _section(readme, "## Two commands"), re.S)
    assert block, "README: no ```bash block under '## Two commands'"
    lines = (line.split("#", 1)[0].strip() for line in block.group(1).splitlines())
    return [line for line in lines if line]


def makefile_targets() -> set[str]:
    return set(re.findall(r"^([A-Za-z][\w.-]*):(?!=)", (ROOT / "Makefile").read_text(), re.M))


def test_readme_is_at_most_6_kb():
    size = len(README.read_bytes())
    assert size <= 6 * 1024, f"README.md is {size} bytes; at most {6 * 1024}"


def test_exactly_two_commands_both_make_targets_lab_then_test():
    commands = two_commands(README.read_text())
    assert len(commands) == 2, f"'Two commands' lists {len(commands)}: {commands}"
    targets = makefile_targets()
    for command in commands:
        assert re.fullmatch(r"make [\w-]+", command), f"not a make target: {command!r}"
        assert command.split()[1] in targets, f"{command!r}: no such target in the Makefile"
    assert commands == ["make lab", "make test"], commands
    assert "make test" in (ROOT / ".ci" / "run").read_text(), "CI must run the README's test command"


def test_two_commands_finds_a_third_command():
    readme = "## Two commands\n\n```bash\nmake lab   # opens\nmake course\n\nmake test  # tests\n```\n"
    assert two_commands(readme) == ["make lab", "make course", "make test"]


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_first_command_installs_then_opens_lab_00_in_jupyterlab(tmp_path):
    """`make -n` prints what the target would run without running it; with a venv that does not exist yet, the
    install comes first."""
    command = two_commands(README.read_text())[0].split()
    dry = subprocess.run([*command, "-n", "-C", str(ROOT), f"VENV={tmp_path / 'venv'}"], capture_output=True,
                         text=True, check=True).stdout.splitlines()
    opening = [i for i, line in enumerate(dry) if "jupyter lab" in line]
    assert len(opening) == 1 and dry[opening[0]].split()[-1] == FIRST_LAB, dry
    assert any("pip install" in line for line in dry[:opening[0]]), f"no install before JupyterLab: {dry}"
    assert (ROOT / FIRST_LAB).is_file()
    assert "lab 00" in _section(README.read_text(), "## Two commands").lower()


def test_make_course_is_described_as_running_the_solutions_and_doctor_is_up_front():
    readme = README.read_text()
    course = next(p for p in readme.split("\n\n") if "`make course`" in p)
    assert "solution" in course and ("CI" in course or "instructor" in course.lower()), course
    assert readme.index("mhc-lab doctor") < readme.index("## The labs"), "mhc-lab doctor belongs up front"


# ---- links ----------------------------------------------------------------------------------------------------

def github_anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped (hyphens and underscores kept), spaces to
    hyphens."""
    text = re.sub(r"`|\*\*|\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip().lower())
    kept = "".join(ch for ch in text if ch in " -_" or unicodedata.category(ch)[0] in "LN")
    return kept.replace(" ", "-")


def anchors(markdown: str) -> set[str]:
    seen, out = {}, set()
    in_code = False
    for line in markdown.splitlines():
        if line.startswith("```"):
            in_code = not in_code
        elif not in_code and (m := re.match(r"#{1,6} (.+)", line)):
            base = github_anchor(m.group(1))
            count = seen.get(base, 0)
            seen[base] = count + 1
            out.add(base if count == 0 else f"{base}-{count}")
    return out


def test_github_anchor_matches_githubs_rules():
    assert github_anchor("torch.compile") == "torchcompile"
    assert github_anchor("Launched vs graph timing") == "launched-vs-graph-timing"
    assert github_anchor("Split-K") == "split-k"
    assert anchors("# A\n### A\n```\n# not a heading\n```\n") == {"a", "a-1"}


def _links(markdown: str):
    for target in re.findall(r"\]\(([^)\s]+)\)", markdown):
        if not re.match(r"[a-z][a-z0-9+.-]*:", target):   # http:, https:, mailto:
            yield target


def _markdown_of(path: Path) -> str:
    if path.suffix == ".ipynb":
        cells = json.loads(path.read_text())["cells"]
        return "\n\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown")
    return path.read_text()


def broken_links(path: Path, markdown: str | None = None) -> list[str]:
    """The relative links of a page (its markdown, or the given text as if it were the page's) that name a file
    that does not exist, or a heading that a markdown file does not have."""
    broken = []
    for link in _links(_markdown_of(path) if markdown is None else markdown):
        file, _, anchor = link.partition("#")
        target = (path.parent / file).resolve() if file else path
        if not target.exists():
            broken.append(f"{link}: no file {target.relative_to(ROOT) if target.is_relative_to(ROOT) else target}")
        elif anchor and target.suffix == ".md" and anchor not in anchors(target.read_text()):
            broken.append(f"{link}: no heading with anchor #{anchor} in {target.name}")
    return broken


DOCUMENTS = [README, *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "solutions").glob("*.ipynb")),
             *sorted((ROOT / "labs").glob("*.ipynb"))]


@pytest.mark.parametrize("path", DOCUMENTS, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(path):
    assert not broken_links(path), f"{path.relative_to(ROOT)}: " + "; ".join(broken_links(path))


def test_broken_links_finds_a_missing_file_and_a_missing_anchor():
    text = "[a](glossary.md#tma) [b](glossary.md#no-such-term) [c](nothing.md) [d](https://example.org/x.md)"
    found = broken_links(ROOT / "docs" / "probe.md", text)
    assert len(found) == 2 and "#no-such-term" in found[0] and "nothing.md" in found[1], found


# ---- the results table ----------------------------------------------------------------------------------------

def results_rows(readme: str) -> list[list[str]]:
    block = readme.split("<!-- results -->", 1)[1].split("<!-- end of results -->", 1)[0]
    rows = [line for line in block.splitlines() if line.startswith("| ")]
    return [[cell.strip() for cell in row.strip("|").split("|")] for row in rows[1:]]


def ratio_errors(rows: list[list[str]]) -> tuple[int, list[str]]:
    """(rows with a ratio, the rows whose printed ratio is not their first figure over their second). Each figure
    is printed to 0.001 and the ratio to 0.01, so they agree within half a unit of the ratio's last digit plus
    what the figures' rounding can move it."""
    checked, wrong = 0, []
    for what, figure, *_ in rows:
        m = re.fullmatch(r"([\d.]+) / ([\d.]+) ms \(([\d.]+)x\)", figure)
        if not m:
            assert "x)" not in figure, f"a ratio in an unexpected form: {figure!r}"
            continue
        first, second, ratio = map(float, m.groups())
        checked += 1
        slack = 0.005 + 0.0005 * (1 / second + first / second**2) + 1e-9
        if abs(ratio - first / second) > slack:
            wrong.append(f"{what}: {figure} (first / second = {first / second:.3f})")
    return checked, wrong


def test_results_ratios_are_the_first_figure_over_the_second():
    checked, wrong = ratio_errors(results_rows(README.read_text()))
    assert checked >= 3 and not wrong, wrong


def test_ratio_errors_catches_a_ratio_printed_the_other_way_round():
    rows = [["ours / TileKernels", "1.005 / 2.762 ms (0.36x)", "GPU"],
            ["TileKernels / ours", "2.762 / 1.005 ms (0.36x)", "GPU"]]
    assert ratio_errors(rows) == (2, ["TileKernels / ours: 2.762 / 1.005 ms (0.36x) (first / second = 2.748)"])


def test_results_table_introduces_tilekernels_and_its_terms():
    block = README.read_text().split("<!-- results -->", 1)[1].split("<!-- end of results -->", 1)[0]
    assert re.search(r"TileKernels\S* is DeepSeek's", block)
    for word in ("site", "chained", "GPU time", "launched"):
        assert word in block.split("| what")[0], f"the table uses {word!r} without saying what it is"


# ---- the glossary ---------------------------------------------------------------------------------------------

def glossary_entries() -> dict[str, str]:
    text = GLOSSARY.read_text().split("\n## Notation", 1)[0]
    parts = re.split(r"^### (.+)$", text, flags=re.M)
    return {github_anchor(title): body.split("\n## ", 1)[0].strip() for title, body in zip(parts[1::2], parts[2::2])}


def sentences(text: str) -> int:
    plain = re.sub(r"`[^`]*`|\([^)]*\)", "", text)
    return len(re.findall(r"[.!?](?:\s|$)", plain))


def test_glossary_defines_each_term_in_one_or_two_sentences():
    entries = glossary_entries()
    missing = [a for a in GLOSSARY_ANCHORS if a not in entries]
    assert not missing, f"docs/glossary.md lacks {missing}"
    long = {a: sentences(body) for a, body in entries.items() if not 1 <= sentences(body) <= 2}
    assert not long, f"entries of other than one or two sentences: {long}"
    assert sentences("One (e.g. this). Two `a.b`.") == 2


def test_notation_has_one_row_per_symbol():
    notation = GLOSSARY.read_text().split("\n## Notation", 1)[1]
    symbols = [row.split("|")[1].strip() for row in notation.splitlines()
               if row.startswith("| ") and not row.startswith("| symbol")]
    assert len(symbols) == len(set(symbols)), f"a symbol listed twice: {symbols}"
    assert set(NOTATION_SYMBOLS) <= set(symbols), set(NOTATION_SYMBOLS) - set(symbols)
    r_row = next(row for row in notation.splitlines() if row.startswith("| r |"))
    assert "sqrt(mean(x²) + eps)" in r_row and "1/r" in r_row


def test_readme_links_the_glossary():
    assert "(docs/glossary.md)" in README.read_text()
