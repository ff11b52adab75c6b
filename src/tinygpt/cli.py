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
    p.add_argument("--config", default="gpt2-small",
                   help=f"a preset ({', '.join(PRESETS)}) or a config .json file (default: gpt2-small)")
    p.add_argument("--qkv-bias", action="store_true", help="count a bias on the fused QKV projection (+3D per layer)")
    p.add_argument("--tie-weights", action="store_true", help="share the head with the token embedding (-VD)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(run=_run_params)


def _run_params(args: argparse.Namespace) -> int:
    config = _config_from_args(args.config)
    overrides = {}
    if args.qkv_bias:
        overrides["qkv_bias"] = True
    if args.tie_weights:
        overrides["tie_weights"] = True
    config = config.replace(**overrides)
    counts = count_parameters(config)
    if args.json:
        print(json.dumps({"config": config.to_dict(), "parameters": counts.to_dict()}, indent=2))
        return 0
    rows = [
        ("token embedding (V*D)", counts.token_embedding),
        ("position embedding (C*D)", counts.position_embedding),
        (f"attention ({config.n_layers} x {counts.attention_per_block:,})", counts.attention),
        (f"feed-forward ({config.n_layers} x {counts.feed_forward_per_block:,})", counts.feed_forward),
        (f"layer norms ({config.n_layers} x {counts.norms_per_block:,} + {counts.final_norm:,})", counts.norms),
        ("output head (V*D, 0 when tied)", counts.head),
        ("total", counts.total),
    ]
    print(f"{args.config}: V={config.vocab_size} C={config.context_length} D={config.emb_dim} "
          f"H={config.n_heads} L={config.n_layers} qkv_bias={config.qkv_bias} tie_weights={config.tie_weights}")
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


COMMANDS: list[Callable[[argparse._SubParsersAction], None]] = [_add_params, _add_verify]


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
