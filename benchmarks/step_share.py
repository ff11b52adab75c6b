"""Where a training step of nanoGPT's shakespeare-char CPU recipe goes: tinygpt's and, given a nanoGPT checkout,
nanoGPT's own model, the same shapes and AdamW settings, in one process.

    python -m benchmarks.step_share [--nanogpt DIR] [--threads 2] [--steps 200] [--compile]

For each model: the median step (forward, loss, backward, clip, AdamW) over ``--steps`` after a warm-up, and from
``torch.profiler`` over 50 steps (at most ``--steps``) the share of the step's self CPU time in the matrix products (``mm``, ``addmm``,
oneDNN's linear) and the attention kernels (``scaled_dot_product``): kernels both programs call from ATen for the
same shapes, so neither can spend less there without another kernel. What is left is the room any change outside
those kernels has. ``--compile`` also times tinygpt's step through ``torch.compile`` (inductor's CPU backend fuses
the elementwise work around the products), its compile time reported apart.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from tinygpt import GPTConfig, GPTModel

from .common import format_table, run_and_report

BATCH, CONTEXT, VOCAB = 12, 64, 65  # the recipe's batch and context; tinyshakespeare's 65 characters
KERNELS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm")


def _is_shared_kernel(name: str) -> bool:
    return name in KERNELS or "scaled_dot_product" in name or "linear_pointwise" in name


def measure(name: str, step: Callable[[], None], steps: int) -> dict[str, Any]:
    """Median step time, then the products' and attention's share of 50 profiled steps (fewer for a short run)."""
    from torch.profiler import profile

    for _ in range(min(30, steps)):  # warm-up (and a compile, if any)
        step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    with profile() as prof:
        for _ in range(min(50, steps)):
            step()
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events)
    shared = sum(e.self_cpu_time_total for e in events if _is_shared_kernel(e.key))
    median = statistics.median(times)
    return {"model": name, "step_ms": 1e3 * median, "shared_share": shared / total,
            "shared_ms": 1e3 * median * shared / total, "rest_ms": 1e3 * median * (1 - shared / total)}


def _step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, loss_of: Callable[[], torch.Tensor]
          ) -> Callable[[], None]:
    def step() -> None:
        loss = loss_of()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
    return step


def run(nanogpt: Path | None, threads: int, steps: int, compile: bool) -> dict[str, Any]:
    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, VOCAB, (BATCH, CONTEXT), generator=g)
    y = torch.randint(0, VOCAB, (BATCH, CONTEXT), generator=g)
    rows = []
    torch.manual_seed(0)
    ours = GPTModel(GPTConfig(vocab_size=VOCAB, context_length=CONTEXT, emb_dim=128, n_heads=4, n_layers=4,
                              drop_rate=0.0))
    opt = torch.optim.AdamW(ours.parameters(), lr=1e-3, betas=(0.9, 0.99), weight_decay=0.1)
    rows.append(measure("tinygpt", _step(ours, opt, lambda: ours(x, targets=y)), steps))
    if compile:
        compiled = torch.compile(ours)
        start = time.perf_counter()
        _step(ours, opt, lambda: compiled(x, targets=y))()
        compile_s = time.perf_counter() - start
        rows.append({**measure("tinygpt, torch.compile", _step(ours, opt, lambda: compiled(x, targets=y)),
                               steps), "compile_s": compile_s})
    if nanogpt is not None:
        sys.path.insert(0, str(nanogpt))
        from model import GPT, GPTConfig as NanoConfig  # nanoGPT's model.py

        torch.manual_seed(0)
        theirs = GPT(NanoConfig(block_size=CONTEXT, vocab_size=VOCAB, n_layer=4, n_head=4, n_embd=128, dropout=0.0,
                                bias=True))
        nano_opt = theirs.configure_optimizers(0.1, 1e-3, (0.9, 0.99), "cpu")
        rows.append(measure("nanoGPT", _step(theirs, nano_opt, lambda: theirs(x, y)[1]), steps))
    return {"threads": threads, "steps": steps, "rows": rows}


def table(result: dict[str, Any]) -> str:
    head = (f"shakespeare-char recipe step (4 x 128, batch {BATCH} x {CONTEXT}, AdamW), {result['threads']} "
            f"thread(s), median of {result['steps']} steps; shared kernels = products + attention")
    return head + "\n" + format_table(result["rows"], [
        ("model", "model"), ("step_ms", "step ms"), ("shared_share", "shared kernels' share"),
        ("shared_ms", "in shared kernels, ms"), ("rest_ms", "the rest, ms"), ("compile_s", "compile s")])


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.step_share", description=__doc__.split("\n\n")[0])
    parser.add_argument("--nanogpt", type=Path, help="a nanoGPT checkout: profile its model too")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--compile", action="store_true", help="also time tinygpt's step through torch.compile")
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)
    if args.nanogpt is not None and not (args.nanogpt / "model.py").is_file():
        parser.error(f"--nanogpt {args.nanogpt}: no model.py there (a nanoGPT checkout is expected)")
    if args.threads < 1 or args.steps < 1:
        parser.error("--threads and --steps must be >= 1")
    return run_and_report(parser, lambda: run(args.nanogpt, args.threads, args.steps, args.compile), table,
                          args.json)


if __name__ == "__main__":
    raise SystemExit(main())
