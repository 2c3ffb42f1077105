"""Hidden checks: the checks an instructor writes for an exercise beyond the visible one (tests/hidden/labNN.py,
never inside a lab notebook), and the generic ones every exercise gets where they apply (the visible check on fresh
inputs, inputs left unchanged, gradients matching the reference's).

    from mhc_lab.classroom.hidden_checks import hidden, same_as_reference

    @hidden("3.2", "doubly stochastic at n = 8")
    def _(sinkhorn_answer):
        ...

The grader reads the hidden check files once, in its own process (``read_hidden``), and hands their text to each
submission's kernel (``registry_from_sources``): no path to them is left where a submission could find it.
"""

from __future__ import annotations

import functools
import hashlib
import sys
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from mhc_lab.classroom.grading_kernel import tensors_in
from mhc_lab.classroom.notebook_build import ROOT

HIDDEN_DIR = ROOT / "tests" / "hidden"

# ---- hidden checks ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class HiddenCheck:
    exercise: str
    name: str
    run: Callable[[Any], object]  # raises (CheckFailed or anything) when the answer is wrong


HIDDEN: dict[str, list[HiddenCheck]] = {}  # checks registered outside a hidden check file (interactively)
_COLLECTING: list[dict[str, list[HiddenCheck]]] = []  # the registry a hidden check file being run registers into
_BY_DIRECTORY: dict[Path, dict[str, list[HiddenCheck]]] = {}


class HiddenChecksError(ValueError):
    """A folder of hidden checks is missing, empty, broken, or has no checks for a lab being graded."""


def hidden(exercise: str, name: str):
    """Decorator for a hidden check in tests/hidden/labNN.py: ``@hidden("3.2", "n = 1 and 16, batch dims")``.
    The function takes the learner's answer and raises (a CheckFailed with a plain message) when it is wrong."""

    def decorate(fn):
        registry = _COLLECTING[-1] if _COLLECTING else HIDDEN
        registry.setdefault(exercise, []).append(HiddenCheck(exercise, name, fn))
        return fn

    return decorate


def read_hidden(directory: Path | str) -> dict[str, str]:
    """The text of every ``lab*.py`` in ``directory`` ({file name: source}); a folder that is missing or holds
    no such file is an error naming it."""
    folder = Path(directory).resolve()
    if not folder.is_dir():
        raise HiddenChecksError(f"hidden checks folder {folder}: expected a folder of lab*.py files, "
                                f"{'got a file' if folder.exists() else 'found nothing there'} "
                                "(grade with --no-hidden to run the visible checks only)")
    sources = {path.name: path.read_text() for path in sorted(folder.glob("lab*.py")) if path.is_file()}
    if not sources:
        raise HiddenChecksError(f"hidden checks folder {folder}: expected lab*.py files, found none "
                                "(grade with --no-hidden to run the visible checks only)")
    return sources


def sources_digest(sources: dict[str, str]) -> str:
    """A SHA-256 of a set of hidden check files (names and text), to notice when they change."""
    digest = hashlib.sha256()
    for name in sorted(sources):
        digest.update(name.encode() + b"\0" + sources[name].encode() + b"\0")
    return digest.hexdigest()


def registry_from_sources(sources: dict[str, str], where: str = "hidden checks") -> dict[str, list[HiddenCheck]]:
    """Run hidden check files given as text ({file name: source}); returns their checks by exercise id. Nothing
    is read from disk, and the global registry is left alone."""
    registry: dict[str, list[HiddenCheck]] = {}
    _COLLECTING.append(registry)
    try:
        for name in sorted(sources):
            stem = Path(name).stem
            module = types.ModuleType(f"mhc_lab_hidden_{stem}")
            module.__file__ = f"<{where}: {name}>"
            sys.modules[module.__name__] = module
            try:
                exec(compile(sources[name], module.__file__, "exec"), module.__dict__)
            except Exception as error:
                raise HiddenChecksError(f"{where}: {name} does not run: {type(error).__name__}: {error}") from error
    finally:
        _COLLECTING.pop()
    return registry


def exercises_of_sources(sources: dict[str, str], where: str = "hidden checks") -> dict[str, set[str]]:
    """{file name: ids of the exercises it has checks for}."""
    return {name: set(registry_from_sources({name: text}, where)) for name, text in sources.items()}


