"""Claims: every sentence of a lab's markdown that says what a recorded table shows, bound to a check on that
recording, so that re-recording a benchmark can never silently contradict the text.

A lab's claims module (``tests/claims/labNN.py``) holds three things:

    CLAIMS   a list of :class:`Claim`: a phrase that appears verbatim in the lab's markdown and a predicate that
             says whether the recordings still bear it out;
    GENERAL  phrases of sentences that use a comparing word ("faster", "agree", "bound", ...) about the concept
             rather than about a recorded figure (so they need no recording to hold);
    break_one(recordings) -> str
             edits (in place) a copy of the recordings so that one claim no longer holds, and returns that claim's
             phrase: the test shows the claim then fails.

``tests/test_claims.py`` checks that each phrase is in the lab, that each claim holds on the shipped recordings,
that the edited copy breaks the named claim, and that every markdown sentence of the lab with a comparing word is
either bound to a claim or listed as general. A sentence that a cell prints from the data (the ``reading``
functions of mhc_lab.course) needs neither: it changes when the data does.
"""

from __future__ import annotations

import copy
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[2]
RECORDED = ROOT / "mhc_lab" / "recorded"

# Words that compare figures. A sentence holding one is about data unless the lab's GENERAL list says otherwise.
COMPARING = re.compile(
    r"\b(faster|slower|quicker|agree[sd]?|disagree[sd]?|rises?|rising|falls?|falling|grows?|shrinks?|"
    r"lands? in|[a-z]+-bound|bound by|below|above|more than|less than|fewer than|at most|at least|"
    r"twice|half|ahead|behind|beats?|wins?|loses?|costs? more|costs? less|within \d)",
    re.IGNORECASE)


@dataclass(frozen=True)
class Claim:
    phrase: str  # verbatim in the lab's markdown (whitespace and markdown emphasis aside)
    holds: Callable[["Recordings"], bool]  # True while the recordings bear the phrase out


class Recordings(dict):
    """name -> recording (the JSON of mhc_lab/recorded/<name>.json), loaded lazily; ``copy()`` is deep."""

    def __missing__(self, name: str) -> dict:
        value = json.loads((RECORDED / f"{name}.json").read_text())
        self[name] = value
        return value

    def results(self, name: str, *path: str):
        node = self[name]["results"]
        for key in path:
            node = node[key]
        return node

    def copy(self) -> "Recordings":
        return Recordings(copy.deepcopy(dict(self)))


def normalize(text: str) -> str:
    """Markdown to comparable plain text: emphasis, code ticks and links dropped, whitespace collapsed."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    text = re.sub(r"[*_`]", "", text)
    return re.sub(r"\s+", " ", text).strip()


def markdown_of(notebook: Path) -> str:
    nb = json.loads(notebook.read_text())
    return "\n\n".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "markdown")


def sentences(markdown: str) -> list[str]:
    """The lab's prose as sentences (tables, code blocks and headings left out)."""
    markdown = re.sub(r"```.*?```", " ", markdown, flags=re.DOTALL)
    kept = [line for line in markdown.splitlines()
            if not line.lstrip().startswith(("|", "#", "$$")) and line.strip()]
    text = normalize(" ".join(kept))
    return [s.strip() for s in re.split(r"(?<=[.!?])\s+(?=[A-Z(])", text) if s.strip()]
