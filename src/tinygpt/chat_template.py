"""Chat templates: the Jinja text in ``tokenizer_config.json`` that turns a conversation into the prompt a model saw.

This is Hugging Face's convention (``tokenizer.chat_template``; ``apply_chat_template``): the template belongs to the
tokenizer, travels with it (a tinygpt checkpoint writes it into ``tokenizer_config.json`` beside its tokenizer,
``write_hf_tokenizer`` into the exported folder's), and is rendered with the conversation as ``messages`` (a list of
``{"role", "content"}``), ``add_generation_prompt`` and the tokenizer's special tokens (``bos_token``,
``eos_token``, ...) as variables. ``render_chat_template`` renders as transformers does -- jinja2's
``ImmutableSandboxedEnvironment`` with ``trim_blocks`` and ``lstrip_blocks``, the ``loopcontrols`` extension, its
``tojson`` filter and its ``raise_exception`` / ``strftime_now`` globals -- so both give the same string for the same
template and messages (tests/test_chat_template.py compares them). Templates from the Hub are untrusted code: the
sandbox is why. The sandbox stops code, not time or size: ``render_chat_template`` also stops a template that runs
past ``RenderLimits.seconds`` (a tracer on the template's own frames checks the clock and a cancel flag at every
line it runs), writes more than ``RenderLimits.max_chars`` characters (checked as the output streams out), or
builds one value that large (``*``, ``**`` and ``%`` are checked before they run). Every failure is a one-line
``ValueError`` naming the template.

The template tinygpt's SFT writes is the Alpaca prompt (``alignment.data.ALPACA_CHAT_TEMPLATE``).
"""

from __future__ import annotations

import json
import sys
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from .fileio import read_json_object

TOKENIZER_CONFIG = "tokenizer_config.json"
TEMPLATE_FILE = "chat_template.jinja"  # where current transformers saves the template instead (read; not written)
SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")
_SENTINEL = "\x00tinygpt-answer\x00"
_TEMPLATE_FILENAME = "<template>"  # the filename jinja2 gives the code it compiles from a string


@dataclass(frozen=True)
class RenderLimits:
    """What one rendering may spend: ``seconds`` of wall time, ``max_chars`` characters of output (and of any one
    value it builds); ``cancelled`` (set from another thread, e.g. when the client left) stops it too."""

    seconds: float = 2.0
    max_chars: int = 1 << 20
    cancelled: threading.Event | None = None
    max_chars_note: str = ""  # why max_chars is what it is (said when a rendering goes past it)


class _Stopped(Exception):
    """Raised inside a rendering that went past its limits (by the tracer, the output count or a checked op)."""


@dataclass(frozen=True)
class ChatTemplate:
    """A Jinja chat template and the special tokens it sees (``bos_token``, ``eos_token``, ...: their text)."""

    source: str
    special_tokens: Mapping[str, str] = field(default_factory=dict)

    def render(self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True,
               tools: Sequence[Mapping[str, Any]] | None = None, limits: RenderLimits | None = None) -> str:
        return render_chat_template(self, messages, add_generation_prompt=add_generation_prompt, tools=tools,
                                    limits=limits)