def load_hidden(directory: Path | str | None = HIDDEN_DIR) -> dict[str, list[HiddenCheck]]:
    """The hidden checks of every ``lab*.py`` in ``directory`` by exercise id (read and run once per folder);
    ``None``: the checks registered outside a hidden check file."""
    if directory is None:
        return HIDDEN
    folder = Path(directory).resolve()
    if folder not in _BY_DIRECTORY:
        _BY_DIRECTORY[folder] = registry_from_sources(read_hidden(folder), f"hidden checks in {folder}")
    return _BY_DIRECTORY[folder]


def same_as_reference(answer, reference, *args, case: str, name: str = "result", rel: float = 1e-9, **kwargs):
    """Hidden-check helper: call the learner's function and the reference on the same arguments (the reference on
    float64 copies of floating tensors, its result cast back) and compare: tensors with checks.assert_close,
    tuples element by element, numbers with checks.expect_number. Returns ``case``."""
    import torch

    from mhc_lab.course.checks import CheckFailed, assert_close, call, expect_number

    got = call(answer, *_clone(args), case=case, **_clone(kwargs))

    def wide(v):
        if isinstance(v, torch.Tensor) and v.is_floating_point():
            return v.detach().to(torch.float64)
        if isinstance(v, (list, tuple)) and not hasattr(v, "_fields"):
            return type(v)(wide(x) for x in v)
        return v

    expected = reference(*[wide(a) for a in args], **{k: wide(v) for k, v in kwargs.items()})
    floating = [t for t in tensors_in((args, kwargs)) if t.is_floating_point()]
    dtype = floating[0].dtype if floating else None

    def compare(g, e, label):
        if isinstance(e, torch.Tensor):
            e = e.to(dtype) if dtype is not None and e.is_floating_point() else e
            assert_close(g, e, case=case, name=label)
        elif isinstance(e, (tuple, list)):
            if not isinstance(g, (tuple, list)) or len(g) != len(e):
                raise CheckFailed(f"{case}: expected {label} to be {len(e)} values, got {type(g).__name__}")
            for index, (gi, ei) in enumerate(zip(g, e)):
                compare(gi, ei, f"{label}[{index}]")
        else:
            expect_number(g, float(e), case=case, name=label, rel=rel)

    compare(got, expected, name)
    return case


# ---- generic hidden checks ----------------------------------------------------------------------------------


def _clone(value):
    import torch

    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        return type(value)(_clone(v) for v in value)
    if isinstance(value, dict):
        return {k: _clone(v) for k, v in value.items()}
    return value


def recorder(fn):
    """``fn`` wrapped to record a copy of the arguments of every call (taken before the call)."""
    calls: list[tuple[tuple, dict]] = []

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        calls.append((_clone(args), _clone(kwargs)))
        return fn(*args, **kwargs)

    return wrapper, calls


def _same(a, b) -> bool:
    import torch

    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape
                and a.dtype == b.dtype and bool(torch.equal(a, b) or (a.isnan().all() and b.isnan().all())))
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    try:
        return bool(a == b)
    except Exception:
        return False


def _float_leaves(args, kwargs):
    """Copies of the arguments in which every top-level float32/float64 tensor requires grad; and those leaves."""
    import torch

    leaves = []

    def prepare(v):
        if isinstance(v, torch.Tensor) and v.dtype in (torch.float32, torch.float64) and v.numel() > 0:
            leaf = v.detach().clone().requires_grad_(True)
            leaves.append(leaf)
            return leaf
        return _clone(v)

    return tuple(prepare(a) for a in args), {k: prepare(v) for k, v in kwargs.items()}, leaves


def gradients_of(fn, args, kwargs):
    """Gradients of a fixed random projection of fn's tensor outputs with respect to its float tensor inputs;
    None when the output does not depend differentiably on any input. (Run where ``fn`` lives: for a
    learner's function being graded, in the learner's kernel.)"""
    import torch

    a, k, leaves = _float_leaves(args, kwargs)
    if not leaves:
        return None
    with torch.enable_grad():
        outputs = [t for t in tensors_in(fn(*a, **k)) if t.requires_grad and t.is_floating_point()]
        if not outputs:
            return None
        generator = torch.Generator().manual_seed(1234)
        loss = sum((o * torch.randn(o.shape, generator=generator, dtype=torch.float64).to(o.dtype)).sum()
                   for o in outputs)
        grads = torch.autograd.grad(loss, leaves, allow_unused=True)
    return [None if g is None else g.detach() for g in grads]


def _gradients(fn, args, kwargs):
    if getattr(type(fn), "_mhc_lab_remote", False):
        return fn._session.apply("mhc_lab.classroom.hidden_checks.gradients_of", fn, args, kwargs)
    return gradients_of(fn, args, kwargs)


