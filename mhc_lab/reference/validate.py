"""Input checks shared by every layer: one place that says what was expected and what was given."""

from __future__ import annotations

import torch


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


def require_shape(name: str, value, shape: tuple[int, ...]) -> torch.Tensor:
    value = require_tensor(name, value)
    if tuple(value.shape) != tuple(shape):
        raise InputError(f"{name}: expected shape {tuple(shape)}, got {_describe(value)}")
    return value


def require_trailing(name: str, value, trailing: tuple[int, ...], leading: tuple[int, ...] | None = None):
    """Check that ``value`` ends in ``trailing`` dims (and, if given, that its leading dims are ``leading``)."""
    value = require_tensor(name, value)
    k = len(trailing)
    if value.dim() < k or tuple(value.shape[value.dim() - k :]) != tuple(trailing):
        want = "[..., " + ", ".join(str(s) for s in trailing) + "]"
        raise InputError(f"{name}: expected shape {want}, got {_describe(value)}")
    if leading is not None and tuple(value.shape[: value.dim() - k]) != tuple(leading):
        want = "[" + ", ".join(str(s) for s in (*leading, *trailing)) + "]"
        raise InputError(f"{name}: expected shape {want} (batch dims must match), got {_describe(value)}")
    return value


def require_positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InputError(f"{name}: expected a positive int, got {value!r}")
    return value


def require_finite(name: str, value: torch.Tensor) -> torch.Tensor:
    if not torch.isfinite(value).all():
        bad = (~torch.isfinite(value)).sum().item()
        raise InputError(f"{name}: expected finite values, got {bad} non-finite entries ({_describe(value)})")
    return value


def coefficient_dtype(x: torch.Tensor) -> torch.dtype:
    """Coefficients are computed in float32, or float64 when the stream itself is float64."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32
