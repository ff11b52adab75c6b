"""The chapter's and the block lesson's experiments: `experiment NAME`."""

from __future__ import annotations

import argparse
import sys

from .common import Parser, add_options, options_from_args


def _add_experiment(sub: argparse._SubParsersAction) -> None:
    from ..experiment_options import EXPERIMENT_OPTIONS

    p = sub.add_parser("experiment", help="the chapter's and the block lesson's experiments: print a table, write "
                                          "PNGs and a JSON")
    names = p.add_subparsers(dest="experiment", required=True, metavar="NAME", parser_class=Parser)
    for name, (options, help_text) in EXPERIMENT_OPTIONS.items():
        add_options(names.add_parser(name, help=help_text), options)  # one flag per field
    p.set_defaults(run=_run_experiment)


def _run_experiment(args: argparse.Namespace) -> int:
    from .. import experiments
    from ..experiment_options import EXPERIMENT_OPTIONS

    name = args.experiment
    args = options_from_args(EXPERIMENT_OPTIONS[name][0], args)
    common = dict(out=args.out, seed=args.seed)
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
        report = experiments.run_anatomy(**common, configs=args.config or None)  # no --config: every preset
    else:
        report = experiments.EXPERIMENTS[name](**common)
    print(report.text)
    return 0
