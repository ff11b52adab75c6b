"""`tinygpt eval`: sliding-window perplexity of a text or a prepared corpus, and lm-evaluation-harness tasks."""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
from pathlib import Path

from .common import CommandError, add_device_options


def _add_eval(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("eval", help="perplexity of a text (sliding window) and lm-evaluation-harness tasks")
    p.add_argument("--model", required=True, metavar="DIR|HUBNAME",
                   help="a tinygpt checkpoint, a Hugging Face GPT-2 folder, or a hub name (gpt2, gpt2-medium, ...)")
    p.add_argument("--tokenizer-dir", metavar="DIR", help="a saved tokenizer (default: the model's own)")
    source = p.add_mutually_exclusive_group()
    source.add_argument("--text", metavar="FILE", help="perplexity of this UTF-8 text file")
    source.add_argument("--data", metavar="DIR", help="perplexity of a corpus prepared by `tinygpt prepare`")
    p.add_argument("--split", choices=["val", "train"], default="val", help="with --data: which split (default val)")
    p.add_argument("--window", type=int, metavar="N", help="tokens per window (default: the model's context)")
    p.add_argument("--stride", type=int, metavar="N",
                   help="tokens between window starts; each window scores its last N new tokens (default window/2)")
    p.add_argument("--tasks", metavar="NAMES",
                   help="comma-separated lm-eval tasks: the shipped tinygpt_lastword, tinygpt_choice, tinygpt_until, "
                        "or any of lm-eval's (lambada_openai, hellaswag, ...: they download their data)")
    p.add_argument("--include-path", metavar="DIR", help="a folder of extra lm-eval task YAML files")
    p.add_argument("--limit", type=float, metavar="N",
                   help="at most N items per task (a fraction < 1: that share of each task)")
    p.add_argument("--num-fewshot", type=int, metavar="K", help="few-shot examples per prompt (default: the task's)")
    p.add_argument("--batch-size", type=int, default=16, metavar="N", help="rows per forward call (default 16)")
    add_device_options(p)
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True,
                   help="progress bars on stderr (default on)")
    p.add_argument("--json", action="store_true", help="print the figures as JSON")
    p.set_defaults(run=_run_eval)


def _check_args(args: argparse.Namespace) -> None:
    if args.text is None and args.data is None and args.tasks is None:
        raise CommandError("nothing to evaluate: give --text FILE or --data DIR (perplexity) and/or --tasks NAMES")
    for flag in ("window", "stride", "batch_size", "num_fewshot"):
        value = getattr(args, flag)
        low = 0 if flag == "num_fewshot" else 1
        if value is not None and value < low:
            raise CommandError(f"--{flag.replace('_', '-')}={value} must be >= {low}")
    if args.window is not None and args.window < 2:
        raise CommandError(f"--window={args.window} must be >= 2 (one token of context and one to score)")
    if args.limit is not None and not args.limit > 0:
        raise CommandError(f"--limit={args.limit} must be > 0")
    if (args.window or args.stride) and args.text is None and args.data is None:
        raise CommandError("--window and --stride apply to perplexity: give --text FILE or --data DIR")


