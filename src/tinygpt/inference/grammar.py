"""Constrained decoding: a row's next-token mask from a JSON schema, a regex or a grammar, through llguidance.

llguidance (a Rust core, a 3 MB wheel, CPU only) compiles a JSON schema, a regex, or a Lark / GBNF grammar into an
Earley parser over a lexer, and answers for the parser's state which tokens of the vocabulary may come next (a
bitmask). It needs only the bytes of every token, so any tinygpt tokenizer works (GPT-2's BPE, a trained BPE, a
character vocabulary): ``grammar_tokenizer`` builds its ``LLTokenizer`` once per tokenizer.

``compile_grammar`` checks a request's constraint once (a 400 names what is wrong, ``GrammarError``), with
llguidance's resource limits so that a hostile schema costs its own request only; ``Grammar.constraint`` then makes
one ``GrammarConstraint`` per row, the object ``Row.constraint`` holds (the protocol of ``inference.constraint``):

- ``allowed()``: the [V] bool mask of the tokens the row may draw next, on the engine's device;
- ``advance(token)``: the row took ``token``; returns the tokens the grammar forces after it (a JSON key, the
  closing quote of an enum member), which the engine feeds without drawing them;
- ``is_done()``: nothing but the end may follow (the row finishes with reason "stop").

The mask work is host-side and happens between forwards (no device value is read back inside the model's forward);
its cost per token is recorded in ``GrammarConstraint.seconds`` (``benchmarks/serve.py`` reports its median and p99).
"""

from __future__ import annotations

import json
import re
import time
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch

from ..tokenizer import ENDOFTEXT, Tokenizer

GRAMMAR_KINDS = ("json_schema", "json_object", "regex", "grammar", "choice")
# OpenAI-style compact JSON: one space after ":" and ",", none elsewhere. A small model given free whitespace spends
# its tokens on it (llguidance's default allows any run of whitespace between tokens).
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
MAX_GRAMMAR_CHARS = 100_000  # a schema or grammar's text; the body limit bounds it too
# The first mask is the costliest (the lexer builds its states lazily, walking the token table) and llguidance's fuel
# does not bound that walk: a regex like (a{1000}){1000} takes seconds. It is computed at compile time, on the
# request's thread, and a grammar whose first mask takes longer than this is refused before it reaches the engine.
MAX_FIRST_MASK_SECONDS = 2.0

_tokenizers: "weakref.WeakKeyDictionary[Any, Any]" = weakref.WeakKeyDictionary()


class GrammarError(ValueError):
    """A constraint that cannot be compiled: ``reason`` says why (the caller names the field)."""


def _llguidance() -> Any:
    try:
        import llguidance
    except ImportError:  # an extra, not a core dependency
        raise GrammarError("constrained decoding needs the llguidance package: pip install -e '.[serve]'") from None
    return llguidance


def _limits() -> Any:
    """llguidance's parser limits (its defaults, stated so the bound is visible): a grammar over them fails to
    compile; a step over them fails its row alone."""
    return _llguidance().LLParserLimits(max_items_in_row=2000, initial_lexer_fuel=1_000_000,
                                        step_lexer_fuel=200_000, step_max_items=50_000, max_lexer_states=250_000,
                                        max_grammar_size=500_000, verbose_errors=False)


class _TokenList:
    """What ``llguidance.TokenizerWrapper`` reads: every token's bytes (a special token's as 0xFF + its name, the
    convention llguidance uses to keep them out of text), the end-of-text id, and an encoder for forced text."""

    def __init__(self, tokenizer: Any, eos_id: int) -> None:
        size = tokenizer.vocab_size
        self.tokens = [b"\xff" + ENDOFTEXT.encode() if i == eos_id else _token_bytes(tokenizer, i)
                       for i in range(size)]
        if eos_id == size:  # no end-of-text in the tokenizer: a virtual one, never allowed by the mask
            self.tokens.append(b"\xff" + ENDOFTEXT.encode())
        self.eos_token_id, self.bos_token_id, self.special_token_ids = eos_id, None, [eos_id]
        self._tokenizer = tokenizer

    def __call__(self, text: str | bytes) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        try:
            return list(self._tokenizer.encode(text))
        except ValueError:  # a character vocabulary without this character: llguidance falls back to its own
            return []


