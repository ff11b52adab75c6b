"""Reinforcement learning with verifiable rewards: `grpo`, and `arithmetic-task` (the shipped task's data)."""

from __future__ import annotations

import argparse

from ..alignment.options import ArithmeticTaskOptions, GRPOInputs
from .alignment_commands import _add_finetune_options, _finetune_options, _lora_config, _report_finetune
from .common import add_options, options_from_args


def _add_grpo(sub: argparse._SubParsersAction) -> None:
    from ..alignment.grpo_trainer import GRPOConfig

    p = sub.add_parser("grpo", help="GRPO: G sampled completions per prompt, rewards from a verifier, group-relative "
                                    "advantages, the clipped objective (a calculator tool the model may call)")
    add_options(p, GRPOInputs)
    add_options(p, GRPOConfig)
    _add_finetune_options(p, "runs/grpo", 1e-5, 8)
    p.set_defaults(run=_run_grpo)


def _run_grpo(args: argparse.Namespace) -> int:
    from .. import checks
    from ..alignment.grpo_trainer import GRPOConfig, grpo

    checks.positive_int("eval_limit", args.eval_limit)
    config = options_from_args(GRPOConfig, args)
    result = grpo(args.model, args.data, _finetune_options(args), config, reward_fns=args.reward_fns or ["exact"],
                  eval_data=args.eval_data, eval_limit=args.eval_limit, limit=args.limit,
                  tokenizer_dir=args.tokenizer_dir, lora=_lora_config(args))
    return _report_finetune(result, f"grpo done (tinygpt chat --model {result.run_dir})")


def _add_arithmetic_task(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("arithmetic-task", help="write the shipped GRPO task: arithmetic word problems with exact "
                                               "answers (train.jsonl, test.jsonl, corpus.txt)")
    add_options(p, ArithmeticTaskOptions)
    p.set_defaults(run=_run_arithmetic_task)


def _run_arithmetic_task(args: argparse.Namespace) -> int:
    from .. import checks
    from ..alignment.arithmetic import write_task

    args = options_from_args(ArithmeticTaskOptions, args)
    checks.positive_int("train", args.train)
    checks.positive_int("test", args.test)
    checks.number_in_range("direct_share", args.direct_share, 0, 1)
    paths = write_task(args.out, train=args.train, test=args.test, levels=tuple(args.levels), seed=args.seed,
                       direct_share=args.direct_share)
    print(f"wrote {', '.join(str(p) for p in paths.values())}")
    return 0
