"""``/v1/embeddings``: the model's last hidden state (after the final LayerNorm, what Hugging Face's ``GPT2Model``
returns as ``last_hidden_state``), pooled over each input's tokens.

``input``: a string, a list of strings, a list of token ids or a list of id lists (OpenAI's four forms).
``pooling``: "mean" over the input's tokens (the default) or "last" (the last token's state: what a causal model
has read the whole input at); ``normalize`` (default true): unit L2 length, so a dot product is the cosine.
``encoding_format``: "float" (lists of numbers) or "base64" (the little-endian float32 bytes, what the official
``openai`` client asks for and decodes by default).

Each input is an *embedding row* of the inference engine (``Row.pooling``): admitted, scheduled and batched with
the other requests' rows by the scheduler, under the token budget, its prompt prefilled in chunks when it is long,
its final hidden states pooled chunk by chunk (``InferenceEngine._advance_embedding``). A request's inputs enter the
queue in waves of ``--max-batch`` rows, so a request of many inputs takes its turn as the others do. Their prompt
tokens count in ``/metrics``' ``vllm:prompt_tokens`` as vLLM counts a pooling request's.
"""

from __future__ import annotations

import asyncio
import base64
import json
from dataclasses import dataclass
from typing import Any

import torch
from starlette.requests import Request
from starlette.responses import Response
from torch import nn

from ..inference.engine import POOLINGS, InferenceEngine
from ..inference.row import Row
from .engine import EngineRequest, Finish
from .protocol import _Fields, _prompts, bad
from .state import Choices, finish_error

MAX_INPUTS = 2048  # OpenAI's limit on inputs per request


@dataclass
class EmbeddingRequest:
    model: str | None
    inputs: list[str | list[int]]
    pooling: str
    normalize: bool
    encoding_format: str


def parse_embeddings(body: dict[str, Any]) -> EmbeddingRequest:
    f = _Fields(body, {"model", "input", "encoding_format", "dimensions", "user", "pooling", "normalize"})
    if body.get("input") is None:
        raise bad("input", "is required: a string, a list of strings, a list of token ids or a list of id lists")
    try:
        inputs = _prompts(body["input"])
    except Exception:
        raise bad("input", "must be a string, a list of strings, a list of token ids or a list of non-empty lists "
                           "of token ids") from None
    if len(inputs) > MAX_INPUTS:
        raise bad("input", f"at most {MAX_INPUTS} inputs per request, got {len(inputs)}")
    encoding = f.str("encoding_format", "float")
    if encoding not in ("float", "base64"):
        raise bad("encoding_format", f'must be "float" or "base64", got {json.dumps(encoding)}')
    pooling = f.str("pooling", "mean")
    if pooling not in POOLINGS:
        raise bad("pooling", f'must be "mean" or "last", got {json.dumps(pooling)}')
    if f.get("dimensions") is not None:
        raise bad("dimensions", "is not supported: the embedding has the model's width (emb_dim)")
    f.str("user")
    return EmbeddingRequest(f.str("model"), inputs, pooling, f.bool("normalize", True), encoding)


def embed(model: nn.Module, inputs: list[list[int]], pooling: str = "mean", normalize: bool = True, *,
          max_rows: int = 8, token_budget: int | None = None) -> torch.Tensor:
    """The pooled last hidden states [len(inputs), D] (float32) of id lists of lengths 1 .. the context, run as
    embedding rows of an ``InferenceEngine`` (``max_rows`` at once, ``token_budget`` tokens per forward: a longer
    input is prefilled in chunks), as the server runs them."""
    engine = InferenceEngine(model, max_rows=max_rows, token_budget=token_budget)
    rows = [engine.add(Row(list(ids), None, pooling=pooling)) for ids in inputs]
    engine.run_until_done()
    failed = next((r for r in rows if r.finish_reason != "length"), None)
    if failed is not None:
        raise RuntimeError(f"an embedding row failed: {failed.error or failed.finish_reason}")
    out = torch.stack([r.embedding.cpu() for r in rows])  # [N, D]
    return torch.nn.functional.normalize(out, dim=-1) if normalize else out


def _encode(vector: torch.Tensor, encoding: str) -> list[float] | str:
    if encoding == "base64":
        return base64.b64encode(vector.numpy().astype("<f4").tobytes()).decode("ascii")
    return vector.tolist()


async def embeddings(request: Request) -> Response:
    state = request.app.state.tinygpt
    state.authorize(request)
    req = parse_embeddings(await state.parse(await request.body()))  # off the heavy endpoints' threads
    adapter = state.check_model(req.model)

    def tokenize() -> list[list[int]]:
        ids = [state.encode(p, "input") if isinstance(p, str) else state.check_ids(p, "input") for p in req.inputs]
        for i, one in enumerate(ids):
            if not one:
                raise bad("input", f"input {i} is empty: an embedding needs at least one token")
            if len(one) > state.context:
                raise bad("input", f"input {i} has {len(one)} tokens, more than the model's context of "
                                   f"{state.context}")
        return ids

    ids = await asyncio.to_thread(tokenize)
    vectors: list[torch.Tensor] = []
    wave = state.options.max_batch
    for first in range(0, len(ids), wave):
        vectors += await _embed_rows(state, ids[first:first + wave], req.pooling, adapter)
    if req.normalize:
        vectors = list(torch.nn.functional.normalize(torch.stack(vectors), dim=-1))

    def answer() -> bytes:
        data = [{"object": "embedding", "index": i, "embedding": _encode(v, req.encoding_format)}
                for i, v in enumerate(vectors)]
        n = sum(len(one) for one in ids)
        return json.dumps({"object": "list", "data": data, "model": state.served_name(adapter),
                           "usage": {"prompt_tokens": n, "total_tokens": n}}).encode()

    return Response(await asyncio.to_thread(answer), media_type="application/json")


async def _embed_rows(state: Any, ids: list[list[int]], pooling: str, adapter: int) -> list[torch.Tensor]:
    """One wave of inputs as embedding rows of the engine; their pooled states [D] each, in order (429 when the
    queue cannot take them; the rows leave the engine if the request ends first)."""
    choices = Choices(len(ids), state.metrics)
    choices.requests = [EngineRequest(one, None, choices.sink(i), adapter=adapter, pooling=pooling)
                        for i, one in enumerate(ids)]
    state.enqueue(choices)
    out: list[torch.Tensor | None] = [None] * len(ids)
    try:
        async for index, event in choices.events():
            if isinstance(event, Finish):
                error = finish_error(event)
                if error is not None:
                    raise error
                out[index] = event.embedding
    finally:
        state.release(choices)
    return out
