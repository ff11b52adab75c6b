"""The serving engine's token budget: how long one forward takes with R rows decoding plus a prompt chunk.

    python -m benchmarks.token_budget [--quick] [--rows 16] [--context 256] [--budgets 32,64,128,256,512]
                                      [--repeat 5] [--json PATH]

gpt2-small shapes, float32, this machine's cores. R rows sit at ``--context`` cached positions each and decode one
token; a prompt chunk of (budget - R) tokens rides in the same forward (``inference.engine``'s packing). Reported
per budget: the forward's median time, its ratio to a decode-only step (how much a chunk stretches the gap between
two tokens of every stream) and the chunk's prefill rate. The default budget is the largest whose step stays
within 3x a decode-only step (the issue's bound on the longest gap while a long prompt arrives).
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch

from tinygpt import GenerationConfig, GPTModel
from tinygpt.inference.engine import InferenceEngine
from tinygpt.inference.row import Row

from .common import format_table, pin_threads, run_and_report
from .models import gpt2_small, quick_config


def _step_time(engine: InferenceEngine, rows: list[Row], chunk: int, repeat: int) -> list[float]:
    """Times of ``repeat`` forwards: every row feeds one token at its position, plus one chunk of ``chunk`` tokens."""
    times = []
    extra = None
    if chunk:
        extra = Row(list(range(1, chunk + 2)), GenerationConfig(max_new_tokens=1))
        engine.scheduler.add(extra)
        engine.scheduler.schedule()  # admits it (blocks for its window)
    for _ in range(repeat):
        plan = [(r, 1) for r in rows] + ([(extra, chunk)] if extra else [])
        start = time.perf_counter()
        with torch.inference_mode():
            engine.runner.forward(plan)
        times.append(time.perf_counter() - start)
    if extra:
        engine.scheduler.remove(extra)
    return times


def compute(args: argparse.Namespace) -> dict[str, Any]:
    cores = pin_threads()
    config = quick_config() if args.quick else gpt2_small()
    torch.manual_seed(0)
    model = GPTModel(config).eval()
    context = min(args.context, config.context_length // 2)
    budgets = [int(b) for b in args.budgets.split(",") if int(b) - args.rows < config.context_length - 1]
    engine = InferenceEngine(model, max_rows=args.rows + 1, cache_tokens=(args.rows + 1) * config.context_length)
    rows = []
    for i in range(args.rows):
        row = Row([(7 * i + j) % config.vocab_size for j in range(context)], GenerationConfig(max_new_tokens=8))
        engine.add(row)
    while any(r.pending > 1 for r in engine.scheduler.running + list(engine.scheduler.waiting)):
        engine.step()  # prefill every row; each then has one pending token
    rows = list(engine.scheduler.running)
    for row in rows:
        engine.blocks.grow(row.table, row.computed + 1)  # room for the token each forward feeds
    samples: dict[int, list[float]] = {0: []}
    samples.update({b: [] for b in budgets})
    for _ in range(args.repeat):  # interleaved: every budget once per round
        for b in samples:
            samples[b] += _step_time(engine, rows, max(b - args.rows, 0) if b else 0, 1)
    base = statistics.median(samples[0])
    table = [{"budget": "decode only", "chunk": 0, "step_ms": 1000 * base, "ratio": 1.0, "prefill_tok_s": None}]
    for b in budgets:
        t, chunk = statistics.median(samples[b]), max(b - args.rows, 0)
        table.append({"budget": b, "chunk": chunk, "step_ms": 1000 * t, "ratio": t / base,
                      "prefill_tok_s": chunk / max(t - base, 1e-9)})
    fits = [row["budget"] for row in table[1:] if row["ratio"] <= 3.0]
    return {"rows": args.rows, "context": context, "cores": cores, "repeat": args.repeat, "table": table,
            "largest_within_3x": max(fits) if fits else None}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.token_budget", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny layers: checks it runs")
    parser.add_argument("--rows", type=int, default=16)
    parser.add_argument("--context", type=int, default=256, help="cached positions of each decoding row")
    parser.add_argument("--budgets", default="32,64,128,256,512")
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)

    def show(result: dict[str, Any]) -> str:
        columns = [("budget", "budget"), ("chunk", "chunk"), ("step_ms", "step ms"), ("ratio", "x decode step"),
                   ("prefill_tok_s", "chunk tok/s")]
        return (format_table(result["table"], columns) + f"\n{result['rows']} rows at {result['context']} positions, "
                f"{result['cores']} threads; largest budget within 3x a decode step: {result['largest_within_3x']}")

    return run_and_report(parser, lambda: compute(args), show, args.json)


if __name__ == "__main__":
    raise SystemExit(main())
