"""Quality bar and whole-run speed: the character-level Shakespeare "baby GPT" on CPU, through tinygpt's training API,
and -- given a copy of nanoGPT -- nanoGPT's own ``train.py`` on the same recipe in the same sitting.

    python -m benchmarks.shakespeare_char [--steps 2000] [--data PATH] [--out DIR] [--json PATH] [--threads N]
                                          [--optimizer adamw|muon] [--muon-lr LR] [--block gpt2|modern]
                                          [--eval-every N] [--nanogpt DIR [--repeat K]]

The setting is nanoGPT's CPU example for ``shakespeare_char``: 4 layers, 4 heads, D=128, C=64, batch 12, 2000 steps,
lr 1e-3 (warmup 100, cosine to 1e-4), AdamW beta2 0.99, weight decay 0.1, clip 1.0, dropout 0, the first 90% of the
characters for training and the last 10% for validation, loss estimated on 20 batches every 250 steps. nanoGPT's
README reports a validation loss of about 1.88 for it; this script reports tinygpt's, with tokens/s, in a table and a
JSON file. (tinygpt's linears keep their biases -- the seeds' GPT-2 layout -- where that example turns them off.)

``--nanogpt DIR`` (a checkout of karpathy/nanoGPT) times the whole run of both, each in a fresh process, from
process start to exit: tinygpt as ``python -m benchmarks.shakespeare_char`` (its data preparation is part of its
run) and nanoGPT as ``data/shakespeare_char/prepare.py`` on the same text followed by
``train.py config/train_shakespeare_char.py`` with the overrides nanoGPT's README gives for a CPU
(``NANOGPT_CPU_OVERRIDES``; ``--max_iters``/``--lr_decay_iters`` follow ``--steps``). nanoGPT's files are copied
into a temporary folder first, so the checkout given is never written to. ``--repeat K`` runs K pairs, the order
alternating (tinygpt first, then nanoGPT first, ...), so a slow spell of a shared machine hits both alike. Reported
per program: wall seconds, the median step's tokens/s, and the seconds spent outside the optimizer steps (startup,
data, evaluation, samples, plots, checkpoints: wall minus the steps' own time), which a loaded machine disturbs far
less than the wall time; and the ratios tinygpt / nanoGPT. Both also report the time to the target: the first
evaluation at or below nanoGPT's 1.88, its step, and the seconds of the steps up to it (``--eval-every`` sets both
programs' evaluation interval, and so the resolution of that figure).

``--optimizer muon`` (``--muon-lr``) and ``--block modern`` (``config.MODERN_BLOCK``'s switches) change tinygpt's
side only: nanoGPT keeps its recipe, and the time to 1.88 is then the comparison that counts.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from tinygpt import GPTConfig
from tinygpt.config import MODERN_BLOCK
from tinygpt.training import TrainingOptions, train

from .common import shared_data_dir, write_json_atomic

DEFAULT_DATA = shared_data_dir() / "tinyshakespeare.txt"
REFERENCE_VAL_LOSS = 1.88  # nanoGPT README, same setting on CPU
BATCH_SIZE, CONTEXT = 12, 64
WARMUP_STEPS = 10  # steps left out of the median step time (allocator and thread-pool warm-up)

# nanoGPT's README, "I only have a macbook": the shakespeare_char config made small enough for a CPU.
NANOGPT_CPU_OVERRIDES = ["--device=cpu", "--compile=False", "--eval_iters=20", "--log_interval=1",
                         "--block_size=64", "--batch_size=12", "--n_layer=4", "--n_head=4", "--n_embd=128",
                         "--dropout=0.0"]
# What the comparison needs of a nanoGPT checkout (copied into a scratch folder, never written in place).
NANOGPT_FILES = ["train.py", "model.py", "configurator.py", "config/train_shakespeare_char.py",
                 "data/shakespeare_char/prepare.py"]
_NANOGPT_ITER = re.compile(r"^iter (\d+): loss [-+0-9.eE]+, time ([0-9.]+)ms", re.MULTILINE)
_NANOGPT_EVAL = re.compile(r"^step (\d+): train loss ([0-9.]+), val loss ([0-9.]+)", re.MULTILINE)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA, help=f"the text (default: {DEFAULT_DATA})")
    parser.add_argument("--steps", type=int, default=2000, help="optimizer steps (default: 2000, the reference's)")
    parser.add_argument("--out", type=Path, default=None, help="run folder (default: a temporary folder)")
    parser.add_argument("--json", type=Path, default=Path("shakespeare_char.json"),
                        help="where to write the figures (default: ./shakespeare_char.json)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    parser.add_argument("--nanogpt", type=Path, default=None, metavar="DIR",
                        help="a nanoGPT checkout: time its train.py on the same recipe, side by side")
    parser.add_argument("--repeat", type=int, default=1, help="with --nanogpt: pairs of runs (default: 1)")
    parser.add_argument("--nanogpt-steps", type=int, default=None,
                        help="with --nanogpt: nanoGPT's steps when they differ from tinygpt's --steps (default: "
                             "the same); e.g. a shorter tinygpt schedule that ends at nanoGPT's final loss")
    parser.add_argument("--optimizer", choices=("adamw", "muon"), default="adamw", help="tinygpt's optimizer")
    parser.add_argument("--muon-lr", type=float, default=0.02, help="tinygpt's Muon rate (default: 0.02)")
    parser.add_argument("--block", choices=("gpt2", "modern"), default="gpt2",
                        help="tinygpt's block: gpt2 (the recipe's) or modern (config.MODERN_BLOCK)")
    parser.add_argument("--eval-every", type=int, default=None,
                        help="evaluation interval of both (default: the recipe's 250)")
    args = parser.parse_args(argv)
    if not args.data.is_file():
        parser.error(f"{args.data} not found; pass --data PATH to tinyshakespeare.txt")
    if args.steps < 1:
        parser.error(f"--steps {args.steps}: must be >= 1")
    if args.threads is not None and args.threads < 1:
        parser.error(f"--threads {args.threads}: must be >= 1")
    if args.nanogpt_steps is not None and args.nanogpt_steps < 1:
        parser.error(f"--nanogpt-steps {args.nanogpt_steps}: must be >= 1")
    if args.repeat < 1:
        parser.error(f"--repeat {args.repeat}: must be >= 1")
    if args.nanogpt is not None:
        missing = [name for name in NANOGPT_FILES if not (args.nanogpt / name).is_file()]
        if missing:
            parser.error(f"--nanogpt {args.nanogpt}: not a nanoGPT checkout (missing {', '.join(missing)})")
        if args.out is not None:
            parser.error("--out is for a tinygpt-only run; with --nanogpt each run uses a temporary folder")
        figures = side_by_side(args)
        print(side_by_side_table(figures))
    else:
        if args.threads:
            torch.set_num_threads(args.threads)
        figures = run_tinygpt(args.data, args.steps, args.out, optimizer=args.optimizer, muon_lr=args.muon_lr,
                              block=args.block, eval_every=args.eval_every or 250)
        print(tinygpt_table(figures))
    write_json_atomic(args.json, figures)
    print(f"wrote {args.json}", file=sys.stderr)
    return 0


# ------------------------------------------------------------------------------------------------ tinygpt
def run_tinygpt(data: Path, steps: int, out: Path | None, *, optimizer: str = "adamw", muon_lr: float = 0.02,
                block: str = "gpt2", eval_every: int = 250) -> dict[str, Any]:
    """Train the recipe in this process; the figures of ``tinygpt_table``."""
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = out or Path(tmp) / "run"
        # vocab_size: the 65 characters of the text; a config file larger than the vocabulary would only add
        # never-seen rows, so the char tokenizer's own size is used (resolve_config checks it).
        chars = len(set(data.read_text(encoding="utf-8")))
        config = GPTConfig(vocab_size=chars, context_length=CONTEXT, emb_dim=128, n_heads=4, n_layers=4,
                           drop_rate=0.0, **(MODERN_BLOCK if block == "modern" else {}))
        options = TrainingOptions(
            data=[str(data)], tokenizer="char", config=config, out_dir=str(run_dir), max_steps=steps,
            batch_size=BATCH_SIZE, lr=1e-3, min_lr=1e-4, warmup_steps=100, beta2=0.99, weight_decay=0.1,
            grad_clip=1.0, eval_every=eval_every, eval_iters=20, optimizer=optimizer, muon_lr=muon_lr, sample_tokens=200, sample_prompt="\n", device="cpu",
            seed=1337, keep_last=1,
        )
        start = time.perf_counter()
        result = train(options)
        wall = time.perf_counter() - start
        records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]

    # Steady-state speed: the median over steps after the warm-up; step_seconds leaves eval/checkpoint time out.
    step_seconds = [r["step_seconds"] for r in records]
    reached = [r["step"] for r in records if r.get("val_loss", math.inf) <= REFERENCE_VAL_LOSS]
    return {
        "steps_to_target": reached[0] if reached else None,
        "seconds_to_target": sum(step_seconds[: reached[0]]) if reached else None,
        "optimizer": optimizer, "block": block,
        "steps": result.step,
        "val_loss": result.val_loss,
        "train_loss": result.train_loss,
        "reference_val_loss": REFERENCE_VAL_LOSS,
        "val_loss_ratio": result.val_loss / REFERENCE_VAL_LOSS,
        "unigram_entropy": result.unigram_entropy,
        "tokens_per_second_median": BATCH_SIZE * CONTEXT / statistics.median(_steady(step_seconds)),
        "wall_seconds": wall,
        "step_seconds_total": sum(step_seconds),
        "seconds_outside_steps": wall - sum(step_seconds),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "config": config.to_dict(),
        "sample": result.samples[-1] if result.samples else "",
    }


def _steady(step_seconds: list[float]) -> list[float]:
    return step_seconds[WARMUP_STEPS:] or step_seconds


def tinygpt_table(f: dict[str, Any]) -> str:
    rows = [
        ("steps", f"{f['steps']}"),
        ("val loss (tinygpt)", f"{f['val_loss']:.4f}"),
        ("val loss (nanoGPT README)", f"~{REFERENCE_VAL_LOSS}"),
        ("ratio tinygpt / reference", f"{f['val_loss_ratio']:.3f}"),
        ("train loss", f"{f['train_loss']:.4f}"),
        ("unigram baseline", f"{f['unigram_entropy']:.4f}"),
        ("tokens/s (median step)", f"{f['tokens_per_second_median']:,.0f}"),
        ("wall time", f"{f['wall_seconds']:.1f} s on {f['threads']} thread(s)"),
        ("to val <= 1.88", "not reached" if f["steps_to_target"] is None else
         f"step {f['steps_to_target']}, {f['seconds_to_target']:.1f} s of steps"),
        ("outside the steps", f"{f['seconds_outside_steps']:.1f} s (setup, eval, samples, plots, checkpoints)"),
    ]
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"{name:<{width}}  {value}" for name, value in rows) + f"\n--- sample ---\n{f['sample']}"


# ------------------------------------------------------------------------------------------------ side by side
def side_by_side(args: argparse.Namespace) -> dict[str, Any]:
    """``args.repeat`` pairs of whole runs, each program in its own process; medians and ratios."""
    runs: dict[str, list[dict[str, Any]]] = {"tinygpt": [], "nanogpt": []}
    env = dict(os.environ)
    if args.threads:
        env["OMP_NUM_THREADS"] = str(args.threads)  # nanoGPT sets no thread count; torch reads this at start
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for i in range(args.repeat):
            order = ("tinygpt", "nanogpt") if i % 2 == 0 else ("nanogpt", "tinygpt")
            for name in order:
                work = tmp / f"{name}-{i}"
                if name == "tinygpt":
                    runs[name].append(_tinygpt_process(args, work, env))
                else:
                    runs[name].append(_nanogpt_process(args, work, env))
                r = runs[name][-1]
                print(f"[{i + 1}/{args.repeat}] {name}: {r['wall_seconds']:.1f} s wall, "
                      f"{r['seconds_outside_steps']:.1f} s outside the steps, "
                      f"{r['tokens_per_second_median']:,.0f} tok/s median step", file=sys.stderr)
    keys = ("wall_seconds", "seconds_outside_steps", "tokens_per_second_median")
    summary = {name: {k: statistics.median(r[k] for r in rs) for k in keys} for name, rs in runs.items()}
    for name in summary:
        summary[name]["val_loss"] = statistics.median(r["val_loss"] for r in runs[name])
        reached = [r["seconds_to_target"] for r in runs[name] if r["seconds_to_target"] is not None]
        summary[name]["seconds_to_target"] = statistics.median(reached) if len(reached) == len(runs[name]) else None
    # Ratios per pair (the two runs of a pair share the machine's mood), then their median.
    ratios = {k: statistics.median(t[k] / n[k] for t, n in zip(runs["tinygpt"], runs["nanogpt"])) for k in keys}
    if summary["tinygpt"]["seconds_to_target"] is not None and summary["nanogpt"]["seconds_to_target"] is not None:
        ratios["seconds_to_target"] = statistics.median(
            t["seconds_to_target"] / n["seconds_to_target"] for t, n in zip(runs["tinygpt"], runs["nanogpt"]))
    return {"optimizer": args.optimizer, "block": args.block, "steps": args.steps, "nanogpt_steps": args.nanogpt_steps or args.steps, "repeat": args.repeat, "threads": args.threads, "torch": torch.__version__,
            "median": summary, "ratio_tinygpt_over_nanogpt": ratios, "runs": runs}


def _tinygpt_process(args: argparse.Namespace, work: Path, env: dict[str, str]) -> dict[str, Any]:
    """This script without ``--nanogpt``, in a fresh interpreter: imports and data preparation count."""
    work.mkdir(parents=True)
    command = [sys.executable, "-m", "benchmarks.shakespeare_char", "--data", str(args.data),
               "--steps", str(args.steps), "--out", str(work / "run"), "--json", str(work / "figures.json")]
    if args.threads:
        command += ["--threads", str(args.threads)]
    command += ["--optimizer", args.optimizer, "--muon-lr", str(args.muon_lr), "--block", args.block]
    if args.eval_every:
        command += ["--eval-every", str(args.eval_every)]
    root = Path(__file__).resolve().parents[1]
    child_env = dict(env, PYTHONPATH=os.pathsep.join(p for p in (str(root / "src"), str(root),
                                                                  env.get("PYTHONPATH", "")) if p))
    start = time.perf_counter()
    _run(command, cwd=root, env=child_env, log=work / "log.txt")
    wall = time.perf_counter() - start
    inner = json.loads((work / "figures.json").read_text(encoding="utf-8"))
    return {"wall_seconds": wall, "step_seconds_total": inner["step_seconds_total"],
            "seconds_outside_steps": wall - inner["step_seconds_total"],
            "tokens_per_second_median": inner["tokens_per_second_median"], "val_loss": inner["val_loss"],
            "steps": inner["steps"], "steps_to_target": inner["steps_to_target"],
            "seconds_to_target": inner["seconds_to_target"]}


def _nanogpt_process(args: argparse.Namespace, work: Path, env: dict[str, str]) -> dict[str, Any]:
    """nanoGPT's prepare.py on ``args.data`` (as its input.txt), then its train.py with the CPU recipe."""
    for name in NANOGPT_FILES:
        (work / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(args.nanogpt / name, work / name)
    data_dir = work / "data" / "shakespeare_char"
    shutil.copyfile(args.data, data_dir / "input.txt")  # prepare.py downloads the text only when this is missing
    steps = args.nanogpt_steps or args.steps
    train_args = ["config/train_shakespeare_char.py", *NANOGPT_CPU_OVERRIDES, f"--max_iters={steps}",
                  f"--lr_decay_iters={steps}", "--out_dir=out",
                  *([f"--eval_interval={args.eval_every}"] if args.eval_every else [])]
    start = time.perf_counter()
    _run([sys.executable, "prepare.py"], cwd=data_dir, env=env, log=work / "prepare-log.txt")
    output = _run([sys.executable, "train.py", *train_args], cwd=work, env=env, log=work / "log.txt")
    wall = time.perf_counter() - start
    return {**nanogpt_figures(output, wall), "command": " ".join(["python train.py", *train_args])}


def nanogpt_figures(output: str, wall: float) -> dict[str, Any]:
    """Per-step times and the last eval from train.py's printout (``log_interval=1``). An ``iter N`` line's time
    runs from the previous line, so it includes an eval (and a checkpoint) done at the start of iteration N: those
    iterations count at the median step time, the rest of them is outside the steps."""
    times = {int(m.group(1)): float(m.group(2)) / 1e3 for m in _NANOGPT_ITER.finditer(output)}
    evals = [(int(m.group(1)), float(m.group(2)), float(m.group(3))) for m in _NANOGPT_EVAL.finditer(output)]
    if not times or not evals:
        raise RuntimeError("nanoGPT's train.py printed no 'iter N: ... time ...ms' or 'step N: ...' lines; "
                           "is DIR an unmodified nanoGPT checkout?")
    eval_steps = {step for step, _, _ in evals}
    plain = [t for step, t in sorted(times.items()) if step not in eval_steps]
    median = statistics.median(_steady(plain) or list(times.values()))
    in_steps = sum(plain) + median * (len(times) - len(plain))
    reached = [step for step, _, val in evals if val <= REFERENCE_VAL_LOSS]
    # iteration N's line comes after step N's evaluation; the steps up to N are iterations 0 .. N - 1
    to_target = (sum(median if s in eval_steps else t for s, t in times.items() if s < reached[0])
                 if reached else None)
    return {"steps_to_target": reached[0] if reached else None, "seconds_to_target": to_target,
            "wall_seconds": wall, "step_seconds_total": in_steps, "seconds_outside_steps": wall - in_steps,
            "tokens_per_second_median": BATCH_SIZE * CONTEXT / median, "val_loss": evals[-1][2],
            "steps": len(times)}


def _run(command: list[str], *, cwd: Path, env: dict[str, str], log: Path) -> str:
    """Run ``command``, its output into ``log`` and returned; a failure raises with the output's tail."""
    proc = subprocess.run(command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    log.write_text(proc.stdout, encoding="utf-8")
    if proc.returncode != 0:
        tail = "\n".join(proc.stdout.splitlines()[-15:])
        raise RuntimeError(f"{' '.join(command)} (in {cwd}) exited with {proc.returncode}:\n{tail}")
    return proc.stdout


def side_by_side_table(f: dict[str, Any]) -> str:
    t, n, r = f["median"]["tinygpt"], f["median"]["nanogpt"], f["ratio_tinygpt_over_nanogpt"]
    rows = [("", "tinygpt", "nanoGPT", "tinygpt / nanoGPT"),
            ("wall time (s)", f"{t['wall_seconds']:.1f}", f"{n['wall_seconds']:.1f}", f"{r['wall_seconds']:.3f}"),
            ("outside the steps (s)", f"{t['seconds_outside_steps']:.1f}", f"{n['seconds_outside_steps']:.1f}",
             f"{r['seconds_outside_steps']:.3f}"),
            ("tokens/s (median step)", f"{t['tokens_per_second_median']:,.0f}",
             f"{n['tokens_per_second_median']:,.0f}", f"{r['tokens_per_second_median']:.3f}"),
            ("val loss (last eval)", f"{t['val_loss']:.4f}", f"{n['val_loss']:.4f}", ""),
            ("seconds of steps to val <= 1.88", *(("not reached" if x["seconds_to_target"] is None else
                                                  f"{x['seconds_to_target']:.1f}") for x in (t, n)),
             f"{r['seconds_to_target']:.3f}" if "seconds_to_target" in r else "")]
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
             for row in rows]
    steps = f"{f['steps']} steps" if f.get("nanogpt_steps", f["steps"]) == f["steps"] else \
        f"tinygpt {f['steps']} steps, nanoGPT {f['nanogpt_steps']}"
    note = (f"{steps}, tinygpt {f['optimizer']} with the {f['block']} block, median of {f['repeat']} pair(s), each run a fresh process timed start to exit "
            f"(nanoGPT: prepare.py + train.py)")
    return "\n".join(lines + [note])


if __name__ == "__main__":
    sys.exit(main())
