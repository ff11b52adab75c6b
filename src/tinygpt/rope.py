"""Rotary position embeddings (RoPE, Su et al. 2021), the position scheme of the LLaMA family.

Instead of adding a learned [C, D] table to the token embeddings, each query and key head vector is rotated by an
angle proportional to its absolute position p: feature pair j is turned by p * theta^(-2j/hd). The score q_m . k_n
then depends on the positions only through m - n. Keys are rotated *before* they enter the KV cache, so a cached key
keeps the position it was computed at and a decode step at any position sees exactly what a full forward sees.

Pairing convention: feature i is paired with feature i + hd/2 ("rotate_half", as in Hugging Face Llama and GPT-NeoX),
not with its neighbour 2i+1 (Meta's complex-number code). The two differ by a fixed permutation of the q/k output
rows; following HF's layout means HF Llama weights load without any permutation.

Precision: the inverse frequencies, the angles and their cos/sin are computed in float32 whatever the model dtype,
then cast -- as Meta's reference and HF do. Pretrained checkpoints saw these float32 tables, and computing them the
same way lets a float64 run reproduce the reference to ~1e-12 instead of differing by float32 rounding.
"""

from __future__ import annotations

import torch
from torch import nn


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """[..., hd] -> [..., hd]: (x1, x2) -> (-x2, x1), with x1 / x2 the first / second half of the features."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate heads x [B, H, T, hd] by the angles whose cos/sin are [T, hd] (shared by all rows) or [B, T, hd].

    Pair (i, i + hd/2) becomes (x_i cos - x_{i+hd/2} sin, x_{i+hd/2} cos + x_i sin): a 2-D rotation per pair.
    """
    if cos.dim() == 3:  # per-row positions: [B, T, hd] -> [B, 1, T, hd], broadcast over heads
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return (x * cos) + (rotate_half(x) * sin)


class RotaryEmbedding(nn.Module):
    """The cos/sin tables of RoPE for given positions. positions [T] or [B, T] -> (cos, sin), each [..., hd].

    It holds no parameter and no buffer (so it adds nothing to the state dict and survives ``model.to(dtype)``
    unchanged): the tables are a few thousand cos/sin per forward, computed once per forward and shared by all layers.
    """

    def __init__(self, head_dim: int, theta: float = 10000.0) -> None:
        super().__init__()
        if head_dim % 2 != 0:
            raise ValueError(f"head_dim={head_dim} must be even for rotary embeddings")
        self.head_dim = head_dim
        self.theta = float(theta)

    def inv_freq(self, device: torch.device | str | None = None) -> torch.Tensor:
        """theta^(-2j/hd) for j = 0 .. hd/2 - 1, float32, [hd/2]."""
        exponents = torch.arange(0, self.head_dim, 2, dtype=torch.float32, device=device) / self.head_dim
        return 1.0 / (self.theta**exponents)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
        angles = positions.to(torch.float32)[..., None] * self.inv_freq(positions.device)  # [..., hd/2]
        angles = torch.cat((angles, angles), dim=-1)  # [..., hd]: pair (i, i + hd/2) shares angle i
        return angles.cos().to(dtype), angles.sin().to(dtype)

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, theta={self.theta}"
