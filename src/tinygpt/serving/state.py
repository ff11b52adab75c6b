"""The one state object behind every handler: the model and its tokenizer, the settings, the engine, the requests
in flight. Handlers (``serving.app``) reach it as ``request.app.state.tinygpt``.

A request's rows (its choices) send their engine events to a ``Choices``, which hands them to the event loop
through an ``asyncio.Queue``. Every open ``Choices`` is known to the state, so that a shutdown past its timeout can
end each of them with an error (``abort_all``) instead of cutting its body.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator, Callable

from starlette.requests import Request
from torch import nn

from ..chat_template import RenderLimits
from ..generation import GenerationConfig
from ..inference.drafting import check_draft_model
from ..text_stream import TextCodec
from ..tokenizer import Tokenizer
from ..tools import Calculator
from .chat_format import chat_text, encode_chat, prompt_char_limit
from .engine import EngineThread, EngineRequest, EngineStopped, Finish, PromptLogprobs, QueueFull, Step, TokenInfo
from .metrics import ServerMetrics, scheduler_reading
from .options import ServeOptions
from .protocol import APIError, Sampling, bad, parse_json

INLINE_JSON_BYTES = 16384  # a body this small is parsed on the event loop (well under a millisecond)
PARSE_THREADS = 2  # larger bodies: parsed on their own threads, never queued behind /tokenize's work
UTILITY_THREADS = 1  # /tokenize and /detokenize: their own thread, so they never delay a generation request (one:
# tokenizing is Python work under the GIL, so more threads add no speed, only contention with the engine's thread)

RETRY_AFTER_SECONDS = 1


def busy(message: str) -> APIError:
    return APIError(429, f"the server is busy: {message}; retry later", type="rate_limit_error", code="queue_full",
                    headers={"Retry-After": str(RETRY_AFTER_SECONDS)})


def finish_error(event: Finish) -> APIError | None:
    """The error a row's ``Finish`` stands for (None for "stop" and "length")."""
    if event.reason == "cancelled":
        return APIError(503, f"the request was cancelled: {event.message or 'the server is shutting down'}",
                        headers={"Retry-After": str(RETRY_AFTER_SECONDS)})
    if event.reason == "error":
        return APIError(500, f"generation failed: {event.message}")
    return None