def _token_bytes(tokenizer: Any, token: int) -> bytes:
    get = getattr(tokenizer, "token_bytes", None)
    return get(token) if get is not None else tokenizer.decode([token]).encode("utf-8")


def grammar_tokenizer(tokenizer: Tokenizer | Any) -> Any:
    """The ``llguidance.LLTokenizer`` of a tinygpt tokenizer (built once per tokenizer object: GPT-2's 50,257
    tokens take about a second). A tokenizer without an end-of-text id gets a virtual one past its vocabulary."""
    cached = _tokenizers.get(tokenizer)
    if cached is None:
        llg = _llguidance()
        eot = getattr(tokenizer, "eot_id", None)
        eos_id = tokenizer.vocab_size if eot is None else eot
        words = _TokenList(tokenizer, eos_id)
        cached = llg.LLTokenizer(llg.TokenizerWrapper(words), n_vocab=len(words.tokens), eos_token=eos_id)
        _tokenizers[tokenizer] = cached
    return cached


def _grammar_text(kind: str, source: Any) -> str:
    """llguidance's grammar for one constraint: ``json_schema`` (a dict), ``json_object`` (any object), ``regex``,
    ``grammar`` (Lark, or GBNF as llama.cpp writes it), ``choice`` (a list of strings)."""
    llg = _llguidance()
    if kind == "json_object":
        source, kind = {"type": "object"}, "json_schema"
    if kind == "json_schema":
        if not isinstance(source, dict):
            raise GrammarError(f"a JSON schema must be an object, got {type(source).__name__}")
        text = json.dumps(source)
        if len(text) > MAX_GRAMMAR_CHARS:
            raise GrammarError(f"the schema has {len(text)} characters; at most {MAX_GRAMMAR_CHARS} are allowed")
        try:
            return llg.LLMatcher.grammar_from_json_schema(text, defaults=JSON_OPTIONS)
        except ValueError as err:
            raise GrammarError(str(err)) from None
    if kind == "choice":
        if not (isinstance(source, list) and source and all(isinstance(s, str) and s for s in source)):
            raise GrammarError("must be a non-empty list of non-empty strings")
        return llg.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(s) for s in source))
    if not isinstance(source, str) or not source:
        raise GrammarError("must be a non-empty string")
    if len(source) > MAX_GRAMMAR_CHARS:
        raise GrammarError(f"has {len(source)} characters; at most {MAX_GRAMMAR_CHARS} are allowed")
    if kind == "regex":
        return llg.LLMatcher.grammar_from_regex(source)
    if kind == "grammar":
        try:
            return llg.grammar_from("grammar", source)  # Lark as it is; GBNF ("root ::= ...") converted to Lark
        except ValueError as err:
            raise GrammarError(str(err).removeprefix("Failed to convert the grammar from GBNF to Lark: ")) from None
    raise GrammarError(f"unknown constraint kind {kind!r}; one of {', '.join(GRAMMAR_KINDS)}")


@dataclass
class Grammar:
    """A compiled constraint for one tokenizer; ``constraint`` makes each row's own state over it."""

    kind: str
    text: str  # llguidance's grammar
    lltokenizer: Any
    vocab_size: int  # the model's (may exceed the tokenizer's: a padded vocabulary's extra ids are never allowed)
    matcher: Any = field(repr=False, default=None)

    def constraint(self, device: torch.device | str = "cpu") -> "GrammarConstraint":
        return GrammarConstraint(self.matcher.deep_copy(), self.vocab_size, torch.device(device),
                                 self.lltokenizer.vocab_size)


