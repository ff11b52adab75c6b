"""What the page's Inspect view shows: tokens, next-token probabilities, attention weights, the logit lens.

The attention weights are the model's own (``experiments.attention.attention_weights``: the block's
``MultiHeadAttention`` on its ``return_weights`` path), so entries above the diagonal are exactly 0. The logit lens
(nostalgebraist 2020) applies the final norm and the head to the residual stream after each block: what the model
"would say" if it stopped there.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn

from ..experiments.attention import attention_weights
from ..multi_lora import use_adapters
from ..text_stream import TextCodec


def _token_texts(tokenizer: TextCodec, ids: list[int]) -> list[str]:
    return [tokenizer.decode([i]) for i in ids]


def _top_list(probs: torch.Tensor, top: int, tokenizer: TextCodec) -> list[list[dict[str, Any]]]:
    """probs [T, V] -> per position the ``top`` most likely tokens as {id, token, prob}."""
    values, ids = probs.topk(min(top, probs.shape[-1]), dim=-1)
    return [[{"id": i, "token": tokenizer.decode([i]), "prob": round(p, 6)} for i, p in zip(row_ids, row_p)]
            for row_ids, row_p in zip(ids.tolist(), values.tolist())]


@torch.inference_mode()
def inspect_text(model: nn.Module, tokenizer: TextCodec, ids: list[int], *, layer: int, top: int,
                 logit_lens: bool, adapter: int = -1) -> dict[str, Any]:
    """The Inspect view's data for ids (non-empty, within the context):

    ``tokens`` [T] {id, text}; ``next`` [T][top] the next-token distribution after each position; ``attention``
    [H][T][T] the weights of block ``layer`` (query row, key column; rounded to 6 decimals, exact zeros stay 0);
    with ``logit_lens``, ``lens`` [L][T] the top token after each block (the last block's row is ``next``'s first
    column: the model's own prediction). At most the context's tokens: the answer's size is bounded by it.
    ``adapter``: the index of the model's attached LoRA adapter to inspect (``multi_lora``; -1: the base)."""
    context = model.config.context_length
    if not 0 < len(ids) <= context:
        raise ValueError(f"inspect_text takes 1 to {context} token ids (the model's context), got {len(ids)}")
    with contextlib.nullcontext() if adapter < 0 else use_adapters(model, [adapter]):
        return _inspect(model, tokenizer, ids, layer, top, logit_lens)


def _inspect(model: nn.Module, tokenizer: TextCodec, ids: list[int], layer: int, top: int,
             logit_lens: bool) -> dict[str, Any]:
    idx = torch.tensor([ids], device=next(model.parameters()).device)  # [1, T]
    probs = model(idx)[0].float().softmax(-1)  # [T, V]
    weights, _ = attention_weights(model, idx, layer)  # [1, H, T, T]
    out: dict[str, Any] = {
        "tokens": [{"id": i, "text": t} for i, t in zip(ids, _token_texts(tokenizer, ids))],
        "next": _top_list(probs, top, tokenizer),
        "layer": layer,
        "n_layers": len(model.trf_blocks),
        "n_heads": weights.shape[1],
        "attention": weights[0].float().round(decimals=6).tolist(),
    }
    if logit_lens:
        x, rope = model.embed(idx)  # [1, T, D] and the RoPE tables every block shares
        lens = []
        for block in model.trf_blocks:
            x = block(x, rope)
            p = model.out_head(model.final_norm(x))[0].float().softmax(-1)  # [T, V]
            lens.append([row[0] for row in _top_list(p, 1, tokenizer)])
        out["lens"] = lens
    return out
