"""Activation checkpointing (``--grad-checkpoint``): peak memory and step time of one training step, with and without.

    python -m benchmarks.grad_checkpoint [--config gpt2-small] [--batch-size 8] [--context 1024] [--steps 2]
                                         [--rounds 1] [--device cpu|cuda] [--dtype float32|bfloat16] [--json PATH]

A training step is tinygpt's: ``model(x, targets=y)`` (the head-fused loss), ``backward``, AdamW (the optimizer
state exists from the first step on, as in a run). Each mode runs in a fresh process (a peak is a high-water mark
that never goes down), the two modes interleaved ``--rounds`` times. Peak memory: on CUDA
``torch.cuda.max_memory_allocated`` (the tensors alone); on CPU the process's peak RSS (``VmHWM``) minus its RSS
before the first step, i.e. what the steps added on top of the weights. Step time: the median of ``--steps`` steps
after one warm-up step. The table gives both modes and the ratios checkpointed / plain.

One measurement alone: ``python -m benchmarks.grad_checkpoint --worker plain|checkpointed ...`` (one JSON line).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from .common import format_table, write_json_atomic

MODES = ("plain", "checkpointed")
ROOT = Path(__file__).resolve().parents[1]


def _rss_mib(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024  # kB
    return float("nan")


def worker(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from tinygpt import GPTModel, get_config
    from tinygpt.devices import autocast
    from tinygpt.training import build_optimizer
    from tinygpt.training.memory import checkpoint_blocks

    torch.manual_seed(0)
    device = torch.device(args.device)
    config = get_config(args.config).replace(context_length=args.context, drop_rate=0.0)
    with device:
        model = GPTModel(config).train()
    if args.worker == "checkpointed":
        checkpoint_blocks(model)
    optimizer = build_optimizer(model, lr=1e-4)
    x = torch.randint(0, config.vocab_size, (args.batch_size, args.context), device=device)
    y = torch.randint(0, config.vocab_size, (args.batch_size, args.context), device=device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device) if device.type == "cuda" else _rss_mib("VmRSS")
    times = []
    for _ in range(1 + args.steps):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        with autocast(device, args.dtype):
            loss = model(x, targets=y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    if device.type == "cuda":
        peak = (torch.cuda.max_memory_allocated(device) - before) / 1024**2
    else:
        peak = _rss_mib("VmHWM") - before
    return {"mode": args.worker, "step_seconds": statistics.median(times[1:]), "peak_mib_added": peak,
            "loss": float(loss)}


def _one(args: argparse.Namespace, mode: str) -> dict[str, Any]:
    command = [sys.executable, "-m", "benchmarks.grad_checkpoint", "--worker", mode, "--config", args.config,
               "--batch-size", str(args.batch_size), "--context", str(args.context), "--steps", str(args.steps),
               "--device", args.device, "--dtype", args.dtype]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def compare(args: argparse.Namespace) -> dict[str, Any]:
    runs: dict[str, list[dict[str, Any]]] = {mode: [] for mode in MODES}
    for i in range(args.rounds):
        for mode in (MODES if i % 2 == 0 else MODES[::-1]):
            runs[mode].append(_one(args, mode))
    median = {mode: {k: statistics.median(r[k] for r in runs[mode]) for k in ("step_seconds", "peak_mib_added")}
              for mode in MODES}
    ratio = {k: median["checkpointed"][k] / median["plain"][k] for k in ("step_seconds", "peak_mib_added")}
    return {"config": args.config, "batch_size": args.batch_size, "context": args.context, "device": args.device,
            "dtype": args.dtype, "steps": args.steps, "rounds": args.rounds, "median": median,
            "ratio_checkpointed_over_plain": ratio, "runs": runs}


def table(result: dict[str, Any]) -> str:
    rows = [{"mode": mode, "peak": result["median"][mode]["peak_mib_added"],
             "step": result["median"][mode]["step_seconds"]} for mode in MODES]
    r = result["ratio_checkpointed_over_plain"]
    rows.append({"mode": "checkpointed / plain", "peak": r["peak_mib_added"], "step": r["step_seconds"]})
    return format_table(rows, [("mode", "mode"), ("peak", "peak memory added (MiB)"), ("step", "step (s)")])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.grad_checkpoint", description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="gpt2-small")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=2, help="timed steps after one warm-up step")
    parser.add_argument("--rounds", type=int, default=1, help="fresh-process pairs, the order alternating")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--worker", choices=MODES, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(args)))
        return 0
    result = compare(args)
    print(f"{args.config}, batch {args.batch_size} x {args.context}, {args.device} {args.dtype}")
    print(table(result))
    if args.json is not None:
        write_json_atomic(args.json, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
