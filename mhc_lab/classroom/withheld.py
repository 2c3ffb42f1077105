"""While an exercise is graded, the library functions that answer it are withheld in the learner's kernel.

An exercise's own library function (``Exercise.library``) is one answer to it; ANSWERS lists the others the
library holds (found by tests/test_grading_attacks.py's search, or written by hand where an adapter is needed:
``depth_profile(...).gradient`` answers 1.5). Before the notebook's first cell runs, the grader's worker records
the code of every one of them (``record``); while the grader calls the learner's functions for exercise E, every
reference to that code in the kernel (every function object that runs it, under any name, in any thread, and
every list, dict or closure cell that holds the code object itself) is swapped for code that raises
``Withheld`` (``withholding``), from E's first request until the next exercise's. So the library's answer to E cannot run while
E is graded, however it is reached: an alias, getattr, a function rebuilt from the code object, a thread started
earlier, a wrapper, or another library function that calls it (``sinkhorn(variant="paper")`` calls
``sinkhorn_paper``). A call that reaches it fails the check, and the grader reports the exercise as using the
library.

What it does not stop: code the learner pastes (the library's source included, or read from disk at run time),
a compiled or traced program made before grading (``torch.jit.trace`` of the answer in an earlier cell), and a
notebook that replaces this module or the grading channel's side in its kernel (code review flags those). The
design that closes them evaluates each exercise outside the learner's kernel (see docs/instructor-guide.md).
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import types

# Other library functions that answer an exercise, beside its own (Exercise.library).
ANSWERS: dict[str, tuple[str, ...]] = {
    "1.2": ("mhc_lab.course.depth_probe.residual_stack",),
    "1.3": ("mhc_lab.course.depth_probe.residual_stack",),
    "1.5": ("mhc_lab.course.depth_probe.depth_profile",),
    "1.6": ("mhc_lab.reference.metrics.composite_product", "mhc_lab.reference.metrics.composite_gain"),
    "2.3": ("mhc_lab.reference.mhc.mhc_post",),
    "2.6": ("mhc_lab.reference.metrics.composite_gain",),
    "2.7": ("mhc_lab.reference.metrics.composite_gain",),
    "3.2": ("mhc_lab.reference.sinkhorn.sinkhorn_log_domain", "mhc_lab.reference.sinkhorn.sinkhorn"),
    "3.3": ("mhc_lab.reference.sinkhorn.sinkhorn",),
    "3.4": ("mhc_lab.reference.sinkhorn.sinkhorn_paper", "mhc_lab.reference.sinkhorn.sinkhorn"),
    "3.6": ("mhc_lab.reference.hyper_connections.hc_apply",),
    "6.3": ("mhc_lab.course.forward_lab.logits_norm_first",),
}


class Withheld(RuntimeError):
    """A library function that answers the exercise being graded was called."""


_CODES: dict[str, types.CodeType] = {}  # dotted name -> the function's code, recorded before the notebook ran


def withheld_names(exercise_id: str, library: str | None) -> tuple[str, ...]:
    """The dotted names withheld while ``exercise_id`` is graded."""
    return tuple(dict.fromkeys(filter(None, (library, *ANSWERS.get(exercise_id, ())))))


def _function(dotted: str):
    module, _, name = dotted.rpartition(".")
    fn = getattr(importlib.import_module(module), name)
    while hasattr(fn, "__wrapped__"):
        fn = fn.__wrapped__
    return fn


def record(names) -> None:
    """Remember the code of these library functions (run before any of the learner's code)."""
    for dotted in names:
        try:
            code = getattr(_function(dotted), "__code__", None)
        except (ImportError, AttributeError):
            continue
        if isinstance(code, types.CodeType):
            _CODES.setdefault(dotted, code)


def _raiser(code: types.CodeType, dotted: str, exercise: str) -> types.CodeType:
    """Code with ``code``'s name and free variables that raises Withheld."""
    message = (f"{dotted} is withheld while exercise {exercise} is graded: it is the library's own answer to it. "
               "Write it yourself")
    free = code.co_freevars
    lines = ["def _outer():"] + [f"    {v} = None" for v in free] + ["    def _withheld(*args, **kwargs):"]
    lines += [f"        {v}" for v in free]
    lines += [f"        raise __import__('mhc_lab.classroom.withheld', fromlist=['Withheld']).Withheld({message!r})",
              "    return _withheld"]
    namespace: dict = {}
    exec(compile("\n".join(lines), f"<withheld {dotted}>", "exec"), namespace)
    raising = namespace["_outer"]().__code__
    if raising.co_freevars != free:
        raising = raising.replace(co_freevars=free)
    return raising.replace(co_name=code.co_name, co_qualname=getattr(code, "co_qualname", code.co_name))


_ACTIVE: dict = {"key": ((), ""), "swaps": []}  # what is withheld now, and how to give it back


@contextlib.contextmanager
def withholding(names, exercise: str):
    """From now until another exercise's request comes, the recorded code of ``names`` cannot run anywhere in
    this process (module doc); the swap is made once per exercise, at its first request. A reference that
    cannot be swapped (the code in a tuple, a frame running it now) raises Withheld at once."""
    key = (tuple(names), str(exercise))
    if key != _ACTIVE["key"]:
        _give_back()
        _withhold(*key)  # raises, and leaves the key unset, when a reference cannot be swapped: so does every call
        _ACTIVE["key"] = key
    yield


def _give_back() -> None:
    for kind, holder, index, code in reversed(_ACTIVE["swaps"]):
        if kind == "function":
            holder.__code__ = code
        elif kind == "item":
            holder[index] = code
        else:
            holder.cell_contents = code
    _ACTIVE["swaps"] = []
    _ACTIVE["key"] = ((), "")


def _withhold(names: tuple, exercise: str) -> None:
    swaps = _ACTIVE["swaps"]
    codes = {id(_CODES[d]): _CODES[d] for d in names if d in _CODES}  # no tuple of ours may hold a code
    named = {id(_CODES[d]): d for d in names if d in _CODES}
    if not codes:
        return
    raising = {key: _raiser(code, named[key], exercise) for key, code in codes.items()}
    own = {id(_CODES), id(swaps), id(codes), id(_ACTIVE)}
    blocked = None
    for holder in gc.get_referrers(*codes.values()):
        if id(holder) in own:
            continue
        if isinstance(holder, types.FunctionType) and id(holder.__code__) in codes:
            swaps.append(("function", holder, None, holder.__code__))
            holder.__code__ = raising[id(holder.__code__)]
        elif isinstance(holder, dict):
            for index, value in list(holder.items()):
                if id(value) in codes and value is codes[id(value)]:
                    swaps.append(("item", holder, index, value))
                    holder[index] = raising[id(value)]
        elif isinstance(holder, list):
            for index, value in enumerate(holder):
                if id(value) in codes and value is codes[id(value)]:
                    swaps.append(("item", holder, index, value))
                    holder[index] = raising[id(value)]
        elif isinstance(holder, types.CellType):
            value = holder.cell_contents
            if id(value) in codes:
                swaps.append(("cell", holder, None, value))
                holder.cell_contents = raising[id(value)]
        elif isinstance(holder, (tuple, types.FrameType)):
            frame_code = getattr(holder, "f_code", None)
            held = [v for v in (holder if isinstance(holder, tuple) else (frame_code,)) if id(v) in codes]
            if held:
                blocked = named[id(held[0])]
    if blocked is not None:
        raise Withheld(f"{blocked} is withheld while exercise {exercise} is graded, and its code is held where the "
                       "grader cannot withhold it (a tuple, or a call running now)")
