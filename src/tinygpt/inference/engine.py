"""The loop that ties the core together: add rows, ``step`` until they are done.

Each ``step`` is three parts, as nano-vllm's: *schedule* (the context policy for rows that outgrew the context, one
call to the ``drafting.Drafter`` for the running rows' drafts when speculative decoding is on, the scheduler's
plan), *run* (one forward; if the batched forward raises, each planned row is run alone once, so only the rows that
fail alone fail) and *postprocess* (each row on its own: its drawn token, under its constraint's mask and followed
by the tokens it forces, its verified drafts, its score, or its pooled hidden states; a row that raises finishes
alone with reason "error", ``Row.error`` saying why; the plain greedy rows' tokens come from one argmax and one
read-back for all of them). Finished, failed and cancelled rows give their blocks back before the next step.

``tinygpt.generate`` (a batch of prompts), ``serving.engine.EngineThread`` (a thread and request adapter) and the
lm-eval class's scoring all drive this one class; none lays out a cache of its own.
"""

from __future__ import annotations

import sys
import traceback
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
from torch import nn

from .kv_cache import PagedKVCache
from .blocks import RESERVED, BlockManager, prefix_root
from .constraint import masked_logits
from .row import Row, Score
from .runner import ModelRunner, draw, draw_greedy, draw_together, verify
from .drafting import Drafter, DraftModels, Proposer, check_draft_model
from .scheduler import Scheduler

DEFAULT_BLOCK_SIZE = 16
POOLINGS = ("mean", "last")  # an embedding row's pooling of its final hidden states (``Row.pooling``)


@dataclass
class RowOutput:
    """What one step gave a row: its new tokens (0 while its prompt is still being prefilled), their raw logits
    [len(tokens), V] when the row asked for them (a scoring row: the logits of this step's scored positions, in
    order), and whether the row is now finished."""

    row: Row
    tokens: list[int] = field(default_factory=list)
    logits: torch.Tensor | None = None
    forced: list[bool] = field(default_factory=list)  # per token: forced by the row's constraint (not drawn)
    forced_logits: torch.Tensor | None = None  # [k, V]: the raw logits that scored k earlier forced tokens, in order

    @property
    def finished(self) -> bool:
        return self.row.finished


