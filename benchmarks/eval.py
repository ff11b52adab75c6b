"""lm-eval loglikelihood speed on the shipped tasks: tinygpt's model class vs lm-eval's own HF class, same weights.

    python -m benchmarks.eval [--quick] [--json PATH] [--repeats N] [--batch-size N] [--threads N]

gpt2-small-shaped random weights (biased QKV, tied head; ``--quick``: a tiny model with GPT-2's vocabulary), the
``loglikelihood`` requests of the shipped ``tinygpt_lastword`` and ``tinygpt_choice`` tasks (built by lm-eval from
the task files, tokenized with GPT-2's vocabulary from ../shared/data), scored by ``TinyGPTLM`` and by lm-eval's
``HFLM`` around ``GPT2LMHeadModel`` (sdpa) with the same batch size. One untimed warm-up each, then interleaved
rounds (tinygpt, hf, tinygpt, hf, ...); the figures are medians. Tokens/s counts every request's context +
continuation tokens (the work a plain scorer does), so the ratio of the two rates is the ratio of the times. The
two classes' log-likelihoods are compared too (max |difference|).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from typing import Any, Callable, Sequence

import torch

from tinygpt import GPTConfig, gpt2_tokenizer
from tinygpt.tokenizer import HF_GPT2_FILES

from .common import format_table, pin_threads, run_and_report, shared_data_dir, time_interleaved
from .models import build_hf, build_tinygpt, gpt2_small

TASKS = ("tinygpt_lastword", "tinygpt_choice")
TARGET = 1.3  # issue 18: tinygpt's class >= 1.3x lm-eval's HF class


def quick_config() -> GPTConfig:
    """GPT-2's vocabulary (the tasks are tokenized with it) on a model small enough for seconds."""
    return GPTConfig(vocab_size=50257, context_length=128, emb_dim=32, n_heads=2, n_layers=2, qkv_bias=True,
                     tie_weights=True)


def loglikelihood_requests(limit: int | None) -> list[Any]:
    """The shipped tasks' loglikelihood ``Instance``s, as lm-eval builds them (offline)."""
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    from tinygpt.evaluation.task_files import resolve_tasks

    names, manager = resolve_tasks(list(TASKS))
    requests = []
    for task in manager.load(names)["tasks"].values():
        task.build_all_requests(limit=limit, rank=0, world_size=1)
        requests += task.instances
    return requests


def run(quick: bool, *, repeats: int | None = None, batch_size: int = 16, threads: int | None = None,
        log: Callable[[str], None] = lambda line: None) -> dict[str, Any]:
    """Time both classes on the same requests; returns JSON-able results (``table`` formats them)."""
    from lm_eval.models.huggingface import HFLM
    from transformers import GPT2Tokenizer

    from tinygpt.evaluation.harness import TinyGPTLM

    if threads is not None:
        torch.set_num_threads(threads)
    vocab = shared_data_dir() / "gpt2"
    config = quick_config() if quick else gpt2_small()
    repeats = repeats or (1 if quick else 3)
    requests = loglikelihood_requests(8 if quick else None)
    model = build_tinygpt(config)
    tokenizer = gpt2_tokenizer(vocab)
    ours = TinyGPTLM(model=model, tokenizer=tokenizer, batch_size=batch_size, progress=False)
    with tempfile.TemporaryDirectory() as folder:  # transformers 5 reads a GPT-2 vocabulary from a folder only
        tokenizer.write_files(folder, HF_GPT2_FILES)
        hf_tokenizer = GPT2Tokenizer.from_pretrained(folder)
    theirs = HFLM(pretrained=build_hf(config, model), tokenizer=hf_tokenizer, batch_size=batch_size)
    tokens = 0
    for req in requests:
        context, continuation = req.args
        tokens += len(tokenizer.encode(context + continuation))
    impls = {"tinygpt": lambda: ours.loglikelihood(requests, disable_tqdm=True),
             "hf": lambda: theirs.loglikelihood(requests, disable_tqdm=True)}
    answers = {name: fn() for name, fn in impls.items()}  # the warm-up, and the values compared below
    log(f"{len(requests)} requests, {tokens} tokens: {repeats} interleaved rounds")
    stats = time_interleaved(impls, warmup=0, repeats=repeats)
    rows = [{"impl": name, "time_s": st["median_s"], "min_s": st["min_s"], "max_s": st["max_s"],
             "samples": st["samples"], "requests_per_s": len(requests) / st["median_s"],
             "tokens_per_s": tokens / st["median_s"], "tinygpt_speedup": st["median_s"] / stats["tinygpt"]["median_s"]}
            for name, st in stats.items()]
    diff = max(abs(a[0] - b[0]) for a, b in zip(answers["tinygpt"], answers["hf"]))
    same_greedy = all(a[1] == b[1] for a, b in zip(answers["tinygpt"], answers["hf"]))
    return {"quick": quick, "config": config.to_dict(), "tasks": list(TASKS), "requests": len(requests),
            "tokens": tokens, "batch_size": batch_size, "threads": torch.get_num_threads(), "rows": rows,
            "max_abs_loglikelihood_diff": diff, "same_greedy": same_greedy,
            "speedup_vs_hf": stats["hf"]["median_s"] / stats["tinygpt"]["median_s"], "target": TARGET,
            "torch": torch.__version__}


def table(result: dict[str, Any]) -> str:
    rows = [{**r, "time": f"{r['time_s']:.2f} [{r['min_s']:.2f}-{r['max_s']:.2f}]"} for r in result["rows"]]
    columns = [("impl", "impl"), ("time", "s median [min-max]"), ("samples", "n"),
               ("requests_per_s", "requests/s"), ("tokens_per_s", "tokens/s"), ("tinygpt_speedup", "tinygpt speedup")]
    met = "met" if result["speedup_vs_hf"] >= result["target"] else "NOT met"
    return "\n".join([
        f"torch {result['torch']}, {result['threads']} threads"
        f"{' (quick mode: tiny sizes, figures mean nothing)' if result['quick'] else ''}",
        f"{result['requests']} loglikelihood requests ({', '.join(result['tasks'])}), {result['tokens']:,} tokens, "
        f"batch size {result['batch_size']} for both",
        format_table(rows, columns), "",
        f"tinygpt vs lm-eval's HF class: {result['speedup_vs_hf']:.2f}x (target >= {result['target']}x: {met})",
        f"max |loglikelihood difference| {result['max_abs_loglikelihood_diff']:.2e}; same greedy flags: "
        f"{'yes' if result['same_greedy'] else 'NO'}",
    ])


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.eval", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny model, 8 items per task: checks it runs")
    parser.add_argument("--json", metavar="PATH", help="also write the results here as JSON")
    parser.add_argument("--repeats", type=int, default=None, help="timed rounds each (default 3; quick 1)")
    parser.add_argument("--batch-size", type=int, default=16, help="rows per forward, both classes (default 16)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: one per core)")
    args = parser.parse_args(argv)
    for flag in ("repeats", "batch_size", "threads"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            parser.error(f"--{flag.replace('_', '-')}={value} must be >= 1")
    if args.threads is None:
        pin_threads()
    return run_and_report(parser, lambda: run(args.quick, repeats=args.repeats, batch_size=args.batch_size,
                                              threads=args.threads,
                                              log=lambda line: print(line, file=sys.stderr, flush=True)),
                          table, args.json)


if __name__ == "__main__":
    sys.exit(main())
