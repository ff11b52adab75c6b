"""The serving engine as it was before the inference core (kept for the A/B in benchmarks.serve; not the product).

Continuous batching: one thread runs the model; requests join the running batch and leave it step by step.

Every request (one choice of one prompt) becomes a *row*. A newcomer is prefilled alone, exactly as
``tinygpt.generate`` prefills a single prompt (its own ``KVCache``, no padding, no mask), and its first token is
drawn from that forward. It then joins the batch: its keys/values are copied into the batch's cache, and from then
on every step feeds the last token of every row in one forward of B rows, each row with its own position and a
key mask over the columns it owns.

Layout of the batch cache: all rows are right-aligned at column ``width`` (the next column to write); row r owns
columns ``width - cached_r .. width - 1``. A row's keys depend only on its tokens and its own positions (the
``positions`` argument), never on the column they are stored in, so copying a row's columns elsewhere changes
nothing it computes. The cache is rebuilt (``_relayout``) when rows join or leave; its capacity is what the rows
still need, at most C. A row alone with no padding runs with
no mask and default positions: exactly ``generate``'s path for one prompt.

Sampling is per row (``sampling.next_tokens`` on the row's logits [1, V], its own generator and seen-set), so a
row's tokens never depend on its neighbours: a greedy row's output equals ``generate`` on its prompt alone, and a
seeded sampled row repeats with the same seed whatever else is in the batch.

Text: each row decodes its whole continuation at every step and releases only what is final
(``text_stream``'s rules: no split UTF-8 character, no partial stop text); a stop text or the end-of-text token
finishes the row at once (``finish_reason="stop"``), ``max_tokens`` with ``"length"``.
"""

from __future__ import annotations

import collections
import sys
import traceback
from typing import Any, Callable

import torch
from torch import nn

from tinygpt.devices import autocast
from tinygpt.generation import GenerationConfig
from tinygpt.kv_cache import KVCache
from tinygpt.sampling import next_tokens
from tinygpt.serving.engine import (EngineRequest, EngineStopped, Finish, PromptLogprobs, QueueFull, Step,
                                    TokenInfo, _top)
from tinygpt.text_stream import TextCodec, _safe_end


class _TextTracker:
    """The final text of one row's continuation so far (``text_stream``'s rules)."""

    def __init__(self, tokenizer: TextCodec, stop_texts: tuple[str, ...]) -> None:
        self.tokenizer, self.stop_texts = tokenizer, list(stop_texts)
        self.ids: list[int] = []
        self.shown = 0

    def add(self, token: int) -> tuple[str, bool]:
        """Append a token; returns (the newly final text, whether a stop text was reached)."""
        self.ids.append(token)
        text = self.tokenizer.decode(self.ids)
        hits = [i for i in (text.find(s) for s in self.stop_texts) if i >= 0]
        if hits:
            cut = max(min(hits), self.shown)
            piece, self.shown = text[self.shown:cut], cut
            return piece, True
        end = _safe_end(text, self.stop_texts)
        piece = ""
        if end > self.shown:
            piece, self.shown = text[self.shown:end], end
        return piece, False

    def rest(self) -> str:
        """Whatever is still held back (at the end of a row that did not stop on a stop text)."""
        text = self.tokenizer.decode(self.ids)
        piece, self.shown = text[self.shown:], len(text)
        return piece


class _Row:
    """A request being decoded: what it was fed, its cache columns, its sampling state."""

    def __init__(self, req: EngineRequest, tokenizer: TextCodec, vocab_size: int, device: torch.device) -> None:
        self.req = req
        self.cfg = req.config
        self.seq = list(req.prompt)  # prompt + every token drawn (the repetition penalty's "seen")
        self.cached = 0  # tokens whose keys/values are in the cache
        self.last = -1  # the last token drawn, fed at the next step
        self.n_new = 0
        self.slot = -1  # its row in the batch cache
        self.own_cache: KVCache | None = None  # its prefill cache until it joins the batch cache
        self.text = _TextTracker(tokenizer, req.stop_texts)
        self.generator = None
        if self.cfg.seed is not None and self.cfg.temperature > 0:
            self.generator = torch.Generator(device=device).manual_seed(self.cfg.seed)  # as generate() seeds
        self.seen = None
        if self.cfg.repetition_penalty != 1.0:
            self.seen = torch.zeros(1, vocab_size, dtype=torch.bool, device=device)
            self.seen[0, self.seq] = True

    @property
    def remaining(self) -> int:
        """Tokens still to feed before the row is done (the last token drawn is never fed)."""
        return self.cfg.max_new_tokens - self.n_new


