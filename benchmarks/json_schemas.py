"""Seeded JSON schemas for the structured-output proof and benchmark: objects, nested arrays, enums, ``required``,
string lengths, numbers with bounds, ``anyOf``, ``$ref`` / ``$defs``.

Every string has a ``maxLength``, every array a ``maxItems``, every number bounds and a ``multipleOf``, so that a
valid answer fits a few dozen tokens even from a random-weight model (a string without a bound is valid however
long it runs, and ``max_tokens`` would cut it: the mask guarantees every prefix can still be completed, not that
the model stops).
"""

from __future__ import annotations

import random
from typing import Any


def _leaf(rng: random.Random) -> dict[str, Any]:
    kind = rng.choice(["string", "integer", "number", "boolean", "enum", "null"])
    if kind == "string":
        lo = rng.randint(0, 3)
        return {"type": "string", "minLength": lo, "maxLength": lo + rng.randint(0, 6)}
    if kind == "integer":
        lo = rng.randint(-50, 50)
        return {"type": "integer", "minimum": lo, "maximum": lo + rng.randint(0, 500)}
    if kind == "number":
        lo = rng.randint(-10, 10)
        # a bound on the digits too: nothing in JSON schema limits a fraction's length but multipleOf (0.5 and 0.25
        # are exact in binary, so jsonschema's float division checks them exactly)
        return {"type": "number", "minimum": lo, "maximum": lo + rng.randint(1, 100),
                "multipleOf": rng.choice([0.5, 0.25])}
    if kind == "enum":
        return {"enum": rng.sample(["red", "green", "blue", "cyan", "x", "long value", "ü"], rng.randint(1, 4))}
    return {"type": kind}


def _value(rng: random.Random, depth: int) -> dict[str, Any]:
    roll = rng.random()
    if depth <= 0 or roll < 0.45:
        return _leaf(rng)
    if roll < 0.65:
        return {"type": "array", "items": _value(rng, depth - 1), "minItems": rng.randint(0, 1),
                "maxItems": rng.randint(1, 3)}
    if roll < 0.8:
        return {"anyOf": [_leaf(rng), _value(rng, depth - 1)]}
    return _object(rng, depth - 1)


def _object(rng: random.Random, depth: int) -> dict[str, Any]:
    names = rng.sample(["id", "name", "age", "tags", "score", "ok", "kind", "items", "note", "when"], rng.randint(1, 3))
    props = {name: _value(rng, depth) for name in names}
    required = [n for n in names if rng.random() < 0.7]
    schema: dict[str, Any] = {"type": "object", "properties": props, "additionalProperties": False}
    if required:
        schema["required"] = required
    return schema


def random_schema(rng: random.Random) -> dict[str, Any]:
    """One schema; about a fifth put a sub-schema in ``$defs`` and refer to it twice."""
    schema = _object(rng, rng.randint(1, 2))
    if rng.random() < 0.2:
        part = _object(rng, 0)
        schema["$defs"] = {"part": part}
        schema["properties"]["first"] = {"$ref": "#/$defs/part"}
        schema["properties"]["rest"] = {"type": "array", "items": {"$ref": "#/$defs/part"}, "maxItems": 1}
        schema.setdefault("required", []).append("first")
    return schema


def random_schemas(count: int, seed: int = 0) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    return [random_schema(rng) for _ in range(count)]


# Regexes and grammars whose language Python's ``re`` also decides (the proof checks the output with it); every
# repetition bounded, for the reason above.
REGEXES = [r"[a-c]{2,5}", r"(yes|no)", r"[0-9]{3}-[0-9]{4}", r"[A-Z][a-z]{1,6}( [A-Z][a-z]{1,6})?", r"0x[0-9a-f]{1,4}",
           r"(ab|cd){1,3}e", r"-?[1-9][0-9]{0,2}\.[0-9]{1,2}", r"[xyz]{1,3}@[a-c]{1,3}\.(com|org)"]
GRAMMARS = [  # (a GBNF or Lark grammar, the Python regex of the same language)
    ('root ::= "(" num ( ("+" | "*") num ){0,3} ")"\nnum ::= [0-9] | [1-9] [0-9]',
     r"\((\d|[1-9]\d)([+*](\d|[1-9]\d)){0,3}\)"),
    ('start: item ("," item){0,3}\nitem: /[a-z]{1,4}/', r"[a-z]{1,4}(,[a-z]{1,4}){0,3}"),
    ('root ::= ("cat" | "dog") " " ("runs" | "sleeps")', r"(cat|dog) (runs|sleeps)"),
    ('start: "[" (NUMBER ("," NUMBER)~0..3)? "]"\nNUMBER: /[0-9]{1,3}/', r"\[([0-9]{1,3}(,[0-9]{1,3}){0,3})?\]"),
]


def constrained_texts(model: Any, tokenizer: Any, kind: str, sources: list[Any], prompt: str | list[str], *,
                      max_new_tokens: int, temperature: float = 0.0, seed: int = 0, constrained: bool = True,
                      mask_seconds: list[float] | None = None) -> tuple[list[str], list[str]]:
    """Each source (a schema, a regex, a grammar) as one row of one ``tinygpt.generate`` batch, every row under its
    own constraint (``constrained=False``: none, the same rows free): (texts, finish reasons). ``prompt``: one for
    all rows or one per row. The end-of-text token ends a row and is not part of its text. ``mask_seconds``
    receives the host time of every constrained token's mask and advance."""
    from tinygpt import generate
    from tinygpt.inference.grammar import compile_grammar

    vocab = model.config.vocab_size
    constraints = [compile_grammar(kind, s, tokenizer, vocab).constraint() for s in sources] if constrained else None
    prompts = [prompt] * len(sources) if isinstance(prompt, str) else prompt
    eos = getattr(tokenizer, "eot_id", None)
    result = generate(model, [list(tokenizer.encode(p)) for p in prompts], max_new_tokens=max_new_tokens,
                      temperature=temperature, seed=seed if temperature > 0 else None, eos_id=eos,
                      constraints=constraints)
    if mask_seconds is not None and constraints is not None:
        mask_seconds.extend(s for c in constraints for s in c.seconds)
    texts = [tokenizer.decode([t for t in row if t != eos]) for row in result.rows()]
    return texts, result.finish_reasons


def valid_json(text: str, schema: dict[str, Any]) -> bool:
    """The whole text is one JSON value that follows ``schema``."""
    import json

    import jsonschema

    try:
        jsonschema.validate(json.loads(text), schema)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True
