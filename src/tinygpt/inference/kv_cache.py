"""The key/value caches, and the attention over what they hold: the one seam between the model and the engine.

``layers.MultiHeadAttention`` computes q, k, v (RoPE applied) and, given a layer cache, hands them to its
``attend(q, k, v) -> context``: the cache stores this call's keys and values and attends over all it holds. Before
the blocks run, ``GPTModel.hidden_states`` calls the cache's ``begin(idx, pos)``, which checks that the call fits the
cache and returns each token's position id (for the position table or RoPE); after them, ``head_input(x)`` picks
the hidden states the head runs on. Two caches keep that interface:

- ``KVCache`` (a contiguous [B, Hkv, C, hd] buffer per layer; ``pos``: the int position of the call's first token):
  ``model(prompt, cache=cache)`` then ``model(next_id, cache=cache, pos=t)``, the chapter's cached decoding;
- ``PagedKVCache`` (the inference engine's: every layer's keys and values in one pool of fixed-size blocks;
  ``pos``: the ``inference.batch.Batch`` that says where each packed token sits, where its key/value goes and what
  it attends to).

Attention at position t needs the keys and values of positions 0..t. Without a cache every decode step recomputes
them for the whole prefix; with one, a step computes them for the new token only and writes them at its explicit
position (the chapter leaves the cache for later and warns that truncating the window is *not* the same
computation).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..config import GPTConfig
from ..layers import causal_mask
from ..model import check_ids
from .batch import Batch


class KVCache:
    """Keys and values of every layer for ``batch_size`` rows and up to ``max_length`` (default: the context)
    positions.

    ``layers[i]`` is layer i's ``LayerCache``, the one its attention is handed; ``keys[i]`` / ``values[i]`` are its
    buffers, [B, Hkv, C, D/H], Hkv = ``config.kv_heads`` (= H unless the model uses grouped-query attention, whose
    cache holds only the shared key/value heads). ``length`` counts the positions written so far (by the last
    layer); a forward at ``pos`` writes positions ``pos .. pos + T - 1`` and attends over ``0 .. pos + T - 1``.
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
        self.config = config
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

    def begin(self, idx: torch.Tensor, pos: int | None) -> torch.Tensor:
        """A forward of ids idx [B, T] from position ``pos`` (None: 0) starts: check the ids (type, shape, range,
        the fit in the context) and return their positions [T]; each layer then writes at ``pos``."""
        start = 0 if pos is None else pos
        if isinstance(start, bool) or not isinstance(start, int):
            raise TypeError(f"pos must be the int position of the first token with a KVCache, got {pos!r}")
        check_ids(idx, self.config, start)
        for layer in self.layers:
            layer.start = start
        return torch.arange(start, start + idx.shape[1], device=idx.device)  # [T]

    def head_input(self, x: torch.Tensor) -> torch.Tensor:
        """The hidden states [B, T, D] the head runs on: all of them."""
        return x

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
        self.start = 0  # where this forward's keys go (set by ``KVCache.begin``)

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

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [B, H, T, hd], this call's k/v [B, Hkv, T, hd] at ``start`` -> context [B, H, T, hd].

        The T queries see the S = start + T keys so far, query start + i the keys 0 .. start + i (``causal_mask``:
        no mask tensor for a prefill from 0 or a one-token step, which sees every key).
        """
        t = q.shape[2]
        k, v = self.update(self.start, k, v)  # [B, Hkv, S, hd]
        s = k.shape[2]
        allowed = causal_mask(s - t, t, s, device=q.device)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, is_causal=allowed is None and t > 1,
                                              enable_gqa=q.shape[1] != k.shape[1])


class PagedKVCache:
    """The inference engine's cache: every layer's keys and values in one pool of ``num_blocks`` blocks of
    ``block_size`` positions, allocated once. Which block holds which row's positions is the engine's business
    (``inference.blocks``); the attention only sees flat slot numbers, slot = block * block_size + offset, which the
    forward's ``Batch`` carries.

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
        self.batch: Batch | None = None  # the forward under way (``begin``)
        shape = (num_blocks * block_size, config.kv_heads, config.head_dim)
        self.layers = []
        for _ in range(config.n_layers):
            # empty, not zeros: a slot is always written before it is read; only the padding block must be zero
            keys, values = torch.empty(shape, dtype=dtype, device=device), torch.empty(shape, dtype=dtype, device=device)
            keys[:block_size].zero_()
            values[:block_size].zero_()
            self.layers.append(PagedLayerCache(keys, values))

    def begin(self, idx: torch.Tensor, pos: Batch) -> torch.Tensor:
        """A forward of the packed ids idx [1, N] that ``pos`` describes starts: its positions [N]. The ids were
        checked when their rows were added to the engine: no value is read back from the device here."""
        if not isinstance(pos, Batch):
            raise TypeError(f"a PagedKVCache needs pos=Batch (inference.batch), got {type(pos).__name__}")
        if idx.shape != (1, pos.num_tokens):
            raise ValueError(f"a Batch of {pos.num_tokens} tokens needs idx [1, {pos.num_tokens}], "
                             f"got idx {list(idx.shape)}")
        self.batch = pos
        for layer in self.layers:
            layer.batch = pos
        return pos.positions

    def head_input(self, x: torch.Tensor) -> torch.Tensor:
        """Of the forward's hidden states [1, N, D], the M tokens whose logits a row needs: [1, M, D]."""
        return x[:, self.batch.logits_at]


