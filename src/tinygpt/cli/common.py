"""What every command module shares: the one-line user error, the config argument, flags made from the options
dataclasses' fields, and the flag families several commands share (device and dtype, sampling and stop)."""

from __future__ import annotations

import argparse
import dataclasses
import re
import sys
import typing
from typing import Any

from ..checks import OptionError
from ..config import GPTConfig, get_config


class CommandError(Exception):
    """A user error found by a command: printed as one line, exit code 2."""


class Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, no usage dump
        self.exit(2, f"{self.prog}: error: {message}\n")


def config_from_args(name_or_file: str) -> GPTConfig:
    """A preset name or a config ``.json`` file."""
    if name_or_file.endswith(".json"):
        return GPTConfig.from_file(name_or_file)
    return get_config(name_or_file)


# ------------------------------------------------------------------------------------------ options <-> flags
def _flag(f: dataclasses.Field) -> str:
    return f.metadata.get("flag") or "--" + f.name.replace("_", "-")


def _base_type(hint: Any) -> tuple[type, bool]:
    """(the scalar type argparse converts to, whether the field is a list) of a field's type hint."""
    args = [a for a in typing.get_args(hint) if a is not type(None)] or [hint]
    first = args[0]
    if typing.get_origin(first) is list:
        return typing.get_args(first)[0], True
    return (first if first in (int, float, str, bool) else str), False


def add_options(parser: argparse.ArgumentParser, cls: type, *, defaults: dict[str, Any] | None = None,
                skip: tuple[str, ...] = ()) -> None:
    """One flag per field of the dataclass ``cls`` whose metadata has ``help`` (``tinygpt.checks.option``): the
    flag ``--field-name`` (or the metadata's ``flag``), the field's type and default (``defaults`` overrides it
    for this command), the help with its default. A bool field that defaults to True gets a ``--no-...`` flag."""
    defaults = defaults or {}
    hints = typing.get_type_hints(cls)
    groups: dict[str, argparse._MutuallyExclusiveGroup] = {}
    for f in dataclasses.fields(cls):
        meta = f.metadata
        if meta.get("help") is None or f.name in skip:
            continue
        default = defaults.get(f.name, f.default)
        target: Any = parser
        if meta.get("group"):
            if meta["group"] not in groups:
                groups[meta["group"]] = parser.add_mutually_exclusive_group()
            target = groups[meta["group"]]
        kind, is_list = _base_type(hints[f.name])
        if kind is bool:
            action = "store_false" if default else "store_true"
            target.add_argument(_flag(f), dest=f.name, action=action, default=default, help=meta["help"])
            continue
        shown = meta.get("default_help", default)
        help_text = meta["help"] if shown is None else f"{meta['help']} (default: {shown})"
        kwargs: dict[str, Any] = dict(dest=f.name, type=kind, default=default, help=help_text.replace("%", "%%"))
        for key in ("metavar", "choices"):
            if key in meta:
                kwargs[key] = meta[key]
        if "metavar" not in kwargs and "choices" not in kwargs and kind in (int, float):
            kwargs["metavar"] = "N" if kind is int else "X"
        if is_list:
            kwargs["nargs"] = meta.get("nargs", "+")
        target.add_argument(_flag(f), **kwargs)


def options_from_args(cls: type, args: argparse.Namespace, **extra: Any) -> Any:
    """An instance of the dataclass ``cls`` from the parsed flags ``add_options`` made (fields without a flag keep
    their default), with ``extra`` on top."""
    given = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if f.init and hasattr(args, f.name)}
    return cls(**{**given, **extra})


def flag_error(parser: argparse.ArgumentParser, err: OptionError) -> str:
    """``err`` in the words of the command line: the flag whose destination is the field (``--top-k 0 must be
    ...``); the Python wording when no flag sets that field."""
    for action in parser._actions:
        if action.dest == err.field and action.option_strings:
            flag = max(action.option_strings, key=len)
            value = "" if isinstance(err.value, bool) else f" {err.value}"
            return f"{flag}{value} {err.rule}"
    return str(err)


# ------------------------------------------------------------------------------------------ shared flag families
def add_device_options(parser: argparse.ArgumentParser) -> None:
    """``--device`` and ``--dtype``, with one meaning on every command (``tinygpt.devices``)."""
    from ..training.options import DTYPES

    parser.add_argument("--device", default=None, help="cpu, cuda or cuda:N (default: cuda when available)")
    parser.add_argument("--dtype", default="auto", choices=DTYPES,
                        help="bfloat16 = bf16 autocast with float32 weights; auto = bf16 on a bf16-capable GPU, "
                             "else float32 (default: auto)")


