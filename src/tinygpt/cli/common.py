"""What every command module shares: the one-line user error, the config argument, flags made from the options
dataclasses' fields, and the flag family generate and chat share (sampling and stop)."""

from __future__ import annotations

import argparse
import dataclasses
import re
import sys
import typing
from typing import Any

from ..checks import OptionError
from ..config import DEFAULT_SEED, GPTConfig, get_config


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
def _base_type(hint: Any) -> tuple[type, bool]:
    """(the scalar type argparse converts to, whether the field is a list) of a field's type hint."""
    args = [hint] if typing.get_origin(hint) is list else [a for a in typing.get_args(hint) if a is not type(None)]
    first = (args or [hint])[0]
    if typing.get_origin(first) is list:
        return typing.get_args(first)[0], True
    return (first if first in (int, float, str, bool) else str), False


def _is_scalar(hint: Any) -> bool:
    """An int, float, str or bool field (or an optional one)."""
    args = [a for a in typing.get_args(hint) if a is not type(None)] or [hint]
    return len(args) == 1 and args[0] in (int, float, str, bool)


def add_options(parser: argparse.ArgumentParser, cls: type, *, defaults: dict[str, Any] | None = None,
                skip: tuple[str, ...] = (), metadata: dict[str, dict[str, Any]] | None = None,
                every_field: bool = False) -> None:
    """One flag per field of the dataclass ``cls`` whose metadata has ``help`` (``tinygpt.checks.option``): the
    flag ``--field-name`` (or the metadata's ``flag``), the field's type and default (``defaults`` overrides it
    for this command), the help with its default. A bool field that defaults to True gets a ``--no-...`` flag (both
    ``--x``/``--no-x`` with ``both_ways``). ``metadata`` supplies the command-line metadata of fields that have none
    of their own; ``every_field`` also makes flags of the scalar fields that have no help anywhere. Metadata may also
    say ``required``, ``action="append"``, ``escapes`` (the text's escape sequences decoded) and ``type`` (a function
    that reads the text, for a value such as ``6,12``); a required field of a ``group`` makes the group required; a
    ``flag`` without dashes is a positional argument. Each action made here names ``cls`` in ``from_options`` (so a
    test can tell that every flag of every command comes from a field)."""
    defaults = defaults or {}
    hints = typing.get_type_hints(cls)
    groups: dict[str, argparse._MutuallyExclusiveGroup] = {}
    for f in dataclasses.fields(cls):
        meta = dict(f.metadata) if f.metadata.get("help") is not None else dict((metadata or {}).get(f.name, {}))
        kind, is_list = _base_type(hints[f.name])
        if f.name in skip:
            continue
        if meta.get("help") is None:
            if not (every_field and _is_scalar(hints[f.name])):
                continue
            meta["help"] = f"{cls.__name__}.{f.name}"
        default = defaults.get(f.name, f.default)
        target: Any = parser
        if meta.get("group"):
            if meta["group"] not in groups:
                groups[meta["group"]] = parser.add_mutually_exclusive_group(required=bool(meta.get("required")))
            target = groups[meta["group"]]
        flag = meta.get("flag")
        if flag is None:  # a True bool's flag turns it off: --no-x (both --x and --no-x with both_ways)
            negated = kind is bool and default and not meta.get("both_ways")
            flag = ("--no-" if negated else "--") + f.name.replace("_", "-")
        if kind is bool:
            action: Any = (argparse.BooleanOptionalAction if meta.get("both_ways") else
                           "store_false" if default else "store_true")
            made = target.add_argument(flag, dest=f.name, action=action, default=default, help=meta["help"])
            made.from_options = cls.__name__
            continue
        shown = meta.get("default_help", default)
        help_text = meta["help"] if shown is None else f"{meta['help']} (default: {shown})"
        kwargs: dict[str, Any] = dict(dest=f.name, type=meta.get("type") or (decode_escapes if meta.get("escapes")
                                                                             else kind),
                                      default=default, help=help_text.replace("%", "%%"))
        for key in ("metavar", "choices", "action"):
            if key in meta:
                kwargs[key] = meta[key]
        if meta.get("action") == "append" and default is None:
            kwargs["default"] = []
        if meta.get("required") and not meta.get("group"):
            kwargs["required"] = True
        if "metavar" not in kwargs and "choices" not in kwargs and kind in (int, float):
            kwargs["metavar"] = "N" if kind is int else "X"
        if is_list and meta.get("action") != "append":
            kwargs["nargs"] = meta.get("nargs", "+")
        if not flag.startswith("-"):  # a positional argument: its name is its destination
            del kwargs["dest"]
        made = target.add_argument(flag, **kwargs)
        made.from_options = cls.__name__


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
# The command line's words for GenerationConfig's fields (which carry no help of their own). A field not named here
# still becomes a flag of generate and chat, with its name for help; top_p and repetition_penalty default to None
# on the command line so that sampling_config can tell the ones given.
GENERATION_FLAGS: dict[str, dict[str, Any]] = {
    "max_new_tokens": dict(help="tokens to add at most", metavar="N"),
    "temperature": dict(help="0 = greedy; > 0 samples from softmax(logits / T)", metavar="T"),
    "top_k": dict(help="sample among the K most likely tokens", metavar="K", default_help="all"),
    "top_p": dict(help="sample among the most likely tokens whose probability sums to P", metavar="P",
                  default_help="1 = all"),
    "repetition_penalty": dict(help="> 1 discourages tokens already in the text", metavar="R",
                               default_help="1 = none"),
    "seed": dict(help="seed for sampling: the same seed gives the same text"),
    "overflow": dict(help="beyond the context: slide = last C tokens each step, exact but slow; shift = keep the "
                          "last C/2 and continue cached, fast approximation; error = refuse",
                     choices=["slide", "shift", "error"]),
    "shift_keep": dict(help="with --overflow shift: how many of the latest tokens to keep (1 .. C-1)", metavar="N",
                       default_help="C/2"),
    "use_cache": dict(help="recompute the whole window at every step (same text, much slower)", flag="--no-cache"),
    "token_budget": dict(help="tokens per forward over all rows: decodes first, then chunks of the prompts",
                         metavar="N", default_help="all of every prompt at once"),
    "speculative_tokens": dict(help="speculative decoding: draft up to K tokens (from the text's own n-grams, or "
                                    "with --draft's model), verified in one forward (greedy: the same tokens; "
                                    "sampled: the same distribution); 0 = off (with --draft: 4)", metavar="K"),
    "compile": dict(help="compile the decode step (one row ahead of time, kept on disk; several rows with "
                         "torch.compile; needs a C++ compiler on a CPU): seconds at start, then a cheaper step "
                         "(docs/performance.md)"),
}
_SET_BY_THE_COMMAND = ("eos_id", "pad_id", "stop")  # the tokenizer's ids; --stop is text, not token ids
_GIVEN_OR_NOT = {"top_p": 1.0, "repetition_penalty": 1.0}  # None on the command line = this


