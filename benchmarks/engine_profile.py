"""Where the inference engine's time goes under the throughput workload: the bound on its tokens per second.

    python -m benchmarks.engine_profile [--rows 16,64] [--requests 3] [--new-tokens 64] [--quick] [--json F]
                                        [--model gpt2-small|char] [--before]

In process, no server: ``rows`` rows decode at once (as ``rows`` streaming clients keep the server's batch full),
each of ``requests`` greedy requests per row with ``new-tokens`` new tokens after a prompt of 16-64 random tokens
(``benchmarks.serve``'s throughput workload), gpt2-small shapes, float32, ``--threads`` torch threads. Reported
per row count: tokens/s, the share of the wall time inside the model's forward (the rest is the engine's own
Python: scheduling, packing, sampling), the forward's self CPU time by operator group (``torch.profiler``; the
cache's gathers and writes a group of their own), and the linear layers' rate in GFLOP/s against the machine's
float32 matmul ceiling (``common.matmul_ceiling``). When the forward is nearly all the wall time and the linears
nearly all the forward, tokens/s is bounded by the matmul rate, and no scheduling can raise it. ``--model char``
profiles the default ``tinygpt train`` model's shapes instead (``benchmarks.ab.CHAR_MODEL``), where the fixed
cost of a step is all there is; ``--before`` runs the decode step as it was before the lean step
(``benchmarks.ab._decode_before``).
"""

from __future__ import annotations

import argparse
import contextlib
import random
import sys
import time
from pathlib import Path
from typing import Any, Sequence

import torch

from tinygpt import GenerationConfig, GPTModel
from tinygpt.inference.engine import InferenceEngine
from tinygpt.inference.row import Row

from .common import OP_GROUPS, format_table, matmul_ceiling, pin_threads, run_and_report, self_cpu_shares
from .models import gpt2_small, quick_config

GROUPS = {"cache gathers and writes": ("aten::index_select", "aten::index_copy", "aten::index"), **OP_GROUPS}
LINEAR = "matmul (linear layers, head)"


def linear_flops(model: GPTModel, fed: int, logit_rows: int) -> float:
    """FLOPs of the linear layers for ``fed`` tokens through the blocks and ``logit_rows`` through the head."""
    blocks = sum(m.weight.numel() for name, m in model.named_modules()
                 if name.startswith("trf_blocks.") and isinstance(getattr(m, "weight", None), torch.Tensor)
                 and m.weight.dim() == 2)
    return 2.0 * (blocks * fed + model.out_head.weight.numel() * logit_rows)


def run_rows(model: GPTModel, rows: int, requests: int, new_tokens: int, seed: int = 0) -> dict[str, Any]:
    """The workload for one row count, profiled; see the module docstring."""
    from torch.profiler import ProfilerActivity, profile

    rng = random.Random(seed)
    cfg = GenerationConfig(max_new_tokens=new_tokens)
    vocab = model.config.vocab_size
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(16, 64))] for _ in range(rows * requests)]
    engine = InferenceEngine(model, max_rows=rows, token_budget=max(256, rows), chunk_per_decode=8)
    forward_s, fed, logit_rows = 0.0, 0, 0
    run_forward = engine.runner.forward

    def timed(plan: Any) -> list[torch.Tensor]:
        nonlocal forward_s, fed, logit_rows
        start = time.perf_counter()
        out = run_forward(plan)
        forward_s += time.perf_counter() - start
        fed += sum(n for _, n in plan)
        logit_rows += sum(o.shape[0] for o in out)
        return out

    engine.runner.forward = timed
    queue = list(prompts)
    tokens = 0
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        for _ in range(rows):
            engine.add(Row(queue.pop(), cfg))
        while engine.has_work:
            for out in engine.step():
                tokens += len(out.tokens)
                if out.finished and queue:
                    engine.add(Row(queue.pop(), cfg))
        wall = time.perf_counter() - start
    shares = self_cpu_shares(prof, groups=GROUPS)
    linear_s = shares["shares"][LINEAR] * shares["self_cpu_s"]
    return {"rows": rows, "tokens": tokens, "wall_s": wall, "tokens_per_s": tokens / wall,
            "forward_share": forward_s / wall, "steps": engine.steps, "fed_tokens": fed, "logit_rows": logit_rows,
            "linear_gflops": linear_flops(model, fed, logit_rows) / linear_s / 1e9 if linear_s else None,
            **shares}


