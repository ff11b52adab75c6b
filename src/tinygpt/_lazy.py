"""Packages whose public names are imported from their submodules on first use (PEP 562).

``tinygpt.training`` and ``tinygpt.alignment`` use it so that building the CLI's ``--help`` does not import the
training loops, torch.distributed and the generation engine.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable


def lazy_exports(package: str, exports: dict[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``__getattr__`` and ``__dir__`` for ``package``: name -> the submodule (relative) that defines it."""

    def __getattr__(name: str) -> Any:
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(importlib.import_module(f".{exports[name]}", package), name)

    def __dir__() -> list[str]:
        return sorted(exports)

    return __getattr__, __dir__
