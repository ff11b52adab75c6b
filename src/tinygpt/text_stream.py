"""Text in, text out: the generation engine behind a tokenizer, streamed as the text becomes final.

The engine (``tinygpt.generation``) works on token ids; a user reads text. Two things sit between them: a BPE token
may end in the middle of a UTF-8 character, and a stop *text* may be split over tokens in any way (so it cannot be
matched as a token sequence). ``TextStreamer`` handles both incrementally, the way Hugging Face ``tokenizers``'
``DecodeStream`` and vLLM's incremental detokenizer do: it decodes only the tokens since the last point where the
text ended on a whole character (usually one token), and matches stop texts only against the new text plus the
short tail held back because it could begin one. Each token costs work proportional to the new text and the
longest stop text, never to the continuation so far, and the pieces joined are exactly what decoding the whole
continuation at once and cutting it at the first stop text gives.
"""

from __future__ import annotations

from typing import Any, Iterator, Protocol, Sequence

import torch
from torch import nn

from .generation import GenerationConfig, stream

REPLACEMENT = "\ufffd"  # what a decoder shows for bytes that are not (yet) a whole UTF-8 character


class TextCodec(Protocol):
    """What the text helpers need from a tokenizer: any ``tinygpt.tokenizer.Tokenizer`` (``eot_id`` optional)."""

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


def check_stop_texts(stop_texts: Sequence[str]) -> tuple[str, ...]:
    """``stop_texts`` as a tuple of non-empty strings, or a ``ValueError``."""
    if isinstance(stop_texts, str) or not all(isinstance(s, str) and s for s in stop_texts):
        raise ValueError("stop_texts must be a list of non-empty strings")
    return tuple(stop_texts)


def _stop_prefix_length(text: str, stop_texts: Sequence[str], end: int | None = None) -> int:
    """The length of the longest tail of ``text[:end]`` that is a proper prefix of some stop text (0 if none):
    the part that must be held back, since the next tokens could complete a stop text from it."""
    end = len(text) if end is None else end
    held = 0
    for stop in stop_texts:
        for k in range(min(len(stop) - 1, end), held, -1):
            if text.endswith(stop[:k], 0, end):
                held = k
                break
    return held


def _safe_end(text: str, stop_texts: Sequence[str]) -> int:
    """How much of a whole decoded ``text`` can be shown now: hold back an incomplete UTF-8 character (decoded as
    U+FFFD until its last byte arrives) and any tail that could begin a stop text. ``TextStreamer`` applies the
    same two rules to the new text only."""
    end = len(text.rstrip(REPLACEMENT))
    return end - _stop_prefix_length(text, stop_texts, end)


