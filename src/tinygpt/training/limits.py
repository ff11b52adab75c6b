"""Sizes that cannot fit are refused before anything is allocated, with the figure that would be needed.

Two limits: the data (a batch cannot hold more distinct windows than the text has) and memory. The memory figure
is a *lower bound*, so a run it refuses could never have run: float32 weights, gradients and AdamW's two moments
(16 bytes per parameter) plus, per micro-batch, the activations every block must keep for the backward pass --
at least ``ACTIVATIONS_PER_TOKEN_LAYER`` floats per token per layer (the block's input, the two normed inputs,
q/k/v, the attention output and the feed-forward's 4D hidden before and after GELU: 1 + 2 + 3 + 1 + 8 = 15 D).
"""

from __future__ import annotations

import torch

from ..config import GPTConfig
from ..devices import available_memory

ACTIVATIONS_PER_TOKEN_LAYER = 15  # x D floats; see the module docstring
BYTES_PER_PARAMETER = 16  # float32 weight + gradient + AdamW exp_avg + exp_avg_sq


def parameter_count(config: GPTConfig) -> int:
    """The model's parameters, from the formula (``tinygpt.params``; nothing is built)."""
    from ..params import count_parameters

    return count_parameters(config).total


def training_bytes(config: GPTConfig, batch_size: int, parameters: int | None = None, shards: int = 1) -> int:
    """Lower bound of the memory one process needs to train ``config`` on micro-batches of ``batch_size``
    windows of C tokens (see the module docstring); ``shards`` > 1: the weights are split over that many ranks."""
    parameters = parameter_count(config) if parameters is None else parameters
    tokens = batch_size * config.context_length
    activations = 4 * tokens * config.n_layers * ACTIVATIONS_PER_TOKEN_LAYER * config.emb_dim
    return BYTES_PER_PARAMETER * parameters // shards + activations


def _gib(n: int) -> str:
    return f"{n / 2**30:,.1f} GiB"


def check_windows(batch_size: int, world_size: int, train_tokens: int, context_length: int) -> None:
    """``ValueError`` when one global micro-batch asks for more windows than the train split has distinct ones."""
    windows = train_tokens - context_length  # start positions of a (C + 1)-token window
    wanted = batch_size * world_size
    if wanted > windows:
        raise ValueError(f"--batch-size {batch_size}{f' x {world_size} processes' if world_size > 1 else ''} = "
                         f"{wanted:,} windows per step, but the train split ({train_tokens:,} tokens) has only "
                         f"{windows:,} distinct windows of {context_length + 1} tokens: use at most --batch-size "
                         f"{max(1, windows // world_size):,} or more text")


def check_memory(config: GPTConfig, batch_size: int, device: torch.device, *, shards: int = 1,
                 what: str = "training") -> None:
    """``ValueError`` when even the lower bound of ``training_bytes`` exceeds the memory available on ``device``
    (``batch_size`` 0: the weights, gradients and AdamW state alone)."""
    free = available_memory(device)
    if free is None:
        return
    parameters = parameter_count(config)
    needed = training_bytes(config, batch_size, parameters, shards)
    if needed > free:
        weights = BYTES_PER_PARAMETER * parameters // shards
        activations = (f" + {_gib(needed - weights)} of activations for --batch-size {batch_size} x "
                       f"{config.context_length} tokens" if batch_size else "")
        hint = ("" if weights > free or not batch_size
                else "a smaller --batch-size (with --grad-accum for the same batch) or ")
        raise ValueError(
            f"{what} needs at least {_gib(needed)} on {device} ({parameters:,} parameters x {BYTES_PER_PARAMETER} "
            f"bytes{f' / {shards} shards' if shards > 1 else ''} = {_gib(weights)} for weights, gradients and "
            f"AdamW{activations}) but only {_gib(free)} is available: use {hint}a smaller model")
