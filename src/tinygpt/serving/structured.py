"""Structured output for the API: ``response_format``, ``grammar``, ``regex`` and ``tools`` / ``tool_choice`` read from
a request body into one ``ConstraintSpec``, compiled for the served tokenizer (``inference.grammar``);
``tool_calls.py`` turns a tool call's text back into OpenAI's ``tool_calls``.

- ``response_format``: ``{"type": "text"}`` (none), ``{"type": "json_object"}`` (any JSON object),
  ``{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}`` (OpenAI's form);
- ``grammar``: a Lark grammar, or a GBNF one as llama.cpp's server takes it (``root ::= ...``);
- ``regex``: the whole output matches it;
- vLLM's names for the same constraints: ``structured_outputs`` ``{"json" | "regex" | "choice" | "grammar" |
  "json_object": true}`` (vLLM >= 0.10) and the older ``guided_json``, ``guided_regex``, ``guided_choice``,
  ``guided_grammar`` (``choice``: the answer is one of a list of strings);
- ``tools`` with ``tool_choice``: ``"none"`` (the tools reach the chat template, the answer is text), a named
  function ``{"type": "function", "function": {"name": ...}}`` (the answer is that function's arguments, following
  its ``parameters`` schema), ``"required"`` (a JSON list of calls ``[{"name", "arguments"}]``, each following its
  function's schema; at most ``MAX_PARALLEL_CALLS``, one with ``parallel_tool_calls: false``). ``"auto"`` (the
  default with tools) lets the model choose, which needs a chat template that defines how a call is written: the
  one convention read here is Hermes' (Qwen 2.5, NousResearch), ``<tool_call>{"name", "arguments"}</tool_call>``
  in the answer; with any other template "auto" is refused (400) with what to send instead.

At most one of them constrains a request. Every error is a 400 naming the field and the reason.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from ..inference.grammar import Grammar, GrammarError, compile_grammar
from .protocol import ChatRequest, CompletionRequest, bad

CONSTRAINT_FIELDS = ("response_format", "grammar", "regex", "structured_outputs", "guided_json", "guided_regex",
                     "guided_choice", "guided_grammar")
VLLM_KINDS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar"}  # vLLM's keys
TOOL_FIELDS = ("tools", "tool_choice", "parallel_tool_calls")
MAX_TOOLS = 128
MAX_PARALLEL_CALLS = 4  # calls in one answer with parallel_tool_calls (a small model may otherwise list calls forever)
CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"  # Hermes' convention (tool_choice "auto")


@dataclass
class ConstraintSpec:
    """What one request's output must follow: a ``compile_grammar`` kind, its source, the field it came from."""

    kind: str
    source: Any
    param: str


@dataclass
class ToolSpec:
    """A chat request's tools (OpenAI's ``{"type": "function", "function": {...}}`` objects) and its choice:
    "none", "required" or a function's name; ``parallel``: several calls may come back."""

    tools: list[dict[str, Any]]
    choice: str
    named: bool = False
    parallel: bool = True
    functions: dict[str, dict[str, Any]] = field(default_factory=dict)  # name -> parameters schema

    @property
    def calls(self) -> bool:
        """The answer is tool calls (required or named), under their schema."""
        return self.choice not in ("none", "auto")

    @property
    def auto(self) -> bool:
        """The model chooses: its text is read for calls written the template's way."""
        return self.choice == "auto"


def read_completion(req: CompletionRequest, body: dict[str, Any]) -> CompletionRequest:
    """``req`` (``protocol.parse_completion``'s) with its constraint read from ``body``."""
    req.constraint = parse_constraint(body)
    return req


def template_writes_calls(template: Any) -> bool:
    """Whether a chat template defines how a tool call is written, in the one convention read here (Hermes')."""
    return template is not None and CALL_OPEN in getattr(template, "source", "")


def read_chat(req: ChatRequest, body: dict[str, Any], writes_calls: bool = False) -> ChatRequest:
    """``req`` (``protocol.parse_chat``'s) with its messages' tool fields, its tools, and its constraint (the
    request's own, or the tool call's schema) read from ``body``; ``writes_calls``: the model's chat template
    defines how a call is written (``template_writes_calls``), so ``tool_choice: "auto"`` may be honoured."""
    req.extras = [parse_message_extras(i, m) for i, m in enumerate(body["messages"])]
    req.tools = parse_tools(body, writes_calls)
    req.constraint = parse_constraint(body)
    if req.tools is not None and req.tools.calls:
        if req.constraint is not None:
            raise bad(_field(req.constraint), f"conflicts with tool_choice="
                                                          f"{json.dumps(body.get('tool_choice'))} (the tool call's "
                                                          f"schema constrains the answer)")
        req.constraint = tool_constraint(req.tools)
    return req


