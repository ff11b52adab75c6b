"""Speculative decoding's first half: drafting k tokens cheaply for a row, and how many to draft.

The target model is fed ``[last, d_1 .. d_k]`` in one cached forward and keeps what it agrees with
(``acceptance``). The drafts come from:

- ``propose_lookup`` (prompt-lookup decoding: copy what followed the latest earlier occurrence of the row's last
  n-gram, no second model; ``LookupIndex`` gives the same per row at a constant cost per token);
- a ``DraftModel`` (a small tinygpt model sharing the tokenizer; ``DraftModels`` keeps one per engine row);
- ``DraftController``: how many tokens to draft per row, and when to stop drafting for a row whose drafts fail.

``Drafter`` is what the engine holds: ``propose(rows)`` gives every running row its draft for the step (one call
from ``InferenceEngine.step``), ``verified(row, kept)`` and ``release(row)`` keep its per-row state.

Speed, with and without drafting: ``python -m benchmarks.serve --workloads speculative``.
"""

from __future__ import annotations

import sys
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
from torch import nn

from .. import checks
from ..sampling import sampling_probs
from .kv_cache import KVCache
from .row import Row

Proposer = Callable[[Sequence[int], int], list[int]]


def propose_lookup(tokens: Sequence[int], k: int, max_ngram: int = 3) -> list[int]:
    """Prompt-lookup drafting: up to ``k`` tokens copied from the row's own history.

    For n = ``max_ngram`` down to 1: find the latest earlier occurrence of the last n tokens (a match ending
    before the last token) and propose the k tokens that followed it. The longest n-gram wins (a longer match
    predicts better); [] when no n-gram recurs. Costs one backward scan of ``tokens`` per n.
    """
    checks.positive_int("k", k)
    checks.positive_int("max_ngram", max_ngram)
    tokens = list(tokens)
    length = len(tokens)
    for n in range(min(max_ngram, length - 1), 0, -1):
        tail = tokens[length - n:]
        first = tail[0]
        for start in range(length - n - 1, -1, -1):  # the match tokens[start:start + n] ends before the tail
            if tokens[start] == first and tokens[start:start + n] == tail:
                return tokens[start + n:start + n + k]
    return []


class LookupIndex:
    """``propose_lookup`` for a row whose tokens only grow, at O(``max_ngram``) work per token instead of a scan.

    For each n it maps every n-gram that ends before the row's last token to where its latest occurrence ended
    (the start of what followed it). ``update(tokens)`` indexes what was appended since the last call (``tokens``
    is the row's whole sequence; it must extend the one seen before); ``propose(k)`` then returns exactly what
    ``propose_lookup(tokens, k, max_ngram)`` would.
    """

    def __init__(self, max_ngram: int = 3) -> None:
        checks.positive_int("max_ngram", max_ngram)
        self.max_ngram = max_ngram
        self.tokens: list[int] = []
        self.ends: list[dict[tuple[int, ...], int]] = [{} for _ in range(max_ngram + 1)]  # [n][n-gram] -> end

    def update(self, tokens: Sequence[int]) -> None:
        """Index the tokens appended since the last call."""
        old = len(self.tokens)
        if len(tokens) < old or (old and tokens[old - 1] != self.tokens[-1]):  # a cheap check, not a full compare
            raise ValueError("LookupIndex.update needs the row's sequence so far, extended (tokens only grow)")
        self.tokens.extend(int(t) for t in tokens[old:])
        # the n-grams tokens[end - n:end] for the ends not yet indexed, up to len - 1 (a match must end before the
        # last token); a later end overwrites an earlier one, so each n-gram keeps its latest occurrence
        for end in range(max(old, 1), len(self.tokens)):
            for n in range(1, min(self.max_ngram, end) + 1):
                self.ends[n][tuple(self.tokens[end - n:end])] = end

    def propose(self, k: int) -> list[int]:
        """Up to ``k`` tokens: what followed the latest earlier occurrence of the longest recurring tail n-gram."""
        checks.positive_int("k", k)
        length = len(self.tokens)
        for n in range(min(self.max_ngram, length - 1), 0, -1):
            end = self.ends[n].get(tuple(self.tokens[length - n:]))
            if end is not None:
                return self.tokens[end:end + k]
        return []


