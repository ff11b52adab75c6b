"""Chat messages -> the prompt ids of ``/v1/chat/completions``, through the model's own chat template.

The template comes from the checkpoint (``tokenizer.chat_template``, read from ``tokenizer_config.json``; see
``tinygpt.chat_template``): tinygpt's SFT writes the Alpaca one (``alignment.data.ALPACA_CHAT_TEMPLATE``), a Hugging
Face folder brings its own. A model without one has no chat format: the request is refused (400) rather than
guessed at, and the page offers Completion instead. The conversation rules (ends with a user message, user and
assistant alternate) are checked here, so every template gets the same clear errors. The answer stops where the
template ends a turn (``alignment.chat.template_stop_texts``).
"""

from __future__ import annotations

from typing import Any

from ..alignment.chat import STOP_TEXTS, require_chat_template, template_stop_texts
from ..alignment.data import ALPACA_CHAT_TEMPLATE
from ..chat_template import ChatTemplate, RenderLimits
from ..text_stream import TextCodec
from ..tokenizer import ENDOFTEXT, Tokenizer

ROLES = ("system", "developer", "user", "assistant")
CHAT_STOP_TEXTS: tuple[str, ...] = STOP_TEXTS  # the Alpaca template's section headers


def check_conversation(messages: list[tuple[str, str]],
                       extras: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """(role, content) pairs, ending with a user message (or the tool results of the last assistant's calls) -> the
    template's ``messages`` ("developer", OpenAI's newer name for "system", becomes "system"); ``extras``: each
    message's ``tool_calls`` / ``tool_call_id`` (``structured.parse_message_extras``). Raises ``ValueError`` naming
    the message that breaks the rules."""
    extras = extras or [{} for _ in messages]
    for i, (role, _) in enumerate(messages):
        called = any("tool_calls" in extras[j] for j in range(i) if messages[j][0] == "assistant")
        if role == "tool" and (i == 0 or messages[i - 1][0] not in ("assistant", "tool") or not called):
            raise ValueError(f"messages[{i}]: a tool message must follow an assistant message with tool_calls")
    turns = [(i, role) for i, (role, _) in enumerate(messages) if role in ("user", "assistant")]
    ends_with_results = messages[-1][0] == "tool"
    if not turns or (turns[-1][1] != "user" and not ends_with_results):
        raise ValueError("messages must end with a user message (the one the model answers) or tool results")
    previous = "assistant"
    for i, role in turns:
        if role == previous == "user":
            raise ValueError(f"messages[{i}]: two user messages in a row; an assistant reply must come between")
        if role == previous == "assistant":
            raise ValueError(f"messages[{i}]: an assistant message must follow a user message")
        previous = role
    for i, (_, content) in enumerate(messages):
        if ENDOFTEXT in content:
            raise ValueError(f"messages[{i}]: the content contains the special token {ENDOFTEXT!r}; remove it")
    return [{"role": "system" if role == "developer" else role, "content": content, **extra}
            for (role, content), extra in zip(messages, extras)]


def render_chat(messages: list[tuple[str, str]], template: ChatTemplate | None = None,
                extras: list[dict[str, Any]] | None = None, tools: list[dict[str, Any]] | None = None,
                limits: RenderLimits | None = None) -> str:
    """The prompt text for a conversation: ``template`` (default: the Alpaca template SFT writes) with the
    generation prompt (and ``tools``, as ``apply_chat_template`` passes them), within ``limits``
    (``chat_template.RenderLimits``). Errors as ``check_conversation``'s, and the template's own as ``ValueError``."""
    template = template or ChatTemplate(ALPACA_CHAT_TEMPLATE)
    return template.render(check_conversation(messages, extras), add_generation_prompt=True, tools=tools,
                           limits=limits)


def chat_text(tokenizer: TextCodec, messages: list[tuple[str, str]], extras: list[dict[str, Any]] | None = None,
              tools: list[dict[str, Any]] | None = None,
              limits: RenderLimits | None = None) -> tuple[str, tuple[str, ...]]:
    """(prompt text, stop texts) for a conversation with ``tokenizer``'s model, rendered within ``limits``. A
    ``ValueError`` says what is wrong: no chat template, a conversation the rules or the template refuse, a
    template past its limits."""
    template = require_chat_template(tokenizer, "the model", "use /v1/completions (the page's Completion tab)")
    return render_chat(messages, template, extras, tools, limits), template_stop_texts(template, limits)


def encode_chat(tokenizer: TextCodec, text: str) -> list[int]:
    """A rendered chat's ids. The template may write special tokens (eos_token, ...): they become their ids, as
    transformers tokenizes a rendered chat; the messages themselves may not hold one (check_conversation)."""
    ids = tokenizer.encode(text, allowed_special=True) if isinstance(tokenizer, Tokenizer) else tokenizer.encode(text)
    return list(ids)


def prompt_char_limit(tokenizer: TextCodec, context: int, vocab: int, max_body_bytes: int) -> tuple[int, str]:
    """(the longest rendered chat prompt worth tokenizing, why): no token is longer than the tokenizer's longest
    (L bytes), so a text of more than context x L bytes has more tokens than the context holds; and no prompt may be
    longer than a request body (--max-body-bytes). ``vocab``: the ids that have a text."""
    limit, note = max_body_bytes, " (--max-body-bytes)"
    get = getattr(tokenizer, "token_bytes", None)
    if get is not None:
        longest = max(len(get(t)) for t in range(vocab))
        if context * longest < limit:
            limit = context * longest
            note = f" (a longer prompt has more than the context's {context} tokens: no token is longer than " \
                   f"{longest} bytes)"
    return limit, note


def chat_prompt(tokenizer: TextCodec, messages: list[tuple[str, str]], extras: list[dict[str, Any]] | None = None,
                tools: list[dict[str, Any]] | None = None) -> tuple[list[int], tuple[str, ...]]:
    """(prompt ids, stop texts) for a conversation with ``tokenizer``'s model (the default ``RenderLimits``)."""
    text, stops = chat_text(tokenizer, messages, extras, tools)
    return encode_chat(tokenizer, text), stops
