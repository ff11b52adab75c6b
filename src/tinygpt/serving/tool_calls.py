"""A tool call's text turned back into OpenAI's ``tool_calls``, whole or as it streams.

``tool_choice`` "required" or a named function constrains the answer to a JSON list of calls
``[{"name", "arguments"}]`` or to the named function's arguments (``structured.tool_constraint``);
``ToolCallReader`` reads that text as it grows, so a stream sends each call as OpenAI streams one. ``auto_calls``
reads the calls a model wrote itself under "auto" (Hermes' ``<tool_call>{"name", "arguments"}</tool_call>``).
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

from .structured import CALL_CLOSE, CALL_OPEN, ToolSpec

_CALL = re.compile(re.escape(CALL_OPEN) + r"(.*?)" + re.escape(CALL_CLOSE), re.DOTALL)


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


_CALL_HEAD = re.compile(r'[\s\[,}]*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')


class ToolCallReader:
    """Reads a constrained tool-call answer as it grows (``required``: ``[{"name": ..., "arguments": {...}}, ...]``;
    a named function: the arguments alone) and says what is new: OpenAI's streamed ``tool_calls`` deltas, the first
    of each call with its ``id``, ``type``, ``function.name`` and ``arguments: ""``, then its arguments' text as it
    is generated. A call's arguments are the model's own text (the grammar writes compact JSON), streamed or not."""

    def __init__(self, tools: ToolSpec) -> None:
        self.tools, self.text, self.pos = tools, "", 0
        self.calls: list[dict[str, Any]] = []  # OpenAI's tool calls so far (arguments growing)
        self.depth = 0  # the open arguments' JSON nesting (None between calls)
        self.in_string = self.escaped = False
        self.open = False  # inside a call's arguments

    def feed(self, piece: str) -> list[dict[str, Any]]:
        """The deltas (``{"index", ...}`` each) the new text ``piece`` makes."""
        self.text += piece
        deltas: list[dict[str, Any]] = []
        while True:
            if not self.open:
                if self.tools.named:
                    if self.calls:
                        return deltas
                    name = self.tools.choice
                else:
                    head = _CALL_HEAD.match(self.text, self.pos)
                    if head is None:
                        return deltas
                    try:
                        name = json.loads(f'"{head.group(1)}"')
                    except ValueError:
                        return deltas
                    self.pos = head.end()
                self.calls.append({"id": _call_id(), "type": "function",
                                   "function": {"name": name, "arguments": ""}})
                deltas.append({"index": len(self.calls) - 1, **json.loads(json.dumps(self.calls[-1]))})
                self.open, self.depth, self.in_string, self.escaped = True, 0, False, False
            if not self.calls[-1]["function"]["arguments"]:  # the space before the value is not part of it
                while self.pos < len(self.text) and self.text[self.pos].isspace():
                    self.pos += 1
            start, end = self.pos, self._scan()
            if end > start:
                fragment = self.text[start:end]
                self.calls[-1]["function"]["arguments"] += fragment
                deltas.append({"index": len(self.calls) - 1, "function": {"arguments": fragment}})
            if self.open:  # the arguments go on in the next piece
                return deltas

    def _scan(self) -> int:
        """Advance over the open arguments' text; closes them at their value's end. Returns the scanned end."""
        text, i = self.text, self.pos
        while i < len(text):
            c = text[i]
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif c == "\\":
                    self.escaped = True
                elif c == '"':
                    self.in_string = False
            elif c == '"':
                self.in_string = True
            elif c in "{[":
                self.depth += 1
            elif c in "}]":
                if self.depth == 0 and not self.tools.named:  # a scalar's end: the call's own brace
                    self.open = False
                    break
                self.depth -= 1
                if self.depth == 0 and not self.tools.named:
                    i += 1
                    self.open = False
                    break
            elif c == "," and self.depth == 0 and not self.tools.named:
                self.open = False
                break
            i += 1
        self.pos = i
        return i

    def result(self) -> list[dict[str, Any]] | None:
        """The whole answer's calls; None when it does not parse (cut by ``max_tokens``: then the text is returned
        as content, with ``finish_reason: "length"``)."""
        try:
            value = json.loads(self.text)
        except ValueError:
            return None
        if not self.tools.named and not (isinstance(value, list) and value and len(value) == len(self.calls)
                                         and all(isinstance(c, dict) and c.get("name") == call["function"]["name"]
                                                 for c, call in zip(value, self.calls))):
            return None
        return [{**call, "function": dict(call["function"])} for call in self.calls]


def tool_calls(text: str, tools: ToolSpec) -> list[dict[str, Any]] | None:
    """OpenAI's ``tool_calls`` from a constrained answer's whole text (``ToolCallReader``); None when it does not
    parse."""
    reader = ToolCallReader(tools)
    reader.feed(text)
    return reader.result()


def auto_calls(text: str, tools: ToolSpec) -> tuple[str | None, list[dict[str, Any]] | None]:
    """(content, calls) of an answer with ``tool_choice: "auto"``: the calls it wrote as
    ``<tool_call>{"name", "arguments"}</tool_call>`` (each naming one of the tools, with JSON arguments), and the
    text before the first; (text, None) when it wrote none that parse."""
    calls = []
    for found in _CALL.finditer(text):
        try:
            call = json.loads(found.group(1))
        except ValueError:
            return text, None
        if not (isinstance(call, dict) and call.get("name") in tools.functions):
            return text, None
        calls.append({"id": _call_id(), "type": "function",
                      "function": {"name": call["name"], "arguments": json.dumps(call.get("arguments", {}))}})
    if not calls:
        return text, None
    return text[:text.index(CALL_OPEN)].strip() or None, calls
