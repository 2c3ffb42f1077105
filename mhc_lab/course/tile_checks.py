"""Checking a learner's tile program: call their factory, compile it for TileLang's C target, explain failures."""

from __future__ import annotations

import contextlib
import logging
import os
import re
import sys
import tempfile

from mhc_lab.course.checks import CheckFailed, call
from mhc_lab.kernels._target import compile_program

# A Python variable used as a running sum (`s = 0.0`, then `s = s + ...` or `s += ...` in a T.serial loop) fails in
# one of two ways: building the program stops at the first use of `s` after its loop (TVM's "Immutable variable"),
# or, for `s += ...`, the program builds and compiling it finds the loop's variable used outside the loop.
_IMMUTABLE = re.compile(r"Immutable variable `([^`]+)` is used outside its defining region")
_LOOP_VARIABLE_ESCAPED = re.compile(r"variables \(([^)]*)\) are used, but are not passed in as API arguments")


def _python_accumulator(case: str, name: str | None = None, loop_vars: str | None = None) -> CheckFailed:
    """The usual mistake of a first reduction: a running sum in a Python variable instead of a local buffer."""
    if name:
        what = (f"your program keeps a running sum in `{name}`, a plain Python variable ({name} = 0.0, then "
                f"{name} = {name} + ... in a loop)")
    else:
        what = (f"a value computed inside a loop (over {loop_vars or 'a loop variable'}) is used after that loop, "
                "as a running sum kept in a plain Python variable is (s = 0.0, then s += ... in a loop)")
    return CheckFailed(
        f"{case}: {what}. This looks like the usual mistake: a Python accumulator. In a tile program a Python "
        "name is bound once, to one expression, inside the loop that computes it: the loop cannot update it, and "
        "it does not exist after the loop. Keep the running sum in a local buffer, a register: "
        "total = T.alloc_local((1,), \"float32\"); total[0] = 0.0 before the loop; total[0] += ... inside it; "
        "then read total[0] after it (out[r] = total[0]).")


@contextlib.contextmanager
def _stderr_held():
    """Hold what TVM's C++ code writes to stderr (its IR printer's warnings) while a program is built; yields a
    function that discards it. Unless discarded, it is written out afterwards, as it would have been."""
    sys.stderr.flush()
    try:
        saved = os.dup(2)
    except OSError:  # no real stderr (some embedded interpreters): nothing to hold
        yield lambda: None
        return
    held = tempfile.TemporaryFile()
    keep = [True]
    os.dup2(held.fileno(), 2)
    try:
        yield lambda: keep.__setitem__(0, False)
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)
        if keep[0]:
            held.seek(0)
            text = held.read().decode(errors="replace")
            if text:
                sys.stderr.write(text)
        held.close()


@contextlib.contextmanager
def _quiet_builder():
    """TileLang logs a failed program at CRITICAL with its whole generated source; the check says it better."""
    names = ("tilelang.language.eager.builder", "tilelang.cache.kernel_cache", "TileLang")
    loggers = [logging.getLogger(name) for name in names]
    before = [lg.disabled for lg in loggers]
    for lg in loggers:
        lg.disabled = True
    try:
        yield
    finally:
        for lg, was in zip(loggers, before):
            lg.disabled = was


def compile_learner_program(answer, args: tuple, case: str):
    """Call the learner's factory and compile its program for TileLang's C target; clear errors otherwise."""
    with _quiet_builder(), _stderr_held() as discard:
        try:
            program = call(answer, *args, case=case)
        except CheckFailed as failure:
            found = _IMMUTABLE.search(str(failure.__cause__ or ""))
            if found:
                discard()  # TVM's warnings from printing the IR of the failed program
                raise _python_accumulator(case, found.group(1)) from None
            raise
        if type(program).__name__ != "PrimFunc":
            raise CheckFailed(f"{case}: expected your factory to return a tile program (the function decorated "
                              f"with @T.prim_func), got {type(program).__name__}. Did you forget the return?")
        try:
            if getattr(type(program), "_mhc_lab_remote", False):
                # Graded: the program lives in the learner's kernel and is compiled and run there.
                return program._session.apply("mhc_lab.kernels._target.compile_program", program, "c")
            return compile_program(program, "c")
        except Exception as error:
            escaped = _LOOP_VARIABLE_ESCAPED.search(str(error))
            if escaped:
                discard()
                raise _python_accumulator(case, loop_vars=escaped.group(1).strip(" ,")) from None
            lines = [line for line in str(error).splitlines() if line.strip()]
            detail = next((line for line in lines if "Error" in line or "error" in line), lines[-1] if lines else "")
            raise CheckFailed(f"{case}: TileLang could not compile your program for the C target: "
                              f"{type(error).__name__}: {detail.strip()[:300]}. The C target runs CPU-style "
                              "programs: T.alloc_local buffers and T.serial / T.grid loops, no threads=") from None
