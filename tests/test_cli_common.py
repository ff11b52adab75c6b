"""tinygpt.cli.common and the command line's shape: flags built from the options' fields, errors in flag words
naming the subcommand, shared flag families, escape decoding, bare `tinygpt` and `--version`."""

import argparse
import dataclasses
import subprocess
import sys

import pytest

from tinygpt import __version__
from tinygpt.cli import build_parser, main
from tinygpt.cli.common import add_options, decode_escapes, options_from_args


def _subparser(name: str) -> argparse.ArgumentParser:
    parser = build_parser()
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[name]


@pytest.mark.parametrize("command,cls_path,defaults", [
    ("train", "tinygpt.training.options.TrainingOptions", {}),
    # sft's learning rate and epochs are None on the command line: chosen from the model's size when not given
    ("sft", "tinygpt.alignment.options.FinetuneOptions", {"out_dir": "runs/sft", "lr": None, "epochs": None,
                                                          "batch_size": 8}),
    ("ppo", "tinygpt.alignment.ppo.PPOConfig", {}),
])
def test_every_field_with_help_is_a_flag_and_the_defaults_round_trip(command, cls_path, defaults):
    import importlib

    module, name = cls_path.rsplit(".", 1)
    cls = getattr(importlib.import_module(module), name)
    parser = _subparser(command)
    dests = {a.dest: a for a in parser._actions}
    with_help = [f for f in dataclasses.fields(cls) if f.metadata.get("help")]
    assert len(with_help) >= 10
    for f in with_help:
        assert f.name in dests, f"{f.name} has help but no flag on `tinygpt {command}`"
        assert dests[f.name].default == defaults.get(f.name, f.default)
    required = ["--model", "m", "--data", "d"] if command == "sft" else (
        ["--policy", "p", "--reward", "r", "--data", "d"] if command == "ppo" else [])
    args = parser.parse_args(required)
    assert options_from_args(cls, args) == cls(**{f.name: defaults.get(f.name, f.default) for f in with_help})


def test_flag_names_types_and_inverted_booleans():
    @dataclasses.dataclass
    class Demo:
        from tinygpt.checks import option

        top_k: int | None = option(None, "keep K", metavar="K")
        out_dir: str = option("x", "where", flag="--out")
        progress: bool = option(True, "no bar", flag="--no-progress")
        paths: list[str] | None = option(None, "inputs")
        hidden: float = 1.5  # no help: not a flag

    parser = argparse.ArgumentParser()
    add_options(parser, Demo)
    args = parser.parse_args(["--top-k", "3", "--out", "y", "--no-progress", "--paths", "a", "b"])
    assert options_from_args(Demo, args) == Demo(top_k=3, out_dir="y", progress=False, paths=["a", "b"])
    assert "--hidden" not in parser.format_help()
    assert "(default: x)" in parser.format_help()


@pytest.mark.parametrize("argv,expected", [
    (["sft", "--model", "m", "--data", "d", "--batch-size", "0"],
     "tinygpt sft: error: --batch-size 0 must be an integer >= 1 (or unset)"),
    (["ppo", "--policy", "p", "--reward", "r", "--data", "d", "--top-k", "0"],
     "tinygpt ppo: error: --top-k 0 must be an integer >= 1 (or unset)"),
    (["ppo", "--policy", "p", "--reward", "r", "--data", "d", "--gamma", "2"],
     "tinygpt ppo: error: --gamma 2.0 must be a number in [0, 1]"),
    (["train", "--max-steps", "0"], "tinygpt train: error: --max-steps 0 must be an integer >= 1"),
    (["train", "--lr", "0.1", "--min-lr", "0.5"], "tinygpt train: error: --min-lr 0.5 must be a number in [0, 0.1]"),
    (["train", "--n-heads", "0"], "tinygpt train: error: --n-heads 0 must be an integer >= 1 (or unset)"),
    (["dpo", "--model", "m", "--data", "d", "--val-fraction", "1"],
     "tinygpt dpo: error: --val-fraction 1.0 must be a number in [0, 1)"),
    (["train", "--bogus"], "tinygpt train: error: unrecognized arguments: --bogus"),
    (["generate", "--model", "m", "--prompt", "x", "--stop", "\\q"], "tinygpt generate: error: argument --stop"),
])
def test_errors_name_the_subcommand_and_use_flag_names(capsys, argv, expected):
    try:
        code = main(argv)
    except SystemExit as exit_:  # argparse's own errors
        code = exit_.code
    err = capsys.readouterr().err
    assert code == 2 and err.startswith(expected) and err.count("\n") == 1, err
    assert "_" not in err.split(":", 2)[2].split(" must")[0]  # no Python names such as top_k=


def test_bare_tinygpt_lists_the_commands_and_version_exists():
    bare = subprocess.run([sys.executable, "-m", "tinygpt"], capture_output=True, text=True, timeout=60)
    assert bare.returncode == 0 and bare.stderr == ""
    for command in ("train", "generate", "sft", "chat", "convert"):
        assert f"    {command}" in bare.stdout
    version = subprocess.run([sys.executable, "-m", "tinygpt", "--version"], capture_output=True, text=True,
                             timeout=60)
    assert version.returncode == 0 and version.stdout.strip() == f"tinygpt {__version__}"


