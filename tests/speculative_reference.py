"""The reference for the engine's speculative decoding (test support): one prompt, a plain ``KVCache``, drafts
verified by the same ``acceptance`` functions the engine uses. ``tests/test_speculative.py`` holds the engine's
tokens to this loop's (greedy: token for token; sampled: the same distribution)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch import nn

from tinygpt import checks
from tinygpt.inference.acceptance import verify
from tinygpt.inference.drafting import DraftController, DraftModel, check_draft_model, propose_lookup
from tinygpt.inference.kv_cache import KVCache
from tinygpt.inference.sampling_params import GenerationConfig


@dataclass
class SpeculativeResult:
    """What ``speculative_generate`` returns: the new tokens, why it stopped ("eos", "stop" or "length", as
    ``generate``), the drafts proposed and accepted, and the target forwards run (prefill included)."""

    tokens: list[int]
    finish_reason: str
    drafted: int
    accepted: int
    target_forwards: int

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0


SPECULATIVE_DRAFTS = ("lookup", "off")


@torch.inference_mode()
def speculative_generate(model: nn.Module, prompt: Sequence[int], config: Any = None, *,
                         draft: str | DraftModel = "lookup", controller: DraftController | None = None,
                         max_ngram: int = 3, generator: torch.Generator | None = None) -> SpeculativeResult:
    """Generate for one prompt with speculative decoding on a plain ``KVCache``: the reference for the engine.

    ``config``: a ``GenerationConfig`` (its sampling settings, ``max_new_tokens``, ``seed``, ``eos_id`` and
    ``stop``); the text must fit the context (prompt + max_new_tokens - 1 <= C). ``draft``: "lookup" (prompt
    lookup over the prompt and output, n-grams up to ``max_ngram``), "off" (plain decoding, one token per forward)
    or a ``DraftModel``. Greedy rows write exactly ``generate``'s tokens; sampled rows follow the same distribution
    (not the same draws: the random stream is consumed differently).
    """
    cfg = GenerationConfig() if config is None else config
    if not isinstance(cfg, GenerationConfig):
        raise TypeError(f"config must be a GenerationConfig, got {type(cfg).__name__}")
    if isinstance(draft, str):
        checks.choice("draft", draft, SPECULATIVE_DRAFTS)
    elif not isinstance(draft, DraftModel):
        raise TypeError(f"draft must be one of {', '.join(SPECULATIVE_DRAFTS)} or a DraftModel, "
                        f"got {type(draft).__name__}")
    else:
        check_draft_model(model, draft.model)
    seq = [int(t) for t in prompt]
    vocab, context = model.config.vocab_size, model.config.context_length
    if not seq or any(not 0 <= t < vocab for t in seq):
        raise ValueError(f"the prompt must be a non-empty list of token ids in [0, {vocab})")
    if len(seq) + cfg.max_new_tokens - 1 > context:
        raise ValueError(f"a prompt of {len(seq)} tokens + max_new_tokens={cfg.max_new_tokens} does not fit "
                         f"context_length={context}")
    controller = controller or DraftController()
    param = next(model.parameters())
    if generator is None:
        generator = cfg.row_generator(param.device)
    cache = KVCache(model.config, 1, dtype=param.dtype, device=param.device)
    new: list[int] = []
    drafted = accepted = 0
    was_training = model.training
    model.eval()
    try:
        if cfg.max_new_tokens == 0:
            return SpeculativeResult([], "length", 0, 0, 0)
        logits = model(torch.tensor([seq], device=param.device), cache=cache, last_only=True)[0]  # [1, V]
        forwards, drafts, draft_probs = 1, [], None
        while True:
            out = verify(logits, seq, drafts, cfg, draft_probs=draft_probs, generator=generator)
            if drafts:
                drafted, accepted = drafted + len(drafts), accepted + len(out) - 1
                controller.update(len(drafts), len(out) - 1)
                if isinstance(draft, DraftModel):
                    draft.accept(len(out) - 1)
            for token in out:
                seq.append(token)
                new.append(token)
                reason = _finished(new, cfg)
                if reason:
                    return SpeculativeResult(new, reason, drafted, accepted, forwards)
            # Feeding [last, d_1 .. d_k] writes positions len(seq) - 1 .. len(seq) - 1 + k, all < C; the round
            # writes at most k + 1 tokens, all within max_new_tokens.
            k = min(controller.k() if draft != "off" else 0, cfg.max_new_tokens - len(new) - 1, context - len(seq))
            drafts, draft_probs = [], None
            if k > 0 and draft == "lookup":
                drafts = propose_lookup(seq, k, max_ngram)
            elif k > 0 and isinstance(draft, DraftModel):
                drafts, draft_probs = draft.propose(seq, k)
            feed = torch.tensor([[seq[-1], *drafts]], device=param.device)  # [1, k + 1]
            logits = model(feed, cache=cache, pos=len(seq) - 1)[0]  # [k + 1, V]
            forwards += 1
    finally:
        model.train(was_training)


def _finished(new: list[int], cfg: Any) -> str | None:
    """Why the row ends after its latest token (``generate``'s rules), or None."""
    if new[-1] == cfg.eos_id:
        return "eos"
    if any(len(new) >= len(s) and tuple(new[-len(s):]) == s for s in cfg.stop):
        return "stop"
    if len(new) >= cfg.max_new_tokens:
        return "length"
    return None
