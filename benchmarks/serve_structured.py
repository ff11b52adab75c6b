"""The serving benchmark's structured-output workload (``python -m benchmarks.serve --workloads structured``):
what a JSON schema costs a served request, and what it buys.

- tok/s at 1 and 16 clients (quick: 1 and 2), each request once with ``response_format: json_schema`` (a schema of
  ``json_schemas.random_schemas``, one per request) and once without, the same prompts and ``max_tokens``,
  interleaved by round; the constrained/free ratio (target >= 0.9) and the share of constrained answers that
  validate (those cut by ``max_tokens`` do not);
- the mask's host cost per constrained token (``GrammarConstraint.seconds``: computing the mask and advancing the
  parser, median and p99 in microseconds), from the same schemas run through ``tinygpt.generate`` in this process;
- the share of valid answers without the mask against with it, greedy, on the served model (random weights by
  default, ``--model`` for a trained one), asked in the prompt for JSON following the schema.
"""

from __future__ import annotations

import asyncio
import json
import statistics
from typing import Any, Callable

from .json_schemas import constrained_texts, random_schemas, valid_json
from .serve_driver import LABELS, load, percentile, rotated

CLIENTS = (1, 16)
QUICK_CLIENTS = (1, 2)
SCHEMAS = 64
VALIDITY_ROWS = 16  # schemas run offline, with and without the mask (for the share and the mask's cost)


def _prompt(schema: dict[str, Any], tokenizer: Any, room: int) -> str:
    """The request for JSON following ``schema``, with the schema when it fits ``room`` tokens (quick: it does not)."""
    text = f"Answer with one JSON value that follows this JSON schema: {json.dumps(schema)}\nAnswer: "
    return text if len(tokenizer.encode(text)) <= room else "Answer in JSON: "


def measure(run: Any) -> None:
    """Fill ``run.result["structured"]`` (rows and figures); ``run`` is ``benchmarks.serve``'s ``_Run``."""
    keys = run.servers.keys(["tinygpt"])
    if not keys:  # the table's not-available lines say why the server did not start
        return
    key, quick = keys[0], run.result["quick"]
    url, body = run.servers.running[key].url, run.servers.body(key)
    clients = QUICK_CLIENTS if quick else CLIENTS
    context = run.model.config.context_length
    # room for a whole JSON answer, and at least 16 prompt tokens (a small model's context may hold 128 in all)
    new_tokens = 32 if quick else min(max(run.new_tokens, 128), context - 16)
    schemas = random_schemas(SCHEMAS, seed=11)
    room = context - new_tokens
    warm = body(_prompt(schemas[-1], run.tokenizer, room), 4)  # the server's first grammar builds its token table
    warm["response_format"] = {"type": "json_schema", "json_schema": {"name": "warm", "schema": schemas[-1]}}
    asyncio.run(load(url, [[warm]]))
    per: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for r in range(run.rounds):
        for c in clients:
            count = c * run.requests
            picked = [schemas[(r * count + i) % len(schemas)] for i in range(count)]
            for mode in rotated(["free", "json_schema"], r):
                def one(i: int) -> dict[str, Any]:
                    b = body(_prompt(picked[i], run.tokenizer, room), new_tokens)
                    if mode == "json_schema":
                        b["response_format"] = {"type": "json_schema",
                                                "json_schema": {"name": "answer", "schema": picked[i]}}
                    return b

                bodies = [[one(k * run.requests + j) for j in range(run.requests)] for k in range(c)]
                wall, records, cut = asyncio.run(load(url, bodies, run.phase_seconds))
                tokens = sum(rec["tokens"] for rec in records)
                valid = [valid_json(rec["text"], picked[i]) for i, rec in enumerate(records)]
                row = {"impl": LABELS[key], "mode": mode, "clients": c, "tokens_per_s": tokens / wall,
                       "tokens_per_request": tokens / max(len(records), 1), "valid_share": sum(valid) / len(valid),
                       "cut_short": cut}
                per.setdefault((mode, c), []).append(row)
                run.log(f"structured {mode:<12} {c:>3} clients: {row['tokens_per_s']:.1f} tok/s, "
                        f"{row['valid_share']:.0%} valid")
    rows = []
    for (mode, c), measured in per.items():
        rows.append({"impl": measured[0]["impl"], "mode": mode, "clients": c,
                     **{k: statistics.median(m[k] for m in measured)
                        for k in ("tokens_per_s", "tokens_per_request", "valid_share")},
                     "cut_short": any(m["cut_short"] for m in measured)})
    speed = {(r["mode"], r["clients"]): r["tokens_per_s"] for r in rows}
    ratios = {c: speed[("json_schema", c)] / speed[("free", c)] for c in clients if speed.get(("free", c))}

    run.log("structured: the mask's cost and the valid share, offline ...")
    offline = schemas[:4 if quick else VALIDITY_ROWS]
    prompts = [_prompt(s, run.tokenizer, room) for s in offline]
    seconds: list[float] = []
    with_mask, _ = constrained_texts(run.model, run.tokenizer, "json_schema", offline, prompts,
                                     max_new_tokens=new_tokens, mask_seconds=seconds)
    without, _ = constrained_texts(run.model, run.tokenizer, "json_schema", offline, prompts,
                                   max_new_tokens=new_tokens, constrained=False)
    run.result["structured"] = {
        "rows": rows, "ratio_json_over_free": ratios, "max_tokens": new_tokens,
        "mask_us_median": statistics.median(seconds) * 1e6 if seconds else None,
        "mask_us_p99": percentile(seconds, 0.99) * 1e6 if seconds else None, "mask_tokens": len(seconds),
        "valid_share_with_mask": sum(map(valid_json, with_mask, offline)) / len(offline),
        "valid_share_without_mask": sum(map(valid_json, without, offline)) / len(offline),
        "offline_rows": len(offline)}


def table(structured: dict[str, Any], fmt: Callable[[list[dict[str, Any]], list[str]], str]) -> str:
    s = structured
    lines = [fmt(s["rows"], ["impl", "mode", "clients", "tokens_per_s", "tokens_per_request", "valid_share"])]
    lines.append("json_schema / free tok/s: " + ", ".join(f"{c} clients {r:.2f}x"
                                                          for c, r in s["ratio_json_over_free"].items()))
    if s["mask_us_median"] is not None:
        lines.append(f"mask + advance per constrained token: median {s['mask_us_median']:.0f} us, p99 "
                     f"{s['mask_us_p99']:.0f} us ({s['mask_tokens']} tokens)")
    lines.append(f"valid answers, greedy, {s['offline_rows']} schemas: {s['valid_share_without_mask']:.0%} without "
                 f"the mask, {s['valid_share_with_mask']:.0%} with it")
    return "\n".join(lines)
