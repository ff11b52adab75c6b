"""Continuous batching for the server: a thread and request adapter over the inference core.

Every request (one choice of one prompt) becomes a row of ``inference.engine.InferenceEngine``: one paged cache
allocated once, a token budget per step (decodes first, long prompts prefilled in chunks between decode steps),
prefix reuse (a shared system prompt or the previous turn of a conversation is not computed again), preemption by
recompute when the cache is full. This module only moves requests onto the engine's thread, turns each row's new
tokens into events (``Step``, ``Finish``) and its text into final pieces (``text_stream.TextStreamer``: no split
UTF-8 character, no partial stop text; a stop text or the end-of-text token ends the row with
``finish_reason="stop"``, ``max_tokens`` with ``"length"``).

Sampling is per row (its own settings, generator and seen-set), so a greedy row's tokens equal ``generate`` on its
prompt alone and a seeded sampled row repeats whatever else is in the batch. A row that fails (its sampling, its
settings, its sink) finishes alone with reason "error"; the others carry on and every request gets a ``Finish``.
"""

from __future__ import annotations

import collections
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch import nn

from ..devices import autocast
from ..generation import GenerationConfig
from ..inference.engine import InferenceEngine, RowOutput
from ..inference.row import Row
from ..text_stream import TextCodec, TextStreamer

DEFAULT_TOKEN_BUDGET = 256  # tokens per forward; see docs/serving.md for the measurement that chose both
DEFAULT_CHUNK_PER_DECODE = 8  # while rows decode, prompt tokens per step per decoding row (docs/serving.md: measured)


class QueueFull(Exception):
    """Raised by ``EngineThread.submit`` when the waiting queue cannot take the request's rows."""


class EngineStopped(Exception):
    """Raised by ``EngineThread.submit`` once the engine is shutting down."""


@dataclass
class TokenInfo:
    """One generated (or echoed prompt) token: its id, its log-probability under the model's raw logits
    (None for the first prompt token, which has no context), and the top alternatives as (id, logprob)."""

    id: int
    logprob: float | None = None
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class Step:
    """Event: a row produced ``token``; ``text`` is the part of its continuation that became final ("" if none)."""

    token: TokenInfo
    text: str


@dataclass
class Finish:
    """Event: the row ended. reason: "stop" (eos or stop text), "length" (max_tokens), "cancelled" or "error"
    (``message`` says why). ``text``: the last final piece (the rest of the continuation up to a stop text)."""

    reason: str
    text: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    message: str = ""
    accepted_drafts: int = 0  # speculative decoding: draft tokens the model kept / threw away for this row
    rejected_drafts: int = 0
    cached_tokens: int = 0  # prompt tokens taken from the prefix cache
    embedding: torch.Tensor | None = None  # an embedding request's pooled hidden states [D] (float32, on the CPU)


@dataclass
class PromptLogprobs:
    """Event, first of a request with ``prompt_logprobs``: the prompt's tokens with their log-probabilities."""

    tokens: list[TokenInfo]


@dataclass
class EngineRequest:
    """One row to generate. ``config``: a validated ``GenerationConfig`` whose ``max_new_tokens`` fits the
    context (``prompt + max_new_tokens - 1 <= C``); its ``eos_id`` ends the row (not part of the text).
    ``logprobs``: None, or how many top alternatives to report with each token (0 = only the chosen one).
    ``sink`` receives every event, from the engine's thread; it must not block. ``adapter``: the index of the
    model's attached LoRA adapter the row runs with (``multi_lora``; -1: the base). With a ``pooling`` ("mean" or
    "last") the request embeds its prompt instead (``config`` None): an embedding row, scheduled as scoring rows
    are, whose ``Finish`` carries the pooled final hidden states."""

    prompt: list[int]
    config: GenerationConfig | None
    sink: Callable[[Any], None]
    stop_texts: tuple[str, ...] = ()
    logprobs: int | None = None
    prompt_logprobs: bool = False
    adapter: int = -1
    constraint: Any = None  # an inference.constraint.RowConstraint (structured output), one per row
    cache_salt: str | None = None
    pooling: str | None = None
    cancelled: threading.Event = field(default_factory=threading.Event)

    def cancel(self) -> None:
        """Ask the engine to drop this row; it does so before its next step."""
        self.cancelled.set()


def _top(logprobs: torch.Tensor, n: int) -> list[tuple[int, float]]:
    if n <= 0:
        return []
    values, ids = logprobs.topk(min(n, logprobs.shape[-1]))
    return list(zip(ids.tolist(), values.tolist()))


@dataclass
class _Held:
    """A new token before its event: its raw logits [V] (None: not asked for, or never scored); ``ready`` once it
    may go (a forced token of a row that reports log-probabilities waits for the forward that scores it)."""

    token: int
    logits: torch.Tensor | None
    ready: bool


