"""The chapter's and the block lesson's experiments: `experiment NAME`."""

from __future__ import annotations

import argparse
import sys

from .common import Parser


def _add_experiment(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("experiment", help="the chapter's and the block lesson's experiments: print a table, write "
                                          "PNGs and a JSON")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--out", metavar="DIR", help="output directory (default: runs/experiments/NAME)")
    common.add_argument("--seed", type=int, default=123, help="random seed (default: 123)")
    names = p.add_subparsers(dest="experiment", required=True, metavar="NAME", parser_class=Parser)
    names.add_parser("residual", parents=[common], help="gradients of the 5-layer example with/without shortcuts")
    pp = names.add_parser("prepost", parents=[common], help="pre-LN vs post-LN: outputs, gradients, training")
    pp.add_argument("--config", help="preset or config .json for the trained 12-layer models (vocab_size replaced "
                                     "by the character count; default C=64 D=64 H=4 L=12)")
    pp.add_argument("--data", metavar="FILE", help="UTF-8 training text (default: the embedded corpus)")
    pp.add_argument("--max-chars", type=int, default=400_000, help="characters of text used (default: 400000)")
    pp.add_argument("--init", choices=("xavier", "gpt2"), default="xavier",
                    help="weight init of the trained models: xavier (the original Transformer's: Xavier-uniform "
                         "linears, N(0, 1) embeddings) or gpt2 (N(0, 0.02)) (default: xavier)")
    pp.add_argument("--seeds", type=int,
                    help="seeds of the main cell (--seed, --seed + 1, ...) (default: 3; 1 with --stall)")
    pp.add_argument("--stall", action="store_true",
                    help="the stall alone: pre-LN and post-LN without warmup at the main cell, nothing else, and "
                         "one graded line (about 40 s of CPU per seed, one thread)")
    pp.add_argument("--steps", type=int, default=300, help="training steps per model; 0 skips training (default: 300)")
    pp.add_argument("--batch-size", type=int, default=16, help="sequences per step (default: 16)")
    pp.add_argument("--seq-len", type=int, default=32, help="characters per sequence (default: 32)")
    pp.add_argument("--lr", type=float, default=1e-3, help="constant AdamW learning rate after the warmup "
                                                          "(default: 1e-3)")
    pp.add_argument("--warmup", type=int, default=100,
                    help="linear warmup steps of the two warmup runs (default: 100)")
    pp.add_argument("--contrast-depths", type=_int_list, default=(6,), metavar="N,N,...",
                    help="shallower cells, pre-LN and post-LN without warmup, one seed; 0 for none (default: 6)")
    pp.add_argument("--control-init", choices=("gpt2", "xavier", "none"), default="gpt2",
                    help="the control cell's init, pre-LN and post-LN without warmup, one seed (default: gpt2)")
    pp.add_argument("--profile-depths", type=_int_list, default=(2, 6, 12, 24), metavar="N,N,...",
                    help="depths of the gradient profile and the one-step change at init (default: 2,6,12,24)")
    pp.add_argument("--sweep", action="store_true",
                    help="also train the four runs at every --sweep-depths x --sweep-lrs, one seed "
                         "(the evidence in docs/experiments.md)")
    pp.add_argument("--sweep-depths", type=_int_list, default=(6, 12), metavar="N,N,...",
                    help="depths of the sweep (default: 6,12)")
    pp.add_argument("--sweep-lrs", type=_float_list, default=(3e-4, 1e-3, 3e-3), metavar="LR,LR,...",
                    help="learning rates of the sweep (default: 3e-4,1e-3,3e-3)")
    pp.add_argument("--sweep-steps", type=int, help="training steps per sweep run (default: --steps)")
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
    la = names.add_parser("ladder", parents=[common], help="GPT-2 block -> modern block, one change per rung, each "
                                                         "trained for the same CPU time on 3 seeds")
    la.add_argument("--budget", default="20s", help="CPU time per run, one thread: 90s, 5m, ... (default: 20s)")
    la.add_argument("--seeds", type=int, default=3, help="seeds per rung (--seed, --seed + 1, ...) (default: 3)")
    la.add_argument("--rungs", type=lambda t: tuple(t.split(",")), metavar="NAME,NAME,...",
                    help="a subset of the rungs, in ladder order (default: all; each keeps the changes above it)")
    la.add_argument("--data", metavar="FILE", help="UTF-8 training text (default: the embedded corpus)")
    la.add_argument("--max-chars", type=int, default=400_000, help="characters of text used (default: 400000)")
    la.add_argument("--jobs", type=int, default=1, help="runs trained at once, each in its own process (default: 1)")
    la.add_argument("--lr", type=float, default=1e-3, help="AdamW's peak learning rate (default: 1e-3)")
    la.add_argument("--muon-lr", type=float, default=0.04,
                    help="Muon's peak learning rate (default: 0.04, the best of 0.01, 0.02, 0.04 at 10 s)")
    p.set_defaults(run=_run_experiment)


def _int_list(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None


def _float_list(text: str) -> tuple[float, ...]:
    try:
        return tuple(float(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of numbers") from None


def _run_experiment(args: argparse.Namespace) -> int:
    from .. import experiments

    common = dict(out=args.out, seed=args.seed)
    name = args.experiment
    if name == "prepost":
        report = experiments.run_prepost(
            **common, config=args.config, data=args.data, max_chars=args.max_chars, steps=args.steps,
            batch_size=args.batch_size, seq_len=args.seq_len, lr=args.lr, warmup=args.warmup, init=args.init,
            seeds=args.seeds if args.seeds is not None else (1 if args.stall else 3), stall_only=args.stall,
            contrast_depths=tuple(d for d in args.contrast_depths if d != 0),
            control_init=None if args.control_init == "none" else args.control_init,
            profile_depths=args.profile_depths, sweep=args.sweep, sweep_depths=args.sweep_depths,
            sweep_lrs=args.sweep_lrs, sweep_steps=args.sweep_steps,
            progress=lambda line: print(line, file=sys.stderr, flush=True))
    elif name == "attention":
        config = None if args.model is not None else (args.config or "gpt2-small")
        report = experiments.run_attention(**common, model_dir=args.model, config=config, prompt=args.prompt,
                                           layer=args.layer)
    elif name == "ladder":
        from ..experiments.ladder import RUNG_NAMES

        report = experiments.run_ladder(**common, seeds=args.seeds, budget=args.budget, rungs=args.rungs or RUNG_NAMES,
                                        data=args.data, max_chars=args.max_chars, lr=args.lr, muon_lr=args.muon_lr,
                                        jobs=args.jobs,
                                        progress=lambda line: print(line, file=sys.stderr, flush=True))
    elif name == "anatomy":
        report = experiments.run_anatomy(**common, configs=args.config)
    else:
        report = experiments.EXPERIMENTS[name](**common)
    print(report.text)
    return 0