def one_query_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        mask: torch.Tensor | None = None) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` for one query per row, written as sums: q [G, H, 1, hd], k/v
    [G, Hkv, L, hd] (H a multiple of Hkv: grouped-query heads share theirs), mask [G, 1, 1, L] bool (True: attend)
    or None -> [G, H, 1, hd]. Inside a compiled decode step inductor turns this into a few fused loops, where sdpa
    is an external call with a fixed cost per layer that a small model's step is mostly made of."""
    if q.shape[1] != k.shape[1]:
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    scores = (q * k).sum(-1) * q.shape[-1] ** -0.5  # [G, H, L]
    if mask is not None:
        scores = scores.masked_fill(~mask[:, :, 0], float("-inf"))
    weights = torch.softmax(scores, dim=-1)  # [G, H, L]
    return (weights[..., None] * v).sum(-2)[:, :, None]  # [G, H, 1, hd]


class PagedLayerCache:
    """One layer's slice of the pool: keys and values [slots, Hkv, hd]."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        self.keys = keys
        self.values = values
        self.batch: Batch | None = None  # this forward's (set by ``PagedKVCache.begin``)

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

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Attention for packed rows: q [1, H, N, hd], k/v [1, Hkv, N, hd] -> context [1, H, N, hd].

        Every token's key/value is written to its slot first; then the decode rows (one query each) attend, a group
        of rows of similar length at a time, to their gathered keys under a padding mask, and each span attends
        causally to its own: query ``start + i`` sees the span's keys 0 .. start + i, as in a forward over the row
        alone.
        """
        batch = self.batch
        self.write(batch.write_slots, k, v)
        gqa, parts, offset = q.shape[1] > k.shape[1], [], 0
        for group in batch.decode_groups:
            keys, values = self.read(group.keys)  # [G, Hkv, L, hd]
            queries = q[0, :, offset:offset + group.rows].transpose(0, 1).unsqueeze(2)  # [G, H, 1, hd]
            mask = None if group.mask is None else group.mask[:, None, None, :]  # [G, 1, 1, L]
            if torch.compiler.is_compiling():  # a compiled decode step: sums that inductor fuses, not an extern call
                out = one_query_attention(queries, keys, values, mask)
            else:
                out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask, enable_gqa=gqa)
            parts.append(out.squeeze(2).transpose(0, 1).unsqueeze(0))  # [1, H, G, hd]
            offset += group.rows
        for span in batch.spans:
            queries = q[:, :, offset:offset + span.length]  # [1, H, T, hd]
            if span.start == 0:  # the row's first tokens: its keys are this call's, plain causal attention
                keys, values = k[:, :, offset:offset + span.length], v[:, :, offset:offset + span.length]
                mask = None
            else:
                keys, values = self.read(span.keys[None])  # [1, Hkv, start + T, hd]
                mask = causal_mask(span.start, span.length, span.start + span.length, device=q.device)  # [T, S]
            parts.append(F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask,
                                                        is_causal=mask is None and span.length > 1, enable_gqa=gqa))
            offset += span.length
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)  # [1, H, N, hd]