def run(rows: list[int], requests: int, new_tokens: int, quick: bool, model_name: str = "gpt2-small",
        before: bool = False) -> dict[str, Any]:
    for name, value in (("requests", requests), ("new_tokens", new_tokens)):
        if value < 1:
            raise ValueError(f"{name}={value} must be >= 1")
    torch.manual_seed(0)
    from .ab import CHAR_MODEL, _decode_before

    model = GPTModel(quick_config() if quick else CHAR_MODEL if model_name == "char" else gpt2_small()).eval()
    with _decode_before() if before else contextlib.nullcontext():
        warm = run_rows(model, min(rows), 1, 4, seed=99)  # the first calls of a process plan kernels per shape
        del warm
        ceiling = matmul_ceiling(256 if quick else 1024, repeats=3)
        runs = [run_rows(model, r, requests, new_tokens) for r in rows]
    return {"threads": torch.get_num_threads(), "requests": requests, "new_tokens": new_tokens, "model": model_name,
            "before": before, "matmul_ceiling_gflops": ceiling["gflops_median"], "runs": runs}


def table(result: dict[str, Any]) -> str:
    ceiling = result["matmul_ceiling_gflops"]
    out = []
    for r in result["runs"]:
        row = {"rows": r["rows"], "tok/s": r["tokens_per_s"], "forward % of wall": 100 * r["forward_share"],
               **{f"{g} %": 100 * share for g, share in r["shares"].items()},
               "linear GFLOP/s": r["linear_gflops"],
               "% of matmul ceiling": None if r["linear_gflops"] is None else 100 * r["linear_gflops"] / ceiling}
        out.append(row)
    columns = [(k, k) for k in out[0]]
    lines = [f"{result.get('model', 'gpt2-small')}{' (before the lean step)' if result.get('before') else ''}, "
             f"torch {torch.__version__}, {result['threads']} threads, {result['requests']} requests per row, "
             f"{result['new_tokens']} new tokens; matmul ceiling {ceiling:.1f} GFLOP/s (operator groups: share "
             f"of the forward's self CPU time)"]
    # one row per row count, transposed: the groups are many
    for r in out:
        lines.append(f"-- {r['rows']} rows")
        lines.append(format_table([{"figure": k, "value": v} for k, v in r.items() if k != "rows"],
                                  [("figure", "figure"), ("value", "value")]))
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.engine_profile", description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default=None, help="comma-separated row counts (default 16,64; quick 2)")
    parser.add_argument("--requests", type=int, default=None, help="requests per row (default 3; quick 1)")
    parser.add_argument("--new-tokens", type=int, default=None, help="new tokens per request (default 64; quick 4)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: one per core)")
    parser.add_argument("--quick", action="store_true", help="tiny model: checks that the script works")
    parser.add_argument("--json", type=Path, help="also write the result here (atomically)")
    parser.add_argument("--model", choices=["gpt2-small", "char"], default="gpt2-small",
                        help="the shapes: gpt2-small, or the default tinygpt train model's (char)")
    parser.add_argument("--before", action="store_true", help="the decode step before the lean step")
    args = parser.parse_args(argv)
    try:
        rows = [int(x) for x in (args.rows or ("2" if args.quick else "16,64")).split(",")]
    except ValueError:
        parser.error(f"--rows={args.rows!r} must be comma-separated integers")
    if any(r < 1 for r in rows):
        parser.error(f"--rows={args.rows!r}: every count must be >= 1")
    requests = args.requests or (1 if args.quick else 3)
    new_tokens = args.new_tokens or (4 if args.quick else 64)
    torch.set_num_threads(args.threads) if args.threads else pin_threads()
    return run_and_report(parser, lambda: run(rows, requests, new_tokens, args.quick, args.model, args.before), table,
                          args.json)


if __name__ == "__main__":
    sys.exit(main())
