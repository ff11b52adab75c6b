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


class PagedKVCache:
    """The inference engine's cache: every layer's keys and values in one pool of ``num_blocks`` blocks of
    ``block_size`` positions, allocated once. Which block holds which row's positions is the engine's business
    (``inference.blocks``); the model only sees flat slot numbers, slot = block * block_size + offset.

    ``layers[i]`` is layer i's ``PagedLayerCache``: keys and values [num_blocks * block_size, Hkv, hd] (token-major,
    so a row's positions gather into [rows, Hkv, L, hd] with one ``index_select``). Block 0 is kept zero and never
    handed out: it is where padding slots point, so a masked key is a finite zero and never a NaN.
    """

    def __init__(self, config: GPTConfig, num_blocks: int, block_size: int, *, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu") -> None:
        if num_blocks < 2:
            raise ValueError(f"num_blocks={num_blocks} must be >= 2 (block 0 is the padding block)")
        if block_size < 1:
            raise ValueError(f"block_size={block_size} must be >= 1")
        self.num_blocks, self.block_size = num_blocks, block_size
        shape = (num_blocks * block_size, config.kv_heads, config.head_dim)
        self.layers = []
        for _ in range(config.n_layers):
            # empty, not zeros: a slot is always written before it is read; only the padding block must be zero
            keys, values = torch.empty(shape, dtype=dtype, device=device), torch.empty(shape, dtype=dtype, device=device)
            keys[:block_size].zero_()
            values[:block_size].zero_()
            self.layers.append(PagedLayerCache(keys, values))


class PagedLayerCache:
    """One layer's slice of the pool: keys and values [slots, Hkv, hd]."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        self.keys = keys
        self.values = values

    def write(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v [1, Hkv, N, hd] of N tokens at ``slots`` [N]."""
        self.keys.index_copy_(0, slots, k[0].transpose(0, 1).to(self.keys.dtype))  # [N, Hkv, hd]
        self.values.index_copy_(0, slots, v[0].transpose(0, 1).to(self.values.dtype))

    def read(self, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values at ``slots`` [R, L] -> 2 x [R, Hkv, L, hd]."""
        r, n = slots.shape
        k = self.keys.index_select(0, slots.flatten()).view(r, n, *self.keys.shape[1:])  # [R, L, Hkv, hd]
        v = self.values.index_select(0, slots.flatten()).view(r, n, *self.values.shape[1:])
        return k.transpose(1, 2), v.transpose(1, 2)
