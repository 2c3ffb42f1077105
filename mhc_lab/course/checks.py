"""Exercise checks: one call per exercise that compares the learner's answer with the reference and explains.

    from mhc_lab.course.checks import check, hint
    check("3.2", my_sinkhorn)      # prints what passed, or raises CheckFailed with a plain message
    hint("3.2")                    # level 1; hint("3.2", 2) says more

Each exercise registers its checker, its hints, its usual mistakes, and the name of the library function that
holds the exercise's equation (``library``, e.g. "mhc_lab.reference.sinkhorn_paper"). The registry carries no
answer of its own: the checks compute the true values from the library's math or from data, and an answer that
calls the exercise's own library function fails (``library_calls`` watches for it, here and when grading). The
test suite proves for every exercise that the library function passes the checker, the stub fails, and each
usual mistake is named.
"""

from __future__ import annotations

import contextlib
import importlib
import math
import sys
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch


class _ShownAsItsMessage:
    """An exception that IPython shows as its message alone (``_render_traceback_``), not as a traceback through
    the checker's code: the checker's lines are not the learner's concern, and some would give the answer away.
    When the learner's own function raised, its traceback (from the learner's code on) comes first."""

    def _render_traceback_(self) -> list[str]:
        cause = self.__cause__
        lines = _learner_traceback(cause) if isinstance(cause, Exception) and not isinstance(
            cause, _ShownAsItsMessage) else []
        return lines + [f"\x1b[0;31m{type(self).__name__}\x1b[0m: {self}"]


def _learner_traceback(error: Exception) -> list[str]:
    """The traceback of ``error`` from the first frame outside this module (the learner's code) on."""
    tb = error.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename == __file__:
        tb = tb.tb_next
    if tb is None:
        return []
    try:
        from IPython import get_ipython

        shell = get_ipython()
        if shell is not None:
            return shell.InteractiveTB.structured_traceback(type(error), error, tb)
    except Exception:  # no IPython, or its formatter failed: plain Python's
        pass
    import traceback

    return "".join(traceback.format_exception(type(error), error, tb)).splitlines()


class CheckFailed(_ShownAsItsMessage, AssertionError):
    """The answer is wrong; the message says how (shape, dtype or values), how close it is, and names the usual
    mistake that explains it."""


class ExerciseIncomplete(_ShownAsItsMessage, NotImplementedError):
    """The answer is still the stub."""


@dataclass(frozen=True)
class Mistake:
    """A wrong answer the checker must recognise, and a phrase its message must contain."""

    answer: Any
    says: str


@dataclass
class Exercise:
    id: str
    title: str
    checker: Callable[[Any], Sequence[str]]
    hints: list[str]
    library: str | None  # dotted name of the library function that holds this exercise's equation (None: a
    # value exercise, whose checker computes its expected value from the variant)
    mistakes: list[Mistake] = field(default_factory=list)

    def library_function(self) -> Callable | None:
        """The library function named by ``library`` (the grader's reference for its generic checks)."""
        return resolve(self.library) if self.library else None


REGISTRY: dict[str, Exercise] = {}
# Modules that register exercises, imported on first use so that a check works after a plain import.
EXERCISE_MODULES = ("lab00", "lab01", "lab02", "lab03", "lab04", "lab05", "lab06", "lab07", "lab08")

# One tolerance table: (rtol, atol) for comparing a result of this dtype with a float64 reference.
TOLERANCE = {
    torch.float64: (1e-9, 1e-12),
    torch.float32: (1e-4, 1e-5),
    torch.bfloat16: (2e-2, 2e-2),
    torch.float16: (5e-3, 5e-3),
}


def register(id: str, title: str, *, hints: Sequence[str], library: str | None,
             mistakes: Sequence[Mistake] = ()):
    """Decorator: register ``checker(answer) -> list of case descriptions`` as the check of exercise ``id``;
    ``library`` names the library function that holds the exercise's equation ("package.module.function"), or
    is None for a value exercise."""

    def decorate(checker):
        if id in REGISTRY:
            raise ValueError(f"exercise {id} is registered twice")
        if library is not None and (not isinstance(library, str) or "." not in library):
            raise ValueError(f"exercise {id}: library: expected a dotted function name, got {library!r}")
        REGISTRY[id] = Exercise(id, title, checker, list(hints), library, list(mistakes))
        return checker

    return decorate


