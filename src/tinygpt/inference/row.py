"""One request's state in the engine: its tokens, its window, its cache blocks, its sampling, its result.

Two kinds of rows share the loop: a *generation* row (prompt, then tokens drawn one by one, or several at once when
a draft is accepted) and a *scoring* row (a token window whose log-likelihood is wanted, no sampling; or, with a
``pooling``, an *embedding* row: its final hidden states pooled into one vector). Everything
specific to a row lives here, so a per-row setting (an adapter, a draft model) is one more field.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

import torch

from .sampling_params import GenerationConfig

_ids = itertools.count()


@dataclass
class Score:
    """A scoring row's result: summed log-probability (nats) of its scored tokens, whether each was the argmax."""

    logprob: float
    greedy: bool


@dataclass(eq=False)
class Row:
    """``tokens``: everything the row has seen (prompt, then each new token); the model sees
    ``tokens[window_start:]`` (the window moves only under the context policies of ``GenerationConfig``), at
    positions 0.. from the window's start. ``computed``: window positions whose keys/values are in the cache
    (``table``'s blocks); the rest are fed by the next steps. A generation row's last token is drawn but never yet
    fed, so a decoding row has exactly one pending token."""

    tokens: list[int]
    config: GenerationConfig | None = None  # None: a scoring row
    scored: int = 0  # scoring rows: the last ``scored`` tokens are scored (the window is tokens[:-1])
    generator: torch.Generator | None = None
    want_logits: bool = False  # hand each drawn (or scored) token's raw logits to the caller (log-probabilities)
    reuse: bool = True  # may take cached prefix blocks
    adapter: int = -1  # which attached LoRA adapter (multi_lora) the row runs with; -1: the base model
    cache_salt: str | None = None  # shares cached prefix blocks only with rows of the same salt (``blocks``)
    tag: Any = None  # the caller's handle
    id: int = field(default_factory=lambda: next(_ids))
    prompt_len: int = 0
    window_start: int = 0
    computed: int = 0
    table: list[int] = field(default_factory=list)
    hashes: list[int] = field(default_factory=list)
    n_new: int = 0
    seen: torch.Tensor | None = None  # [1, V] bool: the repetition penalty's set
    draft: list[int] = field(default_factory=list)  # tokens proposed for this step (fed after the last token)
    finish_reason: str | None = None  # "eos", "stop", "length", "cancelled", "error"
    error: str = ""
    score: Score | None = None
    drafted: int = 0  # draft tokens verified / accepted (speculative decoding's acceptance rate)
    accepted: int = 0
    drafter: Any = None  # its speculative.DraftController, once it drafts
    lookup: Any = None  # its speculative.LookupIndex, once it drafts by prompt lookup
    constraint: Any = None  # a constraint.RowConstraint: masks each draw, may force tokens (never drafts)
    forced: list[bool] = field(default_factory=list)  # one per new token: True where the constraint forced it
    cached_tokens: int = 0  # prompt tokens whose keys came from the prefix cache at the prompt's admission
    forced_scored: int = 0  # want_logits: tokens before this index had their forced tokens' logits handed out
    score_upto: int = 0  # scoring rows: window positions before this one are in ``score`` (and handed out), so
    # a row preempted mid-prefill and recomputed from its start counts each position once
    pooling: str | None = None  # a scoring row that embeds: "mean" or "last" of its final hidden states
    embedding: torch.Tensor | None = None  # [D] float32: the pooled states (a running sum while "mean" feeds)

    def __post_init__(self) -> None:
        self.tokens = list(self.tokens)  # the row appends to its own copy, never to the caller's list
        self.prompt_len = len(self.tokens)

    @property
    def _end(self) -> int:
        """A scoring row never feeds its last token (it is only a target); an embedding row feeds every token."""
        return len(self.tokens) - 1 if self.config is None and self.pooling is None else len(self.tokens)

    @property
    def window(self) -> list[int]:
        """The tokens the model sees."""
        return self.tokens[self.window_start:self._end]

    @property
    def window_length(self) -> int:
        return self._end - self.window_start

    @property
    def pending(self) -> int:
        """Window tokens not yet in the cache."""
        return self.window_length - self.computed

    @property
    def first_logit(self) -> int:
        """The first window position whose logits (an embedding row: hidden states) the row needs (no cached prefix
        may reach past it)."""
        if self.pooling is not None:
            return 0 if self.pooling == "mean" else self.window_length - 1
        return self.window_length - self.scored if self.config is None else self.window_length - 1

    def forced_after(self, position: int) -> bool:
        """Whether the token after window ``position`` was forced by the constraint and its logits (those of
        ``position``) are still owed to a row that wants logits."""
        t = self.window_start + position + 1  # that token's index in ``tokens``
        return max(self.prompt_len, self.forced_scored) <= t < len(self.tokens) and self.forced[t - self.prompt_len]

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
