"""Several LoRA adapters in one batch: what a decode step costs when its rows use different adapters.

    python -m benchmarks.multi_lora [--quick] [--rows 8] [--context 128] [--adapters 4] [--rank 16]
                                    [--repeat 7] [--json PATH]

gpt2-small shapes (random weights), float32, this machine's cores. ``--rows`` rows sit at ``--context`` cached
positions and decode one token per forward (``inference.runner.ModelRunner.forward``, the engine's packed batch).
The adapters (rank ``--rank``, on QKV and the attention's output projection, B random) are attached with
``multi_lora.attach_adapters``. Timed side by side, interleaved, median of ``--repeat`` forwards each:

- ``base``: the plain model (what a merged fine-tune costs: a merged model has the base's shapes);
- ``attached, base rows``: adapters attached, every row on the base (the runner then adds nothing);
- ``one adapter``: every row on adapter 0;
- ``mixed``: the rows spread round-robin over ``--adapters`` adapters, one forward;
- ``merged, one forward each``: the reference for ``mixed``: ``--adapters`` merged models, each decoding its share of
  the rows in a forward of its own (what serving each fine-tune as its own model costs per step, at best).

Ratios are to ``base``; the last column compares ``mixed`` with the merged models' separate forwards.
"""

from __future__ import annotations

import argparse
from typing import Any, Callable

import torch

from tinygpt import GenerationConfig, GPTModel, lora
from tinygpt.inference.engine import InferenceEngine
from tinygpt.inference.row import Row
from tinygpt.multi_lora import attach_adapters

from .common import format_table, pin_threads, run_and_report, time_interleaved
from .models import gpt2_small, quick_config

TARGETS = ("qkv", "out_proj")


def _decoding(model: GPTModel, rows: int, context: int) -> tuple[InferenceEngine, list[Row]]:
    """An engine whose ``rows`` rows are prefilled to ``context`` positions, each with room for its next token."""
    engine = InferenceEngine(model, max_rows=rows, cache_tokens=rows * (context + 32))
    vocab = model.config.vocab_size
    for i in range(rows):
        engine.add(Row([(7 * i + j) % vocab for j in range(context)], GenerationConfig(max_new_tokens=8)))
    while any(r.pending > 1 for r in engine.rows):
        engine.step()
    live = list(engine.scheduler.running)
    for row in live:
        if not engine.blocks.grow(row.table, row.computed + 1):
            raise RuntimeError("the cache has no room for the decode steps")
    return engine, live


def _adapter_parts(base: GPTModel, rank: int, seed: int) -> tuple[lora.LoRAConfig, dict[str, torch.Tensor]]:
    """An adapter of ``base`` (wrapped in place: pass a copy) with B random, as ``attach_adapters`` takes it."""
    config = lora.LoRAConfig(r=rank, alpha=2 * rank, targets=TARGETS)
    adapted = lora.apply_lora(base, config, seed=seed)
    with torch.no_grad():
        for _, module in lora.lora_modules(adapted):
            for b in module.lora_B.values():
                b.normal_(std=0.02)
    return config, {k: v.clone() for k, v in lora.lora_state_dict(adapted).items()}


def compute(args: argparse.Namespace) -> dict[str, Any]:
    if args.rows < args.adapters or args.adapters < 1:
        raise ValueError(f"--rows {args.rows} must be >= --adapters {args.adapters} >= 1")
    cores = pin_threads()
    config = quick_config() if args.quick else gpt2_small()
    context = min(args.context, config.context_length - 8)
    torch.manual_seed(0)
    base = GPTModel(config).eval()
    served = GPTModel(config).eval()
    served.load_state_dict(base.state_dict())
    parts = {}
    for k in range(args.adapters):
        scratch = GPTModel(config).eval()
        scratch.load_state_dict(base.state_dict())
        parts[f"a{k}"] = _adapter_parts(scratch, args.rank, seed=k)
    attach_adapters(served, parts)
    plain, plain_rows = _decoding(base, args.rows, context)
    multi, multi_rows = _decoding(served, args.rows, context)

    def step(engine: InferenceEngine, rows: list[Row], adapters: list[int]) -> Callable[[], None]:
        def run() -> None:
            for row, k in zip(rows, adapters):
                row.adapter = k
            with torch.inference_mode():
                engine.runner.forward([(r, 1) for r in rows])
        return run

    share = [plain_rows[k::args.adapters] for k in range(args.adapters)]

    def separate() -> None:  # each merged model decodes its own rows (the base's shapes: the base stands for each)
        with torch.inference_mode():
            for rows in share:
                plain.runner.forward([(r, 1) for r in rows])

    n = args.rows
    fns = {
        "base": step(plain, plain_rows, [-1] * n),
        "attached, base rows": step(multi, multi_rows, [-1] * n),
        "one adapter": step(multi, multi_rows, [0] * n),
        "mixed": step(multi, multi_rows, [i % args.adapters for i in range(n)]),
        "merged, one forward each": separate,
    }
    stats = time_interleaved(fns, warmup=2, repeats=args.repeat)
    ref = stats["base"]["median_s"]
    table = [{"case": name, "step_ms": 1000 * s["median_s"], "min_ms": 1000 * s["min_s"],
              "x_base": s["median_s"] / ref} for name, s in stats.items()]
    mixed_vs_separate = stats["mixed"]["median_s"] / stats["merged, one forward each"]["median_s"]
    return {"rows": n, "context": context, "adapters": args.adapters, "rank": args.rank, "cores": cores,
            "repeat": args.repeat, "quick": args.quick, "table": table, "mixed_x_separate": mixed_vs_separate}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.multi_lora", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny layers: checks it runs")
    parser.add_argument("--rows", type=int, default=8)
    parser.add_argument("--context", type=int, default=128, help="cached positions of each decoding row")
    parser.add_argument("--adapters", type=int, default=4)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)

    def show(result: dict[str, Any]) -> str:
        columns = [("case", "case"), ("step_ms", "step ms"), ("min_ms", "min ms"), ("x_base", "x base")]
        return (format_table(result["table"], columns) + f"\n{result['rows']} rows at {result['context']} positions, "
                f"{result['adapters']} adapters of rank {result['rank']}, {result['cores']} threads; mixed / merged "
                f"models' separate forwards: {result['mixed_x_separate']:.2f}x")

    return run_and_report(parser, lambda: compute(args), show, args.json)


if __name__ == "__main__":
    raise SystemExit(main())
