"""What every command module shares: the one-line user error and the config argument."""

from __future__ import annotations

import argparse

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
