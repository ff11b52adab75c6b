"""Pretraining commands: `prepare`, `train`."""

from __future__ import annotations

import argparse
import sys

from ..config import PRESETS


_TOKENIZER_HELP = ("gpt2 (the pretrained GPT-2 BPE), char (one id per character seen) or bpe[:VOCAB] (a byte-level "
                   "BPE trained on the data; VOCAB >= 257, default 4096)")


def _add_prepare(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("prepare", help="tokenize text files/folders into a memmapped token file with a train/val split")
    p.add_argument("--data", nargs="+", required=True, metavar="PATH",
                   help="text files or folders (searched recursively; hidden and binary files skipped)")
    p.add_argument("--tokenizer", default="char", help=f"{_TOKENIZER_HELP} (default: char)")
    p.add_argument("--out", required=True, help="output folder (prepared.json, tokens.bin, tokenizer/)")
    p.add_argument("--val-fraction", type=float, default=0.1,
                   help="the last fraction of the tokens held out for validation (default: 0.1)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--force", action="store_true", help="write into a folder that holds other files (kept)")
    p.set_defaults(run=_run_prepare)


def _run_prepare(args: argparse.Namespace) -> int:
    from ..training import prepare_corpus

    corpus = prepare_corpus(args.data, args.tokenizer, args.out, val_fraction=args.val_fraction,
                            progress=not args.no_progress, overwrite=args.force)
    h = corpus.header
    print(f"{args.out}: {h['total_tokens']:,} tokens ({h['train_tokens']:,} train / {h['val_tokens']:,} val) from "
          f"{len(h['sources'])} file(s), {h['total_bytes']:,} bytes; tokenizer {h['tokenizer']['spec']} "
          f"(vocab {h['tokenizer']['vocab_size']:,}), {h['dtype']}")
    return 0


def _add_train(sub: argparse._SubParsersAction) -> None:
    from ..training.options import DEFAULT_MODEL, TrainingOptions

    d = TrainingOptions()
    default_model = ", ".join(f"{k}={v}" for k, v in DEFAULT_MODEL.items())
    p = sub.add_parser("train", help="train a GPT (no --data: on the embedded standard-library corpus)",
                       description="Train (or resume) a GPT. Under torchrun the same command runs data-parallel.")
    data = p.add_mutually_exclusive_group()
    data.add_argument("--data", nargs="+", metavar="PATH",
                      help="text files or folders, prepared into OUT/data (default: the Python standard library's "
                           ".py sources, which every Python installation carries)")
    data.add_argument("--prepared", metavar="DIR", help="a folder written by `tinygpt prepare`")
    p.add_argument("--tokenizer", default=d.tokenizer, help=f"{_TOKENIZER_HELP} (default: {d.tokenizer}; "
                                                                 "ignored with --prepared)")
    p.add_argument("--config", default=None, metavar="NAME|FILE.json",
                   help=f"a preset ({', '.join(PRESETS)}) or a config .json file (default: {default_model}, "
                        f"vocab_size from the tokenizer)")
    p.add_argument("--out", default=d.out_dir, help=f"run folder: checkpoints, metrics, plot, final model "
                                                     f"(default: {d.out_dir})")
    p.add_argument("--resume", default=None, metavar="DIR|auto",
                   help="continue from a step-N checkpoint or a run folder's newest one; auto = OUT's newest, "
                        "or a fresh start when there is none")
    p.add_argument("--max-steps", type=int, default=d.max_steps,
                   help=f"optimizer steps in all (default: {d.max_steps})")
    p.add_argument("--stop-after", type=int, default=None, metavar="STEP",
                   help="end this invocation after STEP (with a checkpoint) as if interrupted; the schedule still "
                        "runs to --max-steps, and --resume continues")
    p.add_argument("--batch-size", type=int, default=d.batch_size,
                   help=f"windows per micro-batch per process (default: {d.batch_size})")
    p.add_argument("--grad-accum", type=int, default=d.grad_accum,
                   help=f"micro-batches per optimizer step (default: {d.grad_accum})")
    p.add_argument("--lr", type=float, default=d.lr, help=f"peak learning rate (default: {d.lr})")
    p.add_argument("--min-lr", type=float, default=None, help="learning rate at the end of the cosine (default: lr/10)")
    p.add_argument("--warmup-steps", type=int, default=d.warmup_steps,
                   help=f"linear warmup steps (default: {d.warmup_steps})")
    p.add_argument("--weight-decay", type=float, default=d.weight_decay,
                   help=f"AdamW weight decay on 2-D weights (default: {d.weight_decay})")
    p.add_argument("--grad-clip", type=float, default=d.grad_clip,
                   help=f"clip the global gradient norm to this, 0 = off (default: {d.grad_clip})")
    p.add_argument("--eval-every", type=int, default=d.eval_every,
                   help=f"evaluate train/val loss, print a sample, plot, every N steps (default: {d.eval_every})")
    p.add_argument("--eval-iters", type=int, default=d.eval_iters,
                   help=f"batches per split in each evaluation (default: {d.eval_iters})")
    p.add_argument("--checkpoint-every", type=int, default=None, help="write step-N/ every N steps "
                                                                       "(default: --eval-every)")
    p.add_argument("--keep-last", type=int, default=d.keep_last,
                   help=f"step-N/ folders kept besides the best by val loss (default: {d.keep_last})")
    p.add_argument("--seed", type=int, default=d.seed, help=f"seed of init, data order and dropout (default: {d.seed})")
    p.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda when available)")
    p.add_argument("--dtype", default=d.dtype, choices=["auto", "float32", "bfloat16"],
                   help="bfloat16 = bf16 autocast with float32 weights; auto = bf16 on a bf16-capable GPU, "
                        "else float32 (default: auto)")
    p.add_argument("--compile", action="store_true", help="torch.compile the model")
    p.add_argument("--fsdp", action="store_true", help="shard with FSDP2 fully_shard (under torchrun) instead of DDP")
    p.add_argument("--sample-tokens", type=int, default=d.sample_tokens,
                   help=f"tokens of the sample printed at each eval (default: {d.sample_tokens})")
    p.add_argument("--sample-prompt", default=None, help="prompt of that sample (default: the start of the val text)")
    p.add_argument("--sample-temperature", type=float, default=d.sample_temperature,
                   help=f"temperature of that sample, 0 = greedy (default: {d.sample_temperature})")
    p.add_argument("--peak-tflops", type=float, default=None,
                   help="peak TFLOP/s for the MFU estimate (default: known GPUs' bf16 peak; none on CPU)")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(run=_run_train)


