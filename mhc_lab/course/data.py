"""Small offline tasks: bytes of Python's own standard library source, and two interleaved spirals."""

from __future__ import annotations

import math
import sysconfig
from pathlib import Path

import torch

# Pure-Python standard library modules present in every CPython 3.10+; their text is the LM corpus.
CORPUS_FILES = (
    "textwrap.py", "string.py", "heapq.py", "bisect.py", "functools.py", "contextlib.py", "dataclasses.py",
    "argparse.py", "difflib.py", "fractions.py", "shlex.py", "statistics.py", "json/decoder.py",
    "json/encoder.py", "collections/__init__.py", "copy.py", "enum.py", "fnmatch.py", "glob.py",
)


def python_source_bytes(max_bytes: int | None = None) -> bytes:
    """The corpus: these standard library files concatenated, at most ``max_bytes`` bytes."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    chunks = []
    for name in CORPUS_FILES:
        path = stdlib / name
        if path.exists():
            chunks.append(path.read_bytes())
    if not chunks:
        raise FileNotFoundError(f"no corpus files found under {stdlib}; expected e.g. {stdlib / CORPUS_FILES[0]}")
    data = b"\n".join(chunks)
    return data[:max_bytes] if max_bytes is not None else data


class ByteCorpus:
    """Byte-level language modelling data (vocabulary 256): a train split and a validation split."""

    vocab_size = 256

    def __init__(self, max_bytes: int | None = 400_000, val_fraction: float = 0.1):
        data = torch.frombuffer(bytearray(python_source_bytes(max_bytes)), dtype=torch.uint8).long()
        cut = int(len(data) * (1 - val_fraction))
        self.train, self.val = data[:cut], data[cut:]

    def batch(self, batch_size: int, seq_len: int, generator: torch.Generator, split: str = "train"):
        """Random windows: inputs [B, T] and next-byte targets [B, T]."""
        data = self.train if split == "train" else self.val
        if len(data) <= seq_len + 1:
            raise ValueError(f"seq_len {seq_len} is too long for the {split} split of {len(data)} bytes")
        start = torch.randint(0, len(data) - seq_len - 1, (batch_size,), generator=generator)
        offsets = torch.arange(seq_len + 1)
        windows = data[start[:, None] + offsets]
        return windows[:, :-1], windows[:, 1:]


def two_spirals(points: int, noise: float = 0.2, seed: int = 0):
    """Two interleaved spirals in the plane: inputs [points, 2] float32 and labels [points] (0 or 1)."""
    g = torch.Generator().manual_seed(seed)
    half = points // 2
    t = torch.rand(half, generator=g) * 3 * math.pi + 0.5
    arm = torch.stack([t * torch.cos(t), t * torch.sin(t)], dim=1) / (3 * math.pi)
    x = torch.cat([arm, -arm]) + noise * torch.randn(2 * half, 2, generator=g) / (3 * math.pi) * 3
    y = torch.cat([torch.zeros(half), torch.ones(half)]).long()
    order = torch.randperm(2 * half, generator=g)
    return x[order].float(), y[order]
