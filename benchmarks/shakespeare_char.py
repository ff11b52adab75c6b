"""Quality bar: the character-level Shakespeare "baby GPT" on CPU, through tinygpt's own training API.

    python -m benchmarks.shakespeare_char [--steps 2000] [--data PATH] [--out DIR] [--json PATH] [--threads N]

The setting is nanoGPT's CPU example for ``shakespeare_char``: 4 layers, 4 heads, D=128, C=64, batch 12, 2000 steps,
lr 1e-3 (warmup 100, cosine to 1e-4), AdamW beta2 0.99, weight decay 0.1, clip 1.0, dropout 0, the first 90% of the
characters for training and the last 10% for validation, loss estimated on 20 batches. nanoGPT's README reports a
validation loss of about 1.88 for it; this script reports tinygpt's, with tokens/s, in a table and a JSON file.
(tinygpt's linears keep their biases -- the seeds' GPT-2 layout -- where that example turns them off.)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from tinygpt import GPTConfig
from tinygpt.training import TrainingOptions, train

from .common import shared_data_dir

DEFAULT_DATA = shared_data_dir() / "tinyshakespeare.txt"
REFERENCE_VAL_LOSS = 1.88  # nanoGPT README, same setting on CPU


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA, help=f"the text (default: {DEFAULT_DATA})")
    parser.add_argument("--steps", type=int, default=2000, help="optimizer steps (default: 2000, the reference's)")
    parser.add_argument("--out", type=Path, default=None, help="run folder (default: a temporary folder)")
    parser.add_argument("--json", type=Path, default=Path("shakespeare_char.json"),
                        help="where to write the figures (default: ./shakespeare_char.json)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    args = parser.parse_args(argv)
    if not args.data.is_file():
        parser.error(f"{args.data} not found; pass --data PATH to tinyshakespeare.txt")
    if args.threads:
        torch.set_num_threads(args.threads)

    with tempfile.TemporaryDirectory() as tmp:
        run_dir = args.out or Path(tmp) / "run"
        # vocab_size: the 65 characters of the text; a config file larger than the vocabulary would only add
        # never-seen rows, so the char tokenizer's own size is used (resolve_config checks it).
        chars = len(set(args.data.read_text(encoding="utf-8")))
        config = GPTConfig(vocab_size=chars, context_length=64, emb_dim=128, n_heads=4, n_layers=4, drop_rate=0.0)
        options = TrainingOptions(
            data=[str(args.data)], tokenizer="char", config=config, out_dir=str(run_dir), max_steps=args.steps,
            batch_size=12, lr=1e-3, min_lr=1e-4, warmup_steps=100, beta2=0.99, weight_decay=0.1, grad_clip=1.0,
            eval_every=250, eval_iters=20, sample_tokens=200, sample_prompt="\n", device="cpu", seed=1337,
            keep_last=1,
        )
        start = time.perf_counter()
        result = train(options)
        wall = time.perf_counter() - start
        records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]

    # Steady-state speed: the median over steps after the first 10 (warm-up), eval/checkpoint time excluded.
    per_step = [r["step_seconds"] for r in records[10:]] or [r["step_seconds"] for r in records]
    tokens_per_step = options.batch_size * config.context_length
    figures = {
        "steps": result.step,
        "val_loss": result.val_loss,
        "train_loss": result.train_loss,
        "reference_val_loss": REFERENCE_VAL_LOSS,
        "val_loss_ratio": result.val_loss / REFERENCE_VAL_LOSS,
        "unigram_entropy": result.unigram_entropy,
        "tokens_per_second_median": tokens_per_step / statistics.median(per_step),
        "wall_seconds": wall,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "config": config.to_dict(),
        "sample": result.samples[-1] if result.samples else "",
    }
    rows = [
        ("steps", f"{figures['steps']}"),
        ("val loss (tinygpt)", f"{figures['val_loss']:.4f}"),
        ("val loss (nanoGPT README)", f"~{REFERENCE_VAL_LOSS}"),
        ("ratio tinygpt / reference", f"{figures['val_loss_ratio']:.3f}"),
        ("train loss", f"{figures['train_loss']:.4f}"),
        ("unigram baseline", f"{figures['unigram_entropy']:.4f}"),
        ("tokens/s (median step)", f"{figures['tokens_per_second_median']:,.0f}"),
        ("wall time", f"{wall:.1f} s on {figures['threads']} thread(s)"),
    ]
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value}")
    print(f"--- sample ---\n{figures['sample']}")
    args.json.write_text(json.dumps(figures, indent=2) + "\n", encoding="utf-8")
    print(f"wrote {args.json}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
