"""Speculative decoding: draft k tokens cheaply, verify them with one forward of the target, keep what it agrees with.

The target model is fed ``[last, d_1 .. d_k]`` in one cached forward; its logits at those k + 1 positions are the
distributions it would have sampled from had it generated the drafts itself. The pieces here are pure functions
over those distributions, so the engine and ``speculative_generate`` (the reference loop at the end) share them:

- drafts: ``propose_lookup`` (prompt-lookup decoding: copy what followed the latest earlier occurrence of the
  row's last n-gram, no second model; ``LookupIndex`` gives the same per row at a constant cost per token) or a
  ``DraftModel`` (a small tinygpt model sharing the tokenizer);
- verification: ``accept_greedy`` (the longest prefix of the draft equal to the target's argmax, then the target's
  own next token: token for token what plain greedy decoding writes) and ``accept_sampled`` (Leviathan et al.
  2023, "Fast Inference from Transformers via Speculative Decoding", Algorithm 1: accept d_i with probability
  min(1, p(d_i) / q(d_i)); at the first rejection draw from norm(max(0, p - q)); after k acceptances draw one more
  from the target's last distribution. Every token then has exactly the target's distribution);
- ``target_probs``: the distributions p the row really samples from (``sampling.sampling_probs``: repetition
  penalty with the draft's earlier tokens counted as seen, temperature, top-k, top-p); ``verify`` is both steps
  for one row, greedy or sampled;
- ``DraftController``: how many tokens to draft per row, and when to stop drafting for a row whose drafts fail.

Speed, with and without drafting: ``python -m benchmarks.serve --workloads speculative``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch import nn

from .. import checks
from .kv_cache import KVCache
from ..sampling import sampling_probs
from .sampling_params import GenerationConfig


# ------------------------------------------------------------------------------------------------ drafts
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


# ------------------------------------------------------------------------------------------------ verification
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


def verify(logits: torch.Tensor, tokens: Sequence[int], draft: Sequence[int], settings: Any, *,
           draft_probs: torch.Tensor | None = None, generator: torch.Generator | None = None) -> list[int]:
    """One row's verification, greedy or sampled: logits [k + 1, V] (the target's, after ``tokens`` and each
    prefix of ``draft``) -> the 1 .. k + 1 tokens the row writes. ``settings``: anything with ``temperature``,
    ``top_k``, ``top_p`` and ``repetition_penalty`` (a ``GenerationConfig``); ``draft_probs`` [k, V] as for
    ``accept_sampled``. With temperature 0 it is ``accept_greedy`` on the (penalised) distributions; with no
    penalty either, on the logits themselves (the same argmax, no softmax)."""
    if settings.temperature == 0.0 and settings.repetition_penalty == 1.0:
        return accept_greedy(draft, logits)
    probs = target_probs(logits, tokens, draft, temperature=settings.temperature, top_k=settings.top_k,
                         top_p=settings.top_p, repetition_penalty=settings.repetition_penalty)  # [k + 1, V]
    if settings.temperature == 0.0:
        return accept_greedy(draft, probs)
    return accept_sampled(draft, draft_probs, probs, generator)


# ------------------------------------------------------------------------------------------------ reference loop
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