class InferenceEngine:
    """One model, one paged cache allocated once, one scheduler.

    ``max_rows``: rows in the running batch. ``token_budget``: tokens per forward (None: no limit, every prompt is
    prefilled in one piece); ``chunk_per_decode``: while rows decode, prompt tokens per step at most this many per
    decoding row (``scheduler``). ``cache_tokens``: positions the cache holds in all (default ``max_rows`` x the
    context). ``speculative_tokens`` k > 0 and a ``proposer(tokens, k) -> draft`` (prompt lookup by default) or a
    ``draft_model`` (a small model sharing the tokenizer): rows feed up to k draft tokens with their last token and
    keep what the model's verification accepts (``drafting.Drafter``, ``acceptance.verify``). ``compile``: decode
    steps run compiled (``runner.ModelRunner``).
    """

    def __init__(self, model: nn.Module, *, max_rows: int = 8, token_budget: int | None = None,
                 cache_tokens: int | None = None, block_size: int = DEFAULT_BLOCK_SIZE, prefix_reuse: bool = True,
                 speculative_tokens: int = 0, proposer: Proposer | None = None,
                 draft_model: nn.Module | None = None, chunk_per_decode: int | None = None,
                 compile: bool = False) -> None:
        for name, value in (("max_rows", max_rows), ("block_size", block_size)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be an integer >= 1")
        if token_budget is not None and (isinstance(token_budget, bool) or not isinstance(token_budget, int)
                                         or token_budget < max_rows):
            raise ValueError(f"token_budget={token_budget!r} must be an integer >= max_rows={max_rows} (every "
                             f"running row decodes at every step)")
        self.model = model
        self.config = model.config
        self.context = model.config.context_length
        cache_tokens = max_rows * self.context if cache_tokens is None else cache_tokens
        if isinstance(cache_tokens, bool) or not isinstance(cache_tokens, int) or cache_tokens < 1:
            raise ValueError(f"cache_tokens={cache_tokens!r} must be an integer >= 1")
        num_blocks = -(-cache_tokens // block_size) + RESERVED  # + the zero block and the scratch block
        param = next(model.parameters())
        self.device = param.device
        self.cache = PagedKVCache(model.config, num_blocks, block_size, dtype=param.dtype, device=param.device)
        self.blocks = BlockManager(num_blocks, block_size)
        self.scheduler = Scheduler(self.blocks, max_rows=max_rows, token_budget=token_budget,
                                   chunk_per_decode=chunk_per_decode)
        self.runner = ModelRunner(model, self.cache, compile=compile)
        self.prefix_reuse = prefix_reuse
        if isinstance(speculative_tokens, bool) or not isinstance(speculative_tokens, int) or speculative_tokens < 0:
            raise ValueError(f"speculative_tokens={speculative_tokens!r} must be an integer >= 0")
        self.speculative_tokens = speculative_tokens
        if draft_model is not None:
            if proposer is not None:
                raise ValueError("give a proposer or a draft_model, not both")
            check_draft_model(model, draft_model)
            if not speculative_tokens:
                raise ValueError("a draft_model needs speculative_tokens >= 1 (the draft tokens per forward)")
        self.drafter = (Drafter(speculative_tokens, self.context, proposer=proposer, draft_model=draft_model)
                        if speculative_tokens else None)
        self.steps = 0
        self.max_rows_seen = 0

    # ------------------------------------------------------------------------------------------ rows
    def add(self, row: Row) -> Row:
        """Queue a row (checked here: its ids, its fit in the cache and the context); ``ValueError`` if bad."""
        v, c = self.config.vocab_size, self.context
        if row.pooling is not None:
            if row.config is not None or row.pooling not in POOLINGS or not 1 <= len(row.tokens) <= c:
                raise ValueError(f"an embedding row needs no config, a pooling in {POOLINGS} (got "
                                 f"{row.pooling!r}) and 1 <= tokens={len(row.tokens)} <= context_length={c}")
            need = len(row.tokens)
            row.reuse = row.reuse and self.prefix_reuse
        elif row.config is None:
            if not 1 <= row.scored <= len(row.tokens) - 1 or len(row.tokens) - 1 > c:
                raise ValueError(f"a scoring row of {len(row.tokens)} tokens with {row.scored} scored must satisfy "
                                 f"1 <= scored <= tokens - 1 and tokens - 1 <= context_length={c}")
            need = len(row.tokens) - 1
        else:
            if not row.tokens:
                raise ValueError("a row needs at least one prompt token")
            if row.config.overflow == "error" and len(row.tokens) + row.config.max_new_tokens - 1 > c:
                raise ValueError(f"a prompt of {len(row.tokens)} tokens + max_new_tokens="
                                 f"{row.config.max_new_tokens} does not fit context_length={c}")
            need = min(c, len(row.tokens) + row.config.max_new_tokens) + self._draft_size(row)
            if row.config.repetition_penalty != 1.0 and row.seen is None:
                row.seen = torch.zeros(1, v, dtype=torch.bool, device=self.device)
                row.seen[0, row.tokens] = True
            row.reuse = row.reuse and self.prefix_reuse and row.config.use_cache
        names = getattr(self.model, "adapter_names", [])
        if not (isinstance(row.adapter, int) and -1 <= row.adapter < len(names)):
            raise ValueError(f"adapter={row.adapter!r} must be -1 (the base) or the index of an attached adapter "
                             f"(0..{len(names) - 1}: {', '.join(names)})" if names else
                             f"adapter={row.adapter!r}: the model has no adapters attached (only -1, the base)")
        bad = next((t for t in row.tokens if not (isinstance(t, int) and 0 <= t < v)), None)
        if bad is not None:
            raise ValueError(f"token id {bad!r} is out of range: ids must satisfy 0 <= id < vocab_size={v}")
        if self.blocks.blocks_for(need) > self.blocks.capacity_blocks:
            raise ValueError(f"a row of up to {need} positions does not fit a cache of "
                             f"{self.blocks.capacity_blocks * self.blocks.block_size}")
        if row.config is not None and row.config.max_new_tokens == 0:
            row.finish_reason = "length"  # nothing to do
            return row
        self._move_window(row)
        self.scheduler.add(row)
        return row

    def cancel(self, row: Row) -> None:
        """Drop a row now (its blocks are free at once)."""
        if not row.finished:
            row.finish_reason = "cancelled"
        self._remove(row)

    @property
    def has_work(self) -> bool:
        return bool(self.scheduler.running or self.scheduler.waiting)

    @property
    def rows(self) -> list[Row]:
        return self.scheduler.running + list(self.scheduler.waiting)

    def _draft_size(self, row: Row) -> int:
        if not self.speculative_tokens or row.config is None or not row.config.use_cache or row.constraint is not None:
            return 0
        return self.speculative_tokens

    def _move_window(self, row: Row) -> bool:
        """Move a generation row's window when it outgrew the context (``GenerationConfig.overflow``)."""
        if row.config is None or row.window_length <= self.context:
            return False
        keep = self.context if row.config.overflow == "slide" else (row.config.shift_keep or self.context // 2)
        row.window_start = len(row.tokens) - keep
        return True

    def _apply_window(self, row: Row) -> None:
        """A queued or running row whose window moved is recomputed from its new start."""
        if self._move_window(row):
            self.scheduler.requeue(row)

    # ------------------------------------------------------------------------------------------ the step
    @torch.inference_mode()
    def step(self) -> list[RowOutput]:
        """Run one scheduled forward; what it gave each row that took part (plus rows that failed alone)."""
        plan = self._schedule()
        if not plan:
            return []
        results = self._run(plan)
        return self._postprocess(plan, results)

    @property
    def drafts(self) -> DraftModels | None:
        """The draft model's per-row states (None without a draft model)."""
        return None if self.drafter is None else self.drafter.drafts

    def _schedule(self) -> list[tuple[Row, int]]:
        """The context policy for rows that outgrew the context, each running row's draft, the scheduler's plan."""
        running = list(self.scheduler.running)
        for row in list(self.scheduler.waiting) + running:
            self._apply_window(row)
        if self.drafter is not None:
            self.drafter.propose(running, lambda row: self._draft_size(row) > 0)
        plan = self.scheduler.schedule()
        if plan:
            self.steps += 1
            self.max_rows_seen = max(self.max_rows_seen, len(self.scheduler.running))
        return plan

    def _run(self, plan: list[tuple[Row, int]]) -> list[torch.Tensor | BaseException]:
        """One forward over the plan: each row's logits. If the batched forward raises, each row runs alone once,
        so that only the rows that fail alone fail (their entry is the error)."""
        try:
            return list(self.runner.forward(plan))
        except Exception:
            traceback.print_exc(file=sys.stderr)
        results: list[torch.Tensor | BaseException] = []
        for row, n in plan:
            try:
                results.extend(self.runner.forward([(row, n)]))
            except Exception as err:
                results.append(err)
        return results

    def _postprocess(self, plan: list[tuple[Row, int]], results: list[torch.Tensor | BaseException]
                     ) -> list[RowOutput]:
        """Each row on its own: its tokens (drawn, verified drafts, forced by its constraint) or its score; a row
        that raises fails alone. Then the finished rows leave and the computed full blocks are published."""
        outputs = [self._fail(row, lg) for (row, _), lg in zip(plan, results) if isinstance(lg, BaseException)]
        ran = [(row, n, lg) for (row, n), lg in zip(plan, results) if not isinstance(lg, BaseException)]
        # rows sharing a generator draw in one call, and so do the plain greedy rows
        together = _draw_at_once([(row, lg) for row, n, lg in ran if _draws_together(row, n, plan)], draw_together)
        together.update(_draw_at_once([(row, lg) for row, n, lg in ran if _draws_greedy(row, n)], draw_greedy))
        for row, n, lg in ran:
            try:
                outputs.append(self._advance(row, n, lg, together.get(row.id)))
            except Exception as err:
                outputs.append(self._fail(row, err))
        for out in outputs:
            row = out.row
            if row.finish_reason != "error":  # its computed full blocks serve later rows (the next turn of a chat)
                self.blocks.register(row.table, row.window, row.computed, row.hashes,
                                     prefix_root(row.adapter, row.cache_salt))
            if row.finished:
                self._remove(row)
            elif row.config is not None and not row.config.use_cache and row.pending == 1:
                self.scheduler.requeue(row)  # no cache: the whole window again at the next step
        return outputs

    def _fail(self, row: Row, err: BaseException) -> RowOutput:
        row.finish_reason, row.error = "error", f"{type(err).__name__}: {err}"
        return RowOutput(row)

    def _advance(self, row: Row, n: int, logits: torch.Tensor, drawn: int | None) -> RowOutput:
        """Account for the row's n fed tokens and take what its logits give (tokens, or its score)."""
        if row.pooling is not None:
            return self._advance_embedding(row, n, logits)
        if row.config is None:
            return self._advance_score(row, n, logits)
        scored_forced = None
        if row.draft:
            tokens = verify(row, logits)
            self.drafter.verified(row, len(tokens) - 1)
            row.computed += len(tokens)  # the fed last token and the accepted drafts; the final token is new
            kept = logits[:len(tokens)]
        else:
            row.computed += n
            if row.want_logits and row.constraint is not None:  # ``runner.logit_offsets``: forced tokens first
                drawing = row.pending == 0  # then the last logits are the next draw's, after the forced ones
                k = logits.shape[0] - int(drawing)
                scored_forced = logits[:k] if k else None
                settled = row.window_start + row.computed + int(not drawing)  # tokens before it are scored
                row.forced_scored = max(row.forced_scored, settled)
            if row.pending > 0:  # a chunk of the prompt (or of forced tokens): nothing to draw yet
                return RowOutput(row, forced_logits=scored_forced)
            if drawn is None:
                last = logits[-1] if row.constraint is None else masked_logits(logits[-1], row.constraint.allowed())
                drawn = draw(row, last)
            tokens = [drawn]
            kept = logits[-1:]
        row.draft = []
        taken: list[int] = []
        for token in tokens:
            self._take(row, token, forced=False)
            taken.append(token)
            if row.finished:
                break
        out = RowOutput(row, taken, kept[:len(taken)] if row.want_logits else None, [False] * len(taken),
                        scored_forced)
        if row.constraint is not None and not row.finished:
            for token in row.constraint.advance(taken[-1]):  # forced tokens: fed by the next forwards
                self._take(row, int(token), forced=True)
                out.tokens.append(int(token))
                out.forced.append(True)
                if row.finished:
                    break
            if not row.finished and row.constraint.is_done():
                row.finish_reason = "stop"
        return out

    def _take(self, row: Row, token: int, *, forced: bool) -> None:
        """Append one new token to the row and see whether it ends the row (eos, a stop sequence, the length)."""
        if forced and not 0 <= token < self.config.vocab_size:
            raise ValueError(f"the row's constraint forced token id {token}, outside 0 <= id < vocab_size="
                             f"{self.config.vocab_size}")
        row.tokens.append(token)
        row.n_new += 1
        row.forced.append(forced)
        if row.seen is not None:
            row.seen[0, token] = True
        reason = _finish_reason(row, token)
        if reason is not None:
            row.finish_reason = reason

    def _advance_score(self, row: Row, n: int, logits: torch.Tensor) -> RowOutput:
        first = row.computed + n - logits.shape[0]  # window position of the first scored logits
        skip = max(0, row.score_upto - first)  # positions a preempted row scored before its recompute
        logits, first = logits[skip:], first + skip
        if logits.shape[0]:
            row.score_upto = row.computed + n
            targets = torch.tensor(row.tokens[first + 1:row.computed + n + 1], device=logits.device)
            logp = torch.log_softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=-1)  # [m, V]
            total = float(logp.gather(1, targets[:, None]).sum())
            greedy = bool((logp.argmax(dim=-1) == targets).all())
            prev = row.score or Score(0.0, True)
            row.score = Score(prev.logprob + total, prev.greedy and greedy)
        row.computed += n
        if row.pending == 0:
            row.finish_reason = "length"
        return RowOutput(row, logits=logits if row.want_logits else None)

    def _advance_embedding(self, row: Row, n: int, states: torch.Tensor) -> RowOutput:
        """Pool this chunk's hidden states [m, D] into ``row.embedding``: "mean" sums them (divided by the length
        once the last chunk is in), "last" keeps the last position's."""
        if states.shape[0]:
            states = states.float()
            if row.pooling == "last":
                row.embedding = states[-1]
            else:
                part = states.sum(0)  # [D]
                row.embedding = part if row.embedding is None else row.embedding + part
        row.computed += n
        if row.pending == 0:
            if row.pooling == "mean":
                row.embedding = row.embedding / row.window_length
            row.finish_reason = "length"
        return RowOutput(row)

    # ------------------------------------------------------------------------------------------ helpers
    def _remove(self, row: Row) -> None:
        self.scheduler.remove(row)
        if self.drafter is not None:
            self.drafter.release(row)

    def run_until_done(self) -> None:
        while self.has_work:
            self.step()


def _draw_at_once(rows: list[tuple[Row, torch.Tensor]], draw: Callable[[list[Row], list[torch.Tensor]], list[int]]
                  ) -> dict[int, int]:
    """The next token of each row (by id) from one ``draw`` over the rows and their last logits [V] each; empty when
    the draw raises: each row then draws alone, and fails alone if it must."""
    if not rows:
        return {}
    try:
        tokens = draw([r for r, _ in rows], [lg[-1] for _, lg in rows])
    except Exception:
        return {}
    return {r.id: t for (r, _), t in zip(rows, tokens)}


def _draws_together(row: Row, n: int, plan: Sequence[tuple[Row, int]]) -> bool:
    """A sampled row drawing its next token this step with a generator other planned rows share."""
    return (not row.draft and row.config is not None and row.config.temperature > 0 and row.constraint is None
            and row.computed + n == row.window_length and _shares_generator(row, plan))


def _draws_greedy(row: Row, n: int) -> bool:
    """A greedy row drawing its next token this step that nothing else decides: no draft to verify, no
    constraint's mask, no repetition penalty (its argmax is the plain argmax of its logits)."""
    cfg = row.config
    return (not row.draft and cfg is not None and cfg.temperature == 0 and row.constraint is None
            and cfg.repetition_penalty == 1.0 and row.computed + n == row.window_length)


def _shares_generator(row: Row, plan: Sequence[tuple[Row, int]]) -> bool:
    return row.generator is not None and sum(1 for r, _ in plan if r.generator is row.generator) > 1


def _finish_reason(row: Row, token: int) -> str | None:
    cfg = row.config
    if token == cfg.eos_id:
        return "eos"
    if any(row.n_new >= len(s) and tuple(row.tokens[-len(s):]) == s for s in cfg.stop):
        return "stop"
    if row.n_new >= cfg.max_new_tokens:
        return "length"
    return None
