"""Small models the labs train: a deep MLP stack (plain or residual) and a byte-level transformer whose
sub-layers are joined by a plain residual, Hyper-Connections or mHC."""

from __future__ import annotations

import torch
from torch import nn
import torch.nn.functional as F

from mhc_lab.reference import (
    HyperConnection,
    ManifoldHyperConnection,
    collapse_lanes,
    expand_lanes,
)

CONNECTIONS = ("residual", "hc", "mhc")


class DeepStack(nn.Module):
    """depth layers of width ``width``: h <- f(h) (plain) or h <- h + f(h) (residual), f = tanh(W h + b)."""

    def __init__(self, depth: int, width: int, inputs: int = 2, outputs: int = 2, residual: bool = True):
        super().__init__()
        self.residual = residual
        self.inp = nn.Linear(inputs, width)
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.out = nn.Linear(width, outputs)

    def forward(self, x: torch.Tensor, keep: list | None = None) -> torch.Tensor:
        h = self.inp(x)
        for layer in self.layers:
            f = torch.tanh(layer(h))
            h = h + f if self.residual else f
            if keep is not None:
                h.retain_grad()
                keep.append(h)
        return self.out(h)


class CausalSelfAttention(nn.Module):
    def __init__(self, width: int, heads: int):
        super().__init__()
        if width % heads:
            raise ValueError(f"width {width} must be a multiple of heads {heads}")
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        B, T, C = h.shape
        q, k, v = self.qkv(h).view(B, T, 3, self.heads, C // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


class MLP(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(h)))


class PreNorm(nn.Module):
    """F(h) = sublayer(RMSNorm(h)): the layer function a connection wraps."""

    def __init__(self, width: int, sublayer: nn.Module):
        super().__init__()
        self.norm, self.sublayer = nn.RMSNorm(width), sublayer

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.sublayer(self.norm(h))


class TinyLM(nn.Module):
    """A byte-level transformer; each block is two sub-layers (attention, MLP), each wrapped by a connection.

    connection = "residual": h <- h + F(h); "hc": Hyper-Connections over n lanes (dynamic by default);
    "mhc": mHC over n lanes (DeepSeek-V4 convention by default). Lanes are copies of the embedding at the
    start and are summed before the final norm.
    """

    def __init__(
        self,
        vocab: int = 256,
        width: int = 64,
        depth: int = 2,
        heads: int = 4,
        seq_len: int = 64,
        connection: str = "residual",
        n: int = 4,
        variant: str = "deepseek_v4",
        hc_dynamic: bool = True,
    ):
        super().__init__()
        if connection not in CONNECTIONS:
            raise ValueError(f"connection: expected one of {CONNECTIONS}, got {connection!r}")
        self.connection, self.n, self.seq_len = connection, n, seq_len
        self.embed = nn.Embedding(vocab, width)
        self.position = nn.Parameter(torch.randn(seq_len, width) * 0.02)
        self.sublayers = nn.ModuleList()
        for _ in range(depth):
            self.sublayers.append(PreNorm(width, CausalSelfAttention(width, heads)))
            self.sublayers.append(PreNorm(width, MLP(width)))
        if connection == "hc":
            self.connections = nn.ModuleList(
                HyperConnection(n, width, layer_index=k, dynamic=hc_dynamic) for k in range(2 * depth)
            )
        elif connection == "mhc":
            self.connections = nn.ModuleList(
                ManifoldHyperConnection(n, width, variant=variant) for _ in range(2 * depth)
            )
        self.norm = nn.RMSNorm(width)
        self.head = nn.Linear(width, vocab)

    def forward(self, idx: torch.Tensor, residual_matrices: list | None = None) -> torch.Tensor:
        """Logits [B, T, vocab]; if ``residual_matrices`` is a list, each site's H_res [B, T, n, n] is added."""
        T = idx.shape[1]
        if T > self.seq_len:
            raise ValueError(f"sequence of {T} tokens is longer than the model's seq_len {self.seq_len}")
        h = self.embed(idx) + self.position[:T]
        if self.connection == "residual":
            for f in self.sublayers:
                h = h + f(h)
        else:
            x = expand_lanes(h, self.n)
            for connection, f in zip(self.connections, self.sublayers):
                if residual_matrices is not None:
                    with torch.no_grad():
                        if self.connection == "hc":
                            residual_matrices.append(connection.residual_matrix(x))
                        else:
                            residual_matrices.append(connection.coefficients(x).res)
                x = connection(x, f)
            h = collapse_lanes(x)
        return self.head(self.norm(h))
