"""Text generation: the chapter's greedy loop (``generate_text_simple``) and the cached generation engine built on it.

``generate_greedy`` is the upstream's ``generate_text_simple``, kept as the reference. ``generate`` / ``stream`` add a
KV cache (prefill the prompt once, then feed one token per step), sampling (``tinygpt.sampling``), stop conditions
and batches of prompts of different lengths (left padding + a key mask + per-row positions).

The context limit is a *policy* (``GenerationConfig.overflow``), applied whenever the text the model must see
next would be longer than C tokens. The cache never changes which tokens come out, only how fast:

- ``"slide"`` (default): the chapter's semantics -- each step sees the last C tokens, positions from 0. Up to C this
  is the cached fast path; beyond C every position's embedding changes at every step, so nothing cached can be
  reused and each step is a full forward over C tokens (the cost of the uncached loop: about C times a cached
  step). Identical tokens to ``generate_greedy``, so switching the cache off never changes the output.
- ``"shift"``: keep the last ``shift_keep`` tokens (default C // 2), re-prefill them once at positions from 0 and
  continue cached; one prefill per C - shift_keep new tokens. Fast, but an approximation: the model forgets the
  dropped text and the kept text moves to new positions (as the chapter warns, truncation is not a cache).
- ``"error"``: a ``ValueError`` before any work, saying how many new tokens fit.

Speed, cached and uncached, against Hugging Face and LLMs-from-scratch: ``python -m benchmarks.generation``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

import torch
from torch import nn

from . import checks
from .inference.constraint import RowConstraint
from .inference.engine import DEFAULT_BLOCK_SIZE, InferenceEngine
from .inference.row import Row
from .inference.sampling_params import (  # noqa: F401  (the settings' home; their names stay importable here)
    OVERFLOW_POLICIES, REPETITION_PENALTY_RANGE, SEED_RANGE, TEMPERATURE_RANGE, TOP_P_RANGE, GenerationConfig,
    check_sampling,
)
from .inference.drafting import check_draft_model

DEFAULT_DRAFT_TOKENS = 4  # draft tokens per step with a draft model when speculative_tokens is 0 (= serve's default)


@torch.no_grad()
def generate_greedy(
    model: nn.Module, idx: torch.Tensor, max_new_tokens: int, context_size: int | None = None
) -> torch.Tensor:
    """Append ``max_new_tokens`` argmax tokens to idx [B, T]; returns [B, T + max_new_tokens].

    Exactly the upstream's ``generate_text_simple``: each step crops to the last ``context_size`` tokens (default C),
    runs the full forward (positions restart at 0 for the crop, so once the sequence outgrows the window this is
    *not* what a cache keeping all history would compute), and takes the argmax of the last position. Runs in eval
    mode without gradients and puts the model back in the mode it was in.
    """
    limit = model.config.context_length
    context_size = limit if context_size is None else context_size
    checks.non_negative_int("max_new_tokens", max_new_tokens)
    checks.int_in_range("context_size", context_size, 1, limit, note="(the context_length)")
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


@dataclass
class GenerationResult:
    """What ``generate`` returns. ``tokens`` [B, N]: the new tokens of each row (N = the longest row's count),
    ``pad_id`` after a row finished; ``lengths[i]``: row i's real new tokens; ``finish_reasons[i]``: "eos",
    "stop" or "length"; ``forced[i][j]``: whether row i's j-th new token was forced by its constraint."""

    tokens: torch.Tensor
    lengths: list[int]
    finish_reasons: list[str]
    forced: list[list[bool]] = field(default_factory=list)

    def rows(self) -> list[list[int]]:
        """The new tokens of each row without padding."""
        return [row[:n] for row, n in zip(self.tokens.tolist(), self.lengths)]


def _prompt_rows(prompts: object, vocab_size: int) -> list[list[int]]:
    """A [T] / [B, T] integer tensor, a list of ids or a list of id lists -> B non-empty lists of valid ids."""
    if isinstance(prompts, torch.Tensor):
        if prompts.dtype.is_floating_point or prompts.dtype.is_complex or prompts.dtype == torch.bool:
            raise TypeError(f"prompt tensor must hold integer token ids, got dtype {prompts.dtype}")
        if prompts.dim() not in (1, 2):
            raise ValueError(f"prompt tensor must have shape [tokens] or [batch, tokens], got {list(prompts.shape)}")
        rows = prompts.tolist() if prompts.dim() == 2 else [prompts.tolist()]
    elif isinstance(prompts, Sequence) and not isinstance(prompts, (str, bytes)):
        if len(prompts) > 0 and all(checks.is_int(t) for t in prompts):
            rows = [list(prompts)]
        elif len(prompts) > 0 and all(isinstance(r, Sequence) and not isinstance(r, (str, bytes)) for r in prompts):
            rows = [list(r) for r in prompts]
        else:
            raise ValueError("prompts must be a non-empty list of token ids or a non-empty list of such lists")
    else:
        raise TypeError(f"prompts must be a tensor or a list of token ids, got {type(prompts).__name__}")
    if not rows:
        raise ValueError("the batch of prompts is empty")
    for i, row in enumerate(rows):
        if not row:
            raise ValueError(f"prompt {i} is empty: at least one token is needed")
        for t in row:
            if not checks.is_int(t) or not 0 <= t < vocab_size:
                raise ValueError(f"prompt {i} has token id {t!r}: ids must be integers with 0 <= id < {vocab_size}")
    return rows


def _check_for_model(cfg: GenerationConfig, rows: list[list[int]], vocab_size: int, context_length: int) -> int:
    """Check the settings that depend on the model; returns the shift policy's kept length."""
    for name in ("eos_id", "pad_id"):
        value = getattr(cfg, name)
        if value is not None and value >= vocab_size:
            raise ValueError(f"{name}={value} is out of range: ids must satisfy 0 <= id < vocab_size={vocab_size}")
    for seq in cfg.stop:
        if max(seq) >= vocab_size:
            raise ValueError(f"stop sequence {list(seq)} has an id >= vocab_size={vocab_size}")
    keep = context_length // 2 if cfg.shift_keep is None else cfg.shift_keep
    if cfg.overflow == "shift":
        checks.int_in_range("shift_keep", keep, 1, context_length - 1, note="(context_length - 1)")
    longest = max(len(r) for r in rows)
    # The last new token is never fed back, so the model sees at most longest + max_new_tokens - 1 tokens.
    if cfg.overflow == "error" and longest + cfg.max_new_tokens - 1 > context_length:
        fit = context_length - longest + 1
        raise ValueError(
            f"a prompt of {longest} tokens + max_new_tokens={cfg.max_new_tokens} does not fit context_length="
            f"{context_length}: at most {max(fit, 0)} new tokens fit"
            + ("" if fit > 0 else " (the prompt alone is too long)")
            + '; use overflow="slide" or "shift" to go beyond the context'
        )
    return keep


def stream(
    model: nn.Module,
    prompts: torch.Tensor | Sequence[int] | Sequence[Sequence[int]],
    config: GenerationConfig | None = None,
    *,
    generator: torch.Generator | None = None,
    draft_model: nn.Module | None = None,
    constraints: Sequence[RowConstraint | None] | None = None,
    **overrides: Any,
) -> Iterator[list[int | None]]:
    """Yield, at every step, the new token of each row (``None`` for rows that already finished).

    prompts: [T] or [B, T] ids, or a list of B id lists of any lengths. Settings come from ``config`` and
    ``overrides`` (``GenerationConfig`` fields). ``draft_model``: a small model sharing the tokenizer that drafts
    ``speculative_tokens`` tokens per step (``DEFAULT_DRAFT_TOKENS`` when that is 0) instead of prompt lookup; the
    same tokens for greedy rows, the same distribution for sampled ones. ``constraints``: one per prompt (or None),
    each a ``RowConstraint`` that masks the row's draws and may force tokens (``inference.constraint``); a
    constrained row does not draft. Everything is checked before the first
    step; the model is in eval mode while the iterator runs and goes back to its mode when it ends or is closed.
    """
    rows, cfg = _prepare(model, prompts, config, generator, overrides, draft_model)
    _check_constraints(constraints, len(rows))
    return _steps(model, rows, cfg, generator, draft_model=draft_model, constraints=constraints)


def _check_constraints(constraints: object, n: int) -> None:
    if constraints is None:
        return
    if not isinstance(constraints, Sequence) or len(constraints) != n:
        raise ValueError(f"constraints must be a list of {n} entries (one per prompt, each a RowConstraint or None)")
    bad = next((c for c in constraints if c is not None and not isinstance(c, RowConstraint)), None)
    if bad is not None:
        raise TypeError(f"a constraint must have allowed(), advance(token) and is_done() (inference.constraint."
                        f"RowConstraint), got {type(bad).__name__}")


def _prepare(
    model: nn.Module, prompts: object, config: GenerationConfig | None, generator: torch.Generator | None,
    overrides: dict[str, Any], draft_model: nn.Module | None = None,
) -> tuple[list[list[int]], GenerationConfig]:
    """Every check, before any work: settings, prompts, their fit in the context, the generator, the draft."""
    if config is not None and not isinstance(config, GenerationConfig):
        raise TypeError(f"config must be a GenerationConfig, got {type(config).__name__}")
    cfg = (config or GenerationConfig()).replace(**overrides)
    if draft_model is not None:
        check_draft_model(model, draft_model)
        if not cfg.use_cache:
            raise ValueError("a draft_model needs use_cache=True (drafts are verified against the cache)")
        if cfg.speculative_tokens == 0:
            cfg = cfg.replace(speculative_tokens=DEFAULT_DRAFT_TOKENS)
    rows = _prompt_rows(prompts, model.config.vocab_size)
    _check_for_model(cfg, rows, model.config.vocab_size, model.config.context_length)
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(f"generator must be a torch.Generator, got {type(generator).__name__}")
    if cfg.token_budget is not None and cfg.token_budget < len(rows):
        raise ValueError(f"token_budget={cfg.token_budget} must be >= the batch's {len(rows)} prompts (every row "
                         f"decodes at every step)")
    return rows, cfg


def _steps(
    model: nn.Module, prompts: list[list[int]], cfg: GenerationConfig, generator: torch.Generator | None,
    finish_reasons: list[str] | None = None, draft_model: nn.Module | None = None,
    constraints: Sequence[RowConstraint | None] | None = None, forced: list[list[bool]] | None = None,
) -> Iterator[list[int | None]]:
    """The inference engine on the batch: one row per prompt, each at its own positions in one paged cache.

    The engine gives each row 0 or more tokens per forward (none while its prompt is prefilled in chunks, several
    when a draft is accepted); this yields step k's list once every unfinished row has its k-th token, so the
    lists are what stepping every row together gives.
    """
    if cfg.max_new_tokens == 0:
        return
    context = model.config.context_length
    longest = max(len(p) for p in prompts)
    per_row = min(context, longest + cfg.max_new_tokens) + cfg.speculative_tokens
    blocks = -(-per_row // DEFAULT_BLOCK_SIZE)
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    try:
        with torch.inference_mode():
            engine = InferenceEngine(model, max_rows=len(prompts), token_budget=cfg.token_budget,
                                     cache_tokens=len(prompts) * blocks * DEFAULT_BLOCK_SIZE,
                                     speculative_tokens=cfg.speculative_tokens, draft_model=draft_model,
                                     compile=cfg.compile)
            rows = []
            for i, prompt in enumerate(prompts):
                own = generator if generator is not None else cfg.row_generator(device, i)  # row i: seed + i
                rows.append(engine.add(Row(list(prompt), cfg, generator=own,
                                           constraint=None if constraints is None else constraints[i])))
        queues: list[list[int]] = [[] for _ in rows]
        given = [0] * len(rows)  # tokens already yielded per row
        while True:
            while not all(q or r.finished for q, r in zip(queues, rows)):
                with torch.inference_mode():
                    engine.step()
                for i, row in enumerate(rows):
                    if row.finish_reason == "error":
                        raise RuntimeError(f"generation failed for prompt {i}: {row.error}")
                    queues[i].extend(row.tokens[len(prompts[i]) + given[i] + len(queues[i]):])
            if not any(queues):
                break
            out = [q.pop(0) if q else None for q in queues]
            for i, token in enumerate(out):
                given[i] += token is not None
            yield out
        if finish_reasons is not None:
            finish_reasons[:] = [r.finish_reason for r in rows]
        if forced is not None:
            forced[:] = [list(r.forced) for r in rows]
    finally:
        model.train(was_training)


def generate(
    model: nn.Module,
    prompts: torch.Tensor | Sequence[int] | Sequence[Sequence[int]],
    config: GenerationConfig | None = None,
    *,
    generator: torch.Generator | None = None,
    draft_model: nn.Module | None = None,
    constraints: Sequence[RowConstraint | None] | None = None,
    **overrides: Any,
) -> GenerationResult:
    """Generate for a batch of prompts; returns the new tokens of every row. Arguments as for ``stream``.

    >>> generate(model, [[1, 2, 3], [4]], max_new_tokens=5).rows()  # doctest: +SKIP
    """
    rows, cfg = _prepare(model, prompts, config, generator, overrides, draft_model)
    _check_constraints(constraints, len(rows))
    reasons = ["length"] * len(rows)
    forced: list[list[bool]] = [[] for _ in rows]
    per_row: list[list[int]] = [[] for _ in rows]
    for step in _steps(model, rows, cfg, generator, reasons, draft_model, constraints, forced):
        for i, tok in enumerate(step):
            if tok is not None:
                per_row[i].append(tok)
    width = max((len(r) for r in per_row), default=0)
    tokens = torch.full((len(rows), width), cfg.pad_id, dtype=torch.long)
    for i, r in enumerate(per_row):
        tokens[i, : len(r)] = torch.tensor(r, dtype=torch.long)
    return GenerationResult(tokens=tokens, lengths=[len(r) for r in per_row], finish_reasons=reasons, forced=forced)