class TextStreamer:
    """An incremental detokeniser with stop texts: feed the continuation's tokens one at a time with ``add``.

    ``add(token)`` returns ``(new_text, stopped)``: the text that became final with this token ("" if none) and
    whether a stop text was reached (the text ends just before it; later tokens are ignored). ``finish()`` returns
    what was still held back (a trailing incomplete character, shown as U+FFFD, or the start of a stop text that
    never completed). Never released early: a split UTF-8 character, a tail that could begin a stop text.

    How: ``window`` is the tokens since the last point where the decoded text ended on a whole character. Each
    step decodes only the window (the text of a byte-level tokenizer up to such a point never changes, UTF-8 being
    self-synchronising), releases it up to any trailing U+FFFD, and moves the window on once the text ends whole
    (a run of bytes that never form a character keeps the window open until a whole character follows). Stop texts
    are searched in ``held`` (at most the longest stop text - 1 characters) + the new text.
    """

    def __init__(self, tokenizer: TextCodec, stop_texts: Sequence[str] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop_texts = check_stop_texts(stop_texts)
        self.tokens: list[int] = []  # every token added (the caller's record; decoding only reads the window)
        self.window: list[int] = []
        self.window_shown = 0  # characters of decode(window) already passed on
        self.held = ""  # final text that could begin a stop text
        self.stopped = False

    def add(self, token: int) -> tuple[str, bool]:
        """Append one token; returns (the newly final text, whether a stop text was reached)."""
        if self.stopped:
            return "", True
        self.tokens.append(token)
        self.window.append(token)
        text = self.tokenizer.decode(self.window)
        end = len(text.rstrip(REPLACEMENT))
        new = text[self.window_shown:end] if end > self.window_shown else ""
        if end == len(text):  # the text ends on a whole character: the next token starts a new window
            self.window, self.window_shown = [], 0
        elif end > self.window_shown:
            self.window_shown = end
        return self._release(new, final=False)

    def finish(self) -> str:
        """The rest, once no more tokens come: the held-back tail and any incomplete character (as U+FFFD)."""
        if self.stopped:
            return ""
        rest = self.tokenizer.decode(self.window)[self.window_shown:] if self.window else ""
        self.window, self.window_shown = [], 0
        piece, _ = self._release(rest, final=True)
        self.stopped = True
        return piece

    def _release(self, new: str, *, final: bool) -> tuple[str, bool]:
        if not new and not final:
            return "", False
        buffer = self.held + new
        hits = [i for i in (buffer.find(s) for s in self.stop_texts) if i >= 0]
        if hits:
            self.held, self.stopped = "", True
            return buffer[:min(hits)], True
        keep = 0 if final else _stop_prefix_length(buffer, self.stop_texts)
        self.held = buffer[len(buffer) - keep:] if keep else ""
        return buffer[:len(buffer) - keep], False


def stream_text(
    model: nn.Module,
    tokenizer: TextCodec,
    prompt: str,
    config: GenerationConfig | None = None,
    *,
    stop_texts: Sequence[str] = (),
    generator: torch.Generator | None = None,
    draft_model: nn.Module | None = None,
    constraint: Any = None,
    **overrides: Any,
) -> Iterator[str]:
    """Yield the continuation of ``prompt`` as text pieces, as soon as they are final (``TextStreamer``).

    Characters split across BPE tokens come out whole. Stops before the first occurrence of any of ``stop_texts``
    (not shown) or at the tokenizer's ``eot_id`` (used as ``eos_id`` when the config sets none; not shown).
    ``draft_model``: as for ``generation.stream`` (speculative decoding with a small model). ``constraint``: the
    row's ``RowConstraint`` (a tool such as ``tools.Calculator``: its forced tokens are streamed like drawn ones).
    """
    if not isinstance(prompt, str):
        raise TypeError(f"prompt must be a str, got {type(prompt).__name__}")
    stop_texts = check_stop_texts(stop_texts)
    ids = list(tokenizer.encode(prompt))
    if not ids:
        raise ValueError("the prompt is empty: at least one token is needed")
    if config is not None and not isinstance(config, GenerationConfig):
        raise TypeError(f"config must be a GenerationConfig, got {type(config).__name__}")
    cfg = (config or GenerationConfig()).replace(**overrides)
    eot = getattr(tokenizer, "eot_id", None)
    if cfg.eos_id is None and eot is not None:
        cfg = cfg.replace(eos_id=eot)
    steps = stream(model, [ids], cfg, generator=generator, draft_model=draft_model,
                   constraints=None if constraint is None else [constraint])
    return _text_pieces(steps, tokenizer, cfg.eos_id, list(stop_texts))


def _text_pieces(
    steps: Iterator[list[int | None]], tokenizer: TextCodec, eos_id: int | None, stop_texts: list[str]
) -> Iterator[str]:
    streamer = TextStreamer(tokenizer, stop_texts)
    try:
        for (tok,) in steps:
            if tok is None or tok == eos_id:
                break
            piece, stopped = streamer.add(tok)
            if piece:
                yield piece
            if stopped:
                return
        rest = streamer.finish()
        if rest:
            yield rest
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
    draft_model: nn.Module | None = None,
    **overrides: Any,
) -> str:
    """The continuation of ``prompt`` as one string (``stream_text`` joined)."""
    return "".join(stream_text(model, tokenizer, prompt, config, stop_texts=stop_texts, generator=generator,
                               draft_model=draft_model, **overrides))
