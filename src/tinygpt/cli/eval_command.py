"""`tinygpt eval`: sliding-window perplexity of a text or a prepared corpus, and lm-evaluation-harness tasks."""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from .common import CommandError, add_options, load_for_command, options_from_args

if TYPE_CHECKING:
    from ..evaluation.options import EvalOptions


def _add_eval(sub: argparse._SubParsersAction) -> None:
    from ..evaluation.options import EvalOptions

    p = sub.add_parser("eval", help="perplexity of a text (sliding window) and lm-evaluation-harness tasks")
    add_options(p, EvalOptions)
    p.set_defaults(run=_run_eval)


def _read_text(path: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise CommandError(f"cannot read --text {path}: {err}") from None


def _run_eval(args: argparse.Namespace) -> int:
    from ..evaluation.options import EvalOptions

    options = options_from_args(EvalOptions, args)
    options.check()  # an OptionError is worded with the flag's name by main()
    text = _read_text(options.text) if options.text is not None else None
    corpus = None
    if options.data is not None:
        from ..training.data import PreparedCorpus

        corpus = PreparedCorpus.open(options.data)  # FileNotFoundError / ValueError: one line, exit 2
    tasks = None
    if options.tasks is not None:
        from ..evaluation.task_files import resolve_tasks

        tasks = resolve_tasks(options.tasks, options.include_path)  # before the model loads: names and files checked
    from ..devices import autocast

    model, tokenizer, device = load_for_command(options.model, options.tokenizer_dir, options.device,
                                                options.weights)
    report: dict = {"model": options.model}
    with autocast(device, options.dtype):
        if text is not None or corpus is not None:
            report["perplexity"] = _perplexity(options, model, tokenizer, text, corpus)
        if tasks is not None:
            report["tasks"] = _tasks(options, model, tokenizer, tasks)
    if options.json:
        print(json.dumps(report, indent=2))
    else:
        _print_report(report)
    return 0


def _perplexity(options: EvalOptions, model, tokenizer, text, corpus) -> dict:
    from ..evaluation.perplexity import perplexity, stream_bytes, text_tokens

    if text is not None:
        ids, n_bytes = text_tokens(tokenizer, text)
        source = options.text
    else:
        if corpus.vocab_size > model.config.vocab_size:
            raise CommandError(f"{options.data} was prepared with {corpus.vocab_size} tokens but the model's "
                               f"vocab_size is {model.config.vocab_size}")
        ids = getattr(corpus, options.split).tolist()
        n_bytes = stream_bytes(corpus.load_tokenizer(), ids)
        source = f"{options.data} ({options.split})"
    window = options.window or model.config.context_length
    if window > model.config.context_length:
        raise CommandError(f"--window={window} is longer than the model's context ({model.config.context_length})")
    if options.stride is not None and options.stride > window:
        raise CommandError(f"--stride={options.stride} must be <= the window ({window})")
    if len(ids) < window:
        raise CommandError(f"{source} is {len(ids)} tokens, shorter than one window of {window} tokens; "
                           f"give a longer text or a smaller --window")
    result = perplexity(model, ids, window=window, stride=options.stride, n_bytes=n_bytes, batch_size=options.batch_size,
                        progress=options.progress)
    return {"source": source, **result.to_dict()}


def _tasks(options: EvalOptions, model, tokenizer, tasks) -> dict:
    import logging

    import lm_eval

    from ..evaluation.harness import TinyGPTLM

    names, manager = tasks
    logging.getLogger("lm_eval").setLevel(logging.ERROR)  # its per-task notes would drown the figures
    lm = TinyGPTLM(model=model, tokenizer=tokenizer, batch_size=options.batch_size, progress=options.progress)
    limit = None if options.limit is None else (int(options.limit) if options.limit >= 1 else options.limit)
    try:
        with contextlib.redirect_stdout(sys.stderr):  # lm-eval prints progress notes; stdout is the report's
            results = lm_eval.simple_evaluate(model=lm, tasks=names, task_manager=manager, limit=limit,
                                              num_fewshot=options.num_fewshot, log_samples=False, bootstrap_iters=0,
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
