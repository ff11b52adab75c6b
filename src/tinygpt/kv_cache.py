"""A pre-allocated key/value cache: one [B, H, C, D/H] buffer per layer for keys and one for values.

Attention at position t needs the keys and values of positions 0..t. Without a cache every decode step recomputes
them for the whole prefix; with it, a step computes them for the new token only and writes them at its explicit
position (the chapter leaves the cache for later and warns that truncating the window is *not* the same
computation).
"""

from __future__ import annotations

import torch

from .config import GPTConfig


class KVCache:
    """Keys and values of every layer for ``batch_size`` rows and up to ``context_length`` positions.

    ``layers[i]`` is layer i's ``LayerCache``, the one its attention is handed; ``keys[i]`` / ``values[i]`` are its
    buffers, [B, Hkv, C, D/H], Hkv = ``config.kv_heads`` (= H unless the model uses grouped-query attention, whose
    cache holds only the shared key/value heads). ``length`` counts the positions written so far (by the last
    layer); the model's forward writes positions ``start_pos .. start_pos + T - 1`` and attends over
    ``0 .. start_pos + T - 1``.
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
        self.layers = [LayerCache(torch.zeros(shape, dtype=dtype, device=device),
                                  torch.zeros(shape, dtype=dtype, device=device)) for _ in range(config.n_layers)]

    @property
    def keys(self) -> list[torch.Tensor]:
        return [layer.keys for layer in self.layers]

    @property
    def values(self) -> list[torch.Tensor]:
        return [layer.values for layer in self.layers]

    @property
    def batch_size(self) -> int:
        return self.layers[0].keys.shape[0]

    @property
    def length(self) -> int:
        return self.layers[-1].length

    def update(
        self, layer: int, start_pos: int, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``layers[layer].update(start_pos, k, v)``."""
        return self.layers[layer].update(start_pos, k, v)

    def reset(self) -> None:
        for layer in self.layers:
            layer.length = 0


class LayerCache:
    """One layer's keys and values, [B, Hkv, C, D/H] each: all that this layer's attention reads and writes."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        self.keys = keys
        self.values = values
        self.length = 0  # the end of the last write

    def update(self, start_pos: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write k, v [B, H, T, D/H] at ``start_pos`` and return all keys/values so far, [B, H, start_pos+T, D/H].

        Positions after ``start_pos + T`` may hold stale entries from an earlier, longer fill; they are never
        returned, so refilling from position 0 (a re-prefill) needs no clearing.
        """
        batch_size, max_length = self.keys.shape[0], self.keys.shape[2]
        end = start_pos + k.shape[2]
        if start_pos < 0 or end > max_length:
            raise ValueError(f"positions {start_pos}..{end - 1} do not fit the cache of max_length={max_length}")
        if k.shape[0] != batch_size:
            raise ValueError(f"batch of {k.shape[0]} rows does not match the cache's batch_size={batch_size}")
        self.keys[:, :, start_pos:end] = k
        self.values[:, :, start_pos:end] = v
        self.length = end
        return self.keys[:, :, :end], self.values[:, :, :end]