class DraftModel:
    """A small tinygpt model that drafts for a larger one (``--draft MODEL``); it must share the tokenizer.

    It keeps its own ``KVCache`` (one row) and a record of the tokens whose keys and values it holds. ``propose``
    feeds only what it has not seen (the tokens accepted since the last call: the longest common prefix with its
    record is reused) and then drafts k tokens, one forward each; ``accept(n)`` tells it how many of its k drafts
    the target kept, so its record rolls back to them (the cache's later positions are overwritten next time).
    With ``temperature`` 0 it drafts greedily and returns no probabilities (deterministic drafts, q one-hot);
    otherwise it samples from ``sampling_probs`` under the same settings as the target and returns them [k, V].
    """

    def __init__(self, model: nn.Module, *, temperature: float = 0.0, top_k: int | None = None,
                 top_p: float = 1.0, generator: torch.Generator | None = None, cache: KVCache | None = None) -> None:
        checks.non_negative_number("temperature", temperature, note="(0 means greedy)")
        checks.positive_int("top_k", top_k, optional=True, note="(unset: no top-k filter)")
        checks.number_in_range("top_p", top_p, 0, 1, low_open=True, note="(1 means no nucleus filter)")
        self.model = model
        self.settings = dict(temperature=temperature, top_k=top_k, top_p=top_p, repetition_penalty=1.0, seen=None)
        self.generator = generator
        param = next(model.parameters())
        # ``cache``: a spare one-row cache of this model to reuse (its old contents are simply overwritten)
        self.cache = cache if cache is not None else KVCache(model.config, 1, dtype=param.dtype, device=param.device)
        self.device = param.device
        self.cached: list[int] = []  # tokens whose keys/values are in the cache, in order
        self._base = 0  # len(cached) before the last proposal's drafts were fed

    @property
    def context_length(self) -> int:
        return self.model.config.context_length

    @torch.inference_mode()
    def propose(self, tokens: Sequence[int], k: int) -> tuple[list[int], torch.Tensor | None]:
        """Draft up to ``k`` tokens after ``tokens`` (the row's whole text so far); returns (drafts, their
        probabilities [k', V] or None when greedy). Fewer than k (maybe none) where its context runs out."""
        checks.positive_int("k", k)
        tokens = list(tokens)
        k = min(k, self.context_length - len(tokens))
        if k < 1 or not tokens:
            return [], None
        common = 0
        for mine, theirs in zip(self.cached, tokens):
            if mine != theirs:
                break
            common += 1
        common = min(common, len(tokens) - 1)  # at least one token is fed, for its logits
        was_training = self.model.training
        self.model.eval()
        try:
            feed = tokens[common:]
            drafts: list[int] = []
            probs: list[torch.Tensor] = []
            start = common
            for _ in range(k):
                idx = torch.tensor([feed], device=self.device)  # [1, T]
                logits = self.model(idx, cache=self.cache, pos=start, last_only=True)[:, -1]  # [1, V]
                start += len(feed)
                dist = sampling_probs(logits, **self.settings)  # [1, V]
                if self.settings["temperature"] == 0.0:
                    token = int(dist.argmax(dim=-1))
                else:
                    token = int(torch.multinomial(dist, 1, generator=self.generator))
                    probs.append(dist[0])
                drafts.append(token)
                feed = [token]
        finally:
            self.model.train(was_training)
        self.cached = tokens + drafts[:-1]  # the last draft was never fed
        self._base = len(tokens)
        return drafts, (torch.stack(probs) if probs else None)

    def accept(self, accepted: int) -> None:
        """The target kept ``accepted`` of the last drafts: forget the keys/values of the rejected ones."""
        checks.non_negative_int("accepted", accepted)
        self.cached = self.cached[:self._base + accepted]


