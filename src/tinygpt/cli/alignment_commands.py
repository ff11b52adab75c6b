"""From pretrained model to assistant: `sft`, `reward`, `dpo`, `ppo`, `chat`."""

from __future__ import annotations

import argparse
import sys

from .common import CommandError


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
    from ..alignment.loop import FinetuneOptions

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
    from ..alignment.sft import sft

    result = sft(args.model, args.data, _finetune_options(args), limit=args.limit)
    return _report_finetune(result, f"sft done (tinygpt chat --model {result.run_dir})")


def _add_reward(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("reward", help="train a reward model (GPT trunk + scalar head) on chosen/rejected pairs")
    p.add_argument("--model", required=True, metavar="DIR|HUBNAME", help="the trunk to start from (an SFT model)")
    p.add_argument("--data", required=True, metavar="FILE", help=_DATA_HELP.format("chosen, rejected"))
    _add_finetune_options(p, "runs/reward", 1e-5, 8)
    p.set_defaults(run=_run_reward)


def _run_reward(args: argparse.Namespace) -> int:
    from ..alignment.reward import train_reward_model

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
    from ..alignment.dpo import dpo

    result = dpo(args.model, args.data, _finetune_options(args), beta=args.beta, limit=args.limit)
    return _report_finetune(result, f"dpo done (tinygpt chat --model {result.run_dir})")


def _add_ppo(sub: argparse._SubParsersAction) -> None:
    from ..alignment.ppo import PPOConfig

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
    from ..alignment.ppo import PPOConfig
    from ..alignment.ppo_trainer import ppo

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
    from ..alignment.chat import chat
    from ..generation import GenerationConfig
    from ..interop.pretrained import load_pretrained

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
