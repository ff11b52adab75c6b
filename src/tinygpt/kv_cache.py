"""A pre-allocated key/value cache: one [B, H, C, D/H] buffer per layer for keys and one for values.

Attention at position t needs the keys and values of positions 0..t. Without a cache every decode step recomputes
them for the whole prefix; with it, a step computes them for the new token only and writes them at its explicit
position (seed 000 §6.9 defers this to "chapter 8": truncating the window is *not* the same computation).
"""

from __future__ import annotations

import torch

from .config import GPTConfig


class KVCache:
    """Keys and values of every layer for ``batch_size`` rows and up to ``context_length`` positions.

    ``keys[layer]`` / ``values[layer]``: [B, Hkv, C, D/H], Hkv = ``config.kv_heads`` (= H unless the model uses
    grouped-query attention, whose cache holds only the shared key/value heads). ``length`` counts the positions
    written so far; the model's forward writes positions ``start_pos .. start_pos + T - 1`` and attends over
    ``0 .. start_pos + T - 1``. ``layers[i]`` is layer i's view, the one its attention is handed.
    """

    def __init__(
        self,
        config: GPTConfig,
        batch_size: int,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        max_length: int | None = None,
    ) -> None:
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size} must be >= 1")
        self.max_length = config.context_length if max_length is None else max_length
        if not 1 <= self.max_length <= config.context_length:
            raise ValueError(f"max_length={max_length} must be in [1, context_length={config.context_length}]")
        shape = (batch_size, config.kv_heads, self.max_length, config.head_dim)
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.n_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.n_layers)]
        self.layers = [LayerCache(self, layer) for layer in range(config.n_layers)]  # what each attention sees
        self.length = 0

    @property
    def batch_size(self) -> int:
        return self.keys[0].shape[0]

    def update(
        self, layer: int, start_pos: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v [B, H, T, D/H] at ``start_pos`` and return all keys/values so far, [B, H, start_pos+T, D/H].

        Positions after ``start_pos + T`` may hold stale entries from an earlier, longer fill; they are never
        returned, so refilling from position 0 (a re-prefill) needs no clearing.
        """
        end = start_pos + k.shape[2]
        if start_pos < 0 or end > self.max_length:
            raise ValueError(
                f"positions {start_pos}..{end - 1} do not fit the cache of max_length={self.max_length}"
            )
        if k.shape[0] != self.batch_size:
            raise ValueError(f"batch of {k.shape[0]} rows does not match the cache's batch_size={self.batch_size}")
        self.keys[layer][:, :, start_pos:end] = k
        self.values[layer][:, :, start_pos:end] = v
        if layer == len(self.keys) - 1:
            self.length = end
        return self.keys[layer][:, :, :end], self.values[layer][:, :, :end]

    def reset(self) -> None:
        self.length = 0


class LayerCache:
    """One layer's part of a ``KVCache``: the attention of layer ``layer`` writes and reads only through it."""

    def __init__(self, cache: KVCache, layer: int) -> None:
        self.cache = cache
        self.layer = layer

    def update(self, start_pos: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``KVCache.update`` for this layer: k, v [B, Hkv, T, hd] -> all keys/values so far [B, Hkv, S, hd]."""
        return self.cache.update(self.layer, start_pos, k, v)
