"""Autograd-free forward ops of one mHC site on the fused TileLang kernels.

    layer_input, post, res, pre = mhc_pre_fused(x, phi, bias, alpha)     # x [..., n, C]
    out = mhc_post_fused(x, layer_output, post, res)                    # next lanes [..., n, C]

Both check their inputs (shape, dtype, device, n) and raise ``InputError`` saying what was expected and
what was given, allocate the outputs (or fill the ``out=`` tensors you pass, e.g. NaN-poisoned ones in
tests), and dispatch: CUDA tensors run the CUDA kernels, CPU tensors run the same kernels compiled by
TileLang's C target. The math is ``mhc_lab.reference`` (DeepSeek-V4 convention: 20 Sinkhorn rounds,
eps 1e-6, H_post = 2 sigmoid).

Supported: n = 1..8 lanes for pre, n = 1..16 for post. Lanes dtype: bfloat16 for pre on CUDA (the
tensor-core projection multiplies bf16 lanes by phi split into two bf16 parts); bfloat16, float16 or
float32 for post on CUDA; on the CPU every kernel computes in float32 (the C target has no bf16 type), so
bfloat16/float16 lanes are widened on the way in and rounded back on the way out.
"""

from __future__ import annotations

import contextlib
from typing import NamedTuple

import torch

from mhc_lab.reference.validate import InputError, require_lanes, require_tensor

_NO_GUARD = contextlib.nullcontext()


def cuda_guard(x: torch.Tensor):
    """The device guard under which the ops launch kernels on the GPU x is on: none where that is the current
    device already (entering torch.cuda.device costs about 4 us of host time, several times per site)."""
    index = x.device.index
    return _NO_GUARD if index == torch.cuda.current_device() else torch.cuda.device(index)

PRE_MAX_LANES = 8
POST_MAX_LANES = 16

_DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}


class PreOutputs(NamedTuple):
    layer_input: torch.Tensor  # [..., C], x's dtype: H_pre x
    post: torch.Tensor  # [..., n] float32: H_post
    res: torch.Tensor  # [..., n, n] float32: H_res (new lane i = sum_j res[i, j] x_j)
    pre: torch.Tensor  # [..., n] float32: H_pre


def _describe(t: torch.Tensor) -> str:
    return f"shape {tuple(t.shape)}, dtype {t.dtype}, device {t.device}"


def _check_lanes(name: str, x, max_lanes: int, op: str) -> tuple[int, int]:
    n, C = require_lanes(name, x)
    if n > max_lanes:
        raise InputError(
            f"{op}: the fused kernels support n = 1..{max_lanes} lanes, got n = {n} ({name}: {_describe(x)}); "
            f"use mhc_lab.reference for wider streams"
        )
    return n, C


def _check_param(name: str, value, shape: tuple[int, ...], device: torch.device, op: str) -> torch.Tensor:
    require_tensor(name, value)
    if tuple(value.shape) != tuple(shape):
        raise InputError(f"{op}: {name}: expected shape {tuple(shape)}, got {_describe(value)}")
    if value.dtype != torch.float32:
        raise InputError(f"{op}: {name}: expected dtype torch.float32, got {_describe(value)}")
    if value.device != device:
        raise InputError(f"{op}: {name}: expected device {device} (the lanes' device), got {_describe(value)}")
    return value.contiguous()


def _check_out(name: str, value, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, op: str):
    require_tensor(name, value)
    if tuple(value.shape) != tuple(shape) or value.dtype != dtype or value.device != device:
        raise InputError(
            f"{op}: out {name}: expected shape {tuple(shape)}, dtype {dtype}, device {device}, got {_describe(value)}"
        )
    if not value.is_contiguous():
        raise InputError(f"{op}: out {name}: expected a contiguous tensor, got strides {value.stride()}")
    return value


def _lane_dtype(x: torch.Tensor, allowed: tuple[torch.dtype, ...], op: str) -> None:
    if x.dtype not in allowed:
        names = ", ".join(str(d) for d in allowed)
        raise InputError(f"{op}: x: expected dtype in ({names}) on {x.device.type}, got {_describe(x)}")