def add_generation_options(parser: argparse.ArgumentParser, *, max_new_tokens: int) -> None:
    """One flag per field of ``GenerationConfig`` (words from ``GENERATION_FLAGS``), for ``generate`` and ``chat``."""
    from ..generation import GenerationConfig

    add_options(parser, GenerationConfig, metadata=GENERATION_FLAGS, every_field=True, skip=_SET_BY_THE_COMMAND,
                defaults={"max_new_tokens": max_new_tokens, "seed": DEFAULT_SEED,
                          **{name: None for name in _GIVEN_OR_NOT}})


def sampling_config(args: argparse.Namespace, command: str, **extra: Any) -> Any:
    """The ``GenerationConfig`` of ``add_generation_options``' flags (and ``extra`` fields), checked; then a warning
    (one line on stderr, as Hugging Face gives) about sampling flags that greedy decoding (``--temperature 0``)
    ignores."""
    from ..generation import GenerationConfig

    given = {f.name: getattr(args, f.name) for f in dataclasses.fields(GenerationConfig)
             if f.name not in _SET_BY_THE_COMMAND and hasattr(args, f.name)}
    if given.get("shift_keep") is not None and given.get("overflow") != "shift":
        raise CommandError(f"--shift-keep applies to --overflow shift only (got --overflow {given.get('overflow')})")
    config = GenerationConfig(**{**given, **{k: v for k, v in _GIVEN_OR_NOT.items() if given.get(k) is None},
                                 **extra})
    unused = [flag for flag, value in (("--top-k", args.top_k), ("--top-p", args.top_p)) if value is not None]
    if args.temperature == 0 and unused:
        print(f"tinygpt {command}: warning: {' and '.join(unused)} {'has' if len(unused) == 1 else 'have'} no "
              f"effect with --temperature 0 (greedy decoding); give --temperature > 0 to sample", file=sys.stderr)
    return config


_ESCAPE = re.compile(r"\\(?:x([0-9a-fA-F]{2})|u([0-9a-fA-F]{4})|(.))", re.DOTALL)
_SIMPLE_ESCAPES = {"n": "\n", "t": "\t", "r": "\r", "0": "\0", "\\": "\\", "'": "'", '"': '"'}


def load_for_command(model: str, tokenizer_dir: str | None, device_name: str,
                     weights: str = "float32", *, base: str | None = None) -> tuple[Any, Any, Any]:
    """(model, tokenizer, device) for a command that runs a model on text: ``--model`` loaded on ``--device``
    (an adapter folder on ``--base``, when given), a tokenizer required (``CommandError`` naming the fix when the
    checkpoint has none), its linears in ``--weights``' type (``fast.weights``; a GGUF file's read straight into it)."""
    from ..devices import resolve_device
    from ..interop.pretrained import load_pretrained

    device = resolve_device(device_name)
    loaded, tokenizer = load_pretrained(model, tokenizer_dir=tokenizer_dir, device=device, base=base, weights=weights)
    if tokenizer is None:
        raise CommandError(f"{model} has no tokenizer: pass --tokenizer-dir DIR")
    return loaded, tokenizer, device


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
