"""What an instructor should look at in a submission: code that reaches for the grader instead of the exercise.

Grading computes its verdicts outside the learner's kernel, so a notebook cannot change them; but it can change
what its own functions answer, and the ways to answer without doing the work (replacing the grading channel's
side in the kernel, calling the library under a name built at run time, rebuilding a library function from its
code object) all need code that a lab never asks for. ``suspicious_cells`` finds such code in the cells the
learner wrote (those that differ from every cell of the handout) and names it; the grader flags the submission
for review. It is a net, not a proof: it flags, it does not score.
"""

from __future__ import annotations

import re

# (pattern, what it does): each is code no lab asks a learner to write.
PATTERNS = [
    (r"\bmhc_lab\.classroom\b|from\s+mhc_lab\s+import\s+[^\n]*\bclassroom\b", "reaches into the grader (mhc_lab.classroom)"),
    (r"\bmhc_lab\.course\.exercises\b|\bREGISTRY\b|\bget_exercise\b|\blibrary_function\b|\blibrary_calls\b",
     "reaches into the course's check registry"),
    (r"\b(sys|threading)\s*\.\s*(setprofile|settrace|getprofile|gettrace)\b", "changes the interpreter's tracing"),
    (r"\bsys\s*\.\s*modules\b", "edits the loaded modules (sys.modules)"),
    (r"\bimportlib\b|\b__import__\b|\bbuiltins\b|\b__builtins__\b", "imports or replaces names at run time"),
    (r"(?<![.\w])(exec|eval)\s*\(", "runs code built at run time (exec/eval)"),
    (r"\b__code__\b|\b__globals__\b|\b__closure__\b|\bFunctionType\b|\bCodeType\b|\bmarshal\b",
     "rebuilds functions from their internals"),
    (r"\bctypes\b|\bos\s*\.\s*kill\b|\bsignal\s*\.\s*(signal|SIG)|/proc/|\bgc\s*\.\s*get_objects\b|\bptrace\b",
     "reaches outside the notebook (processes, memory, signals)"),
    (r"\bpublish_display_data\b|\bget_ipython\s*\(\s*\)\s*\.\s*(events|register|kernel|display_pub)\b",
     "intercepts the kernel's messages"),
    (r"(?m)^\s*mhc_lab(\.\w+)+\s*=[^=]|\bsetattr\s*\(\s*mhc_lab\b|\bgetattr\s*\(\s*mhc_lab\b|\bmhc_lab\s*\.\s*__dict__",
     "replaces or looks up a library function by name"),
    (r"\bresolve_name\b|\battrgetter\b|\bgetattr\s*\([^)\n]*(\+|\bf[\"']|\.join\b|%|\.format\b)|\b__dict__\s*\[|"
     r"\bvars\s*\([^)\n]*\)\s*\[|\bglobals\s*\(\s*\)\s*\[",
     "looks up a name built at run time"),
    (r"\binspect\s*\.\s*(getsource\w*|getfile)|\b__file__\b|\bsys\s*\.\s*(path|meta_path|path_hooks)\b|"
     r"site-packages|\.py[\"']",
     "reads or redirects the library's source files"),
    (r"\bgc\s*\.\s*\w+|\bwithheld\b", "reaches for the grader's withholding of library functions"),
    (r"\btorch\s*\.\s*jit\s*\.\s*(trace|script)\b", "compiles a function ahead of grading (torch.jit)"),
]
_COMPILED = [(re.compile(pattern), what) for pattern, what in PATTERNS]


def _first_line(source: str, start: int) -> str:
    line = source[source.rfind("\n", 0, start) + 1:].split("\n", 1)[0]
    return line.strip()[:100]


def suspicious_cells(nb, handout=None) -> list[dict]:
    """For each code cell of ``nb`` that differs from every code cell of ``handout`` (all of them when None):
    what in it reaches for the grader. Cells are numbered from 1 over all of ``nb``'s cells, as JupyterLab
    numbers them."""
    given = {cell.source.strip() for cell in (handout.cells if handout is not None else []) if cell.cell_type == "code"}
    found = []
    for number, cell in enumerate(nb.cells, start=1):
        if cell.cell_type != "code" or cell.source.strip() in given:
            continue
        source = re.sub(r"#[^\n]*", "", cell.source)  # comments name things without doing them
        for pattern, what in _COMPILED:
            match = pattern.search(source)
            if match:
                found.append({"cell": number, "what": what, "line": _first_line(source, match.start())})
    return found