class BatchEngine:
    """The scheduler: a thread that admits waiting requests (up to ``max_batch`` rows decode together) and steps
    the batch. ``submit`` is thread-safe; events reach each request's ``sink``. ``max_queue`` bounds the rows that
    wait for a place in the batch (beyond it ``submit`` raises ``QueueFull``)."""

    def __init__(self, model: nn.Module, tokenizer: TextCodec, *, max_batch: int = 8, max_queue: int = 64,
                 dtype: str = "auto") -> None:
        if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
            raise ValueError(f"max_batch={max_batch!r} must be an integer >= 1")
        if isinstance(max_queue, bool) or not isinstance(max_queue, int) or max_queue < 0:
            raise ValueError(f"max_queue={max_queue!r} must be an integer >= 0")
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.max_batch, self.max_queue = max_batch, max_queue
        self.context = model.config.context_length
        self.vocab_size = model.config.vocab_size
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        self.autocast_dtype = dtype  # "auto" / "float32" / "bfloat16": every model call runs under ``autocast``
        autocast(self.device, dtype)  # a bad value fails here, not on the engine's thread
        self._waiting: collections.deque[EngineRequest] = collections.deque()
        self._jobs: collections.deque[tuple[Callable[[], Any], Callable[[Any, BaseException | None], None]]] = (
            collections.deque())
        self._rows: list[_Row] = []
        self._cache: KVCache | None = None
        self._width = 0
        self._dirty = False  # the rows changed since the cache was laid out
        self._cv = threading.Condition()
        self._stopping = False
        self.steps = 0  # batched decode steps run (for /health and tests)
        self.max_rows_seen = 0
        self._thread = threading.Thread(target=self._loop, name="tinygpt-engine", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------------------------------ public API
    def submit(self, requests: list[EngineRequest]) -> None:
        """Queue rows (all or none). Raises ``QueueFull`` when they do not fit the waiting queue's free places,
        ``EngineStopped`` after ``shutdown``."""
        with self._cv:
            if self._stopping:
                raise EngineStopped("the server is shutting down")
            free_rows = self.max_batch - len(self._rows)
            if len(self._waiting) + len(requests) > self.max_queue + max(free_rows, 0):
                raise QueueFull(f"the queue is full ({len(self._waiting)} waiting, --max-queue {self.max_queue})")
            self._waiting.extend(requests)
            self._cv.notify()

    def call(self, fn: Callable[[], Any], done: Callable[[Any, BaseException | None], None]) -> None:
        """Run ``fn()`` on the engine's thread between two steps (so it never competes with the batch for the
        model); ``done(result, error)`` is called there afterwards."""
        with self._cv:
            if self._stopping:
                raise EngineStopped("the server is shutting down")
            self._jobs.append((fn, done))
            self._cv.notify()

    def load(self) -> dict[str, int]:
        """Rows decoding and rows waiting now."""
        with self._cv:
            return {"running": len(self._rows), "waiting": len(self._waiting)}

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop: every row still running or waiting is finished with reason "cancelled"; waits for the thread."""
        with self._cv:
            self._stopping = True
            self._cv.notify()
        self._thread.join(timeout)

    # ------------------------------------------------------------------------------------------ the loop
    def _loop(self) -> None:
        torch.set_grad_enabled(False)  # this thread only runs inference
        while True:
            with self._cv:
                while not (self._rows or self._waiting or self._jobs or self._stopping):
                    self._cv.wait()
                if self._stopping:
                    leftovers = [r.req for r in self._rows] + list(self._waiting)
                    self._rows, self._cache = [], None
                    self._waiting.clear()
                    jobs = list(self._jobs)
                    self._jobs.clear()
                    break
                jobs = list(self._jobs)
                self._jobs.clear()
                room = self.max_batch - len(self._rows)
                newcomers = [self._waiting.popleft() for _ in range(min(room, len(self._waiting)))]
            try:
                with torch.inference_mode(), autocast(self.device, self.autocast_dtype):
                    for fn, done in jobs:
                        self._run_job(fn, done)
                    self._drop_cancelled()
                    for req in newcomers:
                        self._admit(req)
                    if self._rows:
                        self._step()
            except Exception as err:  # a bug or an out-of-memory: fail the rows, keep serving
                traceback.print_exc(file=sys.stderr)
                for row in self._rows:
                    self._emit(row.req, Finish("error", message=f"{type(err).__name__}: {err}",
                                               prompt_tokens=len(row.req.prompt), completion_tokens=row.n_new))
                self._rows, self._cache, self._width, self._dirty = [], None, 0, False
        for req in leftovers:
            self._emit(req, Finish("cancelled", message="the server shut down", prompt_tokens=len(req.prompt)))
        for fn, done in jobs:
            done(None, EngineStopped("the server is shutting down"))

    @staticmethod
    def _run_job(fn: Callable[[], Any], done: Callable[[Any, BaseException | None], None]) -> None:
        try:
            result = fn()
        except Exception as err:
            done(None, err)
        else:
            done(result, None)

    @staticmethod
    def _emit(req: EngineRequest, event: Any) -> None:
        try:
            req.sink(event)
        except Exception:  # a sink whose client went away must not stop the batch
            traceback.print_exc(file=sys.stderr)

    def _drop_cancelled(self) -> None:
        kept = [r for r in self._rows if not r.req.cancelled.is_set()]
        if len(kept) != len(self._rows):
            for row in self._rows:
                if row.req.cancelled.is_set():
                    self._emit(row.req, Finish("cancelled", prompt_tokens=len(row.req.prompt),
                                               completion_tokens=row.n_new))
            self._rows, self._dirty = kept, True

    def _admit(self, req: EngineRequest) -> None:
        """Prefill a newcomer alone (``generate``'s first call for one prompt), draw its first token, and put it in
        the batch unless that token already finished it."""
        if req.cancelled.is_set():
            self._emit(req, Finish("cancelled", prompt_tokens=len(req.prompt)))
            return
        row = _Row(req, self.tokenizer, self.vocab_size, self.device)
        ids = torch.tensor([req.prompt], device=self.device)  # [1, P]
        if req.prompt_logprobs:
            self._emit(req, PromptLogprobs(self._prompt_logprobs(ids, req.logprobs or 0)))
        own = KVCache(self.model.config, 1, dtype=self.dtype, device=self.device, max_length=len(req.prompt))
        logits = self.model(ids, cache=own, last_only=True)[:, -1]  # [1, V]
        row.cached = len(req.prompt)
        if self._take(row, logits):
            return
        row.own_cache = own  # copied into the batch cache by the next _relayout
        self._rows.append(row)
        self._dirty = True
        self.max_rows_seen = max(self.max_rows_seen, len(self._rows))

    def _prompt_logprobs(self, ids: torch.Tensor, top: int) -> list[TokenInfo]:
        """Each prompt token's log-probability given the tokens before it (the first has none). ids [1, P]."""
        logprobs = self.model(ids)[0].float().log_softmax(-1)  # [P, V]: position t predicts token t + 1
        prompt = ids[0].tolist()
        out = [TokenInfo(prompt[0], None, [])]
        for t in range(1, len(prompt)):
            out.append(TokenInfo(prompt[t], float(logprobs[t - 1, prompt[t]]), _top(logprobs[t - 1], top)))
        return out

    def _take(self, row: _Row, logits: torch.Tensor) -> bool:
        """Draw the row's next token from its logits [1, V], emit it; True when that finished the row."""
        cfg = row.cfg
        token = int(next_tokens(logits, temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p,
                                repetition_penalty=cfg.repetition_penalty, seen=row.seen,
                                generator=row.generator)[0])
        row.n_new += 1
        row.seq.append(token)
        row.last = token
        if row.seen is not None:
            row.seen[0, token] = True
        info = TokenInfo(token)
        if row.req.logprobs is not None:
            logprobs = logits[0].float().log_softmax(-1)  # the model's distribution, before any sampling setting
            info = TokenInfo(token, float(logprobs[token]), _top(logprobs, row.req.logprobs))
        counts = dict(prompt_tokens=len(row.req.prompt), completion_tokens=row.n_new)
        if token == cfg.eos_id:  # counted, but not part of the text or the tokens reported
            self._emit(row.req, Finish("stop", row.text.rest(), **counts))
            return True
        piece, stopped = row.text.add(token)
        self._emit(row.req, Step(info, piece))
        if stopped:
            self._emit(row.req, Finish("stop", "", **counts))
            return True
        if row.remaining == 0:
            self._emit(row.req, Finish("length", row.text.rest(), **counts))
            return True
        return False

    def _relayout(self) -> None:
        """A fresh cache for the current rows, each row's columns right-aligned at the new width.

        The rows already in the batch move together: one copy per layer of the old cache's last columns (a row's
        own columns are among them, since every row ends at the write column); what else comes along is another
        row's data or zeros in columns the row's key mask hides, whose softmax weight is exactly 0. Newcomers
        bring their prefill cache, copied row by row.
        """
        old_rows = [r for r in self._rows if r.own_cache is None]
        new_rows = [r for r in self._rows if r.own_cache is not None]
        rows = old_rows + new_rows
        width = max(r.cached for r in rows)
        capacity = min(self.context, width + max(r.remaining for r in rows))
        cache = KVCache(self.model.config, len(rows), dtype=self.dtype, device=self.device, max_length=capacity)
        old, old_width = self._cache, self._width
        span = min(width, old_width)
        slots = torch.tensor([r.slot for r in old_rows], dtype=torch.long, device=self.device)
        for layer in range(len(cache.keys)):
            if old_rows:
                k = len(old_rows)
                cache.keys[layer][:k, :, width - span:width] = old.keys[layer][slots, :, old_width - span:old_width]
                cache.values[layer][:k, :, width - span:width] = (
                    old.values[layer][slots, :, old_width - span:old_width])
            for i, row in enumerate(new_rows, start=len(old_rows)):
                n = row.cached  # the prefill cache holds columns 0..n-1
                cache.keys[layer][i, :, width - n:width] = row.own_cache.keys[layer][0, :, :n]
                cache.values[layer][i, :, width - n:width] = row.own_cache.values[layer][0, :, :n]
        for i, row in enumerate(rows):
            row.slot = i
            row.own_cache = None
        self._rows, self._cache, self._width, self._dirty = rows, cache, width, False

    def _step(self) -> None:
        """One decode step for every row: feed each row's last token at column ``width``."""
        if self._dirty:
            self._relayout()
        # No other re-packing is ever needed: after a layout the longest row starts at column 0, so the write
        # column is that row's own length, which stays < C while it still has a token to feed; when it leaves,
        # the rows change and are laid out again. The capacity covers every row's remaining steps (at most C).
        rows, width = self._rows, self._width
        tokens = torch.tensor([[r.last] for r in rows], device=self.device)  # [B, 1]
        positions = key_mask = None
        if any(r.cached != width for r in rows):  # some row does not start at column 0: positions and a mask
            cached = torch.tensor([r.cached for r in rows], device=self.device)[:, None]  # [B, 1]
            positions = cached  # each row's next position is its own length
            key_mask = torch.arange(width + 1, device=self.device) >= (width - cached)  # [B, width + 1]
        logits = self.model(tokens, cache=self._cache, start_pos=width, positions=positions, key_mask=key_mask,
                            last_only=True)[:, -1]  # [B, V]
        self._width = width + 1
        self.steps += 1
        kept = []
        for i, row in enumerate(rows):
            row.cached += 1
            if not self._take(row, logits[i:i + 1]):
                kept.append(row)
        if len(kept) != len(rows):
            self._rows, self._dirty = kept, True
