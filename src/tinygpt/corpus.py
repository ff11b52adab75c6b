"""The embedded default corpus: the Python standard library's own ``.py`` sources.

Every Python installation carries them, so ``tinygpt train`` with no ``--data`` has real text to learn from, offline,
without shipping a data file. Found through ``sysconfig`` (the ``stdlib`` path); tests and site-packages are left out.
"""

from __future__ import annotations

import sysconfig
from pathlib import Path

_SKIP_DIRS = {"test", "tests", "idlelib", "site-packages", "dist-packages", "__pycache__", "lib2to3", "turtledemo"}


def embedded_corpus_files() -> list[Path]:
    """The standard library's ``.py`` files, sorted by path (a stable order, so runs are reproducible)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [
        p for p in root.rglob("*.py")
        if not _SKIP_DIRS.intersection(p.relative_to(root).parts[:-1])
    ]
    if not files:
        raise FileNotFoundError(f"no .py files found under the standard library path {root}")
    return sorted(files)


def embedded_corpus_text(max_chars: int | None = None) -> str:
    """The files' text joined with blank lines, cut to ``max_chars`` characters when given."""
    parts, total = [], 0
    for path in embedded_corpus_files():
        text = path.read_text(encoding="utf-8", errors="replace")
        parts.append(text)
        total += len(text) + 2
        if max_chars is not None and total >= max_chars:
            break
    joined = "\n\n".join(parts)
    return joined if max_chars is None else joined[:max_chars]
