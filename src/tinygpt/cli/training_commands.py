"""Pretraining commands: `prepare`, `train`."""

from __future__ import annotations

import argparse

from ..config import PRESETS
from ..training.options import PrepareOptions
from .common import CommandError, add_options, options_from_args


def _add_prepare(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("prepare", help="tokenize text files/folders into a memmapped token file with a train/val split")
    add_options(p, PrepareOptions)
    p.set_defaults(run=_run_prepare)


def _run_prepare(args: argparse.Namespace) -> int:
    from ..checks import positive_int
    from ..training import prepare_corpus

    args = options_from_args(PrepareOptions, args)
    try:
        positive_int("workers", args.workers)
    except ValueError:
        raise CommandError(f"--workers {args.workers} must be an integer >= 1") from None
    try:
        corpus = prepare_corpus(args.data, args.tokenizer, args.out, val_fraction=args.val_fraction,
                                progress=not args.no_progress, overwrite=args.force, format=args.format,
                                text_field=args.text_field, split=args.split, workers=args.workers)
    except ImportError as err:
        raise CommandError(str(err)) from None
    h = corpus.header
    print(f"{args.out}: {h['total_tokens']:,} tokens ({h['train_tokens']:,} train / {h['val_tokens']:,} val) from "
          f"{len(h['sources'])} file(s), {h['total_bytes']:,} bytes; tokenizer {h['tokenizer']['spec']} "
          f"(vocab {h['tokenizer']['vocab_size']:,}), {h['dtype']}")
    return 0


def _add_train(sub: argparse._SubParsersAction) -> None:
    from ..training.options import TrainingOptions

    p = sub.add_parser("train", help="train a GPT (no --data: on the embedded standard-library corpus)",
                       description="Train (or resume) a GPT. Under torchrun the same command runs data-parallel. "
                                   f"--config: a preset ({', '.join(PRESETS)}) or a .json file. Ctrl-C or SIGTERM "
                                   "saves a checkpoint at the current step and prints the command that resumes.")
    add_options(p, TrainingOptions)  # one flag per field, help and default from the field
    p.set_defaults(run=_run_train)


def _run_train(args: argparse.Namespace) -> int:
    from ..training import TrainingOptions, train
    from ..training.distributed import is_main_process

    options = options_from_args(TrainingOptions, args)
    result = train(options)
    finished = result.step == options.max_steps or "budget_seconds_spent" in result.summary
    if result.val_loss is not None and finished and is_main_process():
        print(f"done: step {result.step}, train loss {result.train_loss:.4f}, val loss {result.val_loss:.4f} nats/token "
              f"({result.last_eval['val_bpb']:.4f} bits/byte), "
              f"unigram baseline {result.unigram_entropy:.4f} nats/token; best val {result.best_val_loss:.4f} at "
              f"step {result.best_step}; model in {result.run_dir} (tinygpt generate --model {result.run_dir})")
    return 0
