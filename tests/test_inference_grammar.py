"""Constrained decoding through llguidance (``inference.grammar``): masks from every tokenizer kind, the proof that
constrained output parses and validates (JSON schemas with ``jsonschema``, regexes and grammars with Python's ``re``),
on a random-weight and a trained model, greedy and sampled, and one-line errors for what cannot be compiled."""

from __future__ import annotations

import json
import random
import re

import jsonschema
import pytest
import torch

from benchmarks.json_schemas import GRAMMARS, REGEXES, constrained_texts, random_schemas
from conftest import GPT2_VOCAB_DIR
from serving_support import tiny_model, tokenizer
from tinygpt import GPTConfig, GPTModel, generate
from tinygpt.inference.constraint import RowConstraint
from tinygpt.inference.grammar import GrammarError, compile_grammar
from tinygpt.tokenizer import CharTokenizer, gpt2_tokenizer

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "tags": {"type": "array", "items": {"enum": ["a", "bb"]}, "maxItems": 3}},
          "required": ["name", "n", "tags"], "additionalProperties": False}


def _walk(grammar, tok, rng: random.Random, steps: int = 300) -> tuple[str, int]:
    """Draw uniformly among the allowed tokens until the grammar is done: (text, forced tokens)."""
    c = grammar.constraint()
    assert isinstance(c, RowConstraint)
    out, forced, eos = [], 0, getattr(tok, "eot_id", None)
    for _ in range(steps):
        allowed = c.allowed()
        assert allowed.dtype == torch.bool and allowed.shape == (grammar.vocab_size,)
        assert not allowed[tok.vocab_size:].any()  # a padded vocabulary's extra ids are never allowed
        token = rng.choice(allowed.nonzero().flatten().tolist())
        if token == eos:
            break
        more = c.advance(token)
        out += [token, *more]
        forced += len(more)
        if c.is_done():
            break
    return tok.decode(out), forced


def _tokenizers():
    kinds = [tokenizer(), CharTokenizer('{}[]":, abcdefgnmtrs0123456789')]
    if (GPT2_VOCAB_DIR / "encoder.json").exists():
        kinds.append(gpt2_tokenizer(GPT2_VOCAB_DIR))
    return kinds


@pytest.mark.parametrize("tok", _tokenizers(), ids=lambda t: t.kind)
def test_every_tokenizer_kind_gives_valid_json_and_forces_the_keys(tok):
    grammar = compile_grammar("json_schema", SCHEMA, tok, tok.vocab_size + 5)  # a vocabulary padded by 5
    rng = random.Random(0)
    for _ in range(3):
        text, forced = _walk(grammar, tok, rng)
        jsonschema.validate(json.loads(text), SCHEMA)
        assert forced > 0  # the keys and the punctuation around them are forced, never drawn


def _proof(model: GPTModel, schemas: list, temperature: float) -> None:
    texts, reasons = constrained_texts(model, tokenizer(), "json_schema", schemas, "Answer in JSON:",
                                       max_new_tokens=200, temperature=temperature, seed=1)
    assert all(r in ("eos", "stop") for r in reasons), reasons  # none cut by max_new_tokens
    for schema, text in zip(schemas, texts):
        jsonschema.validate(json.loads(text), schema)
    for kind, cases in (("regex", [(r, r) for r in REGEXES]), ("grammar", GRAMMARS)):
        texts, _ = constrained_texts(model, tokenizer(), kind, [g for g, _ in cases], "x", max_new_tokens=60,
                                     temperature=temperature, seed=1)
        for (_, pattern), text in zip(cases, texts):
            assert re.fullmatch(pattern, text), (pattern, text)