DEFAULT_SEED = 1337  # the one default of every command's --seed (= TrainingOptions.seed, FinetuneOptions.seed)


def add_sampling_options(parser: argparse.ArgumentParser, *, max_new_tokens: int) -> None:
    """The sampling and stop flags of ``generate`` and ``chat``. The sampling flags default to None so that
    ``warn_unused_sampling`` can tell the ones given."""
    parser.add_argument("--max-new-tokens", type=int, default=max_new_tokens, metavar="N",
                        help=f"tokens to add at most (default: {max_new_tokens})")
    parser.add_argument("--temperature", type=float, default=0.0, metavar="T",
                        help="0 = greedy (default); > 0 samples from softmax(logits / T)")
    parser.add_argument("--top-k", type=int, default=None, metavar="K", help="sample among the K most likely tokens")
    parser.add_argument("--top-p", type=float, default=None, metavar="P",
                        help="sample among the most likely tokens whose probability sums to P (default 1 = all)")
    parser.add_argument("--repetition-penalty", type=float, default=None, metavar="R",
                        help="> 1 discourages tokens already in the text (default 1 = none)")
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED,
                        help=f"seed for sampling: the same seed gives the same text (default: {DEFAULT_SEED})")
    parser.add_argument("--stop", action="append", default=[], metavar="TEXT", type=decode_escapes,
                        help="stop before this text (repeatable); escape sequences are decoded: \\n newline, \\t tab, "
                             "\\\\ backslash, \\xHH, \\uHHHH (so --stop '\\n\\n' is a blank line); generation also "
                             "stops at the end-of-text token")
    parser.add_argument("--tokenizer-dir", metavar="DIR",
                        help="a saved tokenizer, or a folder with GPT-2's encoder.json + vocab.bpe (or vocab.json + "
                             "merges.txt); default: the model's own, else $TINYGPT_GPT2_VOCAB, else tiktoken's cache")


def sampling_config(args: argparse.Namespace, command: str, **extra: Any) -> Any:
    """The ``GenerationConfig`` of ``add_sampling_options``' flags (and ``extra`` fields), checked; then a warning
    (one line on stderr, as Hugging Face gives) about sampling flags that greedy decoding (``--temperature 0``)
    ignores."""
    from ..generation import GenerationConfig

    if any(not text for text in args.stop):
        raise CommandError("--stop needs a non-empty text")
    config = GenerationConfig(
        max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
        top_p=1.0 if args.top_p is None else args.top_p,
        repetition_penalty=1.0 if args.repetition_penalty is None else args.repetition_penalty, seed=args.seed,
        **extra)
    unused = [flag for flag, value in (("--top-k", args.top_k), ("--top-p", args.top_p)) if value is not None]
    if args.temperature == 0 and unused:
        print(f"tinygpt {command}: warning: {' and '.join(unused)} {'has' if len(unused) == 1 else 'have'} no "
              f"effect with --temperature 0 (greedy decoding); give --temperature > 0 to sample", file=sys.stderr)
    return config


_ESCAPE = re.compile(r"\\(?:x([0-9a-fA-F]{2})|u([0-9a-fA-F]{4})|(.))", re.DOTALL)
_SIMPLE_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "0": "\0", "\\": "\\", "'": "'", '"': '"'}


def decode_escapes(text: str) -> str:
    """``\\n``, ``\\t``, ``\\r``, ``\\0``, ``\\\\``, quotes, ``\\xHH`` and ``\\uHHHH`` in ``text`` decoded (so a shell's
    ``--stop "\\n\\n"`` means two newlines); other characters, non-ASCII included, stay as they are; an unknown
    escape is an error."""
    def one(match: re.Match) -> str:
        hex2, hex4, char = match.groups()
        if hex2 or hex4:
            return chr(int(hex2 or hex4, 16))
        if char in _SIMPLE_ESCAPES:
            return _SIMPLE_ESCAPES[char]
        raise argparse.ArgumentTypeError(f"unknown escape \\{char} in {text!r}; allowed: \\n \\t \\r \\0 \\\\ \\' "
                                         f"\\\" \\xHH \\uHHHH")

    return _ESCAPE.sub(one, text)
