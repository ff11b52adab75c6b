"""The ASGI app (Starlette): OpenAI's completions and chat endpoints, tokenize/detokenize, Inspect, and the page.

One handler per endpoint, at module level (as vLLM's API server has them); the app is the list of routes over one
``ServerState`` (``request.app.state.tinygpt``) behind the edge's middleware (``serving.edge``). Handlers only
translate: a body is checked by ``protocol``, its prompts are tokenized (off the event loop), one ``EngineRequest``
per choice goes to the ``EngineThread`` (whose thread runs the model), and the engine's events come back as one
JSON answer or as Server-Sent Events (``data: {chunk}`` ... ``data: [DONE]``, what the official ``openai`` client
parses). A client that goes away, streaming or not, cancels its rows; the engine drops them before its next step.
A stream that ends in an error (a failed row, a shutdown) sends the error object as its last event, then
``[DONE]``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
import time
import traceback
import uuid
from importlib import resources
from pathlib import Path
from typing import Any, AsyncIterator

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, RedirectResponse, Response, StreamingResponse
from starlette.routing import Route
from torch import nn

from ..text_stream import TextCodec
from .edge import BodyGuard, HostGuard
from .embeddings import embeddings
from .engine import Finish, PromptLogprobs, Step, TokenInfo
from .inspect import inspect_text
from .metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from .options import ServeOptions
from .protocol import (
    MAX_INSPECT_TOKENS, APIError, bad, fit_max_tokens, parse_chat, parse_completion, parse_detokenize, parse_inspect,
    parse_tokenize,
)
from .state import Choices, ServerState, Usage, finish_error
from .structured import ToolSpec, compile_spec, read_chat, read_completion, template_writes_calls
from .tool_calls import ToolCallReader, auto_calls, tool_calls

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat defaults to the rest of the context


def _state(request: Request) -> ServerState:
    return request.app.state.tinygpt


async def _body(request: Request) -> dict[str, Any]:
    """The authorized request's JSON body, parsed and checked off the event loop (a large body takes a while)."""
    state = _state(request)
    state.authorize(request)
    return await state.parse(await request.body())


def _usage(state: ServerState, prompt_tokens: int, usage: Usage) -> dict[str, Any]:
    """OpenAI's ``usage``; ``completion_tokens_details`` (the drafts accepted / rejected) when the server drafts."""
    return usage.to_dict(prompt_tokens, drafts=state.speculative != "off")


