"""The ASGI app (Starlette): OpenAI's completions and chat endpoints, tokenize/detokenize, Inspect, and the page.

Handlers only translate: a body is checked by ``protocol``, its prompts are tokenized, one ``EngineRequest`` per
choice goes to the ``BatchEngine`` (whose thread runs the model), and the engine's events come back through an
``asyncio.Queue`` as one JSON answer or as Server-Sent Events (``data: {chunk}`` ... ``data: [DONE]``, what the
official ``openai`` client parses). A streaming client that goes away cancels its rows; the engine drops them
before its next step.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import sys
import time
import traceback
import uuid
from importlib import resources
from typing import Any, AsyncIterator, Callable

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from torch import nn

from ..generation import GenerationConfig
from ..text_stream import TextCodec
from ..tokenizer import Tokenizer
from .chat_format import CHAT_STOP_TEXTS, render_chat
from .engine import BatchEngine, EngineRequest, EngineStopped, Finish, PromptLogprobs, QueueFull, Step, TokenInfo
from .inspect import inspect_text
from .protocol import (
    MAX_INSPECT_TOKENS, APIError, Sampling, bad, fit_max_tokens, parse_chat, parse_completion, parse_detokenize,
    parse_inspect, parse_json, parse_tokenize,
)

COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat defaults to the rest of the context
RETRY_AFTER_SECONDS = 1


def _page() -> str:
    return resources.files("tinygpt.serving").joinpath("static", "index.html").read_text(encoding="utf-8")


class _Choices:
    """The events of one request's rows (its choices), gathered on the event loop."""

    def __init__(self, count: int) -> None:
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()
        self.requests: list[EngineRequest] = []
        self.open = count

    def sink(self, index: int) -> Callable[[Any], None]:
        return lambda event: self.loop.call_soon_threadsafe(self.queue.put_nowait, (index, event))

    async def events(self) -> AsyncIterator[tuple[int, Any]]:
        while self.open:
            index, event = await self.queue.get()
            if isinstance(event, Finish):
                self.open -= 1
            yield index, event

    def cancel(self) -> None:
        for req in self.requests:
            req.cancel()

    async def gather(self) -> tuple[list[str], list[list[TokenInfo]], list[str], int]:
        """Every choice's whole answer: (texts, tokens with the prompt's first when asked, finish reasons, the
        completion tokens of all); a cancelled or failed row raises its ``APIError``; the rows are freed."""
        count = len(self.requests)
        texts, tokens, reasons, completion_tokens = [""] * count, [[] for _ in range(count)], [""] * count, 0
        try:
            async for index, event in self.events():
                if isinstance(event, PromptLogprobs):
                    tokens[index] = event.tokens + tokens[index]
                elif isinstance(event, Step):
                    texts[index] += event.text
                    tokens[index].append(event.token)
                else:
                    error = _finish_error(event)
                    if error is not None:
                        raise error
                    texts[index] += event.text
                    reasons[index] = event.reason
                    completion_tokens += event.completion_tokens
        finally:
            self.cancel()
        return texts, tokens, reasons, completion_tokens


def _finish_error(event: Finish) -> APIError | None:
    if event.reason == "cancelled":
        return APIError(503, f"the request was cancelled: {event.message or 'the server is shutting down'}",
                        headers={"Retry-After": str(RETRY_AFTER_SECONDS)})
    if event.reason == "error":
        return APIError(500, f"generation failed: {event.message}")
    return None