def resolve(dotted: str) -> Callable:
    """The function a dotted name ("package.module.function") names."""
    module, _, name = dotted.rpartition(".")
    return getattr(importlib.import_module(module), name)


# ---- an answer that calls the exercise's own library function ---------------------------------------------


class library_calls:
    """Watches for calls of the named library functions (their code, however they are reached: imported under
    another name, wrapped, rebuilt from their code object) made while a learner's function runs, in any thread::

        watch = library_calls(["mhc_lab.reference.sinkhorn_paper"])
        answer = watch.wrap(answer)     # the checker calls this; the reference's own calls are not watched
        ...; watch.seen                 # the dotted names the learner's function called

    The checks wrap a learner's function in it: an answer that calls the exercise's own library function does
    not count."""

    def __init__(self, names: Sequence[str]):
        self.codes = {}
        for dotted in filter(None, names):
            fn = resolve(dotted)
            code = getattr(getattr(fn, "__wrapped__", fn), "__code__", None)
            if code is not None:
                self.codes[code] = dotted
        self.seen: set[str] = set()
        self._depth = 0

    def _profile(self, frame, event, arg):
        if event == "call":
            name = self.codes.get(frame.f_code)
            if name is not None:
                self.seen.add(name)

    @contextlib.contextmanager
    def watching(self):
        """Watch while the block runs (nested blocks watch once)."""
        if not self.codes or self._depth:
            self._depth += 1
            try:
                yield
            finally:
                self._depth -= 1
            return
        saved = sys.getprofile(), threading.getprofile()
        sys.setprofile(self._profile)
        threading.setprofile(self._profile)
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1
            sys.setprofile(saved[0])
            threading.setprofile(saved[1])

    def wrap(self, fn: Callable) -> Callable:
        """``fn`` watched while it runs (and whatever it returns that is itself a function, e.g. a compiled
        program, is not: its work is the learner's, already traced when built)."""
        if not callable(fn):
            return fn

        def watched(*args, **kwargs):
            with self.watching():
                return fn(*args, **kwargs)

        watched.__name__ = getattr(fn, "__name__", "answer")
        watched.__doc__ = getattr(fn, "__doc__", None)
        watched.__wrapped__ = fn
        return watched


def library_use_message(exercise_id: str, names) -> str:
    listed = ", ".join(f"`{name}`" for name in sorted(names))
    return (f"Exercise {exercise_id}: your function calls {listed}, the library's own answer to this exercise. "
            "Write it yourself: the library's version is there to compare with, after your own passes.")


def _load(module: str) -> None:
    try:
        importlib.import_module(f"mhc_lab.course.exercises.{module}")
    except ModuleNotFoundError as error:
        if error.name != f"mhc_lab.course.exercises.{module}":
            raise


def _load_all() -> None:
    for module in EXERCISE_MODULES:
        _load(module)


def _exercise_id(id) -> str:
    """An exercise id as registered, "6.1"; a number 6.1 is taken as the string it prints as."""
    if isinstance(id, str):
        return id
    if isinstance(id, (int, float)) and not isinstance(id, bool):
        return str(id)
    raise TypeError(f"exercise id: expected a string such as \"6.1\", got {type(id).__name__} {id!r}")


def get_exercise(id: str) -> Exercise:
    id = _exercise_id(id)
    if id not in REGISTRY:
        # Exercise "3.2" lives in exercises/lab03.py: load that lab alone, so one lab's checks never depend
        # on another lab's module importing cleanly.
        lab = id.split(".")[0]
        if lab.isdigit():
            _load(f"lab{int(lab):02d}")
    if id not in REGISTRY:
        _load_all()
    if id not in REGISTRY:
        raise KeyError(f"no exercise {id!r}; known: {sorted(REGISTRY, key=_order)} (give the id as a string: a "
                       "number such as 6.10 reads as 6.1)")
    return REGISTRY[id]


def all_exercises() -> list[Exercise]:
    _load_all()
    return [REGISTRY[k] for k in sorted(REGISTRY, key=_order)]


def _order(id: str):
    return tuple(int(part) for part in id.split("."))