def _compare_gradients(answer, solution, calls, case_names) -> None:
    import torch

    from mhc_lab.course.checks import CheckFailed

    for (args, kwargs), case in zip(calls, case_names):
        expected = _gradients(solution, args, kwargs)
        if expected is None:
            continue
        try:
            got = _gradients(answer, args, kwargs)
        except RuntimeError as error:
            raise CheckFailed(f"{case}: backpropagating through your function failed: {error}") from None
        if got is None:
            raise CheckFailed(f"{case}: your result carries no gradient (the reference's does): was it detached, "
                              "computed under torch.no_grad, through .item(), numpy or a Python float?")
        for index, (g, e) in enumerate(zip(got, expected)):
            if e is None:
                continue
            if g is None:
                raise CheckFailed(f"{case}: no gradient reaches tensor argument {index} (the reference's does)")
            e64, g64 = e.to(torch.float64), g.to(torch.float64)
            rtol, atol = (1e-3, 1e-4) if e.dtype == torch.float32 else (1e-7, 1e-9)
            atol = atol * max(1.0, float(e64.abs().max()))
            if e64.shape != g64.shape or not torch.allclose(g64, e64, rtol=rtol, atol=atol):
                worst = float((g64 - e64).abs().max()) if e64.shape == g64.shape else float("nan")
                raise CheckFailed(f"{case}: the gradient with respect to tensor argument {index} differs from the "
                                  f"reference's (largest difference {worst:.3g})")


def fresh_draw_for_variant(seed: int) -> int:
    """Which fresh draw of the visible check's inputs a variant's grading uses (checks.fresh_inputs): one of its
    own for each variant (the notebook's SEED), so that two learners' graded answers are computed on other
    inputs; 1 for SEED 0."""
    return 1 + int(seed) % 104_729


def generic_checks(exercise, answer, learner_calls: list | None) -> list[HiddenCheck]:
    """The generic hidden checks that apply to this exercise (those the reference solution itself passes)."""
    from mhc_lab.course.checks import fresh_inputs, variant_seed

    solution = exercise.library_function()
    fresh_draw = fresh_draw_for_variant(variant_seed())
    if not (callable(answer) and callable(solution)):
        return []
    found = []
    # Record the reference's calls on the visible inputs and on fresh ones.
    wrapped, visible_calls = recorder(solution)
    fresh_wrapped, fresh_calls = recorder(solution)
    try:
        exercise.checker(wrapped)
        with fresh_inputs(fresh_draw):
            exercise.checker(fresh_wrapped)
        fresh_ok = not _same(visible_calls, fresh_calls)
    except Exception:
        fresh_ok = False
    if fresh_ok:
        def fresh(answer):
            with fresh_inputs(fresh_draw):
                return exercise.checker(answer)

        found.append(HiddenCheck(exercise.id, "visible check on fresh random inputs", fresh))

    calls = visible_calls[:4]
    if calls and learner_calls is not None:
        def unchanged_by(fn, args, kwargs) -> bool:
            a, k = _clone(args), _clone(kwargs)
            fn(*a, **k)
            return _same(a, args) and _same(k, kwargs)

        try:
            reference_keeps_inputs = all(unchanged_by(solution, a, k) for a, k in calls)
        except Exception:
            reference_keeps_inputs = False
        if reference_keeps_inputs and any(tensors_in(c) for c in calls):
            def inputs_unchanged(answer):
                from mhc_lab.course.checks import CheckFailed

                for number, (args, kwargs) in enumerate(calls[:3]):
                    a, k = _clone(args), _clone(kwargs)
                    answer(*a, **k)
                    if not (_same(a, args) and _same(k, kwargs)):
                        raise CheckFailed(f"call {number + 1} of the visible check: your function changed one of "
                                          "its input tensors in place; work on a copy (or out-of-place ops)")
                return ["inputs unchanged"]

            found.append(HiddenCheck(exercise.id, "leaves its inputs unchanged", inputs_unchanged))

        try:
            differentiable = [c for c in calls if _gradients(solution, *c) is not None][:2]
        except Exception:
            differentiable = []
        if differentiable:
            def gradients(answer):
                names = [f"call {i + 1} of the visible check" for i in range(len(differentiable))]
                _compare_gradients(answer, solution, differentiable, names)
                return names

            found.append(HiddenCheck(exercise.id, "gradients match the reference's", gradients))
    return found


