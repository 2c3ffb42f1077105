"""Compiled kernels that check every call's tensors (the ones a learner can call directly)."""

from __future__ import annotations

from typing import Sequence

import torch

from mhc_lab.reference.validate import InputError


class CheckedKernel:
    """A compiled kernel that checks, on every call, its tensors against what it was compiled for: how many,
    their dtypes, device, contiguity and static sizes, and that a dynamic size (the tokens T) is the same in
    every tensor that has it. An InputError names the argument, what was expected and what was given.

    TileLang checks each tensor's static sizes, dtype and device, but not that the tensors agree on T: handed an
    ``out`` with fewer tokens than x, a kernel writes past its end. Anything else (get_kernel_source, ...) is
    the compiled kernel's own; ``kernel`` is the compiled kernel itself, unchecked."""

    def __init__(self, kernel, name: str, arguments: Sequence[str] | None = None):
        buffers = [kernel.prim_func.buffer_map[p] for p in kernel.prim_func.params]
        arguments = tuple(arguments) if arguments is not None else tuple(b.name for b in buffers)
        if len(arguments) != len(buffers):
            raise ValueError(f"{name}: {len(arguments)} argument names for {len(buffers)} tensors")
        self.kernel, self.name, self.arguments = kernel, name, arguments
        # per argument: (name, sizes: an int, or the name of a dynamic size, dtype)
        self._signature = tuple(
            (arg, tuple(int(d.value) if hasattr(d, "value") else str(d.name) for d in b.shape),
             getattr(torch, str(b.dtype)))
            for arg, b in zip(arguments, buffers))
        self.device_type = "cuda" if kernel.target.kind.name == "cuda" else "cpu"
        self._accepted = set()  # (shape, dtype, device, contiguous) of each tensor, for calls that passed

    def __call__(self, *tensors):
        self.check(*tensors)
        return self.kernel(*tensors)

    def check(self, *tensors) -> None:
        """Raise InputError unless the tensors fit the compiled kernel (see the class docstring). Tensors like those
        of a call that passed (sizes, dtypes, devices, contiguity) pass at the cost of one set lookup."""
        try:
            key = tuple((t.shape, t.dtype, t.device, t.is_contiguous()) for t in tensors)
        except AttributeError:  # not a tensor: _check_each says which
            key = None
        if key is not None and key in self._accepted:
            return
        self._check_each(tensors)
        if key is not None and len(self._accepted) < 64:
            self._accepted.add(key)

    def _check_each(self, tensors) -> None:
        if len(tensors) != len(self._signature):
            raise InputError(f"{self.name}: expected {len(self._signature)} tensors ({', '.join(self.arguments)}), "
                             f"got {len(tensors)}")
        sizes, first = {}, None
        for value, (arg, shape, dtype) in zip(tensors, self._signature):
            if not isinstance(value, torch.Tensor):
                raise InputError(f"{self.name}: {arg}: expected a torch.Tensor, got {type(value).__name__}")
            if value.device.type != self.device_type:
                raise InputError(f"{self.name}: {arg}: expected a {self.device_type} tensor (the kernel is compiled "
                                 f"for {self.device_type}), got device {value.device}")
            if first is None:
                first = value
            elif value.device != first.device:
                raise InputError(f"{self.name}: {arg}: expected device {first.device} (like {self.arguments[0]}), "
                                 f"got device {value.device}")
            if value.dtype != dtype:
                raise InputError(f"{self.name}: {arg}: expected dtype {dtype}, got {value.dtype}")
            if value.dim() != len(shape) or any(size != want for size, want in zip(value.shape, shape)
                                                 if isinstance(want, int)):
                raise InputError(f"{self.name}: {arg}: expected shape {self._shape(shape, sizes)}, got shape "
                                 f"{tuple(value.shape)}")
            for size, want in zip(value.shape, shape):
                if not isinstance(want, int):
                    known = sizes.setdefault(want, (size, arg))
                    if known[0] != size:
                        raise InputError(f"{self.name}: {arg}: expected shape {self._shape(shape, sizes)}, got shape "
                                         f"{tuple(value.shape)}: its {want} must be the same in every tensor")
            if not value.is_contiguous():
                raise InputError(f"{self.name}: {arg}: expected a contiguous tensor, got strides {value.stride()} "
                                 f"(shape {tuple(value.shape)})")

    @staticmethod
    def _shape(shape, sizes) -> str:
        dims = ", ".join(str(d) for d in shape) + ("," if len(shape) == 1 else "")
        known = [f"{name} = {size} (from {arg})" for name, (size, arg) in sizes.items() if name in shape]
        return f"({dims})" + (f" with {', '.join(known)}" if known else "")

    def __getattr__(self, attribute):
        if attribute == "kernel":  # not set yet (a copy being built): no recursion
            raise AttributeError(attribute)
        return getattr(self.kernel, attribute)

    def __repr__(self) -> str:
        return f"CheckedKernel({self.name})"