def _run_train(args: argparse.Namespace) -> int:
    from ..training import TrainingDiverged, TrainingOptions, train

    options = TrainingOptions(
        data=args.data, prepared=args.prepared, tokenizer=args.tokenizer, config=args.config, out_dir=args.out,
        max_steps=args.max_steps, stop_after=args.stop_after, batch_size=args.batch_size, grad_accum=args.grad_accum,
        lr=args.lr, min_lr=args.min_lr, warmup_steps=args.warmup_steps, weight_decay=args.weight_decay,
        grad_clip=args.grad_clip, eval_every=args.eval_every, eval_iters=args.eval_iters,
        checkpoint_every=args.checkpoint_every, keep_last=args.keep_last, seed=args.seed, device=args.device,
        dtype=args.dtype, compile=args.compile, fsdp=args.fsdp, resume=args.resume, sample_tokens=args.sample_tokens,
        sample_prompt=args.sample_prompt, sample_temperature=args.sample_temperature, peak_tflops=args.peak_tflops,
        progress=not args.no_progress,
    )
    try:
        result = train(options)
    except TrainingDiverged as err:
        print(f"tinygpt train: {err}", file=sys.stderr)
        return 1
    if result.val_loss is not None and result.step == options.max_steps:
        print(f"done: step {result.step}, train loss {result.train_loss:.4f}, val loss {result.val_loss:.4f}, "
              f"unigram baseline {result.unigram_entropy:.4f} nats/token; best val {result.best_val_loss:.4f} at "
              f"step {result.best_step}; model in {result.run_dir} (tinygpt generate --model {result.run_dir})")
    return 0
