"""Input checks shared by every layer: one place that says what was expected and what was given.

Value checks (NaN, inf) read a value back to the host. The reference functions make them, except inside
``skipping_value_checks()``: mhc_lab.ops runs the same math there, with no host sync, and lets NaN and inf
propagate to its outputs instead.
"""

from __future__ import annotations

import contextlib
import contextvars

import torch

_VALUE_CHECKS = contextvars.ContextVar("mhc_lab_value_checks", default=True)


class InputError(ValueError):
    """Raised when an argument has the wrong shape, dtype, device or value; the message says which."""


def _describe(t: torch.Tensor) -> str:
    return f"shape {tuple(t.shape)}, dtype {t.dtype}, device {t.device}"


def require_tensor(name: str, value) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise InputError(f"{name}: expected a torch.Tensor, got {type(value).__name__}")
    return value


def require_lanes(name: str, x, n: int | None = None) -> tuple[int, int]:
    """Check a residual stream ``[..., n, C]``; return (n, C)."""
    x = require_tensor(name, x)
    if x.dim() < 2:
        raise InputError(
            f"{name}: expected a residual stream of shape [..., n, C] (at least 2 dims), got {_describe(x)}"
        )
    if not x.is_floating_point():
        raise InputError(f"{name}: expected a floating-point tensor, got {_describe(x)}")
    lanes, width = x.shape[-2], x.shape[-1]
    if n is not None and lanes != n:
        swapped = " (the last two dims look swapped: lanes [..., C, n]?)" if width == n else ""
        raise InputError(f"{name}: expected n = {n} lanes in dim -2 of [..., n, C], got {_describe(x)}{swapped}")
    if lanes < 1 or width < 1:
        raise InputError(f"{name}: expected n >= 1 and C >= 1, got {_describe(x)}")
    return lanes, width


def require_lanes_not_transposed(name: str, x: torch.Tensor, phi, op: str = "") -> None:
    """Refuse lanes passed as [..., C, n]: phi [n^2+2n, nC] says which of x's last two dims is n.

    Lanes and phi checked separately would blame phi (its rows do not fit the n read from x); when the rows fit
    x's last dim instead, the likely mistake is the lanes' layout, and the message names x."""
    if not isinstance(phi, torch.Tensor) or phi.dim() != 2:
        return
    lanes, width = x.shape[-2], x.shape[-1]
    rows = phi.shape[0]
    if lanes == width or rows == lanes * lanes + 2 * lanes:
        return
    if rows == width * width + 2 * width and phi.shape[1] == lanes * width:
        prefix = f"{op}: " if op else ""
        raise InputError(
            f"{prefix}{name}: expected lanes [..., n, C] with n = {width} (phi has n^2+2n = {rows} rows); "
            f"got [..., C, n]? {name} has shape {tuple(x.shape)}, so its last two dims look swapped: pass "
            f"{name}.transpose(-2, -1) (lanes [..., {width}, {lanes}])"
        )


def require_floating(name: str, value: torch.Tensor) -> torch.Tensor:
    if not value.is_floating_point():
        raise InputError(f"{name}: expected a floating-point tensor, got {value.dtype} ({_describe(value)})")
    return value


def require_shape(name: str, value, shape: tuple[int, ...]) -> torch.Tensor:
    """A floating-point tensor of exactly this shape."""
    value = require_tensor(name, value)
    if tuple(value.shape) != tuple(shape):
        raise InputError(f"{name}: expected shape {tuple(shape)}, got {_describe(value)}")
    return require_floating(name, value)


def require_trailing(name: str, value, trailing: tuple[int, ...], leading: tuple[int, ...] | None = None):
    """Check that ``value`` is a floating-point tensor ending in ``trailing`` dims (and, if given, that its leading
    dims are ``leading``)."""
    value = require_tensor(name, value)
    k = len(trailing)
    if value.dim() < k or tuple(value.shape[value.dim() - k :]) != tuple(trailing):
        want = "[..., " + ", ".join(str(s) for s in trailing) + "]"
        raise InputError(f"{name}: expected shape {want}, got {_describe(value)}")
    if leading is not None and tuple(value.shape[: value.dim() - k]) != tuple(leading):
        want = "[" + ", ".join(str(s) for s in (*leading, *trailing)) + "]"
        raise InputError(f"{name}: expected shape {want} (batch dims must match), got {_describe(value)}")
    return require_floating(name, value)


def require_positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InputError(f"{name}: expected a positive int, got {value!r}")
    return value


def require_finite(name: str, value: torch.Tensor) -> torch.Tensor:
    """No NaN, +inf or -inf in value (a value check: it reads back to the host)."""
    bad = ~torch.isfinite(value)
    if bad.any():
        counts = [int(t.sum()) for t in (torch.isnan(value), value == float("inf"), value == float("-inf"))]
        first = tuple(int(i) for i in bad.nonzero()[0])
        raise InputError(f"{name}: expected no NaN or inf entries (finite values), got {counts[0]} NaN, "
                         f"{counts[1]} +inf and {counts[2]} -inf, the first at index {first} ({_describe(value)})")
    return value


def checking_values() -> bool:
    """Whether the reference functions check values here: True, except inside skipping_value_checks() and
    while torch.compile traces them (a value read back would break the graph)."""
    return not torch.compiler.is_compiling() and _VALUE_CHECKS.get()


@contextlib.contextmanager
def skipping_value_checks():
    """The reference math without its value checks, for mhc_lab.ops: a value check reads a value back to the
    host (a sync on every call, which also stops CUDA graphs and torch.compile), so the ops make none, and NaN
    or inf in their inputs comes out as NaN or inf. Shapes, dtypes and devices are still checked, and so is what
    a function cannot compute from finite input (sinkhorn_paper's underflow). While torch.compile traces, the
    checks are off already (checking_values) and the switch is left alone: the tracer does not follow it."""
    if torch.compiler.is_compiling():
        yield
        return
    token = _VALUE_CHECKS.set(False)
    try:
        yield
    finally:
        _VALUE_CHECKS.reset(token)


def coefficient_dtype(x: torch.Tensor) -> torch.dtype:
    """Coefficients are computed in float32, or float64 when the stream itself is float64."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32
