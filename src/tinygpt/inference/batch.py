"""The batch description: where each of one forward's N tokens sits, where its key/value goes, what it attends to.

The engine packs every scheduled row's tokens into one sequence [1, N] (so each linear layer runs once over all of
them) in this order: first the *decode rows*, one token each, then the *spans*, rows that feed several tokens (a
chunk of a prompt, a draft to verify), each contiguous. A row's keys and values live in the paged cache
(``kv_cache.PagedKVCache``) at flat slots; this object carries every index the attention needs as a tensor built on
the host beforehand, so the forward never reads a value back from the device.

It imports torch only: the paged cache's attention (``kv_cache.PagedLayerCache.attend``) reads it, and it is the
``pos`` of a forward over the paged cache (``GPTModel.forward(idx, cache=paged, pos=batch)``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch


@dataclass(frozen=True)
class Span:
    """A row feeding ``length`` tokens at positions ``start .. start + length - 1``; ``keys`` [start + length]: the
    slots of all its keys, earlier ones first (its own new ones last)."""

    start: int
    length: int
    keys: torch.Tensor


@dataclass(frozen=True)
class DecodeGroup:
    """``rows`` consecutive one-token rows that attend together: to ``keys`` [rows, L] (slots, padded with slot 0)
    under ``mask`` [rows, L] (None when every row has L keys)."""

    rows: int
    keys: torch.Tensor
    mask: torch.Tensor | None


@dataclass(frozen=True)
class Batch:
    """One forward of N packed tokens.

    ``positions`` [N]: each token's position in its own row (for the position table or RoPE). ``write_slots`` [N]:
    where each token's key/value is stored. ``decode_rows``: the first Bd tokens are rows of one token, longest
    first, in ``decode_groups`` of rows of similar length (each group's keys are padded to its longest row only).
    ``spans``: the multi-token rows, in token order after the decode rows. ``logits_at`` [M]: which of the N tokens
    the head runs on.
    """

    positions: torch.Tensor
    write_slots: torch.Tensor
    decode_rows: int
    decode_groups: tuple[DecodeGroup, ...]
    spans: tuple[Span, ...]
    logits_at: torch.Tensor

    @property
    def num_tokens(self) -> int:
        return self.positions.shape[0]


@dataclass(frozen=True)
class RowSlice:
    """What one row feeds in a forward: ``length`` tokens from window position ``start``, its block table, and the
    offsets (0 .. length - 1) of the tokens whose logits it needs."""

    start: int
    length: int
    table: Sequence[int]
    logits: Sequence[int]


def slot_of(table: Sequence[int], position: int, block_size: int) -> int:
    return table[position // block_size] * block_size + position % block_size


def padded_length(n: int) -> int:
    """The packed length a forward of n tokens runs at: n up to 8, then the next multiple of 8. The linear layers'
    kernels are planned (and cached) per shape; a few sizes instead of every n keep that cache, and the memory it
    holds, small at the cost of at most 7 idle tokens."""
    return n if n <= 8 else -(-n // 8) * 8


def build_batch(rows: Sequence[RowSlice], block_size: int, device: torch.device | str, *,
                scratch_slot: int | None = None) -> Batch:
    """The description of one forward over ``rows``, decode rows (length 1) first: the caller packs the tokens in
    the same order (``pack_order``). With ``scratch_slot``, the forward is padded to ``padded_length`` with idle
    tokens at position 0 (a span of their own, which no other row sees) whose keys all go to that slot."""
    order = pack_order(rows)
    positions: list[int] = []
    write: list[int] = []
    logits_at: list[int] = []
    decode = [rows[i] for i in order if rows[i].length == 1]  # longest first
    for i in order:
        r = rows[i]
        for j in range(r.length):
            positions.append(r.start + j)
            write.append(slot_of(r.table, r.start + j, block_size))
        logits_at.extend(len(positions) - r.length + j for j in r.logits)
    groups = tuple(_decode_group(group, block_size, device) for group in _by_length(decode))
    spans = []
    for i in order:
        r = rows[i]
        if r.length > 1:
            keys = [slot_of(r.table, p, block_size) for p in range(r.start + r.length)]
            spans.append(Span(r.start, r.length, torch.tensor(keys, dtype=torch.long, device=device)))
    pad = 0 if scratch_slot is None else padded_length(len(positions)) - len(positions)
    if pad:
        spans.append(Span(0, pad, torch.full((pad,), scratch_slot, dtype=torch.long, device=device)))
        positions += [0] * pad
        write += [scratch_slot] * pad
    return Batch(
        positions=torch.tensor(positions, dtype=torch.long, device=device),
        write_slots=torch.tensor(write, dtype=torch.long, device=device),
        decode_rows=len(decode), decode_groups=groups, spans=tuple(spans),
        logits_at=torch.tensor(logits_at, dtype=torch.long, device=device),
    )


def pack_order(rows: Sequence[RowSlice]) -> list[int]:
    """The rows' order in the packed sequence: single-token rows first, the longest (most keys) first, then the
    others as given."""
    decode = sorted((i for i, r in enumerate(rows) if r.length == 1), key=lambda i: -rows[i].start)
    return decode + [i for i, r in enumerate(rows) if r.length > 1]


def _by_length(decode: Sequence[RowSlice]) -> list[list[RowSlice]]:
    """Decode rows (longest first) in groups whose rows have at least half the keys of the group's first: padded
    to its longest row, a group reads at most twice the keys its rows have. One group for all of them would pad a
    row of 100 keys to the 1,000 of a long prompt's row; reading keys is what a decode step's attention costs."""
    groups: list[list[RowSlice]] = []
    for r in decode:
        if groups and 2 * (r.start + 1) >= groups[-1][0].start + 1:
            groups[-1].append(r)
        else:
            groups.append([r])
    return groups


def _decode_group(rows: Sequence[RowSlice], block_size: int, device: torch.device | str) -> DecodeGroup:
    lengths = [r.start + 1 for r in rows]  # keys of each row: its earlier positions and its new token
    blocks = -(-max(lengths) // block_size)
    tables = torch.tensor([list(r.table[:blocks]) + [0] * (blocks - len(r.table[:blocks])) for r in rows],
                          dtype=torch.long)  # [G, blocks]
    offsets = torch.arange(block_size, dtype=torch.long)  # [bs]
    slots = (tables[:, :, None] * block_size + offsets).flatten(1)[:, :max(lengths)]  # [G, L]
    mask = None
    if min(lengths) != max(lengths):
        mask = torch.arange(max(lengths))[None, :] < torch.tensor(lengths)[:, None]  # [G, L]
        slots = slots.masked_fill(~mask, 0)
        mask = mask.to(device)
    return DecodeGroup(len(rows), slots.to(device), mask)
