"""Per-token log-probabilities and entropies from logits, the quantities every fine-tuning loss is built from."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .batches import IGNORE_INDEX


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log p(target) at every position: logits [B, T, V], targets [B, T] (-100 = ignore) -> [B, T] float32,
    exactly 0 at ignored positions. Computed in float32 (log_softmax of bf16 logits loses the small differences
    DPO and PPO ratios are made of)."""
    logp = F.log_softmax(logits.float(), dim=-1)  # [B, T, V]
    mask = targets != IGNORE_INDEX
    picked = logp.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)  # [B, T]
    return picked * mask


def sequence_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Sum of the response tokens' log-probabilities per row: [B, T, V], [B, T] -> [B] (log p(response | prompt))."""
    return token_logprobs(logits, targets).sum(dim=-1)


def response_logprobs(model: torch.nn.Module, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """``sequence_logprobs(model(inputs), targets)`` with the head applied to the response's positions only:
    inputs, targets [B, T] -> [B]. The prompt's positions (ignored targets, most of an instruction example) never
    become [V]-wide logits, so neither the head's product nor the log-softmax pays for them. ``model``: a
    ``GPTModel`` (its ``hidden_states`` and ``out_head``)."""
    h = model.hidden_states(inputs)  # [B, T, D]
    keep = targets != IGNORE_INDEX  # [B, T]
    picked = token_logprobs(model.out_head(h[keep]), targets[keep])  # [N', V] -> [N'], N' response tokens
    rows = keep.nonzero()[:, 0]  # [N'], the row of each response token
    return torch.zeros(inputs.shape[0], dtype=picked.dtype, device=picked.device).index_add(0, rows, picked)


def entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy (nats) of the next-token distribution at every position: [..., V] -> [...]."""
    logp = F.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(dim=-1)


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``values`` where ``mask`` is true (same shapes); 0 when nothing is selected."""
    mask = mask.to(values.dtype)
    return (values * mask).sum() / mask.sum().clamp(min=1)
