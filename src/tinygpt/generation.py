"""Text generation: the seeds' greedy loop (seed 000 §6.9)."""

from __future__ import annotations

import torch
from torch import nn


@torch.no_grad()
def generate_greedy(
    model: nn.Module, idx: torch.Tensor, max_new_tokens: int, context_size: int | None = None
) -> torch.Tensor:
    """Append ``max_new_tokens`` argmax tokens to idx [B, T]; returns [B, T + max_new_tokens].

    Exactly the seeds' ``generate_text_simple``: each step crops to the last ``context_size`` tokens (default C),
    runs the full forward (positions restart at 0 for the crop, so once the sequence outgrows the window this is
    *not* what a cache keeping all history would compute), and takes the argmax of the last position. Runs in eval
    mode without gradients and puts the model back in the mode it was in.
    """
    limit = model.config.context_length
    context_size = limit if context_size is None else context_size
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 0:
        raise ValueError(f"max_new_tokens={max_new_tokens!r} must be an integer >= 0")
    if isinstance(context_size, bool) or not isinstance(context_size, int) or not 1 <= context_size <= limit:
        raise ValueError(f"context_size={context_size!r} must be an integer in [1, context_length={limit}]")
    was_training = model.training
    model.eval()
    try:
        for _ in range(max_new_tokens):
            logits = model(idx[:, -context_size:])  # [B, T', V]
            next_id = logits[:, -1, :].argmax(dim=-1, keepdim=True)  # [B, 1]
            idx = torch.cat((idx, next_id), dim=1)  # [B, T + 1]
    finally:
        model.train(was_training)
    return idx
