"""Text in, text out: the generation engine behind a tokenizer, streamed as the text becomes final.

The engine (``tinygpt.generation``) works on token ids; a user reads text. Two things sit between them: a BPE token
may end in the middle of a UTF-8 character, and a stop *text* may be split over tokens in any way (so it cannot be
matched as a token sequence). Both are solved by decoding the whole continuation at each step and showing only the
part that can no longer change.
"""

from __future__ import annotations

from typing import Any, Iterator, Protocol, Sequence

import torch
from torch import nn

from .generation import GenerationConfig, stream


class TextCodec(Protocol):
    """What the text helpers need from a tokenizer: any ``tinygpt.tokenizer.Tokenizer`` (``eot_id`` optional)."""

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


def _safe_end(text: str, stop_texts: Sequence[str]) -> int:
    """How much of ``text`` can be shown now: hold back an incomplete UTF-8 character (decoded as U+FFFD until
    its last byte arrives, since a BPE token may end mid-character) and any tail that could begin a stop text."""
    end = len(text)
    while end > 0 and text[end - 1] == "\ufffd":
        end -= 1
    held = 0
    for stop in stop_texts:
        for k in range(min(len(stop) - 1, end), held, -1):
            if text.endswith(stop[:k], 0, end):
                held = k
                break
    return end - held


def stream_text(
    model: nn.Module,
    tokenizer: TextCodec,
    prompt: str,
    config: GenerationConfig | None = None,
    *,
    stop_texts: Sequence[str] = (),
    generator: torch.Generator | None = None,
    **overrides: Any,
) -> Iterator[str]:
    """Yield the continuation of ``prompt`` as text pieces, as soon as they are final.

    Decodes incrementally (the whole new text each step, showing only what became final), so characters split
    across BPE tokens come out whole. Stops before the first occurrence of any of ``stop_texts`` (not shown) or
    at the tokenizer's ``eot_id`` (used as ``eos_id`` when the config sets none; not shown).
    """
    if not isinstance(prompt, str):
        raise TypeError(f"prompt must be a str, got {type(prompt).__name__}")
    if isinstance(stop_texts, str) or not all(isinstance(s, str) and s for s in stop_texts):
        raise ValueError("stop_texts must be a list of non-empty strings")
    ids = list(tokenizer.encode(prompt))
    if not ids:
        raise ValueError("the prompt is empty: at least one token is needed")
    if config is not None and not isinstance(config, GenerationConfig):
        raise TypeError(f"config must be a GenerationConfig, got {type(config).__name__}")
    cfg = (config or GenerationConfig()).replace(**overrides)
    eot = getattr(tokenizer, "eot_id", None)
    if cfg.eos_id is None and eot is not None:
        cfg = cfg.replace(eos_id=eot)
    steps = stream(model, [ids], cfg, generator=generator)
    return _text_pieces(steps, tokenizer, cfg.eos_id, list(stop_texts))


def _text_pieces(
    steps: Iterator[list[int | None]], tokenizer: TextCodec, eos_id: int | None, stop_texts: list[str]
) -> Iterator[str]:
    new: list[int] = []
    shown = 0
    try:
        for (tok,) in steps:
            if tok is None or tok == eos_id:
                break
            new.append(tok)
            text = tokenizer.decode(new)
            hits = [i for i in (text.find(s) for s in stop_texts) if i >= 0]
            if hits:
                cut = max(min(hits), shown)
                if cut > shown:
                    yield text[shown:cut]
                return
            end = _safe_end(text, stop_texts)
            if end > shown:
                yield text[shown:end]
                shown = end
        text = tokenizer.decode(new)
        if len(text) > shown:
            yield text[shown:]
    finally:
        steps.close()  # puts the model back in its mode even when the caller stops early


def generate_text(
    model: nn.Module,
    tokenizer: TextCodec,
    prompt: str,
    config: GenerationConfig | None = None,
    *,
    stop_texts: Sequence[str] = (),
    generator: torch.Generator | None = None,
    **overrides: Any,
) -> str:
    """The continuation of ``prompt`` as one string (``stream_text`` joined)."""
    return "".join(stream_text(model, tokenizer, prompt, config, stop_texts=stop_texts, generator=generator,
                               **overrides))
