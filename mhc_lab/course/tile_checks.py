"""Checking a learner's tile program: call their factory, compile it for TileLang's C target, explain failures."""

from __future__ import annotations

import contextlib
import logging

from mhc_lab.course.checks import CheckFailed, call
from mhc_lab.kernels._target import compile_program


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
    with _quiet_builder():
        program = call(answer, *args, case=case)
        if type(program).__name__ != "PrimFunc":
            raise CheckFailed(f"{case}: expected your factory to return a tile program (the function decorated "
                              f"with @T.prim_func), got {type(program).__name__}. Did you forget the return?")
        try:
            return compile_program(program, "c")
        except Exception as error:
            lines = [line for line in str(error).splitlines() if line.strip()]
            detail = next((line for line in lines if "Error" in line or "error" in line), lines[-1] if lines else "")
            raise CheckFailed(f"{case}: TileLang could not compile your program for the C target: "
                              f"{type(error).__name__}: {detail.strip()[:300]}. The C target runs CPU-style "
                              "programs: T.alloc_local buffers and T.serial / T.grid loops, no threads=") from None