def run_check(id: str, answer: Any) -> list[str]:
    """Run exercise ``id``'s checker on ``answer`` quietly; returns the passed cases or raises (CheckFailed when
    the answer calls the exercise's own library function)."""
    exercise = get_exercise(id)
    watch = library_calls([exercise.library])
    try:
        cases = list(exercise.checker(watch.wrap(answer)))
    except NotImplementedError as error:
        if str(error).startswith("Exercise"):
            raise ExerciseIncomplete(f"{error} -- not done yet: replace the `raise NotImplementedError` line") from None
        raise
    except CheckFailed as failure:
        if watch.seen:  # the answer is wrong, and it would not count if it were right
            raise CheckFailed(f"{failure} Besides: {library_use_message(exercise.id, watch.seen)}") from None
        raise
    if watch.seen:
        raise CheckFailed(library_use_message(exercise.id, watch.seen))
    return cases


def check(id: str, answer: Any) -> None:
    """Check exercise ``id``; prints a one-line summary when it passes."""
    exercise = get_exercise(id)
    cases = run_check(id, answer)
    print(f"Exercise {id} ({exercise.title}): passed {len(cases)} case{'s' if len(cases) != 1 else ''}.")


def hint(id: str, level: int = 1) -> None:
    """Print hints 1..level of exercise ``id``."""
    exercise = get_exercise(id)
    id = exercise.id
    if not exercise.hints:
        print(f"Exercise {id} has no hints.")
        return
    level = max(1, min(level, len(exercise.hints)))
    for k in range(level):
        print(f"Hint {k + 1}/{len(exercise.hints)} for exercise {id}: {exercise.hints[k]}")
    if level < len(exercise.hints):
        print(f"(hint({id!r}, {level + 1}) says more)")


# ---- helpers the checkers share ---------------------------------------------------------------------------


def call(answer: Callable, *args, case: str, **kwargs):
    """Call the learner's function on private copies of the arguments; an exception becomes a CheckFailed that
    names the case.

    The learner's function never holds the checker's own tensors (nor the objects holding them: a layer, a
    model), so a checker may compute its expected value from them before or after the call alike: a function
    that writes into its inputs cannot move the expected value with it. A function that changes one of its
    inputs in place fails, whatever it returns: it writes over its caller's tensor."""
    if not callable(answer):
        raise CheckFailed(f"expected a function, got {type(answer).__name__}")
    mine, theirs = (args, kwargs), private_copy((args, kwargs))
    try:
        got = answer(*theirs[0], **theirs[1])
    except NotImplementedError:
        raise
    except CheckFailed:
        raise
    except Exception as error:  # the learner's code failed: say where, keep their traceback
        raise CheckFailed(f"on {case} your function raised {type(error).__name__}: {error}") from error
    changed = changed_inputs(mine, theirs)
    if changed:
        raise CheckFailed(
            f"on {case} your function changed its input {', '.join(changed[:3])} in place. This looks like the usual "
            "mistake: an in-place operation (h += f(h), h.add_(...)) writes over the caller's tensor, and in a stack "
            "every state ends up being the same tensor. Work on a copy, or write h = h + f(h), which makes a new one.")
    return got


def _is_remote(value) -> bool:
    return getattr(type(value), "_mhc_lab_remote", False)


def private_copy(value, _depth: int = 0):
    """A copy of ``value`` that shares no tensor with it: tensors cloned (a leaf keeps requires_grad), lists,
    tuples and dicts copied item by item, other objects (a layer, a model) deep-copied where they can be; a
    function, a module, or an object of the learner's kernel stays itself."""
    import copy
    import types

    if isinstance(value, torch.Tensor):
        twin = value.detach().clone()
        return twin.requires_grad_(True) if value.requires_grad and twin.is_floating_point() else twin
    if _depth > 16 or value is None or _is_remote(value) or isinstance(
            value, (bool, int, float, complex, str, bytes, torch.dtype, torch.device, type, types.ModuleType,
                    types.FunctionType, types.BuiltinFunctionType, types.MethodType)):
        return value
    if isinstance(value, tuple):
        items = [private_copy(v, _depth + 1) for v in value]
        return type(value)(*items) if hasattr(value, "_fields") else tuple(items)
    if isinstance(value, list):
        return [private_copy(v, _depth + 1) for v in value]
    if isinstance(value, dict) and type(value) is dict:
        return {k: private_copy(v, _depth + 1) for k, v in value.items()}
    try:
        return copy.deepcopy(value)
    except Exception:
        return value


