"""torch's intra-op threads on a busy machine: one 40-token generation, and a training step of the main job, with one
thread per core against one thread.

    python -m benchmarks.threads [--repeats N] [--tokens N] [--train-batch N] [--json PATH]

The model is the shape ``tinygpt train`` builds by default (V=222, C=128, D=128, H=4, L=4), randomly initialised:
speed does not depend on what the weights learnt. torch gives each process one thread per core; when other work
holds those cores, its threads wait for one another at every operation, and a small model's work per operation is
far too short to pay for that. Both settings run in this one process, interleaved, so a busy spell hits both
alike; the table gives medians with the min-max spread and the ratio. Record ``uptime``'s load beside the figures.

The training step is ``tinygpt train``'s (a batch of 16 windows of 128 characters: forward, loss, backward, AdamW).
Its last line says whether the two settings give bit-identical weights after the timed steps from the same start:
why the commands say when to use one thread (``tinygpt.devices.crowded_cpu_note``) rather than choose the count
themselves, which would make the same ``--seed`` give other weights on a busier machine where they differ.
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


def _training_step(threads: int, batch: int) -> tuple[GPTModel, Any]:
    """(the model, a call that sets ``threads`` and takes one AdamW step on a fixed batch of ``batch`` windows)."""
    torch.manual_seed(0)
    model = GPTModel(GPTConfig(**DEFAULT_TRAIN_SHAPE))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, DEFAULT_TRAIN_SHAPE["vocab_size"], (batch, DEFAULT_TRAIN_SHAPE["context_length"] + 1),
                        generator=g)

    def call() -> None:
        torch.set_num_threads(threads)
        loss = model(ids[:, :-1], targets=ids[:, 1:])  # [B, C] -> scalar
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model, call


def compute(repeats: int, tokens: int, train_batch: int = 16) -> dict[str, Any]:
    if repeats < 1 or tokens < 1 or train_batch < 1:
        raise ValueError(f"--repeats={repeats}, --tokens={tokens} and --train-batch={train_batch} must be >= 1")
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
    load_before = list(os.getloadavg())
    (model_many, step_many), (model_one, step_one) = _training_step(cores, train_batch), _training_step(1, train_batch)
    train = time_interleaved({f"{cores} threads (torch's default)": step_many, "1 thread": step_one}, warmup=1,
                             repeats=repeats)
    same = all(torch.equal(a, b) for a, b in zip(model_many.parameters(), model_one.parameters()))
    return {"cores": cores, "tokens": tokens, "load_average": load_before, "stats": stats,
            "ratio_default_over_one": many["median_s"] / one["median_s"], "train_batch": train_batch,
            "train_stats": train, "load_average_after": list(os.getloadavg()),
            "ratio_train_default_over_one": train[f"{cores} threads (torch's default)"]["median_s"]
            / train["1 thread"]["median_s"], "train_weights_identical": same}


def table(result: dict[str, Any]) -> str:
    rows = [{"setting": name, "ms": spread(s)} for name, s in result["stats"].items()]
    load = ", ".join(f"{v:.1f}" for v in result["load_average"])
    for row, s in zip(rows, result["train_stats"].values()):
        row["train"] = spread(s)
    after = ", ".join(f"{v:.1f}" for v in result["load_average_after"])
    return (format_table(rows, [("setting", "threads"), ("ms", f"{result['tokens']}-token generation, ms "
                                                                 "median [min-max]"),
                                ("train", f"training step ({result['train_batch']} x 128), ms median [min-max]")])
            + f"\ndefault / one thread: generation {result['ratio_default_over_one']:.1f}x, training step "
              f"{result['ratio_train_default_over_one']:.1f}x  (load average {load}; after: {after})"
            + f"\nweights after the training steps bit-identical in both settings: {result['train_weights_identical']}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5, help="interleaved rounds (default: 5)")
    parser.add_argument("--tokens", type=int, default=40, help="tokens generated per call (default: 40)")
    parser.add_argument("--train-batch", type=int, default=16, help="windows per training step (default: 16)")
    parser.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    args = parser.parse_args(argv)
    return run_and_report(parser, lambda: compute(args.repeats, args.tokens, args.train_batch), table, args.json)


if __name__ == "__main__":
    sys.exit(main())
