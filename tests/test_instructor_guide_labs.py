"""The instructor guide's lab section against the labs: one answer for each reflection question a lab asks, and
no "section N" that the lab does not have."""

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
GUIDE = ROOT / "docs" / "instructor-guide.md"
SOLUTIONS = sorted((ROOT / "solutions").glob("[0-9][0-9]_*.ipynb"))
ANSWERS_HEADING = "Answers to its reflection:"
NUMBERED = re.compile(r"^(\d+)\. ", re.M)
# "section 5", "sections 2 and 3", "sections 1 to 7", "lab 08, section 4": the lab named before it, if any
CITATION = re.compile(r"(?:\blab (\d\d), )?\bsections? (\d+(?:\.\d+)*)(?:(?: and | to |, )(\d+(?:\.\d+)*))?", re.I)


def _cells(path: Path) -> list[str]:
    return ["".join(cell["source"]) for cell in json.loads(path.read_text())["cells"] if cell["cell_type"] == "markdown"]


def reflection_questions(path: Path) -> list[int]:
    """The numbers of the questions in a lab's Reflection cell (the cell whose heading is "## Reflection")."""
    cells = [text for text in _cells(path) if re.search(r"^## Reflection\s*$", text, re.M)]
    assert len(cells) == 1, f"{path.name}: {len(cells)} cells with a '## Reflection' heading, expected 1"
    after = cells[0][re.search(r"^## Reflection\s*$", cells[0], re.M).end():]
    return [int(n) for n in NUMBERED.findall(after)]


def section_numbers(path: Path) -> set[str]:
    """Every numbered heading of a lab: "## 4. The power cap" gives "4", "### 2.2 Sinkhorn" gives "2.2"."""
    numbers = set()
    for text in _cells(path):
        numbers |= set(re.findall(r"^#{2,4} (\d+(?:\.\d+)*)\.? ", text, re.M))
    return numbers


def guide_labs(guide: str) -> dict[str, str]:
    """The text of each "### Lab NN" subsection of the guide, by lab number."""
    parts = re.split(r"^### Lab (\d\d)\b.*$", guide, flags=re.M)
    labs = {}
    for number, body in zip(parts[1::2], parts[2::2]):
        labs[number] = re.split(r"^#{1,3} ", body, maxsplit=1, flags=re.M)[0]
    return labs


def guide_answers(body: str) -> list[int]:
    assert body.count(ANSWERS_HEADING) == 1, f"expected one {ANSWERS_HEADING!r}"
    return [int(n) for n in NUMBERED.findall(body.split(ANSWERS_HEADING, 1)[1])]


def cited_sections(body: str, lab: str) -> list[tuple[str, str]]:
    """(lab, section) for every "section N" in a lab's text, "lab MM, section N" counted as lab MM's."""
    cited = []
    for match in CITATION.finditer(body):
        target = match.group(1) or lab
        cited += [(target, n) for n in match.groups()[1:] if n]
    return cited


LABS = {path.name[:2]: path for path in SOLUTIONS}


def test_the_guide_has_a_subsection_for_every_lab():
    assert LABS, "no solution notebooks found"
    assert sorted(guide_labs(GUIDE.read_text())) == sorted(LABS)


@pytest.mark.parametrize("lab", sorted(LABS))
def test_one_answer_per_reflection_question(lab):
    questions = reflection_questions(LABS[lab])
    assert questions == list(range(1, len(questions) + 1)), f"lab {lab}: questions numbered {questions}"
    answers = guide_answers(guide_labs(GUIDE.read_text())[lab])
    assert answers == questions, (f"lab {lab}: the guide answers {len(answers)} questions ({answers}), "
                                  f"the notebook asks {len(questions)}")


@pytest.mark.parametrize("lab", sorted(LABS))
def test_every_cited_section_exists(lab):
    body = guide_labs(GUIDE.read_text())[lab]
    cited = cited_sections(body, lab)
    missing = [(target, n) for target, n in cited if n not in section_numbers(LABS[target])]
    assert not missing, f"lab {lab}'s text in the guide cites sections its lab lacks: " + ", ".join(
        f"lab {target} section {n}" for target, n in missing)


def test_the_checks_catch_a_missing_answer_and_a_wrong_section():
    """The parsers above, attacked: one answer short, and a section that no lab has."""
    path = LABS["08"]
    body = guide_labs(GUIDE.read_text())["08"]
    last = max(guide_answers(body))
    short = re.sub(rf"^{last}\. ", "   ", body, flags=re.M)
    assert guide_answers(short) != reflection_questions(path)
    wrong = body + "\nSee section 99, and lab 07, section 2.\n"
    missing = [(t, n) for t, n in cited_sections(wrong, "08") if n not in section_numbers(LABS[t])]
    assert ("08", "99") in missing
    assert cited_sections("sections 1 to 7 and lab 05, section 6", "03") == [("03", "1"), ("03", "7"), ("05", "6")]