def _sse(data: dict[str, Any] | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"


class _EventStream(StreamingResponse):
    """Server-Sent Events whose rows are freed however the response ends: finished, failed, or the client gone
    (even before the first event, when the body's generator never started and so never ran its ``finally``)."""

    def __init__(self, state: ServerState, choices: Choices, chunks: AsyncIterator[str]) -> None:
        super().__init__(chunks, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.tinygpt, self.choices = state, choices

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.tinygpt.release(self.choices)


def _gone() -> Response:
    return Response(status_code=499)  # nobody reads it: the client disconnected (nginx's code for that)


# ------------------------------------------------------------------------------------------ /v1/completions
def _completion_logprobs(state: ServerState, tokens: list[TokenInfo], offset: int) -> dict[str, Any]:
    texts = [state.token_text(t.id) for t in tokens]
    offsets, at = [], offset
    for text in texts:
        offsets.append(at)
        at += len(text)
    return {
        "tokens": texts,
        "token_logprobs": [t.logprob for t in tokens],
        "top_logprobs": [None if t.logprob is None else {state.token_text(i): lp for i, lp in t.top} for t in tokens],
        "text_offset": offsets,
    }


async def completions(request: Request) -> Response:
    state = _state(request)
    body = await _body(request)
    req = read_completion(parse_completion(body), body)
    sampling = req.sampling
    adapter = state.check_model(sampling.model)
    served = state.served_name(adapter)

    def tokenize() -> list[list[int]]:
        return [state.encode(p, "prompt") if isinstance(p, str) else state.check_ids(p, "prompt")
                for p in req.prompts]

    prompts = await asyncio.to_thread(tokenize)
    scoring = req.echo and req.logprobs is not None
    limits = [fit_max_tokens(sampling.max_tokens, COMPLETION_DEFAULT_MAX_TOKENS, len(ids), state.context,
                             scoring=scoring) for ids in prompts]
    prompt_texts = [p if isinstance(p, str) else state.tokenizer.decode(p) for p in req.prompts]
    grammar = None if req.constraint is None else await asyncio.to_thread(
        compile_spec, req.constraint, state.tokenizer, state.vocab)  # off the loop: up to a second
    choices = state.submit(prompts, sampling, limits, tuple(sampling.stop), req.logprobs, scoring, adapter, grammar)
    rid, now, n = f"cmpl-{uuid.uuid4().hex}", int(time.time()), sampling.n
    n_prompt = sum(len(ids) for ids in prompts)

    def chunk(index: int, text: str, logprobs: Any = None, finish: str | None = None) -> dict[str, Any]:
        return {"id": rid, "object": "text_completion", "created": now, "model": served,
                "choices": [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}]}

    if sampling.stream:
        async def chunks() -> AsyncIterator[str]:
            offsets = [0] * len(choices.requests)
            if req.echo and req.logprobs is None:
                for index in range(len(choices.requests)):
                    yield _sse(chunk(index, prompt_texts[index // n]))
                    offsets[index] = len(prompt_texts[index // n])
            usage = Usage()
            async for index, event in choices.events():
                if isinstance(event, PromptLogprobs):
                    text = prompt_texts[index // n]
                    yield _sse(chunk(index, text, _completion_logprobs(state, event.tokens, 0)))
                    offsets[index] = len(text)
                elif isinstance(event, Step):
                    logprobs = None
                    if req.logprobs is not None:
                        logprobs = _completion_logprobs(state, [event.token], offsets[index])
                    elif not event.text:
                        continue
                    yield _sse(chunk(index, event.text, logprobs))
                    offsets[index] += len(event.text)
                else:
                    error = finish_error(event)
                    if error is not None:
                        yield _sse(error.body())
                        break
                    usage.add(event, index // n)
                    yield _sse(chunk(index, event.text, None, event.reason))
            else:
                if sampling.include_usage:
                    yield _sse({"id": rid, "object": "text_completion", "created": now, "model": served,
                                "choices": [], "usage": _usage(state, n_prompt, usage)})
            yield _sse("[DONE]")

        return _EventStream(state, choices, chunks())

    answer = await state.answer(request, choices)
    if answer is None:
        return _gone()
    texts, tokens, reasons, usage = answer

    def body() -> bytes:  # with logprobs it grows with n x the prompt: built off the event loop
        out = []
        for index, text in enumerate(texts):
            prefix = prompt_texts[index // n] if req.echo else ""
            logprobs = None
            if req.logprobs is not None:
                logprobs = _completion_logprobs(state, tokens[index], 0)
            out.append({"index": index, "text": prefix + text, "logprobs": logprobs,
                        "finish_reason": reasons[index]})
        return json.dumps({"id": rid, "object": "text_completion", "created": now, "model": served,
                           "choices": out, "usage": _usage(state, n_prompt, usage)}).encode()

    return Response(body() if req.logprobs is None else await asyncio.to_thread(body),
                    media_type="application/json")


# ------------------------------------------------------------------------------------- /v1/chat/completions
def _chat_logprob(state: ServerState, t: TokenInfo) -> dict[str, Any]:
    return {"token": state.token_text(t.id), "logprob": t.logprob, "bytes": list(state.token_bytes(t.id)),
            "top_logprobs": [{"token": state.token_text(i), "logprob": lp, "bytes": list(state.token_bytes(i))}
                             for i, lp in t.top]}


async def chat_completions(request: Request) -> Response:
    state = _state(request)
    body = await _body(request)
    req = read_chat(parse_chat(body), body, template_writes_calls(getattr(state.tokenizer, "chat_template", None)))
    sampling = req.sampling
    adapter = state.check_model(sampling.model)
    served = state.served_name(adapter)
    # the chat template of the model asked for: an adapter's own folder's (the one it was fine-tuned in), else the
    # base checkpoint's; none: 400 (the page offers Completion). Off the loop and bounded in time and size
    # (``ServerState.chat_prompt``).
    prompt = await state.chat_prompt(request, req.messages, req.extras,
                                     None if req.tools is None else req.tools.tools, adapter=adapter)
    if prompt is None:
        return _gone()
    ids, template_stops = prompt
    limit = fit_max_tokens(sampling.max_tokens, None, len(ids), state.context, req.max_tokens_param, "messages")
    grammar = None
    if req.constraint is not None:  # the grammar ends the answer: the template's stop texts could cut a JSON string
        template_stops = ()
        grammar = await asyncio.to_thread(compile_spec, req.constraint, state.tokenizer, state.vocab)
    stop = tuple(sampling.stop) + tuple(s for s in template_stops if s not in sampling.stop)
    choices = state.submit([ids], sampling, [limit], stop, req.logprobs, False, adapter, grammar)
    calls = req.tools if req.tools is not None and req.tools.choice != "none" else None  # read it for tool calls
    rid, now = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

    def chunk(index: int, delta: dict[str, Any], logprobs: Any = None, finish: str | None = None) -> dict[str, Any]:
        return {"id": rid, "object": "chat.completion.chunk", "created": now, "model": served,
                "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]}

    if sampling.stream:
        async def chunks() -> AsyncIterator[str]:
            for index in range(sampling.n):
                yield _sse(chunk(index, {"role": "assistant", "content": ""}))
            usage = Usage()
            held = [""] * sampling.n  # tool_choice "auto": the text is held until it is whole, then read for calls
            # required / named: each call streams as it is generated (its head once the grammar named it, then its
            # arguments' text as it grows)
            readers = [ToolCallReader(calls) for _ in range(sampling.n)] if calls is not None and calls.calls else None
            for index in range(sampling.n if readers else 0):
                for delta in readers[index].feed(""):  # a named function: its call opens at once
                    yield _sse(chunk(index, {"tool_calls": [delta]}))
            async for index, event in choices.events():
                if isinstance(event, Step):
                    if readers is not None:
                        for delta in readers[index].feed(event.text):
                            yield _sse(chunk(index, {"tool_calls": [delta]}))
                        continue
                    if calls is not None:
                        held[index] += event.text
                        continue
                    if not event.text and req.logprobs is None:
                        continue
                    logprobs = None if req.logprobs is None else {"content": [_chat_logprob(state, event.token)]}
                    yield _sse(chunk(index, {"content": event.text}, logprobs))
                elif isinstance(event, Finish):
                    error = finish_error(event)
                    if error is not None:
                        yield _sse(error.body())
                        break
                    usage.add(event)
                    reason = event.reason
                    if readers is not None:
                        reader = readers[index]
                        for delta in reader.feed(event.text):
                            yield _sse(chunk(index, {"tool_calls": [delta]}))
                        if not reader.calls:  # nothing read as a call (cut early): the text, as unstreamed
                            yield _sse(chunk(index, {"content": reader.text}))
                        elif reason == "stop" and reader.result() is not None:
                            reason = "tool_calls"
                    elif calls is not None:
                        message, reason = _answer(held[index] + event.text, reason, calls)
                        delta = {} if message["content"] is None else {"content": message["content"]}
                        if "tool_calls" in message:
                            delta["tool_calls"] = [{"index": k, **call} for k, call in enumerate(message["tool_calls"])]
                        yield _sse(chunk(index, delta))
                    elif event.text:
                        yield _sse(chunk(index, {"content": event.text}))
                    yield _sse(chunk(index, {}, None, reason))
            else:
                if sampling.include_usage:
                    yield _sse({"id": rid, "object": "chat.completion.chunk", "created": now,
                                "model": served, "choices": [],
                                "usage": _usage(state, len(ids), usage)})
            yield _sse("[DONE]")

        return _EventStream(state, choices, chunks())

    answer = await state.answer(request, choices)
    if answer is None:
        return _gone()
    texts, tokens, reasons, usage = answer
    out = []
    for i in range(sampling.n):
        message, reason = _answer(texts[i], reasons[i], calls)
        out.append({"index": i, "message": message, "finish_reason": reason,
                    "logprobs": None if req.logprobs is None else {"content": [_chat_logprob(state, t)
                                                                               for t in tokens[i]]}})
    return JSONResponse({"id": rid, "object": "chat.completion", "created": now, "model": served,
                         "choices": out, "usage": _usage(state, len(ids), usage)})


def _answer(text: str, reason: str, calls: ToolSpec | None) -> tuple[dict[str, Any], str]:
    """A chat choice's message and finish reason: the text, or (tool_choice required / named / auto when the model
    called) its tool calls with ``finish_reason: "tool_calls"``; a call cut by max_tokens stays text, with reason
    "length"."""
    content, parsed = text, None
    if calls is not None and reason == "stop":
        content, parsed = auto_calls(text, calls) if calls.auto else (None, tool_calls(text, calls))
    if parsed is None:
        return {"role": "assistant", "content": text}, reason
    return {"role": "assistant", "content": content, "tool_calls": parsed}, "tool_calls"


# ------------------------------------------------------------------------------------------ the rest
async def health(request: Request) -> Response:
    state = _state(request)
    load = state.engine.load() if state.engine is not None else {"running": 0, "waiting": 0}
    return JSONResponse({"status": "ok" if state.engine is not None else "stopped", "model": state.model_name,
                         "adapters": state.adapters, **load, "max_batch": state.options.max_batch,
                         "max_queue": state.options.max_queue})


def _model_card(state: ServerState, adapter: int = -1) -> dict[str, Any]:
    """A model's entry in OpenAI's list; an adapter's names its base in ``parent`` and ``root`` (as vLLM's LoRA
    entries do; ``root`` is the base's id here, not a path on the server)."""
    lineage = {} if adapter < 0 else {"parent": state.model_name, "root": state.model_name}
    return {"id": state.served_name(adapter), "object": "model", "created": state.created, "owned_by": "tinygpt",
            **lineage, "context_length": state.context, "vocab_size": state.vocab, "n_layers": state.n_layers,
            "n_heads": state.model.config.n_heads,
            "has_chat_template": getattr(state.chat_tokenizer(adapter), "chat_template", None) is not None}  # Chat tab


async def list_models(request: Request) -> Response:
    state = _state(request)
    state.authorize(request)
    return JSONResponse({"object": "list",
                         "data": [_model_card(state, k) for k in range(-1, len(state.adapters))]})


async def get_model(request: Request) -> Response:
    state = _state(request)
    state.authorize(request)
    return JSONResponse(_model_card(state, state.check_model(request.path_params["name"])))


async def tokenize(request: Request) -> Response:
    state = _state(request)
    name, text = parse_tokenize(await _body(request))
    state.check_model(name)

    def answer() -> bytes:  # tokenizing and the answer's JSON both grow with the text: off the event loop
        ids = state.encode(text, "prompt", special=True) if text else []
        return json.dumps({"tokens": ids, "count": len(ids), "max_model_len": state.context,
                           "pieces": [state.token_text(t) for t in ids]}).encode()

    return Response(await state.utility(answer), media_type="application/json")


async def tokenizer_info(request: Request) -> Response:
    """What a client-side tokenizer needs to know (lm-eval's ``tokenizer_backend=remote`` reads it): the end-of-text
    token as text (``/tokenize`` maps that text back to its id), no BOS or padding token."""
    state = _state(request)
    state.authorize(request)
    eos = None if state.eos_id is None else state.tokenizer.decode([state.eos_id])
    return JSONResponse({"eos_token": eos, "bos_token": None, "pad_token": None, "eos_token_id": state.eos_id,
                         "vocab_size": state.vocab, "max_model_len": state.context})


async def detokenize(request: Request) -> Response:
    state = _state(request)
    name, ids = parse_detokenize(await _body(request))
    state.check_model(name)
    state.check_ids(ids, "tokens")
    return JSONResponse({"prompt": await state.utility(lambda: state.tokenizer.decode(ids))})


class _HeldResponse(Response):
    """A response that holds a place until its body is sent (or its client is gone): an answer left unread stays
    counted (``/inspect``'s place in the queue), so unread answers are bounded in number as well as in time
    (``--write-timeout``)."""

    def __init__(self, body: bytes, place: contextlib.AbstractAsyncContextManager[Any]) -> None:
        super().__init__(body, media_type="application/json")
        self.place = place

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.place.__aexit__(None, None, None)


async def inspect(request: Request) -> Response:
    """Admitted through the queue before any work (``ServerState.inspect_place``), which it holds until its answer
    is sent; its size is bounded by the token limit below."""
    state = _state(request)
    state.authorize(request)
    place = state.inspect_place()
    await place.__aenter__()
    try:
        req = parse_inspect(await _body(request))
        adapter = state.check_model(req.model)
        ids = await asyncio.to_thread(state.encode, req.text, "text")
        limit = min(state.context, MAX_INSPECT_TOKENS)
        if len(ids) > limit:
            raise bad("text", f"has {len(ids)} tokens; the Inspect view takes at most {limit}")
        if req.layer >= state.n_layers:
            raise bad("layer", f"must be in [0, {state.n_layers - 1}] (the model has {state.n_layers} blocks), got "
                               f"{req.layer}")
        # the answer's JSON is built on the engine's thread too: its time counts in the inspection's share
        body = await state.run_inspect(lambda: json.dumps(inspect_text(
            state.model, state.tokenizer, ids, layer=req.layer, top=req.top, logit_lens=req.logit_lens,
            adapter=adapter)).encode())
    except BaseException:
        await place.__aexit__(None, None, None)
        raise
    return _HeldResponse(body, place)


async def metrics(request: Request) -> Response:
    """Prometheus' text format under vLLM's names (``serving.metrics``). Open without the API key, as vLLM's is
    (its key guards /v1 only): a gateway's or Prometheus' scraper reads it as it reads vLLM's."""
    state = _state(request)
    return Response(state.metrics.render(), media_type=METRICS_CONTENT_TYPE)


def _page() -> str:
    return resources.files("tinygpt.serving").joinpath("static", "index.html").read_text(encoding="utf-8")


async def page(request: Request) -> Response:
    return HTMLResponse(_page())


# The repository's docs/ beside the package (src/tinygpt/serving/app.py -> the checkout's root): the page's links to
# the guide open there. An installation without a checkout has none: --docs-url points the links elsewhere.
DOCS_ROOT = Path(__file__).resolve().parents[3] / "docs"
DOC_TYPES = {".md": "text/plain; charset=utf-8", ".png": "image/png", ".svg": "image/svg+xml",
             ".jpg": "image/jpeg"}


async def docs(request: Request) -> Response:
    """``GET /docs/PATH``: a page of the guide the page links to, read-only: a Markdown file (as plain text) or an
    image under ``DOCS_ROOT``, nothing outside it; with ``--docs-url`` a redirect there instead."""
    options = _state(request).options
    path = request.path_params["path"]
    if options.docs_url is not None:
        return RedirectResponse(f"{options.docs_url.rstrip('/')}/{path}", status_code=307)
    if not DOCS_ROOT.is_dir():
        raise APIError(404, f"docs/{path}: this installation has no docs folder (it is in the repository's checkout);"
                            f" start the server with --docs-url URL to link the guide elsewhere")
    target = (DOCS_ROOT / path).resolve()
    if DOCS_ROOT not in target.parents or target.suffix.lower() not in DOC_TYPES or not target.is_file():
        raise APIError(404, f"docs/{path}: no such page of the guide (Markdown files and images under docs/)")
    return Response(await asyncio.to_thread(target.read_bytes), media_type=DOC_TYPES[target.suffix.lower()])


# ------------------------------------------------------------------------------------------ errors
async def api_error(request: Request, exc: Exception) -> Response:
    error = exc if isinstance(exc, APIError) else APIError(500, str(exc))
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


async def http_error(request: Request, exc: Exception) -> Response:
    status = getattr(exc, "status_code", 500)
    error = APIError(status, f"{request.method} {request.url.path}: {getattr(exc, 'detail', exc)}",
                     code="not_found" if status == 404 else None)
    return JSONResponse(error.body(), status_code=status, headers=getattr(exc, "headers", None))


async def server_error(request: Request, exc: Exception) -> Response:
    traceback.print_exception(exc, file=sys.stderr)  # the log has it; the client gets one line
    error = APIError(500, f"internal server error ({type(exc).__name__})")
    return JSONResponse(error.body(), status_code=500)


ROUTES = [
    Route("/", page, methods=["GET"]),
    Route("/docs/{path:path}", docs, methods=["GET"]),
    Route("/health", health, methods=["GET"]),
    Route("/v1/models", list_models, methods=["GET"]),
    Route("/v1/models/{name:path}", get_model, methods=["GET"]),
    Route("/v1/completions", completions, methods=["POST"]),
    Route("/v1/chat/completions", chat_completions, methods=["POST"]),
    Route("/tokenize", tokenize, methods=["POST"]),
    Route("/detokenize", detokenize, methods=["POST"]),
    Route("/tokenizer_info", tokenizer_info, methods=["GET"]),
    Route("/inspect", inspect, methods=["POST"]),
    Route("/v1/embeddings", embeddings, methods=["POST"]),
    Route("/metrics", metrics, methods=["GET"]),
]


def create_app(model: nn.Module, tokenizer: TextCodec, options: ServeOptions | None = None, *, dtype: str = "auto",
               draft_model: nn.Module | None = None, **settings: Any) -> Starlette:
    """The server for one model: ``ROUTES`` over one ``ServerState``. ``options`` (or ``settings``, its fields:
    ``max_batch``, ``max_queue``, ``api_key``, ...) as ``tinygpt serve``'s flags; ``dtype`` means what every
    command's ``--dtype`` means (``tinygpt.devices``). The engine thread starts with the app's lifespan and stops
    with it; ``app.state.tinygpt`` is the state."""
    options = options if options is not None else ServeOptions(**settings)
    state = ServerState(model, tokenizer, options, dtype, draft_model)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        state.start()
        try:
            yield
        finally:
            state.stop()

    middleware = [Middleware(HostGuard, options=options)] if options.loopback_only else []
    if options.cors_origin:
        middleware.append(Middleware(CORSMiddleware, allow_origins=options.cors_origin, allow_methods=["GET", "POST"],
                                     allow_headers=["Authorization", "Content-Type"]))
    middleware.append(Middleware(BodyGuard, options=options))
    app = Starlette(routes=ROUTES, lifespan=lifespan, middleware=middleware,
                    exception_handlers={APIError: api_error, HTTPException: http_error, Exception: server_error})
    app.state.tinygpt = state
    return app
