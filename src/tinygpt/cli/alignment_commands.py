"""From pretrained model to assistant: `sft`, `reward`, `dpo`, `ppo`, `chat`."""

from __future__ import annotations

import argparse
import sys

from ..alignment.options import DPOInputs, PPOInputs, RewardInputs, SFTInputs
from .common import (CommandError, add_generation_options, add_options, load_for_command, options_from_args,
                     sampling_config)


def _add_finetune_options(p: argparse.ArgumentParser, out: str, lr: float | None, batch_size: int,
                          epochs: int | None = 1) -> None:
    """The settings every fine-tuning stage shares: one flag per ``FinetuneOptions`` field, plus the data limit
    and the tokenizer. ``lr`` / ``epochs`` None: the stage chooses by the model's size (sft)."""
    from ..alignment.options import FinetuneInputs, FinetuneOptions, sft_defaults_help

    from ..lora_options import LoRAOptions

    add_options(p, FinetuneOptions, defaults={"out_dir": out, "lr": lr, "batch_size": batch_size, "epochs": epochs})
    for action in p._actions:  # the settings the stage chooses by the model's size (sft.SFT_DEFAULTS) say so
        if action.dest in ("lr", "epochs") and action.default is None:
            action.help += f" (default: {sft_defaults_help()})"
    add_options(p, LoRAOptions)
    add_options(p, FinetuneInputs)


def _finetune_options(args: argparse.Namespace):
    from ..alignment.options import FinetuneOptions

    return options_from_args(FinetuneOptions, args)


def _lora_config(args: argparse.Namespace):
    """The ``LoRAConfig`` of the --lora-* flags (None without --lora-r), checked before any model is loaded."""
    from ..lora_options import LoRAOptions

    return options_from_args(LoRAOptions, args).to_config()


def _report_finetune(result, what: str) -> int:
    evals = ", ".join(f"{k} {v:.4f}" for k, v in result.last_eval.items())
    print(f"{what}: step {result.step}{'; ' + evals if evals else ''}; run folder {result.run_dir}")
    return 0


def _add_sft(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("sft", help="supervised fine-tuning on instruction/response pairs (loss on responses only)")
    add_options(p, SFTInputs)
    _add_finetune_options(p, "runs/sft", None, 8, epochs=None)
    p.set_defaults(run=_run_sft)


def _run_sft(args: argparse.Namespace) -> int:
    from ..alignment.sft import sft

    result = sft(args.model, args.data, _finetune_options(args), limit=args.limit, tokenizer_dir=args.tokenizer_dir,
                 lora=_lora_config(args))
    return _report_finetune(result, f"sft done (tinygpt chat --model {result.run_dir})")


def _add_reward(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("reward", help="train a reward model (GPT trunk + scalar head) on chosen/rejected pairs")
    add_options(p, RewardInputs)
    _add_finetune_options(p, "runs/reward", 1e-5, 8)
    p.set_defaults(run=_run_reward)


def _run_reward(args: argparse.Namespace) -> int:
    from ..alignment.reward import train_reward_model

    result = train_reward_model(args.model, args.data, _finetune_options(args), limit=args.limit,
                                tokenizer_dir=args.tokenizer_dir, lora=_lora_config(args))
    return _report_finetune(result, "reward model done")


def _add_dpo(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("dpo", help="Direct Preference Optimization against a frozen copy of the starting model")
    add_options(p, DPOInputs)
    _add_finetune_options(p, "runs/dpo", 5e-6, 8)
    p.set_defaults(run=_run_dpo)


def _run_dpo(args: argparse.Namespace) -> int:
    from ..alignment.dpo import dpo

    result = dpo(args.model, args.data, _finetune_options(args), beta=args.beta, limit=args.limit,
                 tokenizer_dir=args.tokenizer_dir, lora=_lora_config(args))
    return _report_finetune(result, f"dpo done (tinygpt chat --model {result.run_dir})")


def _add_ppo(sub: argparse._SubParsersAction) -> None:
    from ..alignment.ppo import PPOConfig

    p = sub.add_parser("ppo", help="RLHF: PPO of a policy against a reward model, KL-anchored to the start")
    add_options(p, PPOInputs)
    add_options(p, PPOConfig)
    _add_finetune_options(p, "runs/ppo", 1e-5, 8)
    p.set_defaults(run=_run_ppo)


def _run_ppo(args: argparse.Namespace) -> int:
    from ..alignment.ppo import PPOConfig
    from ..alignment.ppo_trainer import ppo

    config = options_from_args(PPOConfig, args)
    result = ppo(args.policy, args.reward, args.data, _finetune_options(args), config, limit=args.limit,
                 tokenizer_dir=args.tokenizer_dir, lora=_lora_config(args))
    return _report_finetune(result, f"ppo done (tinygpt chat --model {result.run_dir})")


def _add_chat(sub: argparse._SubParsersAction) -> None:
    from ..command_options import ChatOptions

    p = sub.add_parser("chat", help="answer instructions typed (or piped) on stdin, one per line; /exit ends")
    add_options(p, ChatOptions)
    add_generation_options(p, max_new_tokens=256)
    p.set_defaults(run=_run_chat)


def _run_chat(args: argparse.Namespace) -> int:
    from ..alignment.chat import chat
    from ..command_options import ChatOptions
    from ..devices import autocast

    options = options_from_args(ChatOptions, args)
    options.check()
    settings = sampling_config(args, "chat")  # checked before the model is loaded
    model, tokenizer, device = load_for_command(options.model, options.tokenizer_dir, options.device,
                                                options.weights, base=options.base)

    def write(text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    def report_error(message: str) -> None:
        print(f"tinygpt chat: error: {message}", file=sys.stderr)

    with autocast(device, options.dtype):
        chat(model, tokenizer, sys.stdin, write, settings, prompt_marker="> " if sys.stdin.isatty() else "",
             report_error=report_error, stop_texts=options.stop, tool=options.tool)
    return 0