def _tensors_within(value, where: str, found: list, depth: int = 0) -> None:
    """(where, tensor) for every tensor in ``value``: in lists, tuples, dicts and the attributes of objects."""
    if isinstance(value, torch.Tensor):
        found.append((where, value))
        return
    if depth > 8 or value is None or _is_remote(value) or isinstance(value, (bool, int, float, str, bytes)):
        return
    if isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            _tensors_within(item, f"{where}[{index}]", found, depth + 1)
    elif isinstance(value, dict):
        for key, item in value.items():
            _tensors_within(item, f"{where}[{key!r}]", found, depth + 1)
    elif isinstance(getattr(value, "__dict__", None), dict) and not isinstance(value, type):
        for key, item in vars(value).items():
            _tensors_within(item, f"{where}.{key}", found, depth + 1)


def changed_inputs(mine, theirs) -> list[str]:
    """Where the tensors of ``theirs`` (a private_copy of ``mine``, ``(args, kwargs)``) no longer equal those of
    ``mine``, named as a learner reads them ("argument 1", "x", "argument 2.weight")."""
    def named(call_args):
        found: list = []
        for index, item in enumerate(call_args[0]):
            _tensors_within(item, f"argument {index + 1}", found)
        for key, item in call_args[1].items():
            _tensors_within(item, f"`{key}`", found)
        return found

    before, after = named(mine), named(theirs)
    if len(before) != len(after):
        return ["(its structure)"]
    changed = []
    for (where, a), (_, b) in zip(before, after):
        with torch.no_grad():
            same = (a.shape == b.shape and a.dtype == b.dtype
                    and (torch.equal(a, b) or bool(((a == b) | (a.isnan() & b.isnan())).all())
                         if a.is_floating_point() or a.is_complex() else torch.equal(a, b)))
        if not same:
            changed.append(where)
    return changed


def _index_str(flat_index: int, shape) -> str:
    idx = []
    for size in reversed(shape):
        idx.append(flat_index % size)
        flat_index //= size
    return str(tuple(reversed(idx)))


# ---- one diagnosis for every comparison ---------------------------------------------------------------------
#
# A wrong answer is told how far it is from the expected value, with the digits that show the difference. Then,
# if a usual mistake explains it better than a slip does (the answer is ten times nearer to the mistake's value
# than to the expected one), that mistake is named; else, if the answer is close, the message says so. A mistake
# that happens to give the expected value on some case (Wᵀ = W for a 1x1 W) therefore never matches there, and a
# near-correct answer is never blamed on a mistake far from it.

CLOSE = 1e-3  # a wrong answer within this fraction of the expected values' size is close
CLOSE_ABS = 1e-6  # and so is one this near them, whatever their size (float32's rounding of numbers near 1)
NEARER = 0.1  # a mistake is named when the answer is this much nearer to its value than to the expected one
SLIP = ("A difference this small is a slip rather than a wrong formula: a constant (an eps), a dtype (float32 "
        "arithmetic where float64 is expected), or the order of operations.")


def pair(expected: float, got: float) -> tuple[str, str]:
    """Two numbers printed with as many digits as it takes to tell them apart (at least 6 significant; whole
    numbers as they are)."""
    if float(expected).is_integer() and abs(expected) < 1e15:  # a count: as it is, got with the decimals it needs
        if not (math.isfinite(got) and abs(got) < 1e15):
            return f"{int(expected)}", f"{got:g}"
        for decimals in range(0, 12):
            g = f"{got:.{decimals}f}"
            if float(g) != expected or decimals == 11:
                return f"{int(expected)}", g
    for digits in range(6, 18):
        e, g = f"{expected:#.{digits}g}", f"{got:#.{digits}g}"
        if e != g:
            return e, g
    return repr(float(expected)), repr(float(got))


def is_close(off: float, size: float, tolerance: float = 0.0) -> bool:
    """Whether a difference ``off`` from values of size ``size`` is close: within CLOSE of it (or ten times the
    comparison's own relative tolerance, if looser), or within CLOSE_ABS."""
    return math.isfinite(off) and off <= max(CLOSE, 10 * tolerance) * size + CLOSE_ABS