def mhc_pre_fused(x, phi, bias, alpha, *, out: PreOutputs | tuple | None = None) -> PreOutputs:
    """H_pre x, H_post, H_res and H_pre of one mHC site (one fused kernel launch on the CPU; on CUDA a phi split,
    a projection pass and an apply pass: mhc_lab.kernels.pre_split).

    x: lanes [..., n, C]; phi [n^2+2n, nC], bias [n^2+2n], alpha [3], all float32 on x's device.
    """
    op = "mhc_pre_fused"
    n, C = _check_lanes("x", x, PRE_MAX_LANES, op)
    m = n * n + 2 * n
    device = x.device
    phi = _check_param("phi", phi, (m, n * C), device, op)
    bias = _check_param("bias", bias, (m,), device, op)
    alpha = _check_param("alpha", alpha, (3,), device, op)
    batch = tuple(x.shape[:-2])
    tokens = 1
    for s in batch:
        tokens *= s
    if device.type == "cuda":
        _lane_dtype(x, (torch.bfloat16,), op)
    elif device.type == "cpu":
        _lane_dtype(x, (torch.bfloat16, torch.float16, torch.float32), op)
    else:
        raise InputError(f"{op}: x: expected a CPU or CUDA tensor, got {_describe(x)}")
    shapes = {"layer_input": batch + (C,), "post": batch + (n,), "res": batch + (n, n), "pre": batch + (n,)}
    dtypes = {"layer_input": x.dtype, "post": torch.float32, "res": torch.float32, "pre": torch.float32}
    if out is None:
        out = PreOutputs(*(torch.empty(shapes[k], dtype=dtypes[k], device=device) for k in PreOutputs._fields))
    else:
        out = PreOutputs(*out)
        for k in PreOutputs._fields:
            _check_out(k, getattr(out, k), shapes[k], dtypes[k], device, op)
    if tokens == 0:
        return out
    xf = x.reshape(tokens, n, C).contiguous()
    y, post, res, pre = (t.view(tokens, *t.shape[len(batch):]) for t in out)
    if device.type == "cpu":
        from mhc_lab.kernels.pre import pre_kernel_c

        kernel = pre_kernel_c(n, C)
        if x.dtype == torch.float32:
            kernel(xf, phi, bias, alpha, y, pre, post, res)
        else:
            y32 = torch.empty((tokens, C), dtype=torch.float32)
            kernel(xf.float(), phi, bias, alpha, y32, pre, post, res)
            y.copy_(y32)
        return out
    from mhc_lab.kernels.pre_cuda import run_pre_cuda

    with cuda_guard(x):
        run_pre_cuda(xf, phi, bias, alpha, y, pre, post, res)
    return out


def mhc_post_fused(x, layer_output, post, res, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """The next lanes: out[..., i, :] = sum_j res[..., i, j] x[..., j, :] + post[..., i] layer_output."""
    op = "mhc_post_fused"
    n, C = _check_lanes("x", x, POST_MAX_LANES, op)
    device = x.device
    batch = tuple(x.shape[:-2])
    tokens = 1
    for s in batch:
        tokens *= s
    if device.type not in ("cpu", "cuda"):
        raise InputError(f"{op}: x: expected a CPU or CUDA tensor, got {_describe(x)}")
    _lane_dtype(x, (torch.bfloat16, torch.float16, torch.float32), op)
    require_tensor("layer_output", layer_output)
    if tuple(layer_output.shape) != batch + (C,) or layer_output.dtype != x.dtype or layer_output.device != device:
        raise InputError(
            f"{op}: layer_output: expected shape {batch + (C,)}, dtype {x.dtype}, device {device} (like x), "
            f"got {_describe(layer_output)}"
        )
    post = _check_param("post", post, batch + (n,), device, op)
    res = _check_param("res", res, batch + (n, n), device, op)
    if out is None:
        out = torch.empty(batch + (n, C), dtype=x.dtype, device=device)
    else:
        _check_out("out", out, batch + (n, C), x.dtype, device, op)
    if tokens == 0:
        return out
    xf = x.reshape(tokens, n, C).contiguous()
    ff = layer_output.reshape(tokens, C).contiguous()
    pf, rf = post.reshape(tokens, n), res.reshape(tokens, n, n)
    of = out.view(tokens, n, C)
    from mhc_lab.kernels.post import post_kernel

    if device.type == "cpu":
        kernel = post_kernel(n, C, "float32", "c")
        if x.dtype == torch.float32:
            kernel(xf, ff, pf, rf, of)
        else:
            o32 = torch.empty((tokens, n, C), dtype=torch.float32)
            kernel(xf.float(), ff.float(), pf, rf, o32)
            of.copy_(o32)
        return out
    from mhc_lab.kernels._target import tensor_target

    kernel = post_kernel(n, C, _DTYPE_NAMES[x.dtype], tensor_target(x)).kernel  # the op checked its tensors above
    with cuda_guard(x):
        kernel(xf, ff, pf, rf, of)
    return out
