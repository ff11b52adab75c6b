"""torch's intra-op threads on a busy machine: one 40-token generation with one thread per core against one thread.

    python -m benchmarks.threads [--repeats N] [--tokens N] [--json PATH]

The model is the shape ``tinygpt train`` builds by default (V=222, C=128, D=128, H=4, L=4), randomly initialised:
speed does not depend on what the weights learnt. torch gives each process one thread per core; when other work
holds those cores, its threads wait for one another at every operation, and a small model's work per operation is
far too short to pay for that. Both settings run in this one process, interleaved, so a busy spell hits both
alike; the table gives medians with the min-max spread and the ratio. Record ``uptime``'s load beside the figures.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any

import torch

from tinygpt import GPTConfig, GPTModel, generate

from .common import format_table, machine_cores, run_and_report, spread, time_interleaved

DEFAULT_TRAIN_SHAPE = dict(vocab_size=222, context_length=128, emb_dim=128, n_heads=4, n_layers=4)


def compute(repeats: int, tokens: int) -> dict[str, Any]:
    if repeats < 1 or tokens < 1:
        raise ValueError(f"--repeats={repeats} and --tokens={tokens} must be >= 1")
    torch.manual_seed(0)
    model = GPTModel(GPTConfig(**DEFAULT_TRAIN_SHAPE)).eval()
    cores = machine_cores()

    def run(threads: int):
        def call() -> None:
            torch.set_num_threads(threads)
            generate(model, [[1, 2, 3, 4]], max_new_tokens=tokens)
        return call

    stats = time_interleaved({f"{cores} threads (torch's default)": run(cores), "1 thread": run(1)},
                             warmup=1, repeats=repeats)
    many, one = stats.values()
    return {"cores": cores, "tokens": tokens, "load_average": list(os.getloadavg()), "stats": stats,
            "ratio_default_over_one": many["median_s"] / one["median_s"]}


def table(result: dict[str, Any]) -> str:
    rows = [{"setting": name, "ms": spread(s)} for name, s in result["stats"].items()]
    load = ", ".join(f"{v:.1f}" for v in result["load_average"])
    return (format_table(rows, [("setting", "threads"), ("ms", f"{result['tokens']}-token generation, ms "
                                                                 "median [min-max]")])
            + f"\ndefault / one thread: {result['ratio_default_over_one']:.1f}x  (load average {load})")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5, help="interleaved rounds (default: 5)")
    parser.add_argument("--tokens", type=int, default=40, help="tokens generated per call (default: 40)")
    parser.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    args = parser.parse_args(argv)
    return run_and_report(parser, lambda: compute(args.repeats, args.tokens), table, args.json)


if __name__ == "__main__":
    sys.exit(main())
