"""The ``tinygpt`` command line: argument parsing only; the work is done by the library.

One module per family of commands; each offers ``_add_<command>(subparsers)``, which registers the command and the
function that runs it.
"""

from __future__ import annotations

import argparse
import os
import shlex
import signal
import sys
import threading
import warnings
from typing import Any, Callable, Sequence

from .common import CommandError, Parser, flag_error
from .alignment_commands import _add_sft, _add_reward, _add_ppo, _add_dpo, _add_chat
from .eval_command import _add_eval
from .grpo_commands import _add_arithmetic_task, _add_grpo
from .lora_commands import _add_merge
from .serve_command import _add_serve
from .experiment_commands import _add_experiment
from .model_commands import _add_params, _add_verify, _add_generate, _add_convert
from .training_commands import _add_prepare, _add_train

COMMANDS: list[Callable[[argparse._SubParsersAction], None]] = [
    _add_params, _add_verify, _add_prepare, _add_train, _add_generate, _add_convert, _add_experiment,
    _add_sft, _add_reward, _add_ppo, _add_dpo, _add_grpo, _add_arithmetic_task, _add_merge, _add_chat, _add_serve, _add_eval,
]


def build_parser() -> argparse.ArgumentParser:
    from .. import __version__

    parser = Parser(prog="tinygpt", description="A GPT-2-family transformer written from first principles.")
    parser.add_argument("--version", action="version", version=f"tinygpt {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    for add in COMMANDS:
        add(sub)
    for command in sub.choices.values():
        command.set_defaults(parser=command)  # for errors worded with the command's own flags
    return parser


def _resume_command(argv: Sequence[str]) -> str:
    """The command line that continues an interrupted run: the same one with ``--resume auto``."""
    args, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--resume":
            skip = True
        elif not arg.startswith("--resume="):
            args.append(arg)
    return shlex.join(["tinygpt", *args, "--resume", "auto"])


def _quiet_closed_stdout() -> None:
    """After a closed pipe (``tinygpt generate | head``): point stdout at /dev/null so that the interpreter's own
    final flush finds nothing to complain about."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass


def main(argv: Sequence[str] | None = None) -> int:
    from ..checks import OptionError
    from ..training.lifecycle import Diverged, Interrupted, Terminated, raise_terminated

    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # worded by the command's own parser: `tinygpt train: error: ...`
        getattr(args, "parser", parser).error(f"unrecognized arguments: {' '.join(unknown)}")
    if args.command is None:  # bare `tinygpt`: the command list
        parser.print_help()
        return 0
    name = f"tinygpt {args.command}"
    previous_sigterm = _on_sigterm(raise_terminated)
    previous_warning = _warnings_as_lines(name)
    try:
        if args.command in RUNS_A_MODEL:
            _note_crowded_cpu(name, getattr(args, "device", None))
        return args.run(args)
    except OptionError as err:
        print(f"{name}: error: {flag_error(args.parser, err)}", file=sys.stderr)
        return 2
    except (CommandError, ValueError, TypeError, FileNotFoundError) as err:
        print(f"{name}: error: {err}", file=sys.stderr)
        return 2
    except Diverged as err:
        print(f"{name}: {err}", file=sys.stderr)
        return 1
    except Interrupted as err:
        print(f"{name}: {err}; resume with: {_resume_command(argv)}", file=sys.stderr)
        return err.exit_code
    except BrokenPipeError:  # the reader went away (`| head`): nothing left to say to it
        _quiet_closed_stdout()
        return 141  # 128 + SIGPIPE, what a process killed by the pipe would report
    except KeyboardInterrupt as err:  # Ctrl-C (or SIGTERM) outside a training loop, or a second one inside it
        print(f"\n{name}: stopped at once; every file already written is complete (each is written atomically)",
              file=sys.stderr)
        return 143 if isinstance(err, Terminated) else 130
    finally:
        _on_sigterm(previous_sigterm)
        warnings.showwarning = previous_warning


# The commands that run a model for long enough that torch's thread count matters
RUNS_A_MODEL = frozenset({"train", "sft", "reward", "ppo", "dpo", "generate", "chat", "serve", "eval", "experiment"})


def _note_crowded_cpu(name: str, device: str | None) -> None:
    """``devices.crowded_cpu_note`` on stderr, for a command that will run on the CPU."""
    import torch

    from ..devices import crowded_cpu_note

    if device in (None, "auto") and torch.cuda.is_available() or str(device).startswith("cuda"):
        return
    note = crowded_cpu_note(name)
    if note:
        print(note, file=sys.stderr)


def _warnings_as_lines(name: str) -> Any:
    """Show every Python warning a command raises as one line, ``tinygpt CMD: warning: ...`` (not the module, line
    number and source line Python prints); returns the previous ``warnings.showwarning`` to restore."""
    previous = warnings.showwarning

    def show(message: Warning | str, category: type[Warning], filename: str, lineno: int, file: Any = None,
             line: str | None = None) -> None:
        print(f"{name}: warning: {message}", file=sys.stderr)

    warnings.showwarning = show
    return previous


def _on_sigterm(handler: Any) -> Any:
    """Install ``handler`` for SIGTERM (main thread only; elsewhere Python cannot); returns the previous one."""
    if handler is None or threading.current_thread() is not threading.main_thread():
        return None
    return signal.signal(signal.SIGTERM, handler)