def check_draft_model(target: nn.Module, draft: nn.Module) -> None:
    """A draft model must share the target's tokenizer: at least its vocabulary size (``ValueError`` naming both)."""
    for name, model in (("the target", target), ("the draft model", draft)):
        if not isinstance(model, nn.Module) or not hasattr(model, "config"):
            raise TypeError(f"{name} must be a tinygpt model (an nn.Module with a config), got {type(model).__name__}")
    if draft.config.vocab_size != target.config.vocab_size:
        raise ValueError(f"the draft model's vocab_size={draft.config.vocab_size} differs from the target's "
                         f"vocab_size={target.config.vocab_size}: they must share the tokenizer (the draft proposes "
                         f"the target's token ids)")


class DraftModels:
    """A small model drafting for every row of the engine: one greedy ``DraftModel`` state per row.

    Each row keeps its own one-row ``KVCache`` of the draft model between steps, so a step feeds the draft only
    what the row accepted since (plus its k draft tokens, one forward each); a row that leaves gives its cache
    back for the next row (``release``). Drafts are always the draft model's argmax (q one-hot), for sampled rows
    too: a sampled draft would spend the row's random draws before the scheduler decides whether the row runs
    this step, and a seeded row must repeat its text whatever its neighbours. A row longer than the draft's
    context shows the draft only its last ``context - k`` tokens (recomputed at each step once the tail moves).
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.context = model.config.context_length
        self._rows: dict[Any, DraftModel] = {}
        self._spare: list[KVCache] = []

    def propose(self, key: Any, tokens: Sequence[int], k: int) -> list[int]:
        """Up to ``k`` greedy draft tokens after ``tokens`` (the row's window) for the row ``key``."""
        checks.positive_int("k", k)
        drafter = self._rows.get(key)
        if drafter is None:
            drafter = DraftModel(self.model, cache=self._spare.pop() if self._spare else None)
            self._rows[key] = drafter
        tokens = list(tokens)[-max(1, self.context - k):]
        drafts, _ = drafter.propose(tokens, k)
        return drafts

    def accept(self, key: Any, accepted: int) -> None:
        """The row's target kept ``accepted`` of the last drafts."""
        if key in self._rows:
            self._rows[key].accept(accepted)

    def release(self, key: Any) -> None:
        """The row left: its cache is free for another row."""
        drafter = self._rows.pop(key, None)
        if drafter is not None:
            self._spare.append(drafter.cache)

    def __len__(self) -> int:
        """Rows holding a draft state now."""
        return len(self._rows)


@dataclass
class DraftController:
    """How many tokens one row drafts next, adapted to how many the target keeps.

    The rule: start at ``k_start``. After each verification, k grows by one (up to ``k_max``) when every draft was
    accepted, and otherwise becomes accepted + 1 (what would just have sufficed, plus one). An exponential average
    of the accepted fraction (weight ``smoothing`` on the newest round, starting at 1) tracks how well drafts do;
    once it falls below ``off_below`` the row stops drafting for ``cooldown`` steps (``k()`` returns 0), then tries
    again with k = 1. Each consecutive failure doubles the pause (up to ``max_cooldown``); a row whose drafts
    recover gets the short pause back. A step with no draft (lookup found nothing) changes nothing.
    """

    k_start: int = 4
    k_max: int = 8
    off_below: float = 0.3
    smoothing: float = 0.5
    cooldown: int = 16
    max_cooldown: int = 256

    def __post_init__(self) -> None:
        checks.positive_int("k_max", self.k_max)
        checks.int_in_range("k_start", self.k_start, 1, self.k_max, note="(k_max)")
        checks.fraction("off_below", self.off_below)
        checks.number_in_range("smoothing", self.smoothing, 0, 1, low_open=True)
        checks.positive_int("cooldown", self.cooldown)
        checks.int_in_range("max_cooldown", self.max_cooldown, self.cooldown, None, note="(cooldown)")
        self.current = self.k_start
        self.rate = 1.0  # smoothed accepted fraction
        self.paused = 0  # steps left without drafting
        self.pause = self.cooldown  # the next pause's length
        self.proposed = self.accepted = 0  # totals, for the acceptance rate

    def k(self) -> int:
        """Tokens to draft this step; 0 while drafting is paused (each call counts one paused step)."""
        if self.paused:
            self.paused -= 1
            return 0
        return self.current

    def update(self, proposed: int, accepted: int) -> None:
        """Record one verification: ``accepted`` (0..proposed) of ``proposed`` drafts were kept."""
        checks.non_negative_int("proposed", proposed)
        checks.int_in_range("accepted", accepted, 0, proposed, note="(proposed)")
        if proposed == 0:
            return
        self.proposed += proposed
        self.accepted += accepted
        self.rate = (1 - self.smoothing) * self.rate + self.smoothing * accepted / proposed
        self.current = min(self.current + 1, self.k_max) if accepted == proposed else min(accepted + 1, self.k_max)
        if self.rate < self.off_below:
            self.paused, self.pause = self.pause, min(2 * self.pause, self.max_cooldown)
            self.current, self.rate = 1, self.off_below  # on resuming: one draft, judged afresh
        elif self.rate >= 2 * self.off_below:
            self.pause = self.cooldown

    @property
    def acceptance_rate(self) -> float:
        """Accepted / proposed drafts over the row's life (0 before any draft)."""
        return self.accepted / self.proposed if self.proposed else 0.0


class Drafter:
    """The engine's drafting: for each running row that may draft this step, up to k tokens to verify.

    ``speculative_tokens`` k >= 1: the most a row drafts (its ``DraftController`` picks how many, starting at
    min(4, k)). Drafts come from ``draft_model`` (``DraftModels``: greedy, a cache per row), or ``proposer(tokens,
    k) -> draft``, or by default prompt lookup through each row's own ``LookupIndex`` (a constant cost per token,
    where ``propose_lookup`` scans the row at every step; after the window slides, the tokens before it still
    count). ``context``: the target's context length (a draft never runs past it).
    """

    def __init__(self, speculative_tokens: int, context: int, *, proposer: Proposer | None = None,
                 draft_model: nn.Module | None = None) -> None:
        self.k = speculative_tokens
        self.context = context
        self.proposer = proposer
        self.drafts = DraftModels(draft_model) if draft_model is not None else None

    def propose(self, rows: Sequence[Row], may_draft: Callable[[Row], bool]) -> None:
        """Set ``row.draft`` for every row: [] unless ``may_draft(row)`` and the row has just drawn a token (drafts
        follow a drawn token); a failing proposer leaves the row without a draft (a draft is only a guess)."""
        for row in rows:
            row.draft = []
            if not (may_draft(row) and row.pending == 1 and row.n_new):
                continue
            if row.drafter is None:
                row.drafter = DraftController(k_start=min(4, self.k), k_max=self.k)
            k = min(row.drafter.k(), row.config.max_new_tokens - row.n_new - 1, self.context - row.window_length)
            if k <= 0:
                continue
            try:
                draft = (self.drafts.propose(row.id, row.window, k) if self.drafts is not None
                         else self.proposer(row.window, k) if self.proposer is not None
                         else _lookup(row, k))
                row.draft = [int(t) for t in draft][:k]
            except Exception:
                traceback.print_exc(file=sys.stderr)

    def verified(self, row: Row, kept: int) -> None:
        """The target kept ``kept`` of the row's drafts: its counts, its controller and its draft model's state."""
        row.drafted += len(row.draft)
        row.accepted += kept
        row.drafter.update(len(row.draft), kept)
        if self.drafts is not None:
            self.drafts.accept(row.id, kept)

    def release(self, row: Row) -> None:
        """The row left the engine: its draft model's cache is free for another row."""
        if self.drafts is not None:
            self.drafts.release(row.id)


def _lookup(row: Row, k: int) -> list[int]:
    """Prompt lookup over the row's tokens, which only grow: its index takes only what was appended since."""
    if row.lookup is None:
        row.lookup = LookupIndex()
    row.lookup.update(row.tokens)
    return row.lookup.propose(k)