def parse_constraint(body: dict[str, Any]) -> ConstraintSpec | None:
    """The request's ``response_format`` / ``grammar`` / ``regex``, checked for shape (compiling comes later)."""
    found: list[ConstraintSpec] = []
    fmt = body.get("response_format")
    if fmt is not None:
        if not isinstance(fmt, dict) or not isinstance(fmt.get("type"), str):
            raise bad("response_format", 'must be an object with a "type": "text", "json_object" or "json_schema"')
        kind = fmt["type"]
        extra = sorted(set(fmt) - {"type", "json_schema"})
        if extra:
            raise bad(f"response_format.{extra[0]}", "unknown field; allowed: type, json_schema")
        if kind == "json_object":
            found.append(ConstraintSpec("json_object", None, "response_format"))
        elif kind == "json_schema":
            spec = fmt.get("json_schema")
            if not isinstance(spec, dict):
                raise bad("response_format.json_schema", 'must be an object {"name", "schema", "strict"}')
            unknown = sorted(set(spec) - {"name", "schema", "strict", "description"})
            if unknown:
                raise bad(f"response_format.json_schema.{unknown[0]}",
                          "unknown field; allowed: name, description, schema, strict")
            schema = spec.get("schema", {"type": "object"})
            if not isinstance(schema, dict):
                raise bad("response_format.json_schema.schema", "must be a JSON schema (an object)")
            found.append(ConstraintSpec("json_schema", schema, "response_format.json_schema.schema"))
        elif kind != "text":
            raise bad("response_format.type", f'must be "text", "json_object" or "json_schema", got {json.dumps(kind)}')
    for name in ("grammar", "regex"):
        value = body.get(name)
        if value is not None:
            if not isinstance(value, str) or not value:
                raise bad(name, "must be a non-empty string")
            found.append(ConstraintSpec(name, value, name))
    found += _vllm_constraints(body)
    if len(found) > 1:
        first, second = (_field(spec) for spec in found[:2])
        raise bad(second, f"conflicts with {first}: give one of {', '.join(CONSTRAINT_FIELDS)}, not several")
    return found[0] if found else None


def _field(spec: ConstraintSpec) -> str:
    """The request field a constraint came from (``structured_outputs``' own key kept)."""
    return spec.param if spec.param.startswith("structured_outputs") else spec.param.split(".")[0]


def _vllm_constraints(body: dict[str, Any]) -> list[ConstraintSpec]:
    """vLLM's ``structured_outputs`` object and its older ``guided_*`` fields, as ``ConstraintSpec``s."""
    found = [_vllm_spec(key, body[f"guided_{key}"], f"guided_{key}") for key in VLLM_KINDS
             if body.get(f"guided_{key}") is not None]
    outputs = body.get("structured_outputs")
    if outputs is None:
        return found
    allowed = ", ".join([*VLLM_KINDS, "json_object"])
    if not isinstance(outputs, dict):
        raise bad("structured_outputs", f"must be an object with one of {allowed}")
    unknown = sorted(set(outputs) - set(VLLM_KINDS) - {"json_object"})
    if unknown:
        raise bad(f"structured_outputs.{unknown[0]}", f"unknown field; allowed: {allowed}")
    for key in VLLM_KINDS:
        if outputs.get(key) is not None:
            found.append(_vllm_spec(key, outputs[key], f"structured_outputs.{key}"))
    if outputs.get("json_object") is not None:
        if outputs["json_object"] is not True:
            raise bad("structured_outputs.json_object", "must be true (any JSON object) or absent")
        found.append(ConstraintSpec("json_object", None, "structured_outputs.json_object"))
    return found


def _vllm_spec(key: str, value: Any, param: str) -> ConstraintSpec:
    """One vLLM constraint: ``json`` a schema (an object, or its JSON text), ``choice`` a list of strings,
    ``regex`` / ``grammar`` a string."""
    if key == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError:
                raise bad(param, "must be a JSON schema (an object, or its JSON text); the text does not "
                                 "parse") from None
        if not isinstance(value, dict):
            raise bad(param, "must be a JSON schema (an object, or its JSON text)")
    elif key == "choice":
        if not (isinstance(value, list) and value and all(isinstance(v, str) and v for v in value)):
            raise bad(param, "must be a non-empty list of non-empty strings")
    elif not isinstance(value, str) or not value:
        raise bad(param, "must be a non-empty string")
    return ConstraintSpec(VLLM_KINDS[key], value, param)