def _relative(off: float, size: float, of: str) -> str:
    """' (3e-05 of the largest expected value)', when that says something."""
    return f" ({off / size:.2g} of {of})" if 0 < off <= size else ""


def _as_float64(value) -> torch.Tensor | None:
    if isinstance(value, torch.Tensor):
        return value.detach().to(torch.float64).cpu()
    try:
        return torch.tensor(float(value), dtype=torch.float64)
    except (TypeError, ValueError, OverflowError):
        return None


def recognise(got, expected, mistakes: dict | None) -> str:
    """The usual mistake that explains ``got`` better than being close to ``expected`` does, as a sentence
    (". This looks like the usual mistake: ..."), or "". ``mistakes`` maps each explanation to the value that
    mistake gives, a tensor or a number. The nearest mistake is named when ``got`` is ten times nearer to it
    than to ``expected``; with ``expected`` None (got's shape is wrong), when ``got`` equals it within 1e-4."""
    g = _as_float64(got)
    if not mistakes or g is None:
        return ""
    e = _as_float64(expected) if expected is not None else None
    off = (g - e).abs().max().item() if e is not None and e.shape == g.shape and g.numel() else None
    best, nearest = None, math.inf
    for explanation, wrong in mistakes.items():
        w = _as_float64(wrong)
        if w is None or w.shape != g.shape or w.numel() == 0:
            continue
        distance = (g - w).abs().max().item()
        if off is None:
            matches = torch.allclose(g, w, rtol=1e-4, atol=1e-6)
        else:
            matches = math.isfinite(distance) and distance <= NEARER * off
        if matches and distance < nearest:
            best, nearest = explanation, distance
    return f". This looks like the usual mistake: {best}" if best is not None else ""


def assert_close(
    got,
    expected: torch.Tensor,
    *,
    case: str,
    name: str = "result",
    rtol: float | None = None,
    atol: float | None = None,
    check_dtype: bool = True,
    mistakes: dict[str, torch.Tensor] | None = None,
) -> None:
    """Compare a tensor with the expected one: type, shape, dtype, NaN, then values; a wrong value is said to be
    close when it is, and named as the usual mistake it matches when that explains it better."""
    if not isinstance(got, torch.Tensor):
        raise CheckFailed(f"{case}: expected {name} to be a torch.Tensor, got {type(got).__name__}")
    if tuple(got.shape) != tuple(expected.shape):
        message = f"{case}: expected {name} of shape {tuple(expected.shape)}, got {tuple(got.shape)}"
        raise CheckFailed(message + recognise(got, None, mistakes))
    if check_dtype and got.dtype != expected.dtype:
        raise CheckFailed(f"{case}: expected {name} of dtype {expected.dtype}, got {got.dtype}")
    default_rtol, default_atol = TOLERANCE.get(expected.dtype, (1e-4, 1e-5))
    rtol = default_rtol if rtol is None else rtol
    atol = default_atol if atol is None else atol
    g, e = got.detach().to(torch.float64).cpu(), expected.detach().to(torch.float64).cpu()
    if torch.isnan(g).any() and not torch.isnan(e).any():
        where = _index_str(int(torch.isnan(g).flatten().nonzero()[0]), g.shape)
        raise CheckFailed(f"{case}: {name} has NaN at index {where}; the expected values are all finite")
    diff = (g - e).abs()
    bad = diff > atol + rtol * e.abs()
    if bad.any():
        raise CheckFailed(_values_differ(g, e, diff.nan_to_num(0.0), bad, case=case, name=name, rtol=rtol,
                                         usual=recognise(g, e, mistakes)))


def _values_differ(g, e, diff, bad, *, case: str, name: str, rtol: float, usual: str) -> str:
    """How the values differ (how many, the largest difference and where), then the usual mistake that explains
    it, or else whether the answer is close."""
    worst = int(diff.flatten().argmax())
    off, size = diff.flatten()[worst].item(), e.abs().nan_to_num(0.0).max().item()
    want, have = pair(e.flatten()[worst].item(), g.flatten()[worst].item())
    where = f"at index {_index_str(worst, g.shape)}: expected {want}, got {have}"
    count = f"{int(bad.sum())} of {bad.numel()} entries"
    if not usual and is_close(off, size, rtol):
        return (f"{case}: {name} is close, but not within the tolerance: {count} differ, the largest by {off:.2g}"
                f"{_relative(off, size, 'the largest expected value')} {where}. {SLIP}")
    return f"{case}: {name} differs in {count}; largest difference {off:.3g} {where}{usual}"


