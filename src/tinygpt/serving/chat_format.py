"""Chat messages -> the prompt text the SFT stage trained on (``alignment.data.format_prompt``, the Alpaca template).

The template has one instruction and one response, no turns. A conversation is rendered as what the model saw in
training, repeated: every earlier (user, assistant) exchange as a complete example (prompt + response), then the
last user message as the prompt the model answers. System messages replace the template's preamble (the
"Below is an instruction ..." line; the default when there is none). The answer stops where the model starts a
new template section (``alignment.chat.STOP_TEXTS``), as in ``tinygpt chat``.
"""

from __future__ import annotations

from ..alignment.chat import STOP_TEXTS
from ..alignment.data import PREAMBLE, RESPONSE_HEADER

ROLES = ("system", "developer", "user", "assistant")


def render_chat(messages: list[tuple[str, str]]) -> str:
    """(role, content) pairs, ending with a user message -> the prompt text. Roles: ``ROLES`` ("developer" is
    OpenAI's newer name for "system"). Raises ``ValueError`` naming the message that breaks the rules."""
    system = [content for role, content in messages if role in ("system", "developer")]
    turns = [(i, role, content) for i, (role, content) in enumerate(messages) if role in ("user", "assistant")]
    if not turns or turns[-1][1] != "user":
        raise ValueError("messages must end with a user message (the one the model answers)")
    preamble = "\n".join(system) if system else PREAMBLE
    parts, pending = [], None
    for i, role, content in turns:
        if role == "user":
            if pending is not None:
                raise ValueError(f"messages[{i}]: two user messages in a row; an assistant reply must come between")
            pending = content
        else:
            if pending is None:
                raise ValueError(f"messages[{i}]: an assistant message must follow a user message")
            parts.append(f"{preamble}\n\n### Instruction:\n{pending}{RESPONSE_HEADER}{content}")
            pending = None
    parts.append(f"{preamble}\n\n### Instruction:\n{pending}{RESPONSE_HEADER}")
    return "\n\n".join(parts)


CHAT_STOP_TEXTS: tuple[str, ...] = STOP_TEXTS
