"""``/v1/embeddings``: the model's last hidden state (after the final LayerNorm, what Hugging Face's ``GPT2Model``
returns as ``last_hidden_state``), pooled over each input's tokens.

``input``: a string, a list of strings, a list of token ids or a list of id lists (OpenAI's four forms).
``pooling``: "mean" over the input's tokens (the default) or "last" (the last token's state: what a causal model
has read the whole input at); ``normalize`` (default true): unit L2 length, so a dot product is the cosine.
``encoding_format``: "float" (lists of numbers) or "base64" (the little-endian float32 bytes, what the official
``openai`` client asks for and decodes by default).

The inputs run as one right-padded batch per group on the engine's thread between two decode steps (as ``/inspect``
does), so they never compete with the batch for the model. A causal model's position t reads positions <= t only,
so the padding after an input changes none of its states: a batch gives what each input alone gives.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
from dataclasses import dataclass
from typing import Any

import torch
from starlette.requests import Request
from starlette.responses import Response
from torch import nn

from ..multi_lora import use_adapters
from .protocol import _Fields, _prompts, bad

POOLINGS = ("mean", "last")
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


def embed(model: nn.Module, inputs: list[list[int]], pooling: str = "mean", normalize: bool = True,
          max_tokens: int | None = None) -> torch.Tensor:
    """The pooled last hidden states [len(inputs), D] (float32) of id lists of any lengths <= the context; batches
    of at most ``max_tokens`` padded tokens (default: 8 contexts)."""
    device = next(model.parameters()).device
    budget = max_tokens or 8 * model.config.context_length
    order = sorted(range(len(inputs)), key=lambda i: len(inputs[i]))  # similar lengths share a batch: less padding
    out = torch.empty(len(inputs), model.config.emb_dim)
    start = 0
    while start < len(order):
        end = start + 1
        while end < len(order) and (end + 1 - start) * len(inputs[order[end]]) <= budget:
            end += 1
        group = [inputs[i] for i in order[start:end]]
        width = max(len(ids) for ids in group)
        idx = torch.zeros(len(group), width, dtype=torch.long)
        real = torch.zeros(len(group), width, dtype=torch.bool)
        for r, ids in enumerate(group):
            idx[r, :len(ids)] = torch.tensor(ids)
            real[r, :len(ids)] = True
        states = model.hidden_states(idx.to(device)).float().cpu()  # [G, T, D]: right padding changes no state
        if pooling == "mean":
            pooled = (states * real[..., None]).sum(1) / real.sum(1, keepdim=True)  # [G, D]
        else:
            lengths = torch.tensor([len(ids) for ids in group])
            pooled = states[torch.arange(len(group)), lengths - 1]  # [G, D]
        if normalize:
            pooled = torch.nn.functional.normalize(pooled, dim=-1)
        out[torch.tensor(order[start:end])] = pooled
        start = end
    return out


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
            if len(one) > state.context:
                raise bad("input", f"input {i} has {len(one)} tokens, more than the model's context of "
                                   f"{state.context}")
        return ids

    def run() -> torch.Tensor:
        with contextlib.nullcontext() if adapter < 0 else use_adapters(state.model, [adapter]):
            return embed(state.model, ids, req.pooling, req.normalize)

    async with state.inspect_place():  # a place in the queue, as /inspect takes one
        ids = await asyncio.to_thread(tokenize)
        vectors = await state.run_inspect(run)

    def answer() -> bytes:
        data = [{"object": "embedding", "index": i, "embedding": _encode(v, req.encoding_format)}
                for i, v in enumerate(vectors)]
        n = sum(len(one) for one in ids)
        return json.dumps({"object": "list", "data": data, "model": state.served_name(adapter),
                           "usage": {"prompt_tokens": n, "total_tokens": n}}).encode()

    return Response(await asyncio.to_thread(answer), media_type="application/json")
