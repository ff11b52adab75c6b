"""``tinygpt chat``: read a line, render it with the model's chat template, stream the model's answer.

The template is the checkpoint's own (``tokenizer.chat_template``: the Alpaca one for a model ``tinygpt sft``
trained, see ``data.ALPACA_CHAT_TEMPLATE``); a model without one is refused with a ``ValueError`` before the first
line is read. Each line is one user message on its own (SFT trained single instructions, so there is no memory of
earlier lines). The answer stops at the end-of-text token, at ``max_new_tokens``, where the template ends a turn,
or for the Alpaca template where the model starts a new section (``STOP_TEXTS``: a fine-tuned model has seen those
headers only in prompts, but a weak one may write them).
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Sequence

from torch import nn

from ..chat_template import ChatTemplate, RenderLimits, end_of_turn
from ..generation import GenerationConfig
from ..text_stream import TextCodec, stream_text
from ..tools import Calculator
from .data import ALPACA_CHAT_TEMPLATE, ALPACA_CHAT_TEMPLATE_V1

EXIT_COMMAND = "/exit"
STOP_TEXTS = ("\n### Instruction:", "\n### Input:", "\n### Response:")
NO_TEMPLATE = ("has no chat template (no 'chat_template' in its tokenizer_config.json): it was not fine-tuned for "
               "chat (tinygpt sft writes the template)")


def require_chat_template(tokenizer: TextCodec, what: str, instead: str) -> ChatTemplate:
    """``tokenizer``'s chat template, or a ``ValueError``: "{what} has no chat template ...; {instead}"."""
    template = getattr(tokenizer, "chat_template", None)
    if template is None:
        raise ValueError(f"{what} {NO_TEMPLATE}; {instead}")
    return template


def template_stop_texts(template: ChatTemplate, limits: RenderLimits | None = None) -> tuple[str, ...]:
    """Where an answer in ``template``'s format ends, besides the end-of-text token: the template's end-of-turn
    text (rendered within ``limits``), and for the Alpaca template the starts of its sections."""
    end = end_of_turn(template, limits)
    return (*(STOP_TEXTS if template.source in (ALPACA_CHAT_TEMPLATE, ALPACA_CHAT_TEMPLATE_V1) else ()), *((end,) if end else ()))


def chat(model: nn.Module, tokenizer: TextCodec, lines: Iterable[str], write: Callable[[str], None],
         config: GenerationConfig | None = None, *, prompt_marker: str = "",
         report_error: Callable[[str], None] | None = None, stop_texts: Sequence[str] = (),
         tool: bool = False, **overrides: Any) -> int:
    """Answer every non-empty line of ``lines`` until it ends or a line is ``/exit``; returns the answers given.

    ``write`` receives the answer piece by piece as it streams (then a newline); ``prompt_marker`` is written
    before each line is read (e.g. "> " at a terminal). A line the tokenizer cannot encode is reported through
    ``report_error`` (default: written as a line) and skipped. Generation settings come from ``config`` and
    ``overrides`` (``GenerationConfig`` fields), checked before the first line is read. An answer also ends before
    any of ``stop_texts`` (besides the template's own, ``template_stop_texts``). A tokenizer without a chat template
    is a ``ValueError``. ``tool``: each answer may call the calculator (``tools.Calculator``: the model writes
    ``<<4*12=``, the tool writes ``48>>``), as in ``tinygpt grpo``.
    """
    template = require_chat_template(tokenizer, "the model", "use tinygpt generate for plain text")
    stops = (*template_stop_texts(template), *stop_texts)
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
                prompt = template.render([{"role": "user", "content": text.strip()}])
                pieces = stream_text(model, tokenizer, prompt, config, stop_texts=stops,
                                     constraint=Calculator(tokenizer) if tool else None)
                for piece in pieces:
                    write(piece)
                write("\n")
                answered += 1
            except ValueError as err:
                report_error(str(err))
        write(prompt_marker)
    return answered
