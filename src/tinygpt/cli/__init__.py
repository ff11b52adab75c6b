"""The ``tinygpt`` command line: argument parsing only; the work is done by the library.

One module per family of commands; each offers ``_add_<command>(subparsers)``, which registers the command and the
function that runs it.
"""

from __future__ import annotations

import argparse
import sys
from typing import Callable, Sequence

from .common import CommandError, Parser
from .alignment_commands import _add_sft, _add_reward, _add_ppo, _add_dpo, _add_chat
from .experiment_commands import _add_experiment
from .model_commands import _add_params, _add_verify, _add_generate, _add_convert
from .training_commands import _add_prepare, _add_train

COMMANDS: list[Callable[[argparse._SubParsersAction], None]] = [
    _add_params, _add_verify, _add_prepare, _add_train, _add_generate, _add_convert, _add_experiment,
    _add_sft, _add_reward, _add_ppo, _add_dpo, _add_chat,
]


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="tinygpt", description="A GPT-2-family transformer written from first principles.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=Parser)
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