def _read_text(path: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise CommandError(f"cannot read --text {path}: {err}") from None


def _run_eval(args: argparse.Namespace) -> int:
    _check_args(args)
    text = _read_text(args.text) if args.text is not None else None
    corpus = None
    if args.data is not None:
        from ..training.data import PreparedCorpus

        corpus = PreparedCorpus.open(args.data)  # FileNotFoundError / ValueError: one line, exit 2
    tasks = None
    if args.tasks is not None:
        from ..evaluation.task_files import resolve_tasks

        tasks = resolve_tasks(args.tasks, args.include_path)  # before the model loads: names and files checked
    from ..devices import autocast, resolve_device
    from ..interop.pretrained import load_pretrained

    device = resolve_device(args.device)
    model, tokenizer = load_pretrained(args.model, tokenizer_dir=args.tokenizer_dir, device=device)
    if tokenizer is None:
        raise CommandError(f"{args.model} has no tokenizer: pass --tokenizer-dir DIR")
    report: dict = {"model": args.model}
    with autocast(device, args.dtype):
        if text is not None or corpus is not None:
            report["perplexity"] = _perplexity(args, model, tokenizer, text, corpus)
        if tasks is not None:
            report["tasks"] = _tasks(args, model, tokenizer, tasks)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        _print_report(report)
    return 0


def _perplexity(args, model, tokenizer, text, corpus) -> dict:
    from ..evaluation.perplexity import perplexity, stream_bytes, text_tokens

    if text is not None:
        ids, n_bytes = text_tokens(tokenizer, text)
        source = args.text
    else:
        if corpus.vocab_size > model.config.vocab_size:
            raise CommandError(f"{args.data} was prepared with {corpus.vocab_size} tokens but the model's "
                               f"vocab_size is {model.config.vocab_size}")
        ids = getattr(corpus, args.split).tolist()
        n_bytes = stream_bytes(corpus.load_tokenizer(), ids)
        source = f"{args.data} ({args.split})"
    window = args.window or model.config.context_length
    if window > model.config.context_length:
        raise CommandError(f"--window={window} is longer than the model's context ({model.config.context_length})")
    if args.stride is not None and args.stride > window:
        raise CommandError(f"--stride={args.stride} must be <= the window ({window})")
    if len(ids) < window:
        raise CommandError(f"{source} is {len(ids)} tokens, shorter than one window of {window} tokens; "
                           f"give a longer text or a smaller --window")
    result = perplexity(model, ids, window=window, stride=args.stride, n_bytes=n_bytes, batch_size=args.batch_size,
                        progress=args.progress)
    return {"source": source, **result.to_dict()}


def _tasks(args, model, tokenizer, tasks) -> dict:
    import logging

    import lm_eval

    from ..evaluation.harness import TinyGPTLM

    names, manager = tasks
    logging.getLogger("lm_eval").setLevel(logging.ERROR)  # its per-task notes would drown the figures
    lm = TinyGPTLM(model=model, tokenizer=tokenizer, batch_size=args.batch_size, progress=args.progress)
    limit = None if args.limit is None else (int(args.limit) if args.limit >= 1 else args.limit)
    try:
        with contextlib.redirect_stdout(sys.stderr):  # lm-eval prints progress notes; stdout is the report's
            results = lm_eval.simple_evaluate(model=lm, tasks=names, task_manager=manager, limit=limit,
                                              num_fewshot=args.num_fewshot, log_samples=False, bootstrap_iters=0,
                                              verbosity="ERROR")
    except ConnectionError as err:  # datasets: "Couldn't reach 'Rowan/hellaswag' on the Hub (...)"
        raise CommandError(f"--tasks {','.join(map(str, names))}: cannot download the task's data: {err}; lm-eval's "
                           f"tasks need the network once (then the datasets cache), or use a task of "
                           f"tinygpt's own (tinygpt_choice, tinygpt_lastword)") from None
    out = {}
    for name, metrics in results["results"].items():
        figures = {}
        for key, value in metrics.items():
            metric, _, _ = key.partition(",")
            if metric in ("name", "alias", "sample_len") or metric.endswith("_stderr"):
                continue
            if isinstance(value, (int, float)) and not (isinstance(value, float) and math.isnan(value)):
                figures[metric] = float(value)
        counted = results.get("n-samples", {}).get(name, {})  # a group of tasks has no count of its own
        figures["items"] = int(counted.get("effective", metrics.get("sample_len", 0)) or 0)
        out[name] = figures
    return out


def _print_report(report: dict) -> None:
    ppl = report.get("perplexity")
    if ppl is not None:
        bpb = "n/a" if ppl["bits_per_byte"] is None else f"{ppl['bits_per_byte']:.4f}"
        print(f"perplexity of {ppl['source']}: loss {ppl['loss']:.4f}  perplexity {ppl['perplexity']:.3f}  "
              f"bits/byte {bpb}  ({ppl['tokens']:,} tokens scored, {ppl['windows']} windows of {ppl['window']}, "
              f"stride {ppl['stride']})")
    for name, figures in report.get("tasks", {}).items():
        shown = "  ".join(f"{k} {v:.4f}" for k, v in figures.items() if k != "items")
        print(f"{name}: {shown}  ({figures['items']} items)")
