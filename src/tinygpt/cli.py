"""The ``tinygpt`` command line: argument parsing only; the work is done by the library."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Callable, Sequence

from .config import PRESETS, GPTConfig, get_config
from .params import count_parameters


class CommandError(Exception):
    """A user error found by a command: printed as one line, exit code 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, no usage dump
        self.exit(2, f"{self.prog}: error: {message}\n")


def _config_from_args(name_or_file: str) -> GPTConfig:
    if name_or_file.endswith(".json"):
        return GPTConfig.from_file(name_or_file)
    return get_config(name_or_file)


# ---------------------------------------------------------------------------------------------- params
def _add_params(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("params", help="count parameters from the formula N = 2VD + CD + L(12D^2 + 10D) + 2D")
    source = p.add_mutually_exclusive_group()
    source.add_argument("--config", default="gpt2-small",
                        help=f"a preset ({', '.join(PRESETS)}) or a config .json file (default: gpt2-small)")
    source.add_argument("--model", metavar="DIR", help="a saved tinygpt checkpoint: its config, and the tensors stored")
    p.add_argument("--qkv-bias", action="store_true", help="count a bias on the fused QKV projection (+3D per layer)")
    p.add_argument("--tie-weights", action="store_true", help="share the head with the token embedding (-VD)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(run=_run_params)


def _run_params(args: argparse.Namespace) -> int:
    stored = None
    if args.model is not None:
        if args.qkv_bias or args.tie_weights:
            raise CommandError("--qkv-bias and --tie-weights change a config; a saved model already has its own")
        from .checkpoint import count_stored_parameters, load_config

        config, stored, label = load_config(args.model), count_stored_parameters(args.model), args.model
    else:
        config, label = _config_from_args(args.config), args.config
    overrides = {}
    if args.qkv_bias:
        overrides["qkv_bias"] = True
    if args.tie_weights:
        overrides["tie_weights"] = True
    config = config.replace(**overrides)
    counts = count_parameters(config)
    if args.json:
        extra = {} if stored is None else {"stored_parameters": stored}
        print(json.dumps({"config": config.to_dict(), "parameters": counts.to_dict(), **extra}, indent=2))
        return 0
    rows = [
        ("token embedding (V*D)", counts.token_embedding),
        ("position embedding (C*D, 0 with RoPE)", counts.position_embedding),
        (f"attention ({config.n_layers} x {counts.attention_per_block:,})", counts.attention),
        (f"feed-forward ({config.n_layers} x {counts.feed_forward_per_block:,})", counts.feed_forward),
        (f"{config.norm} ({config.n_layers} x {counts.norms_per_block:,} + {counts.final_norm:,})", counts.norms),
        ("output head (V*D, 0 when tied)", counts.head),
        ("total", counts.total),
    ]
    if stored is not None:
        rows.append(("stored in model.safetensors", stored))
    print(f"{label}: V={config.vocab_size} C={config.context_length} D={config.emb_dim} "
          f"H={config.n_heads} L={config.n_layers} qkv_bias={config.qkv_bias} tie_weights={config.tie_weights}")
    defaults = GPTConfig()
    variant = [f"{name}={getattr(config, name)}" for name in ("norm", "ffn", "bias", "pos_emb", "n_kv_heads")
               if getattr(config, name) != getattr(defaults, name)]
    if variant:
        print(f"  variant: {' '.join(variant)}")
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"  {name:<{width}}  {value:>15,}")
    return 0


# ---------------------------------------------------------------------------------------------- verify
def _add_verify(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("verify", help="prove the math: copy weights into a reference implementation, compare logits")
    p.add_argument("reference", choices=["upstream", "hf"],
                   help="upstream = llms_from_scratch ch04 (the seeds'), hf = Hugging Face transformers")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(run=_run_verify)


def _run_verify(args: argparse.Namespace) -> int:
    from .verify import CHECKS, MissingReferenceError

    try:
        results = CHECKS[args.reference]()
    except MissingReferenceError as err:
        raise CommandError(str(err)) from None
    if args.json:
        print(json.dumps([r.to_dict() for r in results], indent=2))
    else:
        for r in results:
            tokens = "" if r.tokens_match is None else f"  greedy tokens {'identical' if r.tokens_match else 'DIFFER'}"
            status = "ok  " if r.passed else "FAIL"
            print(f"{status} {r.dtype:<8} max|diff| {r.max_abs_diff:.3e} <= {r.tolerance:.0e}{tokens}  {r.name}")
    return 0 if all(r.passed for r in results) else 1


# ---------------------------------------------------------------------------------------------- prepare / train
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
    p.set_defaults(run=_run_prepare)


def _run_prepare(args: argparse.Namespace) -> int:
    from .training import prepare_corpus

    corpus = prepare_corpus(args.data, args.tokenizer, args.out, val_fraction=args.val_fraction,
                            progress=not args.no_progress)
    h = corpus.header
    print(f"{args.out}: {h['total_tokens']:,} tokens ({h['train_tokens']:,} train / {h['val_tokens']:,} val) from "
          f"{len(h['sources'])} file(s), {h['total_bytes']:,} bytes; tokenizer {h['tokenizer']['spec']} "
          f"(vocab {h['tokenizer']['vocab_size']:,}), {h['dtype']}")
    return 0


def _add_train(sub: argparse._SubParsersAction) -> None:
    from .training.options import DEFAULT_MODEL, TrainingOptions

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
    from .training import TrainingDiverged, TrainingOptions, train

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


# ---------------------------------------------------------------------------------------------- generate / convert
def _add_generate(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="continue a prompt with a saved model (greedy unless --temperature > 0)")
    p.add_argument("--model", required=True, metavar="DIR|HUBNAME",
                   help="a tinygpt checkpoint, a Hugging Face GPT-2 folder, or a hub name (gpt2, gpt2-medium, ...)")
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", help="the text to continue; - reads it from stdin")
    source.add_argument("--prompt-file", metavar="PATH", help="read the text to continue from a UTF-8 file")
    p.add_argument("--max-new-tokens", type=int, default=50, metavar="N", help="tokens to add (default: 50)")
    p.add_argument("--temperature", type=float, default=0.0, metavar="T",
                   help="0 = greedy (default); > 0 samples from softmax(logits / T)")
    p.add_argument("--top-k", type=int, default=None, metavar="K", help="sample among the K most likely tokens")
    p.add_argument("--top-p", type=float, default=1.0, metavar="P",
                   help="sample among the most likely tokens whose probability sums to P (default 1 = all)")
    p.add_argument("--repetition-penalty", type=float, default=1.0, metavar="R",
                   help="> 1 discourages tokens already in the text (default 1 = none)")
    p.add_argument("--seed", type=int, default=None, help="seed for sampling: the same seed gives the same text")
    p.add_argument("--stop", action="append", default=[], metavar="TEXT",
                   help="stop before this text (repeatable); generation also stops at the end-of-text token")
    p.add_argument("--no-cache", dest="use_cache", action="store_false",
                   help="recompute the whole window at every step (same text, much slower)")
    p.add_argument("--overflow", choices=["slide", "shift", "error"], default="slide",
                   help="beyond the context: slide = last C tokens each step, exact but slow (default); "
                        "shift = keep the last C/2 and continue cached, fast approximation; error = refuse")
    p.add_argument("--stream", action=argparse.BooleanOptionalAction, default=True,
                   help="print the text as it is generated (default) or all at the end")
    p.add_argument("--tokenizer-dir", metavar="DIR",
                   help="a saved tokenizer, or a folder with GPT-2's encoder.json + vocab.bpe (or vocab.json + "
                        "merges.txt); default: the model's own, else $TINYGPT_GPT2_VOCAB, else tiktoken's cache")
    p.set_defaults(run=_run_generate)


def _run_generate(args: argparse.Namespace) -> int:
    from .generation import GenerationConfig
    from .interop.pretrained import load_pretrained
    from .text_stream import stream_text

    if args.max_new_tokens < 0:
        raise CommandError(f"--max-new-tokens={args.max_new_tokens} must be >= 0")
    if args.prompt_file is not None:
        try:
            prompt = open(args.prompt_file, encoding="utf-8").read()
        except (OSError, UnicodeDecodeError) as err:
            raise CommandError(f"cannot read --prompt-file {args.prompt_file}: {err}") from None
    else:
        prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    if any(not text for text in args.stop):
        raise CommandError("--stop needs a non-empty text")
    settings = GenerationConfig(
        max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
        repetition_penalty=args.repetition_penalty, seed=args.seed, overflow=args.overflow,
        use_cache=args.use_cache,
    )  # checked before the model is loaded
    model, tokenizer = load_pretrained(args.model, tokenizer_dir=args.tokenizer_dir)
    if tokenizer is None:
        raise CommandError(f"{args.model} has no tokenizer: pass --tokenizer-dir DIR")
    if not tokenizer.encode(prompt):
        raise CommandError("the prompt is empty: give at least one character of text to continue")
    pieces = stream_text(model, tokenizer, prompt, settings, stop_texts=args.stop)
    if not args.stream:
        print(prompt + "".join(pieces))
        return 0
    sys.stdout.write(prompt)
    sys.stdout.flush()
    for piece in pieces:
        sys.stdout.write(piece)
        sys.stdout.flush()
    sys.stdout.write("\n")
    return 0


def _add_convert(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("convert", help="Hugging Face GPT-2 folder <-> tinygpt checkpoint")
    direction = p.add_mutually_exclusive_group(required=True)
    direction.add_argument("--from-hf", metavar="DIR|HUBNAME", help="import a Hugging Face GPT-2 folder or hub name")
    direction.add_argument("--to-hf", metavar="DIR", help="export a tinygpt checkpoint for transformers")
    p.add_argument("--out", required=True, metavar="DIR", help="the directory to write (replaced atomically)")
    p.set_defaults(run=_run_convert)


def _run_convert(args: argparse.Namespace) -> int:
    from .interop.pretrained import convert_from_hf, convert_to_hf

    files = convert_from_hf(args.from_hf, args.out) if args.from_hf else convert_to_hf(args.to_hf, args.out)
    print(f"wrote {args.out}: {', '.join(files)}")
    return 0


# ---------------------------------------------------------------------------------------------- experiment
def _add_experiment(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("experiment", help="the seeds' experiments: print a table, write a PNG and a JSON")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--out", metavar="DIR", help="output directory (default: runs/experiments/NAME)")
    common.add_argument("--seed", type=int, default=123, help="random seed (default: 123)")
    names = p.add_subparsers(dest="experiment", required=True, metavar="NAME", parser_class=_Parser)
    names.add_parser("residual", parents=[common], help="gradients of the 5-layer example with/without shortcuts")
    pp = names.add_parser("prepost", parents=[common], help="pre-LN vs post-LN: outputs, gradients, training")
    pp.add_argument("--config", help="preset or config .json for the trained 12-layer models (vocab_size replaced "
                                     "by the character count; default C=64 D=64 H=4 L=12)")
    pp.add_argument("--data", metavar="FILE", help="UTF-8 training text (default: the embedded corpus)")
    pp.add_argument("--max-chars", type=int, default=400_000, help="characters of text used (default: 400000)")
    pp.add_argument("--steps", type=int, default=300, help="training steps per model; 0 skips training (default: 300)")
    pp.add_argument("--batch-size", type=int, default=16, help="sequences per step (default: 16)")
    pp.add_argument("--seq-len", type=int, default=64, help="characters per sequence (default: 64)")
    pp.add_argument("--lr", type=float, default=3e-4, help="constant AdamW learning rate (default: 3e-4)")
    names.add_parser("activations", parents=[common], help="GELU (exact, tanh) vs ReLU vs SiLU and derivatives")
    names.add_parser("layernorm", parents=[common], help="the x=[1,3] variance example and LayerNorm statistics")
    at = names.add_parser("attention", parents=[common], help="attention heatmaps of every head of one layer")
    source = at.add_mutually_exclusive_group()
    source.add_argument("--model", metavar="DIR", help="a saved tinygpt checkpoint")
    source.add_argument("--config", help="preset or config .json for a random model (default: gpt2-small); "
                                         "token ids = UTF-8 bytes mod vocab_size")
    at.add_argument("--prompt", default="Every effort moves you forward", help="the text to attend over")
    at.add_argument("--layer", type=int, default=0, help="block index (default: 0)")
    an = names.add_parser("anatomy", parents=[common], help="parameters and training memory by part, per preset")
    an.add_argument("--config", action="append", metavar="NAME|FILE",
                    help="a preset or config .json (repeatable; default: every preset)")
    p.set_defaults(run=_run_experiment)


def _run_experiment(args: argparse.Namespace) -> int:
    from . import experiments

    common = dict(out=args.out, seed=args.seed)
    name = args.experiment
    if name == "prepost":
        report = experiments.run_prepost(
            **common, config=args.config, data=args.data, max_chars=args.max_chars, steps=args.steps,
            batch_size=args.batch_size, seq_len=args.seq_len, lr=args.lr,
            progress=lambda line: print(line, file=sys.stderr, flush=True))
    elif name == "attention":
        config = None if args.model is not None else (args.config or "gpt2-small")
        report = experiments.run_attention(**common, model_dir=args.model, config=config, prompt=args.prompt,
                                           layer=args.layer)
    elif name == "anatomy":
        report = experiments.run_anatomy(**common, configs=args.config)
    else:
        report = experiments.EXPERIMENTS[name](**common)
    print(report.text)
    return 0


# ---------------------------------------------------------------------------------------------- alignment
def _add_finetune_options(p: argparse.ArgumentParser, out: str, lr: float, batch_size: int) -> None:
    """The settings every fine-tuning stage shares (``alignment.FinetuneOptions``)."""
    p.add_argument("--out", default=out, metavar="DIR",
                   help=f"run folder: step-N checkpoints, metrics.jsonl, plot, final model (default: {out})")
    p.add_argument("--epochs", type=int, default=1, help="passes over the training examples (default: 1)")
    p.add_argument("--max-steps", type=int, default=None, help="optimizer steps in all (default: from --epochs)")
    p.add_argument("--stop-after", type=int, default=None, metavar="STEP",
                   help="end this invocation after STEP (with a checkpoint); --resume continues")
    p.add_argument("--batch-size", type=int, default=batch_size, help=f"examples per step (default: {batch_size})")
    p.add_argument("--lr", type=float, default=lr, help=f"peak learning rate (default: {lr})")
    p.add_argument("--min-lr", type=float, default=None, help="learning rate at the end of the cosine (default: lr/10)")
    p.add_argument("--warmup-steps", type=int, default=0, help="linear warmup steps (default: 0)")
    p.add_argument("--weight-decay", type=float, default=0.1, help="AdamW weight decay on 2-D weights (default: 0.1)")
    p.add_argument("--grad-clip", type=float, default=1.0, help="global gradient-norm clip, 0 = off (default: 1.0)")
    p.add_argument("--eval-every", type=int, default=50, help="evaluate and plot every N steps (default: 50)")
    p.add_argument("--checkpoint-every", type=int, default=None, help="write step-N/ every N steps "
                                                                       "(default: --eval-every)")
    p.add_argument("--keep-last", type=int, default=2, help="step-N/ folders kept (default: 2)")
    p.add_argument("--val-fraction", type=float, default=0.1, help="examples held out (default: 0.1)")
    p.add_argument("--limit", type=int, default=None, metavar="N", help="use only the first N entries of --data")
    p.add_argument("--seed", type=int, default=123, help="seed of the split, data order and sampling (default: 123)")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default: cpu)")
    p.add_argument("--resume", default=None, metavar="DIR|auto",
                   help="continue from a step-N checkpoint or a run folder's newest; auto = OUT's newest, if any")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def _finetune_options(args: argparse.Namespace):
    from .alignment.loop import FinetuneOptions

    return FinetuneOptions(
        out_dir=args.out, epochs=args.epochs, max_steps=args.max_steps, stop_after=args.stop_after,
        batch_size=args.batch_size, lr=args.lr, min_lr=args.min_lr, warmup_steps=args.warmup_steps,
        weight_decay=args.weight_decay, grad_clip=args.grad_clip, eval_every=args.eval_every,
        checkpoint_every=args.checkpoint_every, keep_last=args.keep_last, val_fraction=args.val_fraction,
        seed=args.seed, device=args.device, resume=args.resume, progress=not args.no_progress,
    )


def _report_finetune(result, what: str) -> int:
    evals = ", ".join(f"{k} {v:.4f}" for k, v in result.last_eval.items())
    print(f"{what}: step {result.step}{'; ' + evals if evals else ''}; run folder {result.run_dir}")
    return 0


_DATA_HELP = "a JSON list or JSONL file of Alpaca-style entries (instruction, input, {})"


def _add_sft(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("sft", help="supervised fine-tuning on instruction/response pairs (loss on responses only)")
    p.add_argument("--model", required=True, metavar="DIR|HUBNAME", help="the model to start from")
    p.add_argument("--data", required=True, metavar="FILE", help=_DATA_HELP.format("output"))
    _add_finetune_options(p, "runs/sft", 5e-5, 8)
    p.set_defaults(run=_run_sft)


def _run_sft(args: argparse.Namespace) -> int:
    from .alignment.sft import sft

    result = sft(args.model, args.data, _finetune_options(args), limit=args.limit)
    return _report_finetune(result, f"sft done (tinygpt chat --model {result.run_dir})")


def _add_reward(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("reward", help="train a reward model (GPT trunk + scalar head) on chosen/rejected pairs")
    p.add_argument("--model", required=True, metavar="DIR|HUBNAME", help="the trunk to start from (an SFT model)")
    p.add_argument("--data", required=True, metavar="FILE", help=_DATA_HELP.format("chosen, rejected"))
    _add_finetune_options(p, "runs/reward", 1e-5, 8)
    p.set_defaults(run=_run_reward)


def _run_reward(args: argparse.Namespace) -> int:
    from .alignment.reward import train_reward_model

    return _report_finetune(train_reward_model(args.model, args.data, _finetune_options(args), limit=args.limit),
                            "reward model done")


def _add_dpo(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("dpo", help="Direct Preference Optimization against a frozen copy of the starting model")
    p.add_argument("--model", required=True, metavar="DIR|HUBNAME", help="the policy to start from (an SFT model)")
    p.add_argument("--data", required=True, metavar="FILE", help=_DATA_HELP.format("chosen, rejected"))
    p.add_argument("--beta", type=float, default=0.1, help="strength of the pull to the reference (default: 0.1)")
    _add_finetune_options(p, "runs/dpo", 5e-6, 8)
    p.set_defaults(run=_run_dpo)


def _run_dpo(args: argparse.Namespace) -> int:
    from .alignment.dpo import dpo

    result = dpo(args.model, args.data, _finetune_options(args), beta=args.beta, limit=args.limit)
    return _report_finetune(result, f"dpo done (tinygpt chat --model {result.run_dir})")


def _add_ppo(sub: argparse._SubParsersAction) -> None:
    from .alignment.ppo import PPOConfig

    d = PPOConfig()
    p = sub.add_parser("ppo", help="RLHF: PPO of a policy against a reward model, KL-anchored to the start")
    p.add_argument("--policy", required=True, metavar="DIR|HUBNAME", help="the policy to start from (an SFT model)")
    p.add_argument("--reward", required=True, metavar="DIR", help="a reward model written by tinygpt reward")
    p.add_argument("--data", required=True, metavar="FILE",
                   help="prompts: a JSON/JSONL file of entries with instruction (and input)")
    p.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens,
                   help=f"longest sampled response (default: {d.max_new_tokens})")
    p.add_argument("--temperature", type=float, default=d.temperature, help="sampling temperature (default: 1)")
    p.add_argument("--top-k", type=int, default=None, help="sample among the K most likely tokens")
    p.add_argument("--kl-coef", type=float, default=d.kl_coef, help=f"per-token KL penalty (default: {d.kl_coef})")
    p.add_argument("--gamma", type=float, default=d.gamma, help=f"discount (default: {d.gamma})")
    p.add_argument("--lam", type=float, default=d.lam, help=f"GAE lambda (default: {d.lam})")
    p.add_argument("--clip-range", type=float, default=d.clip_range, help=f"policy ratio clip (default: {d.clip_range})")
    p.add_argument("--value-clip-range", type=float, default=d.value_clip_range,
                   help=f"value clip (default: {d.value_clip_range})")
    p.add_argument("--value-coef", type=float, default=d.value_coef, help=f"value loss weight (default: {d.value_coef})")
    p.add_argument("--entropy-coef", type=float, default=d.entropy_coef, help="entropy bonus (default: 0)")
    p.add_argument("--ppo-epochs", type=int, default=d.ppo_epochs,
                   help=f"passes over each rollout batch (default: {d.ppo_epochs})")
    p.add_argument("--minibatch-size", type=int, default=None, help="rows per update (default: the whole batch)")
    _add_finetune_options(p, "runs/ppo", 1e-5, 8)
    p.set_defaults(run=_run_ppo)


def _run_ppo(args: argparse.Namespace) -> int:
    from .alignment.ppo import PPOConfig
    from .alignment.ppo_trainer import ppo

    config = PPOConfig(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                       kl_coef=args.kl_coef, gamma=args.gamma, lam=args.lam, clip_range=args.clip_range,
                       value_clip_range=args.value_clip_range, value_coef=args.value_coef,
                       entropy_coef=args.entropy_coef, ppo_epochs=args.ppo_epochs,
                       minibatch_size=args.minibatch_size)
    result = ppo(args.policy, args.reward, args.data, _finetune_options(args), config, limit=args.limit)
    return _report_finetune(result, f"ppo done (tinygpt chat --model {result.run_dir})")


def _add_chat(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("chat", help="answer instructions typed (or piped) on stdin, one per line; /exit ends")
    p.add_argument("--model", required=True, metavar="DIR|HUBNAME", help="a fine-tuned model (tinygpt sft/dpo/ppo)")
    p.add_argument("--max-new-tokens", type=int, default=256, metavar="N", help="longest answer (default: 256)")
    p.add_argument("--temperature", type=float, default=0.0, metavar="T", help="0 = greedy (default)")
    p.add_argument("--top-k", type=int, default=None, metavar="K", help="sample among the K most likely tokens")
    p.add_argument("--top-p", type=float, default=1.0, metavar="P", help="nucleus sampling mass (default: 1 = off)")
    p.add_argument("--seed", type=int, default=None, help="seed for sampling")
    p.add_argument("--tokenizer-dir", metavar="DIR", help="a saved tokenizer (default: the model's own)")
    p.set_defaults(run=_run_chat)


def _run_chat(args: argparse.Namespace) -> int:
    from .alignment.chat import chat
    from .generation import GenerationConfig
    from .interop.pretrained import load_pretrained

    settings = GenerationConfig(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                                top_p=args.top_p, seed=args.seed)
    model, tokenizer = load_pretrained(args.model, tokenizer_dir=args.tokenizer_dir)
    if tokenizer is None:
        raise CommandError(f"{args.model} has no tokenizer: pass --tokenizer-dir DIR")

    def write(text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    def report_error(message: str) -> None:
        print(f"tinygpt chat: error: {message}", file=sys.stderr)

    chat(model, tokenizer, sys.stdin, write, settings, prompt_marker="> " if sys.stdin.isatty() else "",
         report_error=report_error)
    return 0


# ---------------------------------------------------------------------------------------------- bench
def _add_bench(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="the benchmark suite (source checkout only): python -m benchmarks")
    p.add_argument("--quick", action="store_true", help="tiny sizes: checks the runner works in seconds")
    p.add_argument("--json", metavar="PATH", help="write the results here")
    p.add_argument("--only", metavar="CASES", help="comma-separated subset of the cases")
    p.add_argument("--repeats", metavar="N", help="interleaved timed rounds per case")
    p.set_defaults(run=_run_bench)


def _run_bench(args: argparse.Namespace) -> int:
    import importlib.util
    from pathlib import Path

    if importlib.util.find_spec("benchmarks") is None:
        # The suite is not part of the installed package; an editable install finds it next to src/.
        checkout = Path(__file__).resolve().parents[2]
        if not (checkout / "benchmarks" / "runner.py").exists():
            raise CommandError("the benchmark suite lives in the source checkout's benchmarks/ package; "
                               "run `python -m benchmarks` from a checkout of tinygpt")
        sys.path.insert(0, str(checkout))
    from benchmarks.runner import main as bench_main

    argv = ["--quick"] if args.quick else []
    for flag in ("json", "only", "repeats"):
        if getattr(args, flag) is not None:
            argv += [f"--{flag}", getattr(args, flag)]
    return bench_main(argv)


COMMANDS: list[Callable[[argparse._SubParsersAction], None]] = [
    _add_params, _add_verify, _add_prepare, _add_train, _add_generate, _add_convert, _add_experiment,
    _add_sft, _add_reward, _add_ppo, _add_dpo, _add_chat, _add_bench,
]


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="tinygpt", description="A GPT-2-family transformer written from first principles.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=_Parser)
    for add in COMMANDS:
        add(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except (CommandError, ValueError, TypeError, FileNotFoundError) as err:
        print(f"tinygpt {args.command}: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