def parse_tools(body: dict[str, Any], writes_calls: bool = False) -> ToolSpec | None:
    """``tools`` / ``tool_choice`` / ``parallel_tool_calls`` of a chat request (None without tools)."""
    tools, choice = body.get("tools"), body.get("tool_choice")
    parallel = body.get("parallel_tool_calls", True)
    if parallel is None:
        parallel = True
    if not isinstance(parallel, bool):
        raise bad("parallel_tool_calls", "must be true or false")
    if tools is None:
        if choice not in (None, "none"):
            raise bad("tool_choice", "needs tools")
        return None
    if not isinstance(tools, list) or not tools:
        raise bad("tools", 'must be a non-empty list of {"type": "function", "function": {...}} objects')
    if len(tools) > MAX_TOOLS:
        raise bad("tools", f"at most {MAX_TOOLS} tools are allowed, got {len(tools)}")
    functions: dict[str, dict[str, Any]] = {}
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
            raise bad(where, 'must be {"type": "function", "function": {"name", "description", "parameters"}}')
        fn = tool["function"]
        unknown = sorted(set(fn) - {"name", "description", "parameters", "strict"})
        if unknown:
            raise bad(f"{where}.function.{unknown[0]}", "unknown field; allowed: name, description, parameters, strict")
        name = fn.get("name")
        if not isinstance(name, str) or not name or len(name) > 64:
            raise bad(f"{where}.function.name", "must be a non-empty string of at most 64 characters")
        if name in functions:
            raise bad(f"{where}.function.name", f"{name!r} is defined twice")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise bad(f"{where}.function.parameters", "must be a JSON schema (an object)")
        functions[name] = params
    named = False
    if choice is None:
        choice = "auto"
    if isinstance(choice, dict):
        fn = choice.get("function")
        if choice.get("type") != "function" or not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise bad("tool_choice", 'must be "none", "auto", "required" or {"type": "function", "function": '
                                     '{"name": ...}}')
        if fn["name"] not in functions:
            raise bad("tool_choice.function.name", f"{fn['name']!r} is not among the tools; the tools are "
                                                   f"{', '.join(repr(n) for n in functions)}")
        choice, named = fn["name"], True
    elif choice == "auto" and not writes_calls:  # which text is a call is the chat template's convention
        raise bad("tool_choice", '"auto" needs a chat template that defines how a tool call is written, and this '
                                 'server reads none; send "required", a named function or "none" (the default with '
                                 'tools is "auto", as in OpenAI\'s API)')
    elif choice not in ("none", "required", "auto"):
        raise bad("tool_choice", f'must be "none", "auto", "required" or a named function, got {json.dumps(choice)}')
    return ToolSpec(tools, choice, named, parallel, functions)


def tool_constraint(tools: ToolSpec) -> ConstraintSpec | None:
    """The schema a tool call's text follows: a named function's parameters, or (``required``) a list of calls."""
    if not tools.calls:
        return None
    if tools.named:
        return ConstraintSpec("json_schema", tools.functions[tools.choice],
                              f"tools[{list(tools.functions).index(tools.choice)}].function.parameters")
    calls = [{"type": "object", "properties": {"name": {"const": name}, "arguments": params},
              "required": ["name", "arguments"], "additionalProperties": False}
             for name, params in tools.functions.items()]
    items = calls[0] if len(calls) == 1 else {"anyOf": calls}
    schema = {"type": "array", "items": items, "minItems": 1, "maxItems": MAX_PARALLEL_CALLS if tools.parallel else 1}
    return ConstraintSpec("json_schema", schema, "tools")


def compile_spec(spec: ConstraintSpec, tokenizer: Any, vocab_size: int) -> Grammar:
    """``compile_grammar`` for a request; a constraint that cannot be compiled is a 400 naming its field."""
    try:
        return compile_grammar(spec.kind, spec.source, tokenizer, vocab_size)
    except GrammarError as err:
        raise bad(spec.param, f"cannot be used: {err}") from None


def parse_message_extras(i: int, message: dict[str, Any]) -> dict[str, Any]:
    """A chat message's tool fields, checked: an assistant's ``tool_calls``, a tool message's ``tool_call_id``."""
    role = message.get("role")
    extras: dict[str, Any] = {}
    if role == "tool":
        call_id = message.get("tool_call_id")
        if not isinstance(call_id, str) or not call_id:
            raise bad(f"messages[{i}].tool_call_id", "is required for a tool message (the id of the call it answers)")
        extras["tool_call_id"] = call_id
    elif "tool_call_id" in message:
        raise bad(f"messages[{i}].tool_call_id", "is only allowed in a tool message")
    calls = message.get("tool_calls")
    if calls is not None:
        if role != "assistant":
            raise bad(f"messages[{i}].tool_calls", "is only allowed in an assistant message")
        if not isinstance(calls, list):
            raise bad(f"messages[{i}].tool_calls", "must be a list of tool calls")
        checked = []
        for j, call in enumerate(calls):
            fn = call.get("function") if isinstance(call, dict) else None
            if not (isinstance(fn, dict) and isinstance(fn.get("name"), str)
                    and isinstance(fn.get("arguments", ""), str)):
                raise bad(f"messages[{i}].tool_calls[{j}]", 'must be {"id", "type": "function", "function": '
                                                            '{"name", "arguments"}}')
            try:
                arguments = json.loads(fn.get("arguments") or "{}")
            except ValueError:
                raise bad(f"messages[{i}].tool_calls[{j}].function.arguments", "must be a JSON text") from None
            # templates read arguments as a mapping (transformers' convention); the id travels as sent
            checked.append({"id": call.get("id"), "type": "function",
                            "function": {"name": fn["name"], "arguments": arguments}})
        extras["tool_calls"] = checked
    return extras
