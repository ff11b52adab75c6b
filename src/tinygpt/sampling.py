"""Turning the last position's logits [B, V] into the next token ids [B]: the logits processors and the draw.

The order is the usual one (and Hugging Face's): repetition penalty on the raw logits, then temperature, then the
top-k and top-p filters on the tempered logits, then softmax and one multinomial draw per row. Temperature 0 skips
everything after the penalty and takes the argmax, so greedy decoding is the temperature -> 0 limit and stays
exactly the seeds' argmax (seed 000 §6.9). Every function here works on a whole batch and does no validation: the
settings are checked once, in ``GenerationConfig``.
"""

from __future__ import annotations

import torch


def apply_repetition_penalty(logits: torch.Tensor, seen: torch.Tensor, penalty: float) -> torch.Tensor:
    """CTRL's penalty (Keskar et al. 2019): a seen token's logit is divided by ``penalty`` when positive and
    multiplied by it when negative, so penalty > 1 always makes it less likely. logits [B, V], seen [B, V] bool."""
    penalised = torch.where(logits > 0, logits / penalty, logits * penalty)
    return torch.where(seen, penalised, logits)


def top_k_filter(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Keep exactly the ``k`` largest logits of each row, -inf elsewhere. [B, V] -> [B, V].

    A threshold test (``logits < kth_value``) would keep every token tied with the k-th; ``topk``'s indices keep
    exactly k (ties broken by ``topk``'s order), which is what the setting promises.
    """
    if k >= logits.shape[-1]:
        return logits
    keep = torch.zeros_like(logits, dtype=torch.bool).scatter_(-1, logits.topk(k, dim=-1).indices, True)
    return logits.masked_fill(~keep, float("-inf"))


def top_p_filter(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Nucleus filter (Holtzman et al. 2020): keep the smallest set of most likely tokens whose probability sums
    to >= p, -inf elsewhere. [B, V] -> [B, V]. The most likely token is always kept."""
    if p >= 1.0:
        return logits
    sorted_logits, order = logits.sort(dim=-1, descending=True)  # [B, V]
    probs = sorted_logits.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs  # probability of the strictly more likely tokens
    drop_sorted = mass_before >= p  # the first token has mass_before == 0 < p, so it always stays
    drop = torch.zeros_like(drop_sorted).scatter_(-1, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def sampling_probs(
    logits: torch.Tensor,
    *,
    temperature: float,
    top_k: int | None,
    top_p: float,
    repetition_penalty: float,
    seen: torch.Tensor | None,
) -> torch.Tensor:
    """The distribution ``next_tokens`` draws from: logits [B, V] -> probabilities [B, V] (float32 for half
    logits). Temperature 0 gives the one-hot of the argmax (greedy is sampling from a point mass), so speculative
    decoding can verify greedy and sampled rows against the same kind of distribution."""
    if repetition_penalty != 1.0 and seen is not None:
        logits = apply_repetition_penalty(logits, seen, repetition_penalty)
    if temperature == 0.0:
        dtype = torch.float32 if logits.dtype in (torch.float16, torch.bfloat16) else logits.dtype
        return torch.zeros_like(logits, dtype=dtype).scatter_(-1, logits.argmax(dim=-1, keepdim=True), 1.0)
    logits = logits / temperature
    if top_k is not None:
        logits = top_k_filter(logits, top_k)
    logits = top_p_filter(logits, top_p)
    return logits.float().softmax(dim=-1) if logits.dtype in (torch.float16, torch.bfloat16) else logits.softmax(-1)


def next_tokens(
    logits: torch.Tensor,
    *,
    temperature: float,
    top_k: int | None,
    top_p: float,
    repetition_penalty: float,
    seen: torch.Tensor | None,
    generator: torch.Generator | None,
) -> torch.Tensor:
    """The next token id of every row: logits [B, V] -> ids [B] (int64)."""
    if temperature == 0.0:
        if repetition_penalty != 1.0 and seen is not None:
            logits = apply_repetition_penalty(logits, seen, repetition_penalty)
        return logits.argmax(dim=-1)
    probs = sampling_probs(logits, temperature=temperature, top_k=top_k, top_p=top_p,
                           repetition_penalty=repetition_penalty, seen=seen)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
