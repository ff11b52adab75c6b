"""The GRPO demo, measured: arithmetic word problems, a small model brought to the format by SFT, then GRPO on 3 seeds.

``python -m benchmarks.grpo_arithmetic [--quick] [--out DIR] [--json PATH] [--seeds 0 1 2] [--grpo-steps N]``

Every stage is the command a user types (``tinygpt.cli.main`` with the arguments printed in the table), in order:

1. ``tinygpt arithmetic-task``: the shipped generated task (train / test split by construction);
2. ``tinygpt train`` on the task's solutions (``corpus.txt``), a few steps: a byte-level BPE and a small model;
3. ``tinygpt sft`` on the training problems (most of the learning: the Alpaca prompt, the calculator's call syntax,
   end-of-text; seven solutions in ten give the answer by heart, ``--direct-share 0.7``, so the SFT model answers by
   heart when greedy and calls the tool on about a third of its samples: GRPO has a switch to reinforce);
4. ``tinygpt grpo`` from the SFT model, once per seed, with the calculator (its output forced and masked).

Measured: held-out accuracy (greedy) of the SFT model and of each GRPO run, with the tool and without it (the model
then writes its calls' results itself); the mean and the spread over the seeds; the rollout throughput of one GRPO
batch (prompts x G completions) through the engine together (with and without the G rows of a prompt sharing its
cached prefix blocks) against the same completions drawn one by one, timed interleaved; the median seconds per GRPO step (the loop's ``step_seconds``: rollout + updates); the wall time of
each stage. ``--quick`` is a seconds-long smoke configuration (tests/test_benchmarks_grpo.py).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from .common import format_table, machine_cores, run_and_report, time_interleaved

FULL = dict(train=1000, test=100, levels=["1"], direct_share="0.7", layers=4, heads=4, emb=128, context=96,
            pretrain_steps=20, pretrain_batch=16, sft_steps=1500, sft_lr="3e-3", grpo_steps=160, grpo_lr="5e-4",
            prompts=8, group=8, new_tokens=20, eval_limit=100)
QUICK = dict(train=60, test=8, levels=["1"], direct_share="0.5", layers=1, heads=2, emb=32, context=96,
             pretrain_steps=4, pretrain_batch=4, sft_steps=2, sft_lr="1e-3", grpo_steps=2, grpo_lr="5e-4", prompts=2,
             group=3, new_tokens=8, eval_limit=8)


def _run(argv: list[str]) -> float:
    """``tinygpt ARGV`` in this process; its wall seconds (a failure is a ``RuntimeError`` naming the command)."""
    from tinygpt.cli import main

    start = time.perf_counter()
    code = main(argv)
    if code != 0:
        raise RuntimeError(f"tinygpt {' '.join(argv)} exited with {code}")
    return time.perf_counter() - start


def _accuracies(model_dir: Path, examples: list[dict[str, Any]], new_tokens: int) -> dict[str, float]:
    from tinygpt.alignment.grpo_trainer import accuracy
    from tinygpt.interop.pretrained import load_pretrained

    model, tokenizer = load_pretrained(model_dir, device="cpu")
    return {f"accuracy_{name}": accuracy(model, tokenizer, examples, max_new_tokens=new_tokens, tool=tool)
            for name, tool in (("tool", True), ("no_tool", False))}


def _throughput(model_dir: Path, examples: list[dict[str, Any]], s: dict[str, Any], repeats: int
                ) -> dict[str, Any]:
    """Completions/s of one rollout batch through the engine together vs the same seeded rows one by one."""
    from tinygpt.alignment.data import format_prompt
    from tinygpt.alignment.grpo_trainer import complete
    from tinygpt.interop.pretrained import load_pretrained

    model, tokenizer = load_pretrained(model_dir, device="cpu")
    prompts = [tokenizer.encode(format_prompt(e["instruction"])) for e in examples[: s["prompts"]]]
    rows = [p for p in prompts for _ in range(s["group"])]
    settings = dict(max_new_tokens=s["new_tokens"], temperature=1.0)
    together = lambda: complete(model, tokenizer, rows, seed=7, **settings)  # noqa: E731
    unshared = lambda: complete(model, tokenizer, rows, seed=7, share_prefix=False, **settings)  # noqa: E731
    alone = lambda: [complete(model, tokenizer, [r], seed=7 + i, **settings) for i, r in enumerate(rows)]  # noqa
    same = together().tokens == [a.tokens[0] for a in alone()] == unshared().tokens
    times = time_interleaved({"engine": together, "engine_no_prefix_sharing": unshared, "one_by_one": alone},
                             warmup=1, repeats=repeats)
    n = len(rows)
    return {"completions": n, "same_completions": same,
            "engine_completions_per_s": n / times["engine"]["median_s"],
            "engine_no_prefix_sharing_completions_per_s": n / times["engine_no_prefix_sharing"]["median_s"],
            "one_by_one_completions_per_s": n / times["one_by_one"]["median_s"],
            "engine_speedup": times["one_by_one"]["median_s"] / times["engine"]["median_s"], "times": times}


def measure(out: Path, quick: bool, seeds: list[int], grpo_steps: int | None, repeats: int) -> dict[str, Any]:
    s = dict(QUICK if quick else FULL)
    if grpo_steps is not None:
        s["grpo_steps"] = grpo_steps
    task, base, sft = out / "task", out / "base", out / "sft"
    common = ["--no-progress", "--force"]
    commands: dict[str, list[str]] = {
        "task": ["arithmetic-task", "--out", str(task), "--train", str(s["train"]), "--test", str(s["test"]),
                 "--levels", *s["levels"], "--direct-share", s["direct_share"]],
        "pretrain": ["train", "--data", str(task / "corpus.txt"), "--tokenizer", "bpe:512", "--out", str(base),
                     "--n-layers", str(s["layers"]), "--n-heads", str(s["heads"]), "--emb-dim", str(s["emb"]),
                     "--context-length", str(s["context"]), "--batch-size", str(s["pretrain_batch"]),
                     "--max-steps", str(s["pretrain_steps"]), "--warmup-steps", "20", "--lr", "3e-3",
                     "--eval-every", str(s["pretrain_steps"]), "--eval-iters", "2", "--sample-tokens", "0", *common],
        "sft": ["sft", "--model", str(base), "--data", str(task / "train.jsonl"), "--out", str(sft),
                "--max-steps", str(s["sft_steps"]), "--batch-size", "16", "--lr", s["sft_lr"], "--eval-every",
                str(s["sft_steps"]), "--val-fraction", "0.02", *common],
    }
    seconds = {name: _run(argv) for name, argv in commands.items()}
    test = [json.loads(line) for line in (task / "test.jsonl").read_text().splitlines()][: s["eval_limit"]]
    before = _accuracies(sft, test, s["new_tokens"])
    runs = []
    for seed in seeds:
        run_dir = out / f"grpo-seed{seed}"
        argv = ["grpo", "--model", str(sft), "--data", str(task / "train.jsonl"), "--eval-data",
                str(task / "test.jsonl"), "--eval-limit", str(s["eval_limit"]), "--out", str(run_dir),
                "--max-steps", str(s["grpo_steps"]), "--batch-size", str(s["prompts"]), "--group-size",
                str(s["group"]), "--max-new-tokens", str(s["new_tokens"]), "--lr", s["grpo_lr"], "--warmup-steps",
                "5", "--eval-every", str(max(1, s["grpo_steps"] // 4)), "--seed", str(seed), *common]
        wall = _run(argv)
        records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        runs.append({"seed": seed, "command": "tinygpt " + " ".join(argv), "wall_s": wall,
                     "step_seconds_median": statistics.median(r["step_seconds"] for r in records),
                     "curve": [(r["step"], r["val_accuracy"]) for r in records if "val_accuracy" in r],
                     "tool_curve": [(r["step"], r["tool_calls"]) for r in records],
                     "tool_calls_first_last": [records[0]["tool_calls"], records[-1]["tool_calls"]],
                     **_accuracies(run_dir, test, s["new_tokens"])})
    throughput = _throughput(sft, test, s, repeats)

    def mean_spread(key: str) -> dict[str, float]:
        values = [r[key] for r in runs]
        return {"mean": statistics.mean(values), "min": min(values), "max": max(values),
                "stdev": statistics.stdev(values) if len(values) > 1 else 0.0}

    return {"settings": s, "quick": quick, "cores": machine_cores(), "torch_threads": torch.get_num_threads(),
            "load_average": os.getloadavg(), "commands": {k: "tinygpt " + " ".join(v) for k, v in commands.items()},
            "stage_seconds": seconds, "sft": before, "grpo_runs": runs,
            "grpo": {k: mean_spread(k) for k in ("accuracy_tool", "accuracy_no_tool", "step_seconds_median")},
            "throughput": throughput,
            "total_demo_seconds": sum(seconds.values()) + sum(r["wall_s"] for r in runs) / len(runs)}


def draw(result: dict[str, Any], path: str | Path) -> None:
    """Two panels against the GRPO step, one line per seed: the held-out accuracy (greedy, with the tool; step 0 is
    the SFT model) and the share of sampled completions that call the calculator; as a PNG."""
    from tinygpt.figures import integer_ticks, new_figure, save_png

    fig = new_figure(7, 6)
    top, bottom = fig.subplots(2, 1, sharex=True)
    start = result["sft"]["accuracy_tool"]
    for run in result["grpo_runs"]:
        steps, values = zip(*([(0, start)] + [tuple(point) for point in run["curve"]]))
        top.plot(steps, values, "o-", label=f"seed {run['seed']}")
        steps, values = zip(*[tuple(point) for point in run["tool_curve"]])
        bottom.plot(steps, values, label=f"seed {run['seed']}")
    top.axhline(result["sft"]["accuracy_no_tool"], color="gray", ls="--", lw=1, label="SFT model, no tool")
    top.set_ylabel("held-out accuracy\n(greedy, tool)")
    bottom.set_ylabel("completions that\ncall the tool (sampled)")
    for ax in (top, bottom):
        ax.set_ylim(0, 1)
        ax.set_xlabel("GRPO step")
        ax.xaxis.set_tick_params(labelbottom=True)
        integer_ticks(ax.xaxis)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    save_png(fig, Path(path))


def table(result: dict[str, Any]) -> str:
    rows = [{"model": "SFT (before GRPO)", "tool": result["sft"]["accuracy_tool"],
             "no_tool": result["sft"]["accuracy_no_tool"]}]
    rows += [{"model": f"GRPO seed {r['seed']}", "tool": r["accuracy_tool"], "no_tool": r["accuracy_no_tool"],
              "step": r["step_seconds_median"]} for r in result["grpo_runs"]]
    g = result["grpo"]
    rows.append({"model": "GRPO mean", "tool": g["accuracy_tool"]["mean"], "no_tool": g["accuracy_no_tool"]["mean"],
                 "step": g["step_seconds_median"]["mean"]})
    t = result["throughput"]
    lines = [format_table(rows, [("model", "model"), ("tool", "accuracy, tool"), ("no_tool", "accuracy, no tool"),
                                 ("step", "s / GRPO step")]), "",
             f"rollout of {t['completions']} completions: engine {t['engine_completions_per_s']:.1f}/s (without "
             f"prefix sharing {t['engine_no_prefix_sharing_completions_per_s']:.1f}/s), one by one "
             f"{t['one_by_one_completions_per_s']:.1f}/s ({t['engine_speedup']:.2f}x; same completions: "
             f"{t['same_completions']})",
             "stage seconds: " + ", ".join(f"{k} {v:.0f}" for k, v in result["stage_seconds"].items())
             + f"; the demo (task + pretrain + sft + one GRPO run): {result['total_demo_seconds']:.0f} s",
             f"cores {result['cores']}, load average {', '.join(f'{x:.1f}' for x in result['load_average'])}"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.grpo_arithmetic", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a seconds-long smoke configuration")
    parser.add_argument("--out", default="runs/grpo-arithmetic", help="folder for the task and the runs")
    parser.add_argument("--json", help="write the result here")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--grpo-steps", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=3, help="interleaved rounds of the throughput timing")
    parser.add_argument("--figure", help="draw the accuracy curves into this PNG")
    args = parser.parse_args(argv)

    def compute() -> dict[str, Any]:
        result = measure(Path(args.out), args.quick, args.seeds, args.grpo_steps, args.repeats)
        if args.figure:
            draw(result, args.figure)
        return result

    return run_and_report(parser, compute, table, args.json)


if __name__ == "__main__":
    raise SystemExit(main())
