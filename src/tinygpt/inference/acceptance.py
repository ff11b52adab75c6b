"""Speculative decoding's second half: which of a row's draft tokens the target keeps.

The target's logits at the k + 1 fed positions ``[last, d_1 .. d_k]`` are the distributions it would have sampled
from had it generated the drafts itself. Pure functions over those distributions:

- ``accept_greedy``: the longest prefix of the draft equal to the target's argmax, then the target's own next
  token (token for token what plain greedy decoding writes);
- ``accept_sampled``: Leviathan et al. 2023, "Fast Inference from Transformers via Speculative Decoding",
  Algorithm 1: accept d_i with probability min(1, p(d_i) / q(d_i)); at the first rejection draw from
  norm(max(0, p - q)); after k acceptances draw one more from the target's last distribution. Every token then has
  exactly the target's distribution;
- ``target_probs``: the distributions p the row really samples from (``sampling.sampling_probs``: repetition
  penalty with the draft's earlier tokens counted as seen, temperature, top-k, top-p); ``verify`` is both steps
  for one row, greedy or sampled.
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..sampling import sampling_probs
from .sampling_params import GenerationConfig


def _check_verification(draft: Sequence[int], dists: torch.Tensor, name: str) -> list[int]:
    draft = [int(t) for t in draft]
    if dists.dim() != 2 or dists.shape[0] != len(draft) + 1:
        raise ValueError(f"{name} must be [k + 1, V] = [{len(draft) + 1}, V] for {len(draft)} draft tokens, "
                         f"got {list(dists.shape)}")
    vocab = dists.shape[1]
    if any(not 0 <= t < vocab for t in draft):
        raise ValueError(f"draft {draft} has a token id outside [0, {vocab})")
    return draft


def accept_greedy(draft: Sequence[int], target_logits: torch.Tensor) -> list[int]:
    """Greedy verification: target_logits [k + 1, V] (row i: the target's logits after the context and
    ``draft[:i]``; or the processed ``target_probs``, whose argmax is the same). Returns the drafts that equal the
    target's argmax, up to the first that does not, then the target's own argmax there: 1 .. k + 1 tokens, exactly
    what plain greedy decoding writes next."""
    draft = _check_verification(draft, target_logits, "target_logits")
    best = target_logits.argmax(dim=-1).tolist()  # [k + 1]
    out = []
    for mine, theirs in zip(draft, best):
        if mine != theirs:
            break
        out.append(mine)
    return out + [best[len(out)]]


def residual_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p - q)) [V]: what to sample after a rejected draft so that the output has p's distribution.
    Where p <= q everywhere (p == q up to rounding, so rejection was a rounding accident) it is p itself."""
    residual = (p - q).clamp(min=0)
    total = residual.sum()
    return residual / total if total > 0 else p


def accept_sampled(draft: Sequence[int], draft_probs: torch.Tensor | None, target_probs: torch.Tensor,
                   generator: torch.Generator | None = None) -> list[int]:
    """Speculative sampling (Leviathan et al. 2023): 1 .. k + 1 tokens distributed exactly as the target's.

    draft_probs [k, V]: the distribution each draft was drawn from (q), or None for deterministic drafts (prompt
    lookup, a greedy draft model: q is one-hot on the draft). target_probs [k + 1, V]: the distribution the row
    samples from at each position (``target_probs``). Draft i is kept with probability min(1, p_i(d) / q_i(d)); at
    the first rejection a token is drawn from ``residual_distribution(p_i, q_i)`` and the rest are dropped; after k
    acceptances one more is drawn from p_k. Random draws come from ``generator``.
    """
    draft = _check_verification(draft, target_probs, "target_probs")
    k = len(draft)
    if draft_probs is not None and tuple(draft_probs.shape) != (k, target_probs.shape[1]):
        raise ValueError(f"draft_probs must be [k, V] = [{k}, {target_probs.shape[1]}], "
                         f"got {list(draft_probs.shape)}")
    device = target_probs.device
    out: list[int] = []
    for i, token in enumerate(draft):
        p = target_probs[i]
        q = draft_probs[i] if draft_probs is not None else torch.zeros_like(p).index_fill_(0, torch.tensor(
            [token], device=device), 1.0)
        u = float(torch.rand((), generator=generator, device=device))
        if u * float(q[token]) < float(p[token]):  # u < p/q without dividing by a zero q
            out.append(token)
            continue
        residual = residual_distribution(p, q)
        return out + [int(torch.multinomial(residual, 1, generator=generator))]
    return out + [int(torch.multinomial(target_probs[k], 1, generator=generator))]


def target_probs(logits: torch.Tensor, tokens: Sequence[int], draft: Sequence[int], *, temperature: float,
                 top_k: int | None = None, top_p: float = 1.0, repetition_penalty: float = 1.0) -> torch.Tensor:
    """The target's processed distributions for verification: logits [k + 1, V] -> probabilities [k + 1, V].

    Row i is what the row would sample from after ``tokens`` (its prompt and output so far) and ``draft[:i]``: the
    repetition penalty counts those as seen, then temperature, top-k and top-p as in ``sampling.next_tokens``.
    With temperature 0 each row is the one-hot of its (penalised) argmax.
    """
    draft = _check_verification(draft, logits, "logits")
    seen = None
    if repetition_penalty != 1.0:
        seen = torch.zeros(logits.shape, dtype=torch.bool, device=logits.device)  # [k + 1, V]
        if tokens:
            seen[:, list(tokens)] = True
        for i, token in enumerate(draft):
            seen[i + 1:, token] = True
    return sampling_probs(logits, temperature=temperature, top_k=top_k, top_p=top_p,
                          repetition_penalty=repetition_penalty, seen=seen)


def verify(logits: torch.Tensor, tokens: Sequence[int], draft: Sequence[int], settings: GenerationConfig, *,
           draft_probs: torch.Tensor | None = None, generator: torch.Generator | None = None) -> list[int]:
    """One row's verification, greedy or sampled: logits [k + 1, V] (the target's, after ``tokens`` and each
    prefix of ``draft``) -> the 1 .. k + 1 tokens the row writes. ``settings``: the row's ``GenerationConfig``
    (its ``temperature``, ``top_k``, ``top_p`` and ``repetition_penalty``); ``draft_probs`` [k, V] as for
    ``accept_sampled``. With temperature 0 it is ``accept_greedy`` on the (penalised) distributions; with no
    penalty either, on the logits themselves (the same argmax, no softmax)."""
    if settings.temperature == 0.0 and settings.repetition_penalty == 1.0:
        return accept_greedy(draft, logits)
    probs = target_probs(logits, tokens, draft, temperature=settings.temperature, top_k=settings.top_k,
                         top_p=settings.top_p, repetition_penalty=settings.repetition_penalty)  # [k + 1, V]
    if settings.temperature == 0.0:
        return accept_greedy(draft, probs)
    return accept_sampled(draft, draft_probs, probs, generator)