class TanhLayer:
    """F(h) = tanh(h Wᵀ + b), computed in h's dtype: the layer a check hands to a learner's function. A class
    rather than a closure, so that the grader can send it to the learner's kernel."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor):
        self.weight, self.bias = weight, bias

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        return torch.tanh(h @ self.weight.to(h.dtype).T + self.bias.to(h.dtype))


def seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed + _FRESH_INPUTS[0])


def randn(*shape, seed: int, dtype=torch.float64, scale: float = 1.0) -> torch.Tensor:
    """Seeded normal random numbers (never zeros), the same on every machine."""
    return (torch.randn(*shape, generator=seeded(seed), dtype=torch.float64) * scale).to(dtype)


def expect_number(got, expected: float, *, case: str, name: str, rel: float = 1e-6, explain: str = "",
                  mistakes: dict[str, float] | None = None) -> None:
    """Compare a number (a prediction, a count) with the expected one, within ``rel`` of it; a wrong number is
    said to be close when it is, and named as the usual mistake (``mistakes``: explanation -> the number that
    mistake gives) that explains it better; ``explain`` says why they can differ."""
    try:
        value = float(got)
    except (TypeError, ValueError, OverflowError):
        raise CheckFailed(f"{case}: expected {name} to be a number, got {type(got).__name__}") from None
    off = abs(value - expected)
    if not off <= rel * max(abs(expected), 1e-12):  # NaN fails too
        want, have = pair(expected, value)
        usual = recognise(value, expected, mistakes)
        message = f"{case}: expected {name} = {want}, got {have}{usual}"
        if not usual and is_close(off, abs(expected), rel):
            message += (f": close{_relative(off, abs(expected), 'it')}, but not within the tolerance ({rel:g} of "
                        f"it). {SLIP}")
        raise CheckFailed(f"{message.rstrip('.')}. {explain}".rstrip())


# ---- variants: each section or student can get other numbers --------------------------------------------------
#
# A notebook's papermill parameters (SEED, and any lab parameter such as n or C that the lab passes to setup())
# are its *variant*. setup() records them here; a checker that compares a value answer (a prediction, a count)
# computes the expected value from variant() instead of a constant, so an answer copied from a notebook run
# with other parameters fails. With no variant recorded (checks called outside a lab), variant() is {}.

_VARIANT: dict[str, Any] = {}


def set_variant(**parameters: Any) -> None:
    """Record the running notebook's variant parameters (setup() calls this; replaces what was recorded)."""
    _VARIANT.clear()
    _VARIANT.update(parameters)


def variant() -> dict[str, Any]:
    """The running notebook's variant parameters, e.g. {"SEED": 17, "n": 4}; {} when none was recorded."""
    return dict(_VARIANT)


def variant_value(name: str, default: Any = None) -> Any:
    """One variant parameter (``default`` when the notebook did not set it)."""
    return _VARIANT.get(name, default)


def variant_seed(salt: int = 0) -> int:
    """A seed that depends on the variant's SEED: for a checker whose expected value must differ by variant."""
    return int(_VARIANT.get("SEED", 0)) * 1_000_003 + int(salt)


# ---- fresh inputs: the grader re-runs a visible check on other random inputs ------------------------------

_FRESH_INPUTS = [0]


class fresh_inputs:
    """Within ``with fresh_inputs(k):`` every ``seeded``/``randn`` seed is shifted, so a checker draws other
    random inputs than the visible check did (k = 0 changes nothing). Used by the hidden checks of grading."""

    def __init__(self, k: int):
        self.offset = int(k) * 7_919_111

    def __enter__(self):
        self.saved = _FRESH_INPUTS[0]
        _FRESH_INPUTS[0] = self.offset
        return self

    def __exit__(self, *exc):
        _FRESH_INPUTS[0] = self.saved
        return False
