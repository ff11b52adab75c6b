"""LoRA's training step, tinygpt against Hugging Face + peft, interleaved in one process.

``python -m benchmarks.lora_speed [--quick] [--sizes gpt2-small gpt2-medium] [--ranks 8 16] [--steps N] [--json P]``

``benchmarks.lora`` runs each configuration in a process of its own, which its peak-RSS column needs, but one
after another: on a shared machine its step-time ratios move with the load between two processes. Here both
sides live in one process and take turns, step by step, on the same batches, so whatever slows the machine slows
both: tinygpt's LoRA (r on QKV + the attention's output projection, alpha = 2r) and peft's LoRA on
``GPT2LMHeadModel`` with the same weights (``lora.peft_lora``), AdamW over the adapters, batch 1, rows of the
shipped instruction data cut to ``--tokens`` (prompt tokens masked, as SFT does). The side that goes
first alternates every step. A step is forward + backward + optimizer step; the first step of each side is a
warm-up and not counted. Reported per size and rank: each side's median step, the ratio of the medians
(peft / tinygpt: > 1 is tinygpt faster) and the median of the per-step ratios.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from .common import format_table, pin_threads, run_and_report
from .lora import SHARED_DATA, SIZES, TARGETS, _batches, _model_config, _tokenizer, peft_lora


def _stepper(model, loss_of: Callable) -> Callable:
    import torch

    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3, weight_decay=0.0)

    def step(inputs, targets) -> float:
        start = time.perf_counter()
        loss_of(inputs, targets).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return time.perf_counter() - start

    return step


def compare(size: str, r: int, *, steps: int, tokens: int, quick: bool, data_dir: Path = SHARED_DATA
            ) -> dict[str, Any]:
    """One size and rank: ``steps`` timed steps of each side, interleaved (see the module docstring)."""
    import torch

    from tinygpt import GPTModel
    from tinygpt.lora import LoRAConfig, apply_lora

    config = _model_config(size, quick)
    batches, _ = _batches(_tokenizer(quick, data_dir), min(tokens, config.context_length), 1, steps + 1, 0,
                          data_dir)
    torch.manual_seed(0)
    ours = GPTModel(config).train()
    theirs, theirs_loss = peft_lora(config, ours, r)  # the same weights, copied before the adapters go in
    apply_lora(ours, LoRAConfig(r=r, alpha=2 * r, targets=TARGETS), seed=0)
    sides = {"tinygpt": _stepper(ours, lambda i, t: ours(i, targets=t)), "peft": _stepper(theirs, theirs_loss)}
    times: dict[str, list[float]] = {"tinygpt": [], "peft": []}
    for k, (inputs, targets) in enumerate(batches):
        for name in (("tinygpt", "peft") if k % 2 == 0 else ("peft", "tinygpt")):
            seconds = sides[name](inputs, targets)
            if k > 0:  # step 0: the warm-up of both
                times[name].append(seconds)
    ours_s, theirs_s = statistics.median(times["tinygpt"]), statistics.median(times["peft"])
    return {"size": "tiny" if quick else size, "r": r, "steps": len(times["tinygpt"]),
            "tokens": [int(i.shape[1]) for i, _ in batches[1:]],
            "answer_share": (sum(int((t != -100).sum()) for _, t in batches[1:])
                             / sum(t.numel() for _, t in batches[1:])),
            "tinygpt_step_s": ours_s, "peft_step_s": theirs_s, "speed_x_peft": theirs_s / ours_s,
            "median_step_ratio": statistics.median(p / o for p, o in zip(times["peft"], times["tinygpt"]))}


def run(quick: bool, *, sizes: Sequence[str] = SIZES, ranks: Sequence[int] = (8, 16), steps: int | None = None,
        tokens: int = 128, data_dir: Path = SHARED_DATA) -> dict[str, Any]:
    import importlib.util

    import torch

    if importlib.util.find_spec("peft") is None or importlib.util.find_spec("transformers") is None:
        raise ValueError("this benchmark compares with Hugging Face + peft: pip install transformers peft")
    steps = steps or (2 if quick else 12)
    rows = [compare(size, r, steps=steps, tokens=tokens, quick=quick, data_dir=data_dir)
            for size in (sizes[:1] if quick else sizes) for r in ranks]
    return {"rows": rows, "quick": quick, "steps": steps, "tokens": tokens, "threads": torch.get_num_threads(),
            "cores": os.cpu_count()}


def table(result: dict[str, Any]) -> str:
    columns = [("size", "size"), ("r", "r"), ("steps", "steps"), ("answer_share", "answer tokens share"),
               ("tinygpt_step_s", "tinygpt step s"), ("peft_step_s", "peft step s"),
               ("speed_x_peft", "speed / peft"), ("median_step_ratio", "median step ratio")]
    return (format_table(result["rows"], columns)
            + f"\nbatch 1, rows cut to {result['tokens']} tokens; {result['threads']} torch threads, "
              f"{result['cores']} cores")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.lora_speed", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a tiny model (seconds): the smoke test")
    parser.add_argument("--sizes", nargs="+", choices=SIZES, default=list(SIZES))
    parser.add_argument("--ranks", nargs="+", type=int, default=[8, 16], help="LoRA ranks (default 8 16)")
    parser.add_argument("--steps", type=int, help="timed steps of each side (default 12; quick 2)")
    parser.add_argument("--tokens", type=int, default=128, help="tokens per row at most (default 128)")
    parser.add_argument("--data-dir", type=Path, default=SHARED_DATA, help="folder with instruction-data.json")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = parser.parse_args(argv)
    if args.steps is not None and args.steps < 1:
        parser.error(f"--steps={args.steps} must be >= 1")
    if any(r < 1 for r in args.ranks):
        parser.error(f"--ranks {args.ranks}: every rank must be >= 1")
    if os.environ.get("OMP_NUM_THREADS", "").isdigit():  # a shared machine: the threads it was given
        import torch

        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    else:
        pin_threads()
    return run_and_report(parser, lambda: run(args.quick, sizes=args.sizes, ranks=args.ranks, steps=args.steps,
                                              tokens=args.tokens, data_dir=args.data_dir), table, args.json)


if __name__ == "__main__":
    sys.exit(main())
