"""Chat templates: the Jinja text in ``tokenizer_config.json`` that turns a conversation into the prompt a model saw.

This is Hugging Face's convention (``tokenizer.chat_template``; ``apply_chat_template``): the template belongs to the
tokenizer, travels with it (a tinygpt checkpoint writes it into ``tokenizer_config.json`` beside its tokenizer,
``write_hf_tokenizer`` into the exported folder's), and is rendered with the conversation as ``messages`` (a list of
``{"role", "content"}``), ``add_generation_prompt`` and the tokenizer's special tokens (``bos_token``,
``eos_token``, ...) as variables. ``render_chat_template`` renders as transformers does -- jinja2's
``ImmutableSandboxedEnvironment`` with ``trim_blocks`` and ``lstrip_blocks``, the ``loopcontrols`` extension, its
``tojson`` filter and its ``raise_exception`` / ``strftime_now`` globals -- so both give the same string for the same
template and messages (tests/test_chat_template.py compares them). Templates from the Hub are untrusted code: the
sandbox is why.

The template tinygpt's SFT writes is the Alpaca prompt (``alignment.data.ALPACA_CHAT_TEMPLATE``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any, Mapping, Sequence

TOKENIZER_CONFIG = "tokenizer_config.json"
TEMPLATE_FILE = "chat_template.jinja"  # where current transformers saves the template instead (read; not written)
SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token")
_SENTINEL = "\x00tinygpt-answer\x00"


@dataclass(frozen=True)
class ChatTemplate:
    """A Jinja chat template and the special tokens it sees (``bos_token``, ``eos_token``, ...: their text)."""

    source: str
    special_tokens: Mapping[str, str] = field(default_factory=dict)

    def render(self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True,
               tools: Sequence[Mapping[str, Any]] | None = None) -> str:
        return render_chat_template(self, messages, add_generation_prompt=add_generation_prompt, tools=tools)


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

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda format: datetime.now().strftime(format)
    try:
        return env.from_string(source)
    except jinja2.TemplateSyntaxError as err:
        raise ValueError(f"the chat template is not valid Jinja (line {err.lineno}: {err.message})") from None


def render_chat_template(template: ChatTemplate, messages: Sequence[Mapping[str, Any]], *,
                         add_generation_prompt: bool = True, tools: Sequence[Mapping[str, Any]] | None = None) -> str:
    """The prompt text for ``messages`` (``{"role", "content"}`` dicts, with ``tool_calls`` / ``tool_call_id`` where
    a conversation has them); ``add_generation_prompt`` appends what starts the assistant's answer; ``tools`` (OpenAI's
    function objects) as ``apply_chat_template`` passes them. A template that refuses the conversation
    (``raise_exception``) or fails is a ``ValueError`` with its message."""
    import jinja2

    compiled = _compile(template.source)
    plain = [{str(k): v for k, v in m.items()} for m in messages]
    try:
        return compiled.render(messages=plain, tools=None if tools is None else list(tools), documents=None,
                               add_generation_prompt=add_generation_prompt, **template.special_tokens)
    except jinja2.TemplateError as err:
        raise ValueError(f"the chat template refused the conversation: {err}") from None


def end_of_turn(template: ChatTemplate) -> str:
    """The text the template writes after an assistant's answer, up to the next line break (ChatML's
    ``<|im_end|>``, Llama 3's ``<|eot_id|>``); "" when it writes none. Generation stops there: the model ends its
    turn with it, and the end-of-text token may never come."""
    try:
        text = template.render([{"role": "user", "content": "?"}, {"role": "assistant", "content": _SENTINEL}],
                               add_generation_prompt=False)
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
        try:
            data = json.loads(config_path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
            raise ValueError(f"{config_path}: cannot read it ({err})") from None
        config = data if isinstance(data, dict) else {}
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