class _Live:
    """A request on the engine: its core row and its text. With ``prompt_logprobs`` the prompt is first a scoring
    row of the core (``scoring``: scheduled under the token budget like any row, its logits gathered step by step);
    the generation row joins the core once the prompt's log-probabilities are out."""

    def __init__(self, req: EngineRequest, row: Row, tokenizer: TextCodec) -> None:
        self.req, self.row = req, row
        self.scoring: Row | None = None
        self.prompt_logits: list[torch.Tensor] = []  # the scoring row's logits so far, [m, V] each
        self.text = TextStreamer(tokenizer, req.stop_texts)
        self.count = 0  # tokens delivered (the end-of-text one included)
        self.held: list[_Held] = []  # tokens not yet sent: forced ones wait for the forward that scores them
        self.done = False

    @property
    def current(self) -> Row:
        """The request's row in the core now."""
        return self.row if self.scoring is None else self.scoring


class EngineThread:
    """The server's thread and request adapter over the one inference core (``inference.engine.InferenceEngine``):
    a thread that steps the core; ``submit`` is thread-safe and events reach each request's ``sink``.

    ``max_batch`` rows decode together; ``max_queue`` bounds the rows that wait for a place (beyond it ``submit``
    raises ``QueueFull``). ``token_budget``: tokens per forward (decodes first, then chunks of prompts).
    ``cache_tokens``: positions the cache holds (default ``max_batch`` x the context). ``prefix_reuse``: take cached
    prefixes. ``speculative_tokens``: draft tokens verified per forward (0: off), by prompt lookup or, with a
    ``draft_model`` (sharing the tokenizer), by that model. ``compile``: the decode steps through ``torch.compile``
    (``inference.runner``).
    """

    def __init__(self, model: nn.Module, tokenizer: TextCodec, *, max_batch: int = 8, max_queue: int = 64,
                 dtype: str = "auto", token_budget: int | None = None, cache_tokens: int | None = None,
                 prefix_reuse: bool = True, speculative_tokens: int = 0,
                 draft_model: nn.Module | None = None, compile: bool = False) -> None:
        if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
            raise ValueError(f"max_batch={max_batch!r} must be an integer >= 1")
        if isinstance(max_queue, bool) or not isinstance(max_queue, int) or max_queue < 0:
            raise ValueError(f"max_queue={max_queue!r} must be an integer >= 0")
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.max_batch, self.max_queue = max_batch, max_queue
        param = next(model.parameters())
        self.device = param.device
        self.autocast_dtype = dtype  # "auto" / "float32" / "bfloat16": every model call runs under ``autocast``
        autocast(self.device, dtype)  # a bad value fails here, not on the engine's thread
        budget = max(DEFAULT_TOKEN_BUDGET, max_batch) if token_budget is None else token_budget
        self._options = dict(max_rows=max_batch, token_budget=budget, cache_tokens=cache_tokens,
                             prefix_reuse=prefix_reuse, speculative_tokens=speculative_tokens, compile=compile,
                             draft_model=draft_model,
                             chunk_per_decode=DEFAULT_CHUNK_PER_DECODE)
        self.core = InferenceEngine(model, **self._options)
        self._inbox: collections.deque[EngineRequest] = collections.deque()
        self._jobs: collections.deque[tuple[Callable[[], Any], Callable[[Any, BaseException | None], None]]] = (
            collections.deque())
        self._live: dict[int, _Live] = {}
        self._job_debt = 0.0  # seconds the rows are owed for the last job's time (``_loop``)
        self._cv = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="tinygpt-engine", daemon=True)
        self._thread.start()

    @property
    def steps(self) -> int:
        """Forwards run (for /health and tests)."""
        return self.core.steps

    @property
    def max_rows_seen(self) -> int:
        return self.core.max_rows_seen

    # ------------------------------------------------------------------------------------------ public API
    def submit(self, requests: list[EngineRequest]) -> None:
        """Queue rows (all or none). Raises ``QueueFull`` when they do not fit the waiting queue's free places,
        ``EngineStopped`` after ``shutdown``."""
        with self._cv:
            if self._stopping:
                raise EngineStopped("the server is shutting down")
            load = self._load()
            free_rows = self.max_batch - load["running"]
            if load["waiting"] + len(requests) > self.max_queue + max(free_rows, 0):
                raise QueueFull(f"the queue is full ({load['waiting']} waiting, --max-queue {self.max_queue})")
            self._inbox.extend(requests)
            self._cv.notify()

    def call(self, fn: Callable[[], Any], done: Callable[[Any, BaseException | None], None]) -> None:
        """Run ``fn()`` on the engine's thread between two steps (so it never competes with the batch for the
        model), one at a time, each after the rows have had as much time as the last one took; ``done(result,
        error)`` is called there afterwards."""
        with self._cv:
            if self._stopping:
                raise EngineStopped("the server is shutting down")
            self._jobs.append((fn, done))
            self._cv.notify()

    def load(self) -> dict[str, int]:
        """Rows decoding and rows waiting now."""
        with self._cv:
            return self._load()

    def _load(self) -> dict[str, int]:
        running = sum(1 for live in list(self._live.values()) if live.current in self.core.scheduler.running)
        return {"running": running, "waiting": len(self._live) - running + len(self._inbox)}

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop: every row still running or waiting is finished with reason "cancelled"; waits for the thread."""
        with self._cv:
            self._stopping = True
            self._cv.notify()
        self._thread.join(timeout)

    # ------------------------------------------------------------------------------------------ the loop
    def _loop(self) -> None:
        torch.set_grad_enabled(False)  # this thread only runs inference
        job = None
        while True:
            with self._cv:
                while not (self._live or self._inbox or self._jobs or self._stopping):
                    self._cv.wait()
                newcomers = list(self._inbox)
                self._inbox.clear()
                if self._stopping:
                    break
                # a job (an /inspect) runs when the rows have had as much time since the last one as it took:
                # with rows decoding, jobs get at most half the engine, however many wait
                busy = self.core.has_work
                job = self._jobs.popleft() if self._jobs and (self._job_debt <= 0 or not busy) else None
            try:
                with torch.inference_mode(), autocast(self.device, self.autocast_dtype):
                    if job is not None:
                        start = time.monotonic()
                        self._run_job(*job)
                        self._job_debt = time.monotonic() - start if busy else 0.0
                        job = None
                    for req in newcomers:
                        self._add(req)
                    self._drop_cancelled()
                    if self.core.has_work:
                        start = time.monotonic()
                        self._step()
                        self._job_debt = max(0.0, self._job_debt - (time.monotonic() - start))
            except Exception as err:  # a bug: fail the rows it may have touched, start a fresh core, keep serving
                traceback.print_exc(file=sys.stderr)
                for live in list(self._live.values()):
                    self._finish(live, Finish("error", message=f"{type(err).__name__}: {err}"))
                self.core = InferenceEngine(self.model, **self._options)
        for live in list(self._live.values()):
            self._finish(live, Finish("cancelled", message="the server shut down"))
        for req in newcomers:
            self._emit(req, Finish("cancelled", message="the server shut down", prompt_tokens=len(req.prompt)))
        for fn, done in self._jobs:
            done(None, EngineStopped("the server is shutting down"))
        self._jobs.clear()

    @staticmethod
    def _run_job(fn: Callable[[], Any], done: Callable[[Any, BaseException | None], None]) -> None:
        try:
            result = fn()
        except Exception as err:
            done(None, err)
        else:
            done(result, None)

    @staticmethod
    def _emit(req: EngineRequest, event: Any) -> bool:
        """Hand an event to the request's sink; False if the sink raised (the row then fails alone)."""
        try:
            req.sink(event)
        except Exception:
            traceback.print_exc(file=sys.stderr)
            return False
        return True

    def _finish(self, live: _Live, event: Finish) -> None:
        """End a request once: its Finish event (with its counts), its row out of the core."""
        if live.done:
            return
        live.done = True
        self._live.pop(live.current.id, None)
        self.core.cancel(live.current)
        event.prompt_tokens, event.completion_tokens = len(live.req.prompt), live.count
        event.accepted_drafts, event.rejected_drafts = live.row.accepted, live.row.drafted - live.row.accepted
        event.cached_tokens = min(live.row.cached_tokens, len(live.req.prompt))
        self._emit(live.req, event)

    def _add(self, req: EngineRequest) -> None:
        """A newcomer onto the core; one whose settings or prompt fail here gets its own error event."""
        if req.cancelled.is_set():
            self._emit(req, Finish("cancelled", prompt_tokens=len(req.prompt)))
            return
        try:
            if req.pooling is not None:
                row = Row(list(req.prompt), None, tag=req, adapter=req.adapter, cache_salt=req.cache_salt,
                          pooling=req.pooling)
                live = _Live(req, row, self.tokenizer)
                self.core.add(row)
                self._live[row.id] = live
                return
            cfg = req.config
            row = Row(list(req.prompt), cfg, generator=cfg.row_generator(self.device),  # as generate()'s row 0
                      want_logits=req.logprobs is not None, tag=req, adapter=req.adapter, constraint=req.constraint,
                      cache_salt=req.cache_salt)
            live = _Live(req, row, self.tokenizer)
            if req.prompt_logprobs and len(req.prompt) > 1:
                # position t predicts token t + 1: the scoring row feeds the first P - 1 tokens (a C + 1-token
                # prompt is scored as lm-eval's HF class scores it, the model reading C tokens)
                live.scoring = Row(list(req.prompt), None, scored=len(req.prompt) - 1, want_logits=True, tag=req,
                                   adapter=req.adapter, cache_salt=req.cache_salt)
                self.core.add(live.scoring)
            else:
                if req.prompt_logprobs and not self._emit(req, PromptLogprobs([TokenInfo(req.prompt[0])])):
                    raise RuntimeError("the request's sink failed")
                self.core.add(row)
        except Exception as err:
            self._emit(req, Finish("error", message=f"{type(err).__name__}: {err}", prompt_tokens=len(req.prompt)))
            return
        self._live[live.current.id] = live

    def _scored(self, live: _Live, logits: torch.Tensor | None) -> None:
        """A step of the request's scoring row; once it is done, each prompt token's log-probability given the
        tokens before it (the first has none) goes out, and the generation row joins the core."""
        scoring = live.scoring
        if logits is not None:
            live.prompt_logits.append(logits)
        if scoring.finish_reason == "error":
            self._finish(live, Finish("error", message=scoring.error))
            return
        if not scoring.finished:
            return
        logprobs = torch.cat(live.prompt_logits).float().log_softmax(-1)  # [P - 1, V]
        prompt, top = live.req.prompt, live.req.logprobs or 0
        tokens = [TokenInfo(prompt[0])] + [TokenInfo(prompt[t], float(logprobs[t - 1, prompt[t]]),
                                                      _top(logprobs[t - 1], top)) for t in range(1, len(prompt))]
        self._live.pop(scoring.id, None)
        live.scoring, live.prompt_logits = None, []
        self._live[live.row.id] = live
        if not self._emit(live.req, PromptLogprobs(tokens)):
            raise RuntimeError("the request's sink failed")
        self.core.add(live.row)

    def _drop_cancelled(self) -> None:
        for live in list(self._live.values()):
            if live.req.cancelled.is_set():
                self._finish(live, Finish("cancelled"))

    def _step(self) -> None:
        """One core step; each row's new tokens become its events, each row on its own."""
        for out in self.core.step():
            live = self._live.get(out.row.id)
            if live is None:
                continue
            try:
                if out.row is live.scoring:
                    self._scored(live, out.logits)
                elif out.row.pooling is not None:
                    if out.row.finish_reason == "error":
                        self._finish(live, Finish("error", message=out.row.error))
                    elif out.row.finished:
                        self._finish(live, Finish("length", embedding=out.row.embedding.cpu()))
                else:
                    self._deliver(live, out)
            except Exception as err:
                traceback.print_exc(file=sys.stderr)
                self._finish(live, Finish("error", message=f"{type(err).__name__}: {err}"))

    def _deliver(self, live: _Live, out: RowOutput) -> None:
        """The step's tokens as events, in order. With ``logprobs`` a forced token waits for the next forward,
        which scores it (``RowOutput.forced_logits``); the forced tokens that end the row are never fed, so they go
        out with none."""
        row, req = live.row, live.req
        scored = [] if out.forced_logits is None else list(out.forced_logits)
        for held in live.held:  # the forced tokens this forward scored, in order
            if not held.ready and scored:
                held.logits, held.ready = scored.pop(0), True
        for i, token in enumerate(out.tokens):
            logits = out.logits[i] if out.logits is not None and i < out.logits.shape[0] else None
            owed = req.logprobs is not None and out.forced[i]  # a forced token: scored by the next forward
            live.held.append(_Held(token, logits, not owed))
        ready = 0
        while ready < len(live.held) and (row.finished or live.held[ready].ready):
            ready += 1
        going, live.held = live.held[:ready], live.held[ready:]
        for held in going:
            token, logits = held.token, held.logits
            live.count += 1
            if token == row.config.eos_id:  # counted, but not part of the text or the tokens reported
                self._finish(live, Finish("stop", live.text.finish()))
                return
            info = TokenInfo(token)
            if req.logprobs is not None and logits is not None:  # a forced token that ends the row: none
                logprobs = logits.float().log_softmax(-1)  # the model's distribution, before any setting
                info = TokenInfo(token, float(logprobs[token]), _top(logprobs, req.logprobs))
            piece, stopped = live.text.add(token)
            if not self._emit(req, Step(info, piece)):
                self._finish(live, Finish("error", message="the request's sink failed"))
                return
            if stopped:
                self._finish(live, Finish("stop", ""))
                return
        if row.finish_reason == "error":
            self._finish(live, Finish("error", message=row.error))
        elif row.finish_reason == "stop":
            self._finish(live, Finish("stop", live.text.finish()))
        elif row.finish_reason == "length":
            self._finish(live, Finish("length", live.text.finish()))


BatchEngine = EngineThread  # the name before the redesign (#35), for imports written against it
