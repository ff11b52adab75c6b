"""The OpenAI request bodies, checked field by field into plain dataclasses; anything wrong is an ``APIError``.

Every error names the field and what is allowed, and becomes OpenAI's error object
``{"error": {"message", "type", "param", "code"}}`` with the right status (400 for a bad request, 401, 404 for an
unknown model, 429 when the queue is full). Fields of the OpenAI API that tinygpt cannot honour are refused when
set to anything but their neutral value (``presence_penalty=0``, ...), never silently ignored; unknown fields
are refused too. ``top_k`` and ``repetition_penalty`` are extensions (as in vLLM and llama.cpp's server).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any

from ..checks import OptionError
from ..generation import SEED_RANGE, check_sampling

MAX_STOP = 4  # OpenAI's limit on stop sequences
MAX_STOP_CHARS = 128  # per stop sequence: each is searched for in every row's text at every step
MAX_LOGPROBS = 20  # top alternatives per token
MAX_N = 16  # choices per prompt
MAX_JSON_DEPTH = 32  # the deepest body the API has is 5 levels (messages[i].content[j].text)
MAX_CACHE_SALT_CHARS = 256  # a tenant's key, a hash of it
MAX_INT_DIGITS = 20  # a 64-bit integer has at most 20 digits (a seed, a token id)


class APIError(Exception):
    """An error answered as OpenAI's JSON error object with ``status``."""

    def __init__(self, status: int, message: str, *, param: str | None = None, type: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type = type or ("invalid_request_error" if status < 500 else "server_error")
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad(param: str, message: str) -> APIError:
    return APIError(400, f"{param}: {message}", param=param)


class _BadNumber(ValueError):
    pass


class _LongInteger:
    """An integer literal too long to convert (Python's int() of a huge literal is quadratic); ``_check_tree``
    reports it with the field it sits in."""

    def __init__(self, digits: int) -> None:
        self.digits = digits


def _parse_int(text: str) -> int | _LongInteger:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        return _LongInteger(len(text.lstrip("-")))
    return int(text)


def _parse_constant(text: str) -> float:
    raise _BadNumber(f"{text} is not a JSON number")


def _check_tree(body: Any) -> None:
    """Every value at most ``MAX_JSON_DEPTH`` levels deep, every string (keys too) encodable as UTF-8 (JSON's
    ``\ud800`` escapes can spell a lone surrogate, which no tokenizer or answer can carry)."""
    stack: list[tuple[Any, str, int]] = [(body, "", 1)]
    while stack:
        value, path, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise APIError(400, f"the request body is nested more than {MAX_JSON_DEPTH} levels deep")
        if isinstance(value, _LongInteger):
            where = f"{path}: " if path else "the request body: "
            raise APIError(400, f"{where}an integer of {value.digits} digits (at most {MAX_INT_DIGITS} are allowed)",
                           param=path or None)
        if isinstance(value, str):
            _check_text(value, path or "the request body")
        elif isinstance(value, dict):
            for key, item in value.items():
                _check_text(key, f"the field name {path + '.' if path else ''}{ascii(key)}")
                stack.append((item, f"{path}.{key}" if path else key, depth + 1))
        elif isinstance(value, list):
            stack.extend((item, f"{path}[{i}]", depth + 1) for i, item in enumerate(value))


def _check_text(text: str, where: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as err:
        bad_char = ascii(text[err.start])
        raise APIError(400, f"{where}: contains the lone surrogate {bad_char}, which is not a character; send "
                            f"UTF-8 text (a pair of surrogate escapes must form one character)",
                       param=where if " " not in where else None) from None


def parse_json(raw: bytes) -> dict[str, Any]:
    """The request body as a JSON object: valid JSON, at most ``MAX_JSON_DEPTH`` deep, integers of at most
    ``MAX_INT_DIGITS`` digits, no NaN/Infinity, no lone surrogates. Anything else is a 400."""
    try:
        body = json.loads(raw, parse_int=_parse_int, parse_constant=_parse_constant)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise APIError(400, f"the request body is not valid JSON ({err})") from None
    except _BadNumber as err:
        raise APIError(400, f"the request body has {err}") from None
    except RecursionError:
        raise APIError(400, f"the request body is nested more than {MAX_JSON_DEPTH} levels deep") from None
    if not isinstance(body, dict):
        raise APIError(400, f"the request body must be a JSON object, got {type(body).__name__}")
    _check_tree(body)
    return body


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: object) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


class _Fields:
    """Typed access to a request body; remembers what was read so that unknown fields can be refused."""

    def __init__(self, body: dict[str, Any], allowed: set[str]) -> None:
        unknown = sorted(set(body) - allowed)
        if unknown:
            raise bad(unknown[0], f"unknown field; allowed fields: {', '.join(sorted(allowed))}")
        self.body = body

    def get(self, name: str, default: Any = None) -> Any:
        value = self.body.get(name)
        return default if value is None else value

    def int(self, name: str, default: int | None, lo: int | None = None, hi: int | None = None) -> int | None:
        value = self.get(name, default)
        if value is None:
            return None
        if not _is_int(value):
            raise bad(name, f"must be an integer, got {json.dumps(value)}")
        if (lo is not None and value < lo) or (hi is not None and value > hi):
            bounds = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
            raise bad(name, f"must be {bounds}, got {value}")
        return value

    def number(self, name: str, default: float | None) -> float | None:
        value = self.get(name, default)
        if value is None:
            return None
        if not _is_number(value):
            raise bad(name, f"must be a number, got {json.dumps(value)}")
        return float(value)

    def bool(self, name: str, default: bool) -> bool:
        value = self.get(name, default)
        if not isinstance(value, bool):
            raise bad(name, f"must be true or false, got {json.dumps(value)}")
        return value

    def str(self, name: str, default: str | None = None) -> str | None:
        value = self.get(name, default)
        if value is not None and not isinstance(value, str):
            raise bad(name, f"must be a string, got {json.dumps(value)}")
        return value

    def neutral(self, name: str, neutral: Any) -> None:
        """An OpenAI field tinygpt does not implement: only its neutral value (or null) is accepted."""
        value = self.body.get(name)
        if value is not None and value != neutral:
            raise bad(name, f"is not supported by this server; only {json.dumps(neutral)} (or null) is accepted")


@dataclass
class Sampling:
    """The settings shared by both endpoints (already range-checked)."""

    model: str | None
    max_tokens: int | None  # None: the endpoint's default
    temperature: float
    top_p: float
    top_k: int | None
    repetition_penalty: float
    seed: int | None
    n: int
    stream: bool
    include_usage: bool
    stop: list[str] = field(default_factory=list)
    cache_salt: str | None = None  # vLLM's: only rows with the same salt share cached prefix blocks


@dataclass
class CompletionRequest:
    sampling: Sampling
    prompts: list[str | list[int]]
    echo: bool
    logprobs: int | None
    constraint: Any = None  # structured.ConstraintSpec: response_format / grammar / regex


@dataclass
class ChatRequest:
    sampling: Sampling
    messages: list[tuple[str, str]]
    logprobs: int | None  # None, or how many top alternatives (top_logprobs; 0 = only the chosen token)
    max_tokens_param: str = "max_tokens"  # the name the client used, for error messages
    constraint: Any = None  # structured.ConstraintSpec: response_format / grammar / regex, or the tools' schema
    tools: Any = None  # structured.ToolSpec
    extras: list[dict[str, Any]] = field(default_factory=list)  # per message: tool_calls / tool_call_id


_COMMON = {"model", "max_tokens", "temperature", "top_p", "top_k", "repetition_penalty", "seed", "n", "stream",
           "stream_options", "stop", "user", "presence_penalty", "frequency_penalty", "logit_bias", "cache_salt",
           "response_format", "grammar", "regex", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
           "guided_grammar"}  # from response_format on: serving.structured


def _sampling(f: _Fields, max_tokens_name: str = "max_tokens") -> Sampling:
    model = f.str("model")
    max_tokens = f.int(max_tokens_name, None, lo=1)
    temperature = f.number("temperature", 1.0)
    top_p = f.number("top_p", 1.0)
    top_k = f.int("top_k", None)
    if top_k is not None and top_k < 1:
        top_k = None if top_k in (0, -1) else top_k  # 0 / -1: "no top-k" in vLLM and llama.cpp
        if top_k is not None:
            raise bad("top_k", f"must be an integer >= 1 (or 0, -1, null for none), got {top_k}")
    repetition_penalty = f.number("repetition_penalty", 1.0)
    seed = f.int("seed", None)
    try:  # the ranges every command shares (``generation.check_sampling``)
        check_sampling(temperature, top_p, repetition_penalty, seed)
    except OptionError as err:
        raise bad(err.field, f"{err.rule}, got {err.value!r}") from None
    n = f.int("n", 1, lo=1, hi=MAX_N)
    if seed is not None and seed + n - 1 > SEED_RANGE[1]:  # choice j samples with seed + j
        raise bad("seed", f"seed + n - 1 = {seed + n - 1} must stay a signed 64-bit integer (choice j uses seed + j)")
    stream = f.bool("stream", False)
    options = f.get("stream_options", {})
    if not isinstance(options, dict) or set(options) - {"include_usage"}:
        raise bad("stream_options", 'must be an object with at most the key "include_usage"')
    include_usage = options.get("include_usage", False)
    if not isinstance(include_usage, bool):
        raise bad("stream_options.include_usage", "must be true or false")
    if options and not stream:
        raise bad("stream_options", "is only allowed with stream=true")
    stop = f.get("stop", [])
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise bad("stop", "must be a string or a list of strings")
    if len(stop) > MAX_STOP:
        raise bad("stop", f"at most {MAX_STOP} stop sequences are allowed, got {len(stop)}")
    if any(s == "" for s in stop):
        raise bad("stop", "a stop sequence must not be empty")
    if any(len(s) > MAX_STOP_CHARS for s in stop):
        longest = max(len(s) for s in stop)
        raise bad("stop", f"a stop sequence may have at most {MAX_STOP_CHARS} characters, got {longest}")
    f.str("user")
    cache_salt = f.str("cache_salt")
    if cache_salt is not None and not 0 < len(cache_salt) <= MAX_CACHE_SALT_CHARS:
        raise bad("cache_salt", f"must be a non-empty string of at most {MAX_CACHE_SALT_CHARS} characters")
    f.neutral("presence_penalty", 0)
    f.neutral("frequency_penalty", 0)
    f.neutral("logit_bias", {})
    return Sampling(model, max_tokens, temperature, top_p, top_k, repetition_penalty, seed, n, stream,
                    include_usage, stop, cache_salt)


def _prompts(value: Any) -> list[str | list[int]]:
    """OpenAI's four prompt forms: a string, a list of strings, a list of token ids, a list of id lists."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value:
        if all(isinstance(p, str) for p in value):
            return list(value)
        if all(_is_int(t) for t in value):
            return [list(value)]
        if all(isinstance(p, list) and p and all(_is_int(t) for t in p) for p in value):
            return [list(p) for p in value]
    raise bad("prompt", "must be a string, a list of strings, a list of token ids or a list of non-empty lists "
                        "of token ids")


def parse_completion(body: dict[str, Any]) -> CompletionRequest:
    """The completion request (its ``constraint`` is read by ``structured.read_completion``)."""
    f = _Fields(body, _COMMON | {"prompt", "echo", "logprobs", "best_of", "suffix"})
    if "prompt" not in body or body["prompt"] is None:
        raise bad("prompt", "is required")
    prompts = _prompts(body["prompt"])
    sampling = _sampling(f)
    best_of = f.int("best_of", None)
    if best_of is not None and best_of != sampling.n:
        raise bad("best_of", f"is not supported (only best_of = n = {sampling.n})")
    f.neutral("suffix", "")
    return CompletionRequest(sampling, prompts, f.bool("echo", False), f.int("logprobs", None, lo=0, hi=MAX_LOGPROBS))


def _content(i: int, value: Any) -> str:
    """A message's content: a string, or a list of {"type": "text", "text": ...} parts (joined)."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        texts = []
        for j, part in enumerate(value):
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise bad(f"messages[{i}].content[{j}]", 'only text parts are supported: {"type": "text", '
                                                         '"text": "..."}')
            texts.append(part["text"])
        return "".join(texts)
    raise bad(f"messages[{i}].content", "must be a string or a list of text parts")


def parse_chat(body: dict[str, Any]) -> ChatRequest:
    """The chat request (its tools, constraint and messages' tool fields are read by ``structured.read_chat``)."""
    from .chat_format import ROLES

    f = _Fields(body, _COMMON | {"messages", "max_completion_tokens", "logprobs", "top_logprobs", "tools",
                                 "tool_choice", "parallel_tool_calls"})
    if "max_tokens" in body and "max_completion_tokens" in body:
        raise bad("max_completion_tokens", "give max_tokens or max_completion_tokens, not both")
    max_tokens_param = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
    sampling = _sampling(f, max_tokens_param)
    raw = body.get("messages")
    if not isinstance(raw, list) or not raw:
        raise bad("messages", "must be a non-empty list of {role, content} objects")
    messages = []
    for i, m in enumerate(raw):
        if not isinstance(m, dict):
            raise bad(f"messages[{i}]", "must be an object with role and content")
        role = m.get("role")
        if role not in (*ROLES, "tool"):
            raise bad(f"messages[{i}].role", f"must be one of {', '.join(ROLES)}, tool, got {json.dumps(role)}")
        extra = sorted(set(m) - {"role", "content", "name", "tool_calls", "tool_call_id"})
        if extra:
            raise bad(f"messages[{i}].{extra[0]}", "is not supported (allowed: role, content, name, tool_calls, "
                                                   "tool_call_id)")
        content = m.get("content")  # an assistant's message that only calls tools has none
        messages.append((role, "" if content is None and m.get("tool_calls") else _content(i, content)))
    want = f.bool("logprobs", False)
    top = f.int("top_logprobs", None, lo=0, hi=MAX_LOGPROBS)
    if top is not None and not want:
        raise bad("top_logprobs", "needs logprobs=true")
    return ChatRequest(sampling, messages, (top or 0) if want else None, max_tokens_param)


def fit_max_tokens(requested: int | None, default: int | None, prompt_tokens: int, context: int,
                   param: str = "max_tokens", prompt_param: str = "prompt", scoring: bool = False) -> int:
    """The number of new tokens for a prompt: at most what fits the context (prompt + max_tokens - 1 <= C, the
    last token is never fed back). A requested count that does not fit is an error; the default is cut to fit.

    ``scoring`` (``echo`` with ``logprobs``): the prompt may hold C + 1 tokens, the window lm-eval's HF class
    scores (the model reads C of them: the last one is only predicted); then one new token fits, read from the
    last C tokens, as a sliding window (nanoGPT's ``generate``) reads them."""
    longest = context + 1 if scoring else context
    if prompt_tokens > longest:
        raise bad(prompt_param, f"has {prompt_tokens} tokens, more than the model's context of {context} tokens"
                  + (" (+ 1 when it is only scored, with echo and logprobs)" if scoring else ""))
    fit = max(context - prompt_tokens + 1, 1)
    if requested is None:
        return fit if default is None else min(default, fit)
    if requested > fit:
        raise bad(param, f"{requested} new tokens after a {prompt_tokens}-token prompt do not fit the context of "
                         f"{context} tokens: at most {fit} fit")
    return requested


def parse_tokenize(body: dict[str, Any]) -> tuple[str | None, str]:
    """(model, text). ``add_special_tokens`` (sent by lm-eval's remote tokenizer) is accepted as a boolean: tinygpt's
    tokenizers add no BOS/EOS of their own, so both values give the same ids."""
    f = _Fields(body, {"model", "prompt", "content", "add_special_tokens"})
    if not isinstance(body.get("add_special_tokens", False), bool):
        raise bad("add_special_tokens", "must be a boolean")
    text = f.str("prompt", f.str("content"))
    if text is None:
        raise bad("prompt", "is required (the text to tokenize)")
    return f.str("model"), text


def parse_detokenize(body: dict[str, Any]) -> tuple[str | None, list[int]]:
    f = _Fields(body, {"model", "tokens"})
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(_is_int(t) for t in tokens):
        raise bad("tokens", "must be a list of token ids")
    return f.str("model"), tokens


@dataclass
class InspectRequest:
    text: str
    layer: int
    top: int
    logit_lens: bool
    model: str | None = None


MAX_INSPECT_TOKENS = 256  # the page draws T x T heat maps


def parse_inspect(body: dict[str, Any]) -> InspectRequest:
    f = _Fields(body, {"model", "text", "layer", "top", "logit_lens"})
    model = f.str("model")
    text = f.str("text")
    if not text:
        raise bad("text", "is required and must not be empty")
    return InspectRequest(text, f.int("layer", 0, lo=0), f.int("top", 5, lo=1, hi=MAX_LOGPROBS),
                          f.bool("logit_lens", False), model)
