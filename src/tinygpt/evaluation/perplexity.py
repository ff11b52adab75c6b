"""Perplexity of a token stream with a sliding window: loss, perplexity and bits per byte.

Text longer than the model's context is scored window by window (Hugging Face's "perplexity of fixed-length
models" recipe): windows of ``window`` tokens start every ``stride`` tokens, and each scores only the tokens that
no earlier window scored, so every token is scored exactly once, with up to ``window - stride`` tokens of context
(the first window scores its tokens with whatever precedes them). The windows are independent, so they are batched.

    loss = -(1/N) sum_i log p(x_i | x_<i within its window)   (nats per token)
    perplexity = exp(loss)
    bits per byte = N * loss / (ln 2 * bytes of the scored text)   (comparable across tokenizers)
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Sequence

from ..model import GPTModel
from ..tokenizer import Tokenizer
from .scoring import score_rows


@dataclass(frozen=True)
class PerplexityResult:
    """The figures of one run; ``bits_per_byte`` is None when the byte count is unknown."""

    loss: float
    perplexity: float
    bits_per_byte: float | None
    tokens: int  # scored tokens N
    bytes: int | None
    windows: int
    window: int
    stride: int

    def to_dict(self) -> dict:
        return asdict(self)


def sliding_windows(n_tokens: int, window: int, stride: int) -> list[tuple[int, int, int]]:
    """(begin, end, scored) per window over tokens[begin:end]: its last ``scored`` tokens are new (HF's loop)."""
    if window < 2:
        raise ValueError(f"window={window} must be >= 2 (one token of context and one to score)")
    if not 1 <= stride <= window:
        raise ValueError(f"stride={stride} must be in [1, window={window}]")
    if n_tokens < window:
        raise ValueError(f"the text is {n_tokens} tokens, shorter than one window of {window}; "
                         f"give a longer text or a smaller --window")
    out, previous_end = [], 0
    for begin in range(0, n_tokens, stride):
        end = min(begin + window, n_tokens)
        # The window's first token has no context inside it, so at most end - begin - 1 of its tokens are scored.
        out.append((begin, end, min(end - previous_end, end - begin - 1)))
        previous_end = end
        if end == n_tokens:
            break
    return out


def perplexity(
    model: GPTModel,
    tokens: Sequence[int],
    *,
    window: int | None = None,
    stride: int | None = None,
    n_bytes: int | None = None,
    batch_size: int = 8,
    progress: bool = False,
) -> PerplexityResult:
    """Sliding-window perplexity of ``tokens`` (ids, the first of which is context only).

    ``window`` defaults to the model's context length, ``stride`` to half the window. ``n_bytes``: the UTF-8 size
    of the text that tokens[1:] spell, for bits per byte.
    """
    window = model.config.context_length if window is None else window
    if window > model.config.context_length:
        raise ValueError(f"window={window} is longer than the model's context_length={model.config.context_length}")
    stride = max(1, window // 2) if stride is None else stride
    spans = sliding_windows(len(tokens), window, stride)
    tokens = list(tokens)
    rows = [(tokens[begin:end], scored) for begin, end, scored in spans]
    scores = score_rows(model, rows, batch_size=batch_size, progress=progress, desc="perplexity")
    count = sum(scored for _, _, scored in spans)
    loss = -sum(s.logprob for s in scores) / count
    bpb = None if not n_bytes else count * loss / (math.log(2) * n_bytes)
    return PerplexityResult(loss=loss, perplexity=math.exp(loss), bits_per_byte=bpb, tokens=count, bytes=n_bytes,
                            windows=len(spans), window=window, stride=stride)


def text_tokens(tokenizer: Tokenizer, text: str) -> tuple[list[int], int]:
    """(ids, bytes) for a text: with an end-of-text id it comes first, as the context of the text's first token
    (so every byte of the text is scored: bytes = its UTF-8 size); without one the first token is context only and
    bytes counts what the other tokens spell."""
    ids = tokenizer.encode(text)
    if tokenizer.eot_id is not None:
        return [tokenizer.eot_id] + ids, len(text.encode("utf-8"))
    return ids, len(tokenizer.decode(ids[1:]).encode("utf-8"))


def stream_bytes(tokenizer: Tokenizer, ids: Sequence[int]) -> int:
    """UTF-8 bytes spelled by a prepared token stream's scored tokens ids[1:], end-of-text markers not counted."""
    eot = tokenizer.eot_id
    return len(tokenizer.decode([int(i) for i in ids[1:] if int(i) != eot]).encode("utf-8"))
