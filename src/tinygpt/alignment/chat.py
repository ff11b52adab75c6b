"""``tinygpt chat``: read a line, wrap it in the Alpaca template, stream the model's answer.

Each line is one instruction on its own (the template has no turns, so there is no memory of earlier lines). The
answer stops at the end-of-text token, at ``max_new_tokens``, or where the model starts a new template section
(``STOP_TEXTS``: a fine-tuned model has seen those headers only in prompts, but a weak one may write them).
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Sequence

from torch import nn

from ..generation import GenerationConfig
from ..text_stream import TextCodec, stream_text
from .data import format_prompt

EXIT_COMMAND = "/exit"
STOP_TEXTS = ("\n### Instruction:", "\n### Input:", "\n### Response:")


def chat(model: nn.Module, tokenizer: TextCodec, lines: Iterable[str], write: Callable[[str], None],
         config: GenerationConfig | None = None, *, prompt_marker: str = "",
         report_error: Callable[[str], None] | None = None, stop_texts: Sequence[str] = (),
         **overrides: Any) -> int:
    """Answer every non-empty line of ``lines`` until it ends or a line is ``/exit``; returns the answers given.

    ``write`` receives the answer piece by piece as it streams (then a newline); ``prompt_marker`` is written
    before each line is read (e.g. "> " at a terminal). A line the tokenizer cannot encode is reported through
    ``report_error`` (default: written as a line) and skipped. Generation settings come from ``config`` and
    ``overrides`` (``GenerationConfig`` fields), checked before the first line is read. An answer also ends before
    any of ``stop_texts`` (besides the prompt template's own markers).
    """
    config = (config or GenerationConfig()).replace(**overrides)
    report_error = report_error or (lambda message: write(f"error: {message}\n"))
    answered = 0
    write(prompt_marker)
    for line in lines:
        text = line.rstrip("\r\n")
        if text.strip() == EXIT_COMMAND:
            break
        if text.strip():
            try:
                pieces = stream_text(model, tokenizer, format_prompt(text.strip()), config, stop_texts=(*STOP_TEXTS, *stop_texts))
                for piece in pieces:
                    write(piece)
                write("\n")
                answered += 1
            except ValueError as err:
                report_error(str(err))
        write(prompt_marker)
    return answered
