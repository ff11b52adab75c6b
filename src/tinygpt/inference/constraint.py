"""The per-row hook in the engine's sampling: a mask on the next token, and tokens forced after a drawn one.

Two features need to steer a row from outside the model, one token at a time:

- structured output (a JSON schema, a grammar, a regex) allows only the tokens that keep the text parseable: a
  mask over the vocabulary applied before the draw, greedy or sampled;
- a tool the model calls (a calculator) writes its answer into the row: once the model closes its call, the
  tool's output is *forced* (appended and fed to the model as if drawn, but never sampled), and a training stage
  keeps those tokens out of its loss.

Both are one small object per row (nanochat keeps its tool state the same way). The engine asks it for the mask
before each draw, tells it each token the row took, and feeds whatever it forces; nothing here touches the forward.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class RowConstraint(Protocol):
    """What the engine asks of a row's constraint (``Row.constraint``)."""

    def allowed(self) -> torch.Tensor | None:
        """The tokens the row may draw next: a [V] bool tensor (True = allowed), or None for any token."""
        ...

    def advance(self, token: int) -> list[int]:
        """The row drew ``token``; returns the tokens to force after it (maybe []). The constraint counts the
        tokens it forces as taken: ``advance`` is called for drawn tokens only."""
        ...

    def is_done(self) -> bool:
        """True once the constrained text is complete: the row finishes with reason "stop"."""
        ...


def masked_logits(logits: torch.Tensor, allowed: torch.Tensor | None) -> torch.Tensor:
    """``logits`` [V] with every disallowed token at -inf (a new tensor; the raw logits stay as they were).

    A mask shorter than V (a tokenizer smaller than the model's padded vocabulary) leaves the padding disallowed.
    A mask that allows nothing is an error: no token could be drawn.
    """
    if allowed is None:
        return logits
    if allowed.dtype != torch.bool or allowed.dim() != 1 or allowed.shape[0] > logits.shape[-1]:
        raise ValueError(f"a constraint's mask must be a 1-D bool tensor of at most V={logits.shape[-1]} entries, "
                         f"got {allowed.dtype} of shape {tuple(allowed.shape)}")
    keep = torch.zeros(logits.shape[-1], dtype=torch.bool, device=logits.device)
    keep[:allowed.shape[0]] = allowed.to(logits.device)
    if not bool(keep.any()):
        raise ValueError("the row's constraint allows no token at this point")
    return logits.masked_fill(~keep, float("-inf"))