@lru_cache(maxsize=16)
def _compile(source: str) -> Any:
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(jinja2.ext.Extension):
        """transformers' ``{% generation %}`` block (it marks the assistant's tokens for training masks): rendered
        as its body, so a template that uses it renders here too."""

        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller: Any) -> str:
            return caller()

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        # transformers' override: jinja's own tojson escapes HTML characters, which a prompt must not
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    class Bounded(ImmutableSandboxedEnvironment):
        """The sandbox, with the operators that build one large value in a single C call checked first."""

        intercepted_binops = frozenset(("*", "**", "%"))

        def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
            _check_binop(operator, left, right, _limit.max_chars)
            return super().call_binop(context, operator, left, right)

        def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
            # str.center(10**9), str.ljust, ...: a count argument that large builds that large a string
            if isinstance(getattr(__obj, "__self__", None), str) and any(
                    isinstance(a, int) and a > _limit.max_chars for a in (*args, *kwargs.values())):
                raise _Stopped(f"a call asks for a string of more than {_limit.max_chars} characters")
            return super().call(__context, __obj, *args, **kwargs)

    env = Bounded(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda format: datetime.now().strftime(format)
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as err:
        raise ValueError(f"the chat template is not valid Jinja (line {err.lineno}: {err.message})") from None


class _Limit(threading.local):
    """The limits of the rendering running on this thread (read by the environment's checked operators)."""

    max_chars = RenderLimits.max_chars


_limit = _Limit()


def _check_binop(operator: str, left: Any, right: Any, max_chars: int) -> None:
    """Refuse ``left op right`` when its result would be larger than ``max_chars`` (before it is built)."""
    def size(x: Any) -> int | None:
        return len(x) if isinstance(x, (str, list, tuple)) else None

    if operator == "*":
        for seq, count in ((left, right), (right, left)):
            n = size(seq)
            if n is not None and isinstance(count, int) and n * count > max_chars:
                raise _Stopped(f"a value of {n} x {count} items is larger than {max_chars}")
    elif operator == "**" and isinstance(left, int) and isinstance(right, int) and abs(left) > 1:
        if right * max(1, abs(left).bit_length()) > 8 * max_chars:
            raise _Stopped(f"{left} ** {right} is larger than {max_chars} characters")
    elif operator == "%" and isinstance(left, str) and any(len(part) > 7 for part in
                                                           "".join(c if c.isdigit() else " " for c in left).split()):
        raise _Stopped("a %-format asks for a field wider than 9,999,999 characters")


def _tracer(deadline: float, cancelled: threading.Event | None) -> Callable[..., Any]:
    """A ``sys.settrace`` function that traces only the template's own code (jinja2 compiles it with the filename
    ``<template>``) and stops it, at its next line, once the clock passes ``deadline`` or ``cancelled`` is set: a
    loop in a template runs a line of that code at every turn, so no loop outlives the limit."""
    def line(frame: Any, event: str, arg: Any) -> Any:
        if time.monotonic() > deadline:
            raise _Stopped("it ran longer than its time limit")
        if cancelled is not None and cancelled.is_set():
            raise _Stopped("the request was cancelled")
        return line

    def call(frame: Any, event: str, arg: Any) -> Any:
        return line if frame.f_code.co_filename == _TEMPLATE_FILENAME else None

    return call


def render_chat_template(template: ChatTemplate, messages: Sequence[Mapping[str, Any]], *,
                         add_generation_prompt: bool = True, tools: Sequence[Mapping[str, Any]] | None = None,
                         limits: RenderLimits | None = None) -> str:
    """The prompt text for ``messages`` (``{"role", "content"}`` dicts, with ``tool_calls`` / ``tool_call_id`` where
    a conversation has them); ``add_generation_prompt`` appends what starts the assistant's answer; ``tools`` (OpenAI's
    function objects) as ``apply_chat_template`` passes them. A template that refuses the conversation
    (``raise_exception``), fails in any other way (a type error, a recursion, ...) or goes past ``limits`` (default
    ``RenderLimits()``) is a ``ValueError`` with its message."""
    import jinja2

    limits = limits or RenderLimits()
    compiled = _compile(template.source)
    plain = [{str(k): v for k, v in m.items()} for m in messages]
    previous_trace, previous_limit = sys.gettrace(), _limit.max_chars
    _limit.max_chars = limits.max_chars
    sys.settrace(_tracer(time.monotonic() + limits.seconds, limits.cancelled))
    try:
        pieces, size = [], 0
        for piece in compiled.generate(messages=plain, tools=None if tools is None else list(tools),
                                       documents=None,
                                       add_generation_prompt=add_generation_prompt, **template.special_tokens):
            size += len(piece)
            if size > limits.max_chars:
                raise _Stopped(f"it wrote more than {limits.max_chars} characters")
            pieces.append(piece)
        return "".join(pieces)
    except _Stopped as err:
        what = (f"{limits.seconds:g} s" if "time limit" in str(err) else
                f"{limits.max_chars} characters{limits.max_chars_note}")
        raise ValueError(f"the chat template was stopped: {err} (at most {what} per rendering)") from None
    except jinja2.TemplateError as err:
        raise ValueError(f"the chat template refused the conversation: {err}") from None
    except (RecursionError, MemoryError) as err:
        raise ValueError(f"the chat template failed: {type(err).__name__} (it recursed or grew too far)") from None
    except Exception as err:  # the template is code from the checkpoint: any failure of it is the template's
        raise ValueError(f"the chat template failed: {type(err).__name__}: {err}") from None
    finally:
        sys.settrace(previous_trace)
        _limit.max_chars = previous_limit


def end_of_turn(template: ChatTemplate, limits: RenderLimits | None = None) -> str:
    """The text the template writes after an assistant's answer, up to the next line break (ChatML's
    ``<|im_end|>``, Llama 3's ``<|eot_id|>``); "" when it writes none. Generation stops there: the model ends its
    turn with it, and the end-of-text token may never come."""
    try:
        text = template.render([{"role": "user", "content": "?"}, {"role": "assistant", "content": _SENTINEL}],
                               add_generation_prompt=False, limits=limits)
    except ValueError:
        return ""
    after = text.split(_SENTINEL, 1)[1] if _SENTINEL in text else ""
    return after.strip().split("\n", 1)[0].strip() if after.strip() else ""


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or an AddedToken dict with its ``content``."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def read_chat_template(directory: str | Path) -> ChatTemplate | None:
    """The chat template of a tokenizer folder: ``chat_template.jinja`` if present (current transformers), else
    ``tokenizer_config.json``'s ``chat_template`` (a string, or a list of named templates: the "default" one).
    None when there is none. A file that is there but unreadable is a ``ValueError`` naming it."""
    directory = Path(directory)
    config_path = directory / TOKENIZER_CONFIG
    config: dict[str, Any] = {}
    if config_path.is_file():
        config = read_json_object(config_path)
    source = config.get("chat_template")
    if isinstance(source, list):
        named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
        source = named.get("default")
    if (directory / TEMPLATE_FILE).is_file():
        source = (directory / TEMPLATE_FILE).read_text(encoding="utf-8")
    if source is None:
        return None
    if not isinstance(source, str):
        raise ValueError(f"{config_path}: 'chat_template' must be a string (a Jinja template)")
    tokens = {k: t for k in SPECIAL_TOKEN_KEYS if (t := _token_text(config.get(k))) is not None}
    return ChatTemplate(source, tokens)


def chat_template_config(template: ChatTemplate) -> dict[str, Any]:
    """The ``tokenizer_config.json`` keys that carry ``template`` (read back by ``read_chat_template``)."""
    return {**template.special_tokens, "chat_template": template.source}