@pytest.mark.parametrize("command", ["generate", "chat", "sft", "reward", "ppo", "dpo", "train"])
def test_device_dtype_seed_and_tokenizer_flags_mean_the_same_everywhere(command):
    dests = {a.dest: a for a in _subparser(command)._actions}
    assert dests["device"].default is None and "cuda when available" in dests["device"].help
    assert dests["dtype"].default == "auto" and list(dests["dtype"].choices) == ["auto", "float32", "bfloat16"]
    assert "seed" in dests
    if command != "train":
        assert "tokenizer_dir" in dests
    if command in ("generate", "chat"):
        assert dests["seed"].default == 1337
        for flag in ("top_k", "top_p", "repetition_penalty", "stop", "max_new_tokens", "temperature"):
            assert flag in dests, flag


def test_progress_flag_is_alike():
    for command in ("train", "prepare", "sft", "reward", "ppo", "dpo"):
        action = {a.dest: a for a in _subparser(command)._actions}["progress" if command != "prepare" else
                                                                    "no_progress"]
        assert action.option_strings == ["--no-progress"]


@pytest.mark.parametrize("text,decoded", [
    ("\\n\\n", "\n\n"), ("a\\tb", "a\tb"), ("\\\\n", "\\n"), ("\\x41\\u00e9", "Aé"), ("é\\n", "é\n"),
    ("plain", "plain"), ("end\\", "end\\"),
])
def test_escapes_are_decoded(text, decoded):
    assert decode_escapes(text) == decoded


def test_no_deprecation_warnings_from_tinygpt_itself(tmp_path):
    done = subprocess.run([sys.executable, "-W", "error::DeprecationWarning", "-m", "tinygpt", "params",
                           "--config", "tiny"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("command,cls_path,required", [
    ("generate", "tinygpt.command_options.GenerateOptions", {"model": "m", "prompt": "x"}),
    ("chat", "tinygpt.command_options.ChatOptions", {"model": "m"}),
    ("eval", "tinygpt.evaluation.options.EvalOptions", {"model": "m"}),
])
def test_generate_chat_and_eval_flags_come_from_their_options(command, cls_path, required):
    import importlib

    module, name = cls_path.rsplit(".", 1)
    cls = getattr(importlib.import_module(module), name)
    parser = _subparser(command)
    dests = {a.dest: a for a in parser._actions}
    with_help = [f for f in dataclasses.fields(cls) if f.metadata.get("help")]
    assert len(with_help) >= 5 and all(f.name in dests for f in with_help)
    argv = [arg for key, value in required.items() for arg in (f"--{key}", value)]
    parsed = options_from_args(cls, parser.parse_args(argv))
    expected = {f.name: [] if f.metadata.get("action") == "append" else f.default for f in with_help}
    assert parsed == cls(**{**expected, **required})


@pytest.mark.parametrize("command", ["generate", "chat"])
def test_every_generation_setting_is_a_flag(command):
    """Every GenerationConfig field but the three the command sets itself (token ids) is a flag: a setting added to
    GenerationConfig appears on the command line, and reaches the config."""
    from tinygpt.cli.common import sampling_config
    from tinygpt.generation import GenerationConfig

    parser = _subparser(command)
    dests = {a.dest for a in parser._actions}
    settable = [f.name for f in dataclasses.fields(GenerationConfig) if f.name not in ("eos_id", "pad_id", "stop")]
    assert set(settable) <= dests
    args = parser.parse_args(["--model", "m", *(["--prompt", "x"] if command == "generate" else []),
                              "--temperature", "0.5", "--top-p", "0.9", "--overflow", "shift", "--shift-keep", "3",
                              "--no-cache", "--compile"])
    config = sampling_config(args, command)
    assert (config.temperature, config.top_p, config.overflow, config.shift_keep, config.use_cache, config.compile) == (
        0.5, 0.9, "shift", 3, False, True)
    assert config.seed == 1337 and config.repetition_penalty == 1.0


def test_every_field_makes_flags_of_fields_without_help():
    @dataclasses.dataclass
    class Demo:
        budget: int | None = None
        fast: bool = True
        ids: tuple[int, ...] = ()  # not a command-line value

    parser = argparse.ArgumentParser()
    add_options(parser, Demo, every_field=True, metadata={"budget": {"help": "at most N", "metavar": "N"}})
    assert options_from_args(Demo, parser.parse_args(["--budget", "4", "--no-fast"])) == Demo(budget=4, fast=False)
    assert "at most N" in parser.format_help() and "--ids" not in parser.format_help()


def _commands(parser: argparse.ArgumentParser, prefix: str = "tinygpt"):
    """(name, parser) of every command and subcommand under ``parser``."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield f"{prefix} {name}", sub
                yield from _commands(sub, f"{prefix} {name}")


def test_every_flag_of_every_command_comes_from_an_options_field():
    """No flag is written by hand with add_argument: each is made by add_options from a dataclass field (its help,
    type and default in one place)."""
    commands = dict(_commands(build_parser()))
    assert {"tinygpt prepare", "tinygpt verify", "tinygpt convert", "tinygpt merge", "tinygpt experiment prepost",
            "tinygpt serve", "tinygpt arithmetic-task"} <= set(commands)
    by_hand = [f"{name} {action.option_strings or action.dest}" for name, parser in commands.items()
               for action in parser._actions
               if not isinstance(action, (argparse._HelpAction, argparse._SubParsersAction))
               and not getattr(action, "from_options", None)]
    assert by_hand == []



def test_the_torch_free_copies_of_choices_match_their_source():
    """command_options keeps the choices of --dtype, --weights and --type without importing torch: the same lists."""
    from tinygpt import command_options, devices
    from tinygpt.fast import weights
    from tinygpt.interop import gguf

    assert command_options.DTYPES == devices.DTYPES
    assert command_options.WEIGHT_TYPES == weights.WEIGHT_TYPES
    assert command_options.GGUF_TYPES == gguf.GGUF_TYPES
