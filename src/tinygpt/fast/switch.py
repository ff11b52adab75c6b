"""The fast path's switch: ``with tinygpt.fast.disabled(): ...`` runs the model as ``layers.py`` / ``model.py`` read.

The state is a ``ContextVar``, so a ``disabled`` block affects the thread (or asyncio task) that entered it and
nothing else, and it is restored on exit even when the block raises. Nothing outside this module assigns it.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Iterator

# What each part name switches off, and what runs instead.
PARTS = {
    "onednn": "oneDNN's product in every linear, the head and the fused loss (torch's BLAS instead)",
    "train": "oneDNN's forward, dL/dx and dL/dW for trained weights (large products): F.linear and autograd",
    "head": "the head's kernel choice (oneDNN, padded rows): a plain F.linear",
    "loss": "the fused head + cross-entropy loss: F.cross_entropy over materialised logits",
}

_OFF: contextvars.ContextVar[frozenset[str]] = contextvars.ContextVar("tinygpt_fast_off", default=frozenset())


def is_enabled(part: str) -> bool:
    """Whether ``part`` (a key of ``PARTS``) runs here, i.e. no enclosing ``disabled`` block names it."""
    return part not in _OFF.get()


@contextlib.contextmanager
def disabled(*parts: str) -> Iterator[None]:
    """Switch the named parts of the fast path off inside the block (all of them when none is named).

    ``with disabled():`` gives the plain model (``nn.Linear``, ``F.cross_entropy``); ``with disabled("onednn"):``
    keeps the rest. Blocks nest: an inner block adds to what an outer one switched off.
    """
    unknown = [p for p in parts if p not in PARTS]
    if unknown:
        raise ValueError(f"unknown fast-path part {unknown[0]!r}; the parts are {', '.join(map(repr, PARTS))}")
    token = _OFF.set(_OFF.get() | frozenset(parts or PARTS))
    try:
        yield
    finally:
        _OFF.reset(token)