def create_app(model: nn.Module, tokenizer: TextCodec, *, model_name: str = "tinygpt", max_batch: int = 8,
               max_queue: int = 64, api_key: str | None = None, dtype: str = "auto",
               engine_options: dict[str, Any] | None = None) -> Starlette:
    """The server for one model. ``max_batch`` rows decode together, ``max_queue`` more may wait (beyond that a
    request gets 429 with Retry-After); with ``api_key`` every endpoint but ``/`` and ``/health`` needs
    ``Authorization: Bearer <api_key>``; ``dtype`` means what every command's ``--dtype`` means (``tinygpt.devices``).
    ``engine_options``: more ``BatchEngine`` keywords (token_budget, cache_tokens, prefix_reuse, speculative_tokens).
    The engine thread starts with the app's lifespan and stops with it."""
    context = model.config.context_length
    vocab = model.config.vocab_size
    eos_id = getattr(tokenizer, "eot_id", None)
    created = int(time.time())
    state: dict[str, BatchEngine] = {}

    def engine() -> BatchEngine:
        if "engine" not in state:
            raise APIError(503, "the server is not running (starting or shutting down)")
        return state["engine"]

    def authorize(request: Request) -> None:
        if api_key is None:
            return
        header = request.headers.get("authorization", "")
        given = header[7:] if header.lower().startswith("bearer ") else ""
        if not hmac.compare_digest(given.encode(), api_key.encode()):
            raise APIError(401, "invalid or missing API key: send the header Authorization: Bearer <key>",
                           type="authentication_error", code="invalid_api_key")

    def check_model(name: str | None) -> None:
        if name is not None and name != model_name:
            raise APIError(404, f"the model {name!r} does not exist; this server has {model_name!r}",
                           param="model", code="model_not_found")

    async def body_of(request: Request) -> dict[str, Any]:
        authorize(request)
        return parse_json(await request.body())

    def encode(text: str, param: str) -> list[int]:
        try:
            ids = list(tokenizer.encode(text))
        except ValueError as err:
            raise bad(param, f"cannot be tokenized: {err}") from None
        if not ids:
            raise bad(param, "is empty: at least one token is needed")
        return ids

    def check_ids(ids: list[int], param: str) -> list[int]:
        for t in ids:
            if not 0 <= t < vocab:
                raise bad(param, f"token id {t} is out of range: ids must satisfy 0 <= id < {vocab}")
        return ids

    def token_bytes(token: int) -> bytes:
        get = getattr(tokenizer, "token_bytes", None)
        return get(token) if get is not None else tokenizer.decode([token]).encode("utf-8")

    def token_text(token: int) -> str:
        """A token as logprobs show it: its text, or for part of a UTF-8 character OpenAI's "bytes:\\xNN" form
        (so that distinct tokens never share a key in ``top_logprobs``)."""
        text = tokenizer.decode([token])
        if "\ufffd" in text:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in token_bytes(token))
        return text

    def submit(prompts: list[list[int]], sampling: Sampling, limits: list[int], stop: tuple[str, ...],
               logprobs: int | None, prompt_logprobs: bool) -> _Choices:
        choices = _Choices(len(prompts) * sampling.n)
        for p, ids in enumerate(prompts):
            for j in range(sampling.n):
                seed = None if sampling.seed is None else sampling.seed + j  # n seeded choices differ
                config = GenerationConfig(
                    max_new_tokens=limits[p], temperature=sampling.temperature, top_k=sampling.top_k,
                    top_p=sampling.top_p, repetition_penalty=sampling.repetition_penalty, seed=seed, eos_id=eos_id,
                    overflow="error")
                choices.requests.append(EngineRequest(
                    ids, config, choices.sink(p * sampling.n + j), stop, logprobs, prompt_logprobs))
        if len(choices.requests) > max_batch + max_queue:
            raise bad("n", f"{len(prompts)} prompt(s) x n={sampling.n} = {len(choices.requests)} rows; this server "
                           f"takes at most {max_batch + max_queue} at once (--max-batch + --max-queue)")
        try:
            engine().submit(choices.requests)
        except QueueFull as err:
            raise APIError(429, f"the server is busy: {err}; retry later", type="rate_limit_error",
                           code="queue_full", headers={"Retry-After": str(RETRY_AFTER_SECONDS)}) from None
        except EngineStopped as err:
            raise APIError(503, str(err), headers={"Retry-After": str(RETRY_AFTER_SECONDS)}) from None
        return choices

    def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens}

    def sse(data: dict[str, Any] | str) -> str:
        return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n"

    def stream_response(choices: _Choices, chunks: AsyncIterator[str]) -> StreamingResponse:
        async def body() -> AsyncIterator[str]:
            try:
                async for chunk in chunks:
                    yield chunk
            finally:  # the client went away (or the stream ended): free the rows
                choices.cancel()

        return StreamingResponse(body(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    # ------------------------------------------------------------------------------------ /v1/completions
    def completion_logprobs(tokens: list[TokenInfo], offset: int) -> dict[str, Any]:
        texts = [token_text(t.id) for t in tokens]
        offsets, at = [], offset
        for text in texts:
            offsets.append(at)
            at += len(text)
        return {
            "tokens": texts,
            "token_logprobs": [t.logprob for t in tokens],
            "top_logprobs": [None if t.logprob is None else {token_text(i): lp for i, lp in t.top} for t in tokens],
            "text_offset": offsets,
        }

    async def completions(request: Request) -> Response:
        req = parse_completion(await body_of(request))
        sampling = req.sampling
        check_model(sampling.model)
        prompts = [encode(p, "prompt") if isinstance(p, str) else check_ids(p, "prompt") for p in req.prompts]
        limits = [fit_max_tokens(sampling.max_tokens, COMPLETION_DEFAULT_MAX_TOKENS, len(ids), context)
                  for ids in prompts]
        prompt_texts = [p if isinstance(p, str) else tokenizer.decode(p) for p in req.prompts]
        choices = submit(prompts, sampling, limits, tuple(sampling.stop), req.logprobs, req.echo and req.logprobs
                         is not None)
        rid, now, n = f"cmpl-{uuid.uuid4().hex}", int(time.time()), sampling.n
        n_prompt = sum(len(ids) for ids in prompts)

        def chunk(index: int, text: str, logprobs: Any = None, finish: str | None = None) -> dict[str, Any]:
            return {"id": rid, "object": "text_completion", "created": now, "model": model_name,
                    "choices": [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}]}

        if sampling.stream:
            async def chunks() -> AsyncIterator[str]:
                offsets = [0] * len(choices.requests)
                if req.echo and req.logprobs is None:
                    for index in range(len(choices.requests)):
                        yield sse(chunk(index, prompt_texts[index // n]))
                        offsets[index] = len(prompt_texts[index // n])
                completion_tokens = 0
                async for index, event in choices.events():
                    if isinstance(event, PromptLogprobs):
                        text = prompt_texts[index // n]
                        yield sse(chunk(index, text, completion_logprobs(event.tokens, 0)))
                        offsets[index] = len(text)
                    elif isinstance(event, Step):
                        logprobs = None
                        if req.logprobs is not None:
                            logprobs = completion_logprobs([event.token], offsets[index])
                        elif not event.text:
                            continue
                        yield sse(chunk(index, event.text, logprobs))
                        offsets[index] += len(event.text)
                    else:
                        error = _finish_error(event)
                        if error is not None:
                            yield sse(error.body())
                            return
                        completion_tokens += event.completion_tokens
                        yield sse(chunk(index, event.text, None, event.reason))
                if sampling.include_usage:
                    yield sse({"id": rid, "object": "text_completion", "created": now, "model": model_name,
                               "choices": [], "usage": usage(n_prompt, completion_tokens)})
                yield sse("[DONE]")

            return stream_response(choices, chunks())

        texts, tokens, reasons, completion_tokens = await choices.gather()
        out = []
        for index, text in enumerate(texts):
            prefix = prompt_texts[index // n] if req.echo else ""
            logprobs = None
            if req.logprobs is not None:
                logprobs = completion_logprobs(tokens[index], 0)
            out.append({"index": index, "text": prefix + text, "logprobs": logprobs, "finish_reason": reasons[index]})
        return JSONResponse({"id": rid, "object": "text_completion", "created": now, "model": model_name,
                             "choices": out, "usage": usage(n_prompt, completion_tokens)})

    # ------------------------------------------------------------------------------- /v1/chat/completions
    def chat_logprob(t: TokenInfo) -> dict[str, Any]:
        return {"token": token_text(t.id), "logprob": t.logprob, "bytes": list(token_bytes(t.id)),
                "top_logprobs": [{"token": token_text(i), "logprob": lp, "bytes": list(token_bytes(i))}
                                 for i, lp in t.top]}

    async def chat_completions(request: Request) -> Response:
        req = parse_chat(await body_of(request))
        sampling = req.sampling
        check_model(sampling.model)
        try:
            prompt = render_chat(req.messages)
        except ValueError as err:
            raise bad("messages", str(err)) from None
        ids = encode(prompt, "messages")
        limit = fit_max_tokens(sampling.max_tokens, None, len(ids), context, req.max_tokens_param, "messages")
        stop = tuple(sampling.stop) + tuple(s for s in CHAT_STOP_TEXTS if s not in sampling.stop)
        choices = submit([ids], sampling, [limit], stop, req.logprobs, False)
        rid, now = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

        def chunk(index: int, delta: dict[str, Any], logprobs: Any = None, finish: str | None = None
                  ) -> dict[str, Any]:
            return {"id": rid, "object": "chat.completion.chunk", "created": now, "model": model_name,
                    "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]}

        if sampling.stream:
            async def chunks() -> AsyncIterator[str]:
                for index in range(sampling.n):
                    yield sse(chunk(index, {"role": "assistant", "content": ""}))
                completion_tokens = 0
                async for index, event in choices.events():
                    if isinstance(event, Step):
                        if not event.text and req.logprobs is None:
                            continue
                        logprobs = None if req.logprobs is None else {"content": [chat_logprob(event.token)]}
                        yield sse(chunk(index, {"content": event.text}, logprobs))
                    elif isinstance(event, Finish):
                        error = _finish_error(event)
                        if error is not None:
                            yield sse(error.body())
                            return
                        completion_tokens += event.completion_tokens
                        if event.text:
                            yield sse(chunk(index, {"content": event.text}))
                        yield sse(chunk(index, {}, None, event.reason))
                if sampling.include_usage:
                    yield sse({"id": rid, "object": "chat.completion.chunk", "created": now, "model": model_name,
                               "choices": [], "usage": usage(len(ids), completion_tokens)})
                yield sse("[DONE]")

            return stream_response(choices, chunks())

        texts, tokens, reasons, completion_tokens = await choices.gather()
        out = [{"index": i, "message": {"role": "assistant", "content": texts[i]},
                "logprobs": None if req.logprobs is None else {"content": [chat_logprob(t) for t in tokens[i]]},
                "finish_reason": reasons[i]} for i in range(sampling.n)]
        return JSONResponse({"id": rid, "object": "chat.completion", "created": now, "model": model_name,
                             "choices": out, "usage": usage(len(ids), completion_tokens)})

    # ------------------------------------------------------------------------------------- the rest
    async def health(request: Request) -> Response:
        load = state["engine"].load() if "engine" in state else {"running": 0, "waiting": 0}
        return JSONResponse({"status": "ok" if "engine" in state else "stopped", "model": model_name, **load,
                             "max_batch": max_batch, "max_queue": max_queue})

    def model_card() -> dict[str, Any]:
        return {"id": model_name, "object": "model", "created": created, "owned_by": "tinygpt",
                "context_length": context, "vocab_size": vocab, "n_layers": len(model.trf_blocks),
                "n_heads": model.config.n_heads}

    async def list_models(request: Request) -> Response:
        authorize(request)
        return JSONResponse({"object": "list", "data": [model_card()]})

    async def get_model(request: Request) -> Response:
        authorize(request)
        check_model(request.path_params["name"])
        return JSONResponse(model_card())

    async def tokenize(request: Request) -> Response:
        name, text = parse_tokenize(await body_of(request))
        check_model(name)
        try:
            # The end-of-text text becomes its id here, as HF tokenizers and vLLM's /tokenize parse special tokens.
            ids = list(tokenizer.encode(text, allowed_special=True) if isinstance(tokenizer, Tokenizer)
                       else tokenizer.encode(text))
        except ValueError as err:
            raise bad("prompt", f"cannot be tokenized: {err}") from None
        return JSONResponse({"tokens": ids, "count": len(ids), "max_model_len": context,
                             "pieces": [token_text(t) for t in ids]})

    async def tokenizer_info(request: Request) -> Response:
        """What a client-side tokenizer needs to know (lm-eval's ``tokenizer_backend=remote`` reads it): the
        end-of-text token as text (``/tokenize`` maps that text back to its id), no BOS or padding token."""
        authorize(request)
        eos = None if eos_id is None else tokenizer.decode([eos_id])
        return JSONResponse({"eos_token": eos, "bos_token": None, "pad_token": None, "eos_token_id": eos_id,
                             "vocab_size": vocab, "max_model_len": context})

    async def detokenize(request: Request) -> Response:
        name, ids = parse_detokenize(await body_of(request))
        check_model(name)
        check_ids(ids, "tokens")
        return JSONResponse({"prompt": tokenizer.decode(ids)})

    async def inspect(request: Request) -> Response:
        req = parse_inspect(await body_of(request))
        ids = encode(req.text, "text")
        limit = min(context, MAX_INSPECT_TOKENS)
        if len(ids) > limit:
            raise bad("text", f"has {len(ids)} tokens; the Inspect view takes at most {limit}")
        n_layers = len(model.trf_blocks)
        if req.layer >= n_layers:
            raise bad("layer", f"must be in [0, {n_layers - 1}] (the model has {n_layers} blocks), got {req.layer}")
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()

        def done(result: Any, error: BaseException | None) -> None:
            def settle() -> None:
                if not future.done():
                    future.set_exception(error) if error is not None else future.set_result(result)
            loop.call_soon_threadsafe(settle)

        try:
            engine().call(lambda: inspect_text(model, tokenizer, ids, layer=req.layer, top=req.top,
                                               logit_lens=req.logit_lens), done)
        except EngineStopped as err:
            raise APIError(503, str(err)) from None
        return JSONResponse(await future)

    async def page(request: Request) -> Response:
        return HTMLResponse(_page())

    # ------------------------------------------------------------------------------------ errors
    async def api_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, APIError)
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        error = APIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}",
                         code="not_found" if exc.status_code == 404 else None)
        return JSONResponse(error.body(), status_code=exc.status_code, headers=exc.headers)

    async def server_error(request: Request, exc: Exception) -> Response:
        traceback.print_exception(exc, file=sys.stderr)  # the log has it; the client gets one line
        error = APIError(500, f"internal server error ({type(exc).__name__})")
        return JSONResponse(error.body(), status_code=500)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        state["engine"] = BatchEngine(model, tokenizer, max_batch=max_batch, max_queue=max_queue,
                                      dtype=dtype, **(engine_options or {}))
        try:
            yield
        finally:
            state.pop("engine").shutdown()

    routes = [
        Route("/", page, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/v1/models", list_models, methods=["GET"]),
        Route("/v1/models/{name:path}", get_model, methods=["GET"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/tokenize", tokenize, methods=["POST"]),
        Route("/detokenize", detokenize, methods=["POST"]),
        Route("/tokenizer_info", tokenizer_info, methods=["GET"]),
        Route("/inspect", inspect, methods=["POST"]),
    ]
    app = Starlette(routes=routes, lifespan=lifespan,
                    exception_handlers={APIError: api_error, HTTPException: http_error, Exception: server_error})
    app.state.engines = state
    return app
