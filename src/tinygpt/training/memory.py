"""Activation checkpointing (``--grad-checkpoint``): keep each block's input, recompute the block in the backward.

Without it the backward pass needs every activation of every block (attention scores, the 4D feed-forward hidden
layer, the norms' inputs), kept from the forward: memory grows with L x B x C x D. With it each block keeps only its
input [B, C, D] and runs its forward a second time when its gradients are needed (``torch.utils.checkpoint``,
non-reentrant: it supports keyword arguments and any input that does not require grad, and replays the RNG state so
dropout draws the same masks). The gradients are the same computation; the price is about one more forward per step.
Measured by ``benchmarks/grad_checkpoint.py``.

The model file is not touched: the blocks' ``forward`` is replaced on the instance for the run and put back after.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint


def checkpoint_blocks(model: nn.Module) -> Callable[[], None]:
    """Make every block of ``model.trf_blocks`` recompute itself in the backward pass whenever gradients are being
    recorded (an ``inference_mode`` / ``no_grad`` forward, a cached decode, runs as before). Returns the function
    that puts the plain blocks back."""
    blocks = list(model.trf_blocks)
    for block in blocks:
        plain = block.forward

        def recomputed(*args: Any, _plain: Callable[..., torch.Tensor] = plain, **kwargs: Any) -> torch.Tensor:
            if not torch.is_grad_enabled():
                return _plain(*args, **kwargs)
            return checkpoint(_plain, *args, use_reentrant=False, **kwargs)

        block.forward = recomputed  # an instance attribute: nn.Module.__call__ finds it before the class's method

    def release() -> None:
        for block in blocks:
            block.__dict__.pop("forward", None)

    return release