def compile_grammar(kind: str, source: Any, tokenizer: Tokenizer | Any, vocab_size: int | None = None) -> Grammar:
    """Check and compile a constraint (``_grammar_text``'s kinds) for ``tokenizer``'s model of ``vocab_size`` ids
    (default: the tokenizer's). Raises ``GrammarError`` with llguidance's reason (an unsupported keyword, a regex
    that does not parse, a grammar over the resource limits, a first mask over ``MAX_FIRST_MASK_SECONDS``).
    Compiling releases the GIL (run it off the event loop: it may take up to a few seconds)."""
    llg = _llguidance()
    text = _grammar_text(kind, source)
    lltok = grammar_tokenizer(tokenizer)
    matcher = llg.LLMatcher(lltok, text, log_level=0, limits=_limits())
    if matcher.is_error():
        raise GrammarError(_first_line(matcher.get_error()))
    start = time.perf_counter()
    matcher.compute_bitmask()  # reads the state, changes nothing; the rows' copies start from it
    took = time.perf_counter() - start
    if matcher.is_error():
        raise GrammarError(_first_line(matcher.get_error()))
    if took > MAX_FIRST_MASK_SECONDS:
        raise GrammarError(f"is too complex: its first token mask took {took:.1f} s (at most "
                           f"{MAX_FIRST_MASK_SECONDS:g} s are allowed)")
    size = tokenizer.vocab_size if vocab_size is None else vocab_size
    return Grammar(kind, text, lltok, size, matcher)


def _first_line(message: str) -> str:
    """llguidance's error on one line: its source excerpt (numbered lines, caret lines) left out."""
    kept = [line.strip() for line in message.strip().splitlines()
            if line.strip() and not re.match(r"^\s*(\d+\s*\||\^+\s*$|\|)", line)]
    return " ".join(kept) or "the grammar is invalid"


class GrammarConstraint:
    """One row's state in its grammar (``Row.constraint``). ``seconds``: the host time of each token's mask and
    advance, for measuring what constraining costs per token."""

    def __init__(self, matcher: Any, vocab_size: int, device: torch.device, words: int) -> None:
        self.matcher, self.vocab_size, self.device = matcher, vocab_size, device
        self.words = min(words, vocab_size)  # token ids the grammar knows and the model has
        self._bits = torch.zeros((words + 31) // 32, dtype=torch.int32)  # llguidance's bitmask, 1 bit per token
        self._shifts = torch.arange(8, dtype=torch.uint8)
        self.seconds: list[float] = []
        self._pending = 0.0

    def allowed(self) -> torch.Tensor | None:
        """[V] bool on the engine's device: the tokens the row may draw next."""
        start = time.perf_counter()
        self.matcher.unsafe_compute_mask_ptr(self._bits.data_ptr(), self._bits.numel() * 4)
        if self.matcher.is_error():
            raise GrammarError(f"the grammar failed: {_first_line(self.matcher.get_error())}")
        # little-endian words: token i is bit i % 8 of byte i // 8
        bits = (self._bits.view(torch.uint8)[:, None] >> self._shifts) & 1  # [W * 4, 8]
        mask = torch.zeros(self.vocab_size, dtype=torch.bool)
        mask[:self.words] = bits.flatten()[:self.words].bool()
        self._pending = time.perf_counter() - start
        return mask.to(self.device, non_blocking=True)

    def advance(self, token: int) -> list[int]:
        """The row took ``token`` (drawn under ``allowed``'s mask); the tokens the grammar forces next."""
        start = time.perf_counter()
        if not self.matcher.consume_token(int(token)):
            raise GrammarError(f"token {token} does not follow the grammar: {_first_line(self.matcher.get_error())}")
        forced = [] if self.matcher.is_stopped() else list(self.matcher.compute_ff_tokens())
        if forced and not self.matcher.consume_tokens(forced):
            raise GrammarError(f"the grammar's forced tokens failed: {_first_line(self.matcher.get_error())}")
        self.seconds.append(self._pending + time.perf_counter() - start)
        self._pending = 0.0
        return forced

    def is_done(self) -> bool:
        """Only the end may follow (the grammar is complete and cannot go on)."""
        return self.matcher.is_stopped()

    def is_accepting(self) -> bool:
        return self.matcher.is_accepting()