def trained_model() -> GPTModel:
    """The tiny model trained for 150 steps on JSON answers to the schemas' shapes (seconds on 2 cores): its
    greedy tokens are no longer the random model's."""
    torch.manual_seed(0)
    rng = random.Random(0)
    samples = [json.dumps({"name": rng.choice(["red", "blue", "x"]), "id": rng.randint(0, 99),
                           "tags": [rng.choice(["a", "bb"]) for _ in range(rng.randint(0, 3))], "ok": True})
               for _ in range(200)]
    ids = torch.tensor(tokenizer().encode("Answer in JSON:" + "\n".join(samples)))
    model = tiny_model(context_length=256)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for step in range(150):
        starts = torch.randint(0, len(ids) - 65, (8,))
        x = torch.stack([ids[s:s + 64] for s in starts])
        y = torch.stack([ids[s + 1:s + 65] for s in starts])
        loss = model(x, targets=y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval()


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
def test_forty_schemas_regexes_and_grammars_always_validate(temperature):
    _proof(tiny_model(context_length=256), random_schemas(40, seed=7), temperature)


@pytest.mark.slow
def test_two_hundred_schemas_on_a_random_and_a_trained_model_greedy_and_sampled():
    schemas = random_schemas(200)
    for model in (tiny_model(context_length=256), trained_model()):
        for temperature in (0.0, 1.0):
            _proof(model, schemas, temperature)


def test_the_mask_changes_what_the_model_writes_and_offline_rows_repeat():
    model = tiny_model(context_length=256)
    ids = tokenizer().encode("Answer in JSON:")
    free = generate(model, [ids], max_new_tokens=30, eos_id=tokenizer().eot_id).rows()[0]
    with pytest.raises(ValueError):
        json.loads(tokenizer().decode(free))
    grammar = compile_grammar("json_schema", SCHEMA, tokenizer(), model.config.vocab_size)
    one = generate(model, [ids], max_new_tokens=80, eos_id=tokenizer().eot_id, constraints=[grammar.constraint()])
    two = generate(model, [ids], max_new_tokens=80, eos_id=tokenizer().eot_id, constraints=[grammar.constraint()])
    assert one.rows() == two.rows() and any(one.forced[0]) and not all(one.forced[0])
    jsonschema.validate(json.loads(tokenizer().decode([t for t in one.rows()[0] if t != tokenizer().eot_id])),
                        SCHEMA)


def test_a_tokenizer_without_end_of_text_ends_rows_when_the_grammar_is_done():
    tok = CharTokenizer("abc-0123456789")
    torch.manual_seed(0)
    model = GPTModel(GPTConfig(vocab_size=tok.vocab_size, context_length=64, emb_dim=16, n_heads=2, n_layers=1))
    grammar = compile_grammar("regex", "[abc]{2}-[0-9]{3}", tok)
    result = generate(model.eval(), [tok.encode("ab")], max_new_tokens=20, constraints=[grammar.constraint()])
    assert result.finish_reasons == ["stop"] and re.fullmatch("[abc]{2}-[0-9]{3}", tok.decode(result.rows()[0]))


@pytest.mark.parametrize("kind, source, fragment", [
    ("regex", "a(", "unclosed group"),
    ("grammar", 'root ::= "a" | foo', "Rule 'foo' not found"),
    ("grammar", "start: x\nx: /[/", "unclosed character class"),
    ("json_schema", {"type": "string", "format": "no-such-format"}, "Unknown format"),
    ("json_schema", {"properties": {"a": {"$ref": "#/$defs/missing"}}}, "does not exist"),
    ("json_schema", {"type": "integer", "minimum": "x"}, "minimum"),
    ("json_schema", ["not", "an", "object"], "must be an object"),
    ("choice", [], "non-empty list"),
])
def test_what_cannot_be_compiled_is_one_line_naming_the_reason(kind, source, fragment):
    with pytest.raises(GrammarError) as err:
        compile_grammar(kind, source, tokenizer())
    assert fragment in str(err.value) and "\n" not in str(err.value)


def test_a_grammar_whose_first_mask_is_too_costly_is_refused_at_compile_time(monkeypatch):
    import tinygpt.inference.grammar as grammar

    monkeypatch.setattr(grammar, "MAX_FIRST_MASK_SECONDS", 0.0)  # every mask takes some time: the bound is hit
    with pytest.raises(GrammarError, match="too complex: its first token mask took"):
        compile_grammar("regex", "[ab]{3}", tokenizer())