class Choices:
    """The events of one request's rows, gathered on the event loop."""

    def __init__(self, count: int, metrics: ServerMetrics | None = None) -> None:
        self.metrics = metrics
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
        self.requests: list[EngineRequest] = []
        self.finished: set[int] = set()
        self.count = count
        self.per_prompt = 1  # rows per prompt (the request's n)

    def sink(self, index: int) -> Callable[[Any], None]:
        timer = None if self.metrics is None else self.metrics.row_timer()

        def put(event: Any) -> None:
            if timer is not None:  # timed on the engine's thread, at the event's own moment
                if isinstance(event, Step):
                    timer.step()
                elif isinstance(event, Finish):
                    timer.finish(event.reason, event.prompt_tokens, event.completion_tokens, event.cached_tokens)
            self.loop.call_soon_threadsafe(self.queue.put_nowait, (index, event))

        return put

    async def events(self) -> AsyncIterator[tuple[int, Any]]:
        """(choice index, event) until every row finished; after ``abort`` every open row finishes "cancelled"."""
        while len(self.finished) < self.count:
            index, event = await self.queue.get()
            if index < 0:  # aborted: the rows still open end now, whatever the engine does
                for i in range(self.count):
                    if i not in self.finished:
                        self.finished.add(i)
                        yield i, event
                return
            if index in self.finished:
                continue
            if isinstance(event, Finish):
                self.finished.add(index)
            yield index, event

    def cancel(self) -> None:
        for req in self.requests:
            req.cancel()

    def abort(self, message: str) -> None:
        """End the open rows with ``Finish("cancelled", message)`` (and ask the engine to drop them)."""
        self.cancel()
        self.queue.put_nowait((-1, Finish("cancelled", message=message)))

    async def gather(self) -> tuple[list[str], list[list[TokenInfo]], list[str], "Usage"]:
        """Every choice's whole answer: (texts, tokens with the prompt's first when asked, finish reasons, the
        completion tokens and drafts of all); a cancelled or failed row raises its ``APIError``."""
        count = len(self.requests)
        texts, tokens, reasons, usage = [""] * count, [[] for _ in range(count)], [""] * count, Usage()
        async for index, event in self.events():
            if isinstance(event, PromptLogprobs):
                tokens[index] = event.tokens + tokens[index]
            elif isinstance(event, Step):
                texts[index] += event.text
                tokens[index].append(event.token)
            else:
                error = finish_error(event)
                if error is not None:
                    raise error
                texts[index] += event.text
                reasons[index] = event.reason
                usage.add(event, index // self.per_prompt)
        return texts, tokens, reasons, usage


@dataclass
class Usage:
    """A response's counts over its choices: completion tokens, and the draft tokens speculative decoding kept and
    threw away (OpenAI's ``completion_tokens_details.accepted_prediction_tokens`` / ``rejected_prediction_tokens``,
    its names for a predicted output's tokens that were / were not used)."""

    completion_tokens: int = 0
    accepted_drafts: int = 0
    rejected_drafts: int = 0
    cached: dict[int, int] = field(default_factory=dict)  # per prompt: the largest prefix-cache hit of its rows

    def add(self, finish: Finish, prompt: int = 0) -> None:
        """A row's counts; ``prompt``: which of the request's prompts it answers (its n choices share one)."""
        self.completion_tokens += finish.completion_tokens
        self.accepted_drafts += finish.accepted_drafts
        self.rejected_drafts += finish.rejected_drafts
        self.cached[prompt] = max(self.cached.get(prompt, 0), finish.cached_tokens)

    @property
    def cached_tokens(self) -> int:
        """OpenAI's ``prompt_tokens_details.cached_tokens``: prompt tokens whose keys came from the prefix cache
        (each prompt counted once, as ``prompt_tokens`` counts it)."""
        return sum(self.cached.values())

    def to_dict(self, prompt_tokens: int, drafts: bool) -> dict[str, Any]:
        """The ``usage`` object; with ``drafts`` (the server drafts) its ``completion_tokens_details`` too."""
        out: dict[str, Any] = {"prompt_tokens": prompt_tokens, "completion_tokens": self.completion_tokens,
                               "total_tokens": prompt_tokens + self.completion_tokens,
                               "prompt_tokens_details": {"cached_tokens": self.cached_tokens}}
        if drafts:
            out["completion_tokens_details"] = {"accepted_prediction_tokens": self.accepted_drafts,
                                                "rejected_prediction_tokens": self.rejected_drafts}
        return out


class ServerState:
    """The model, its tokenizer, the settings, the engine (while the app's lifespan runs), the requests in flight."""

    def __init__(self, model: nn.Module, tokenizer: TextCodec, options: ServeOptions, dtype: str = "auto",
                 draft_model: nn.Module | None = None) -> None:
        self.model, self.tokenizer, self.options, self.dtype = model, tokenizer, options, dtype
        self.model_name = options.served_name
        self.adapters = attach_served_adapters(model, options.adapters)  # the adapters' names, by index
        # each adapter's tokenizer for chat: its folder's chat template (a fine-tuning run saves the one it trained
        # in) over the base's tokenizer, else the base's own
        self.adapter_tokenizers = [adapter_chat_tokenizer(tokenizer, d) for d in options.adapters.values()]
        self.speculative = "draft" if draft_model is not None and options.speculative == "off" else options.speculative
        self.draft_model = self._draft(draft_model)
        self.context = model.config.context_length
        self.vocab = model.config.vocab_size
        # ids a prompt may hold: those with a text (a model may have more rows than its tokenizer has tokens, e.g.
        # a vocabulary padded to a multiple of 64; those ids have no text and never appear in the training data)
        self.text_vocab = min(self.vocab, getattr(tokenizer, "vocab_size", self.vocab))
        self.n_layers = len(model.trf_blocks)
        self.eos_id = getattr(tokenizer, "eot_id", None)
        self.created = int(time.time())
        self.engine: EngineThread | None = None
        self.open: set[Choices] = set()
        self.inspect_pending = 0  # /inspect requests admitted and not yet answered
        self.inspect_turn = asyncio.Lock()  # one /inspect on the engine at a time
        self._check_capacity()
        self._pools()
        self.max_prompt_chars, self._prompt_chars_note = prompt_char_limit(
            tokenizer, self.context, self.text_vocab, options.max_body_bytes)
        # surrogateescape: a key from a command line that is not valid UTF-8 keeps its bytes (as Python decoded them)
        self._key = None if options.api_key is None else options.api_key.encode("utf-8", "surrogateescape")
        self.metrics = ServerMetrics(self.model_name, lambda: None if self.engine is None
                                     else scheduler_reading(self.engine))

    # ------------------------------------------------------------------------------------------ lifespan
    def _check_capacity(self) -> None:
        """Refuse settings no request could be served with: the cache must hold one row of a whole context plus
        its draft tokens (a row may reach the context, and drafts are written before they are verified)."""
        o = self.options
        drafts = o.speculative_tokens if self.speculative != "off" else 0
        cache = o.cache_tokens if o.cache_tokens is not None else o.max_batch * self.context
        if cache < self.context + drafts:
            given = f"--cache-tokens {o.cache_tokens}" if o.cache_tokens is not None else (
                f"the default cache (--max-batch {o.max_batch} x the context)")
            parts = f"the model's context of {self.context}" + (f" + --speculative-tokens {drafts}" if drafts else "")
            raise ValueError(f"{given} holds {cache} positions, but one row may need {self.context + drafts} "
                             f"({parts}): raise --cache-tokens" + (" or lower --speculative-tokens" if drafts else ""))

    def _pools(self) -> None:
        self.parse_pool = ThreadPoolExecutor(PARSE_THREADS, thread_name_prefix="tinygpt-parse")
        self.utility_pool = ThreadPoolExecutor(UTILITY_THREADS, thread_name_prefix="tinygpt-utility")
        self._pools_open = True

    def start(self) -> None:
        o = self.options
        if not self._pools_open:  # started again after a stop
            self._pools()
        self.engine = EngineThread(self.model, self.tokenizer, max_batch=o.max_batch, max_queue=o.max_queue,
                                  dtype=self.dtype, token_budget=o.token_budget, cache_tokens=o.cache_tokens,
                                  prefix_reuse=o.prefix_cache,
                                  speculative_tokens=o.speculative_tokens if self.speculative != "off" else 0,
                                  draft_model=self.draft_model, compile=o.compile)

    def _draft(self, given: nn.Module | None) -> nn.Module | None:
        """The draft model with ``--speculative draft``: ``given`` (which implies it), or ``--draft``'s loaded
        (checked: the same vocabulary, the same tokenizer)."""
        if self.speculative != "draft":
            if given is not None:
                raise ValueError(f"a draft model conflicts with speculative={self.speculative!r}: drafts come from "
                                 f"the model")
            return None
        if given is None:
            from ..interop.pretrained import load_draft

            return load_draft(self.options.draft, self.model, self.tokenizer,
                              device=next(self.model.parameters()).device).eval()
        check_draft_model(self.model, given)
        return given.eval()

    def stop(self) -> None:
        engine, self.engine = self.engine, None
        if engine is not None:
            engine.shutdown()
        for pool in (self.parse_pool, self.utility_pool):
            pool.shutdown(wait=False, cancel_futures=True)
        self._pools_open = False

    def abort_all(self, message: str = "the server shut down before the request finished") -> int:
        """End every request in flight with an error (streams: an error event and ``[DONE]``); returns how many."""
        for choices in list(self.open):
            choices.abort(message)
        return len(self.open)

    def running_engine(self) -> EngineThread:
        if self.engine is None:
            raise APIError(503, "the server is not running (starting or shutting down)")
        return self.engine

    # ------------------------------------------------------------------------------------------ checks
    def authorize(self, request: Request) -> None:
        """With an API key, ``Authorization: Bearer <key>``; the key is compared as UTF-8 bytes in constant time
        (HTTP headers arrive as bytes; Starlette decodes them as latin-1, which this undoes)."""
        if self._key is None:
            return
        header = request.headers.get("authorization", "").encode("latin-1")
        given = header[7:] if header[:7].lower() == b"bearer " else b""
        if not hmac.compare_digest(given, self._key):
            raise APIError(401, "invalid or missing API key: send the header Authorization: Bearer <key>",
                           type="authentication_error", code="invalid_api_key",
                           headers={"WWW-Authenticate": "Bearer"})

    @property
    def model_names(self) -> list[str]:
        """Every id this server answers to: the base's, then each adapter's."""
        return [self.model_name, *self.adapters]

    def check_model(self, name: str | None) -> int:
        """The adapter a request's ``model`` field picks: -1 for the base (or no field), else the adapter's index;
        404 for a name the server does not have."""
        if name is None or name == self.model_name:
            return -1
        if name in self.adapters:
            return self.adapters.index(name)
        have = ", ".join(repr(n) for n in self.model_names)
        raise APIError(404, f"the model {name!r} does not exist; this server has {have}", param="model",
                       code="model_not_found")

    def chat_tokenizer(self, adapter: int) -> TextCodec:
        """The tokenizer whose chat template a chat request for ``adapter`` (-1: the base) is rendered with."""
        return self.tokenizer if adapter < 0 else self.adapter_tokenizers[adapter]

    def served_name(self, adapter: int) -> str:
        """The id an answer names: the base's, or its adapter's."""
        return self.model_name if adapter < 0 else self.adapters[adapter]

    def encode(self, text: str, param: str, *, special: bool = False) -> list[int]:
        """Text -> ids (``special``: the end-of-text text becomes its id, as HF tokenizers and vLLM's /tokenize
        parse special tokens). Run it off the event loop (``asyncio.to_thread``): a long text takes a while."""
        try:
            if special and isinstance(self.tokenizer, Tokenizer):
                return list(self.tokenizer.encode(text, allowed_special=True))
            ids = list(self.tokenizer.encode(text))
        except ValueError as err:
            raise bad(param, f"cannot be tokenized: {err}") from None
        if not ids:
            raise bad(param, "is empty: at least one token is needed")
        return ids

    def check_ids(self, ids: list[int], param: str) -> list[int]:
        for t in ids:
            if not 0 <= t < self.text_vocab:
                raise bad(param, f"token id {t} is out of range: ids must satisfy 0 <= id < {self.text_vocab}"
                          + (f" (the tokenizer's; the model has {self.vocab} rows)" if self.text_vocab < self.vocab
                             else ""))
        return ids

    async def parse(self, raw: bytes) -> dict[str, Any]:
        """A request body as JSON (``protocol.parse_json``): a small one on the loop, a larger one on the parse
        threads (``parse_pool``), which nothing else uses."""
        if len(raw) <= INLINE_JSON_BYTES:
            return parse_json(raw)
        return await asyncio.get_running_loop().run_in_executor(self.parse_pool, parse_json, raw)

    async def utility(self, fn: Callable[[], Any]) -> Any:
        """``fn()`` on the /tokenize and /detokenize threads."""
        return await asyncio.get_running_loop().run_in_executor(self.utility_pool, fn)

    # ------------------------------------------------------------------------------------------ chat prompts
    async def chat_prompt(self, request: Request, messages: list[tuple[str, str]],
                          extras: list[dict[str, Any]] | None = None, tools: list[dict[str, Any]] | None = None,
                          *, adapter: int = -1) -> tuple[list[int], tuple[str, ...]] | None:
        """(prompt ids, stop texts) of a conversation (with its tool calls and tools: ``chat_format.render_chat``)
        through the model's chat template, rendered off the loop
        within ``--template-timeout`` and ``max_prompt_chars`` (checked before any token is made, as the text
        streams out), and stopped when the client leaves (None then). 400 naming the template for anything it
        refuses or any limit it passes. ``adapter``: whose template (``chat_tokenizer``)."""
        tokenizer = self.chat_tokenizer(adapter)
        cancelled = threading.Event()
        limits = RenderLimits(self.options.template_timeout, self.max_prompt_chars, cancelled,
                              self._prompt_chars_note)

        def work() -> tuple[list[int], tuple[str, ...]]:
            text, stops = chat_text(tokenizer, messages, extras, tools, limits)
            return encode_chat(tokenizer, text), stops

        task = asyncio.ensure_future(asyncio.to_thread(work))
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
            if not task.done():
                cancelled.set()  # the rendering stops at the template's next line
                return None
            try:
                return task.result()
            except ValueError as err:
                raise bad("messages", str(err)) from None
        finally:
            gone.cancel()

    # ------------------------------------------------------------------------------------------ token text
    def token_bytes(self, token: int) -> bytes:
        if token >= self.text_vocab:
            return b""  # a padding row of the model's vocabulary: no text
        get = getattr(self.tokenizer, "token_bytes", None)
        return get(token) if get is not None else self.tokenizer.decode([token]).encode("utf-8")

    def token_text(self, token: int) -> str:
        """A token as logprobs show it: its text, or for part of a UTF-8 character OpenAI's "bytes:\\xNN" form
        (so that distinct tokens never share a key in ``top_logprobs``); an id past the tokenizer's (a padded
        vocabulary's) ``<|id N|>``."""
        if token >= self.text_vocab:
            return f"<|id {token}|>"
        text = self.tokenizer.decode([token])
        if "\ufffd" in text:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in self.token_bytes(token))
        return text

    # ------------------------------------------------------------------------------------------ work
    def submit(self, prompts: list[list[int]], sampling: Sampling, limits: list[int], stop: tuple[str, ...],
               logprobs: int | None, prompt_logprobs: bool, adapter: int = -1, grammar: Any = None) -> Choices:
        """One engine row per (prompt, choice), run with ``adapter`` (``check_model``'s) and, with ``grammar``
        (``inference.grammar.Grammar``), each under its own constraint; all or none are queued (429 when the queue
        cannot take them)."""
        o = self.options
        rows = len(prompts) * sampling.n
        if rows > o.max_batch + o.max_queue:
            raise bad("n", f"{len(prompts)} prompt(s) x n={sampling.n} = {rows} rows; this server takes at most "
                           f"{o.max_batch + o.max_queue} at once (--max-batch + --max-queue)")
        budget = o.max_batch * self.context  # what the whole batch decodes in one context
        total = sum(limits) * sampling.n
        if total > budget:
            raise bad("n", f"{len(prompts)} prompt(s) x n={sampling.n} x their max_tokens = {total} new tokens; one "
                           f"request may ask for at most {budget} (--max-batch {o.max_batch} x the context of "
                           f"{self.context}): lower n or max_tokens")
        choices = Choices(rows, self.metrics)
        choices.per_prompt = sampling.n
        eos_id = self.eos_id
        device = next(self.model.parameters()).device
        for p, ids in enumerate(prompts):
            for j in range(sampling.n):
                seed = None if sampling.seed is None else sampling.seed + j  # n seeded choices differ
                config = GenerationConfig(
                    max_new_tokens=limits[p], temperature=sampling.temperature, top_k=sampling.top_k,
                    top_p=sampling.top_p, repetition_penalty=sampling.repetition_penalty, seed=seed, eos_id=eos_id,
                    overflow="slide" if len(ids) > self.context else "error")  # a scored C + 1-token prompt
                choices.requests.append(EngineRequest(
                    ids, config, choices.sink(p * sampling.n + j), stop, logprobs, prompt_logprobs,
                    adapter=adapter, constraint=self._constraint(grammar, device),
                    cache_salt=sampling.cache_salt))
        self.enqueue(choices)
        return choices

    def _constraint(self, grammar: Any, device: Any) -> Any:
        """A row's constraint: the request's grammar, else the calculator with ``--tool``, else none."""
        if grammar is not None:
            return grammar.constraint(device)
        return Calculator(self.tokenizer) if self.options.tool else None

    def enqueue(self, choices: Choices) -> None:
        """Queue the choices' requests, all or none (429 when the queue cannot take them, 503 once stopping)."""
        try:
            self.running_engine().submit(choices.requests)
        except QueueFull as err:
            raise busy(str(err)) from None
        except EngineStopped as err:
            raise APIError(503, str(err), headers={"Retry-After": str(RETRY_AFTER_SECONDS)}) from None
        self.open.add(choices)

    def release(self, choices: Choices) -> None:
        """The request is over (answered, failed or its client gone): its rows leave the engine."""
        choices.cancel()
        self.open.discard(choices)

    async def answer(self, request: Request, choices: Choices) -> tuple[list[str], list[list[TokenInfo]],
                                                                         list[str], Usage] | None:
        """``choices.gather()``, or None as soon as the client disconnects (its rows are cancelled, as a stream's
        are: nobody is left to read the answer)."""
        gather = asyncio.ensure_future(choices.gather())
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({gather, gone}, return_when=asyncio.FIRST_COMPLETED)
            if gather.done():
                return gather.result()
            return None
        finally:
            gone.cancel()
            gather.cancel()
            self.release(choices)

    @contextlib.asynccontextmanager
    async def inspect_place(self) -> AsyncIterator[None]:
        """A place in the queue for one /inspect, taken before its body is even parsed: 429 once the waiting rows
        and inspections fill ``--max-queue`` (at least one inspection may always wait)."""
        waiting = self.running_engine().load()["waiting"]
        if self.inspect_pending >= max(1, self.options.max_queue - waiting):
            raise busy(f"{self.inspect_pending} /inspect request(s) and {waiting} row(s) waiting, "
                       f"--max-queue {self.options.max_queue}")
        self.inspect_pending += 1
        try:
            yield
        finally:
            self.inspect_pending -= 1

    async def run_inspect(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` (an Inspect computation) on the engine's thread, alone, between two decode steps, so that a
        stream waits for at most one inspection at a time."""
        async with self.inspect_turn:
            loop = asyncio.get_running_loop()
            future: asyncio.Future[Any] = loop.create_future()

            def done(result: Any, error: BaseException | None) -> None:
                def settle() -> None:
                    if not future.done():
                        future.set_exception(error) if error is not None else future.set_result(result)
                loop.call_soon_threadsafe(settle)

            try:
                self.running_engine().call(fn, done)
            except EngineStopped as err:
                raise APIError(503, str(err)) from None
            return await future


def attach_served_adapters(model: nn.Module, adapters: dict[str, str]) -> list[str]:
    """Read each adapter folder ({NAME: DIR}, ``ServeOptions.adapters``) and attach them all to ``model``
    (``multi_lora``); returns the names in index order. ``ValueError`` naming the adapter for a folder that is no
    adapter, one of another base, or one trained on an NF4 base."""
    if not adapters:
        return []
    from ..interop.peft import read_adapter
    from ..multi_lora import attach_adapters

    if getattr(model, "adapter_names", None) is not None:
        raise ValueError("the model already has adapters attached")
    parts = {}
    for name, directory in adapters.items():
        if not Path(directory).is_dir():
            raise ValueError(f"--adapter {name}={directory}: no such folder")
        try:
            adapter = read_adapter(directory)
        except (ValueError, OSError) as err:
            raise ValueError(f"--adapter {name}={directory}: {err}") from None
        if adapter.model_config is not None and adapter.model_config != model.config:
            raise ValueError(f"--adapter {name}={directory}: the adapter was trained on a model of another config "
                             f"than the served one")
        parts[name] = (adapter.config, adapter.state)
    try:
        return attach_adapters(model, parts)
    except ValueError as err:
        raise ValueError(f"--adapter: {err}") from None


def adapter_chat_tokenizer(tokenizer: TextCodec, directory: str) -> TextCodec:
    """``tokenizer`` with the chat template saved in the adapter folder ``directory``, when there is one there."""
    from ..chat_template import read_chat_template

    template = read_chat_template(directory)
    if template is None or not hasattr(tokenizer, "with_chat_template"):
        return tokenizer
    return tokenizer.with_chat_template(template)


async def _disconnected(request: Request) -> None:
    """Returns when the client has gone (its body was read already, so the next message is the disconnect)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
