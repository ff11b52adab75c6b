"""Token batches for fine-tuning: prompt + response + end-of-text, truncated to C, padded with end-of-text.

As in LLMs-from-scratch chapter 7, every sequence ends with the end-of-text token (so the model learns to stop)
and short rows are padded with the same id. Inputs are ``ids[:-1]`` and targets ``ids[1:]``; a target is replaced
by -100 (``F.cross_entropy``'s ``ignore_index``) when it is a prompt token or padding, so only the response and its
closing end-of-text are learned. The order of the examples is a fresh permutation per epoch drawn from
``seed + epoch``, so the batch of any step follows from the step number alone and a resumed run sees the same data.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch

from ..tokenizer import Tokenizer

IGNORE_INDEX = -100
# The base a character-tokenizer model's owner trains for fine-tuning: the main job's corpus and model, with a BPE
# tokenizer (README's next commands)
BPE_BASE_COMMAND = "tinygpt train --tokenizer bpe --out runs/tinygpt-bpe"


@dataclass(frozen=True)
class EncodedExample:
    """``ids``: prompt + response + end-of-text, at most C + 1 tokens; ``prompt_len``: how many are prompt."""

    ids: tuple[int, ...]
    prompt_len: int


def end_of_text_id(tokenizer: Tokenizer) -> int:
    """The tokenizer's end-of-text id; fine-tuning needs one to end responses and to pad."""
    eot = getattr(tokenizer, "eot_id", None)
    if eot is None:
        raise ValueError(f"the model's {getattr(tokenizer, 'kind', '')} tokenizer has no end-of-text token, which "
                         f"fine-tuning needs to end each answer (and to pad): start from a model with a bpe or gpt2 "
                         f"tokenizer; from the main job's corpus: {BPE_BASE_COMMAND}")
    return int(eot)


def encode_prompt(tokenizer: Tokenizer, prompt: str, context_length: int, where: str, *, whole: bool = False
                  ) -> list[int]:
    """Prompt ids; ``ValueError`` naming ``where`` when the prompt leaves no room for a response token."""
    try:
        ids = tokenizer.encode(prompt)
    except ValueError as err:
        raise ValueError(f"{where}: cannot encode the prompt: {err}") from None
    # Inputs are ids[:-1], so C prompt tokens still leave one response target; a sequence read whole needs C - 1.
    if len(ids) > context_length - int(whole):
        raise ValueError(f"{where}: the prompt is {len(ids)} tokens; with context_length={context_length} no "
                         f"response token fits (shorten the instruction/input or use a longer context)")
    return ids


def encode_example(tokenizer: Tokenizer, prompt: str, response: str, context_length: int, where: str,
                   key: str = "output", *, whole: bool = False) -> EncodedExample:
    """Tokenize prompt + response + end-of-text and truncate to C + 1 tokens (C inputs, C targets), or to C tokens
    with ``whole`` (the sequence is one model input, as for the reward model).

    A response longer than C tokens, or a prompt that leaves no room, is a ``ValueError`` naming ``where``/``key``.
    """
    eot = end_of_text_id(tokenizer)
    prompt_ids = encode_prompt(tokenizer, prompt, context_length, where, whole=whole)
    try:
        response_ids = tokenizer.encode(response)
    except ValueError as err:
        raise ValueError(f"{where}: cannot encode {key!r}: {err}") from None
    if not response_ids:
        raise ValueError(f"{where}: empty response in key {key!r}")
    if len(response_ids) > context_length:
        raise ValueError(f"{where}: response {key!r} is {len(response_ids)} tokens, longer than "
                         f"context_length={context_length}")
    ids = (prompt_ids + response_ids + [eot])[: context_length + int(not whole)]
    return EncodedExample(tuple(ids), len(prompt_ids))


def collate_targets(examples: Sequence[EncodedExample], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets), int64 [B, T] with T = the longest row's length - 1: inputs padded with ``pad_id``,
    targets -100 at prompt and padding positions."""
    width = max(len(e.ids) for e in examples) - 1
    inputs = torch.full((len(examples), width), pad_id, dtype=torch.long)
    targets = torch.full((len(examples), width), IGNORE_INDEX, dtype=torch.long)
    for row, e in enumerate(examples):
        ids = torch.tensor(e.ids, dtype=torch.long)
        n = len(e.ids) - 1
        inputs[row, :n] = ids[:-1]
        targets[row, :n] = ids[1:]
        targets[row, : e.prompt_len - 1] = IGNORE_INDEX  # target j is ids[j + 1]: a prompt token while j + 1 < P
    return inputs, targets


def collate_sequences(sequences: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-padded ids [B, T] and each row's real length [B] (the position of its last real token + 1)."""
    width = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), width), pad_id, dtype=torch.long)
    for row, s in enumerate(sequences):
        ids[row, : len(s)] = torch.tensor(list(s), dtype=torch.long)
    return ids, torch.tensor([len(s) for s in sequences], dtype=torch.long)


def split_indices(n: int, val_fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """A seeded shuffle of range(n) cut into (train, val); val gets round(n * fraction), at least 1 when the
    fraction is > 0 and n >= 2, and train keeps at least one."""
    if not 0 <= val_fraction < 1:
        raise ValueError(f"val_fraction={val_fraction!r} must be in [0, 1)")
    if n < 1:
        raise ValueError("no examples to split")
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    n_val = 0 if val_fraction == 0 or n < 2 else min(n - 1, max(1, round(n * val_fraction)))
    return sorted(order[n_val:]), sorted(order[:n_val])


def batches_per_epoch(n: int, batch_size: int) -> int:
    return math.ceil(n / batch_size)


def batch_for_step(n: int, batch_size: int, step: int, seed: int) -> list[int]:
    """Indices into the n training examples for 0-based ``step``: epoch e is a permutation drawn from seed + e,
    cut into batches of ``batch_size`` (the last one of an epoch may be smaller)."""
    per_epoch = batches_per_epoch(n, batch_size)
    epoch, position = divmod(step, per_epoch)
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed + epoch)).tolist()
    return order[position * batch_size : (position + 1) * batch_size]
