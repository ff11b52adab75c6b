"""What the serving tests share: a tiny BPE tokenizer (with an end-of-text id), tiny seeded models, a live server
on 127.0.0.1 at a free port, and a bounded wait for engine events."""

from __future__ import annotations

import contextlib
import functools
import threading
import time
from typing import Any, Iterator

import torch

from tinygpt import GPTConfig, GPTModel, generate
from tinygpt.alignment.data import ALPACA_CHAT_TEMPLATE
from tinygpt.tokenizer import BPETokenizer

TEXT = ("The quick brown fox jumps over the lazy dog. Every effort moves you forward; a café serves crème brûlée "
        "→ naïve résumé. Below is an instruction that describes a task. Write a response that appropriately "
        "completes the request.\n\n### Instruction:\nName a colour.\n\n### Response:\nBlue.\n") * 4


@functools.lru_cache(maxsize=1)
def tokenizer() -> BPETokenizer:
    """Trained on Alpaca-shaped text, with the Alpaca chat template SFT writes (a chat model's tokenizer)."""
    return BPETokenizer.train([TEXT], 300).with_chat_template(ALPACA_CHAT_TEMPLATE)


def tiny_model(context_length: int = 64, seed: int = 0, **overrides: Any) -> GPTModel:
    torch.manual_seed(seed)
    fields = dict(vocab_size=tokenizer().vocab_size, context_length=context_length, emb_dim=32, n_heads=2,
                  n_layers=2)
    config = GPTConfig(**{**fields, **overrides})
    return GPTModel(config).eval()


def offline(model: GPTModel, ids: list[int], max_tokens: int, **settings: Any) -> list[int]:
    """``tinygpt.generate`` on one prompt alone, stopping at the tokenizer's end-of-text (dropped: the server
    reports no token for it)."""
    row = generate(model, [ids], max_new_tokens=max_tokens, eos_id=tokenizer().eot_id, **settings).rows()[0]
    return row[:-1] if row and row[-1] == tokenizer().eot_id else row


@contextlib.contextmanager
def live_server(model: GPTModel, **options: Any) -> Iterator[Any]:
    from tinygpt.serving.app import create_app
    from tinygpt.serving.server import BackgroundServer

    app = create_app(model, tokenizer(), model_name="tiny", **options)
    with BackgroundServer(app) as server:
        server.app = app
        yield server


def engine_of(server: Any) -> Any:
    return server.app.state.tinygpt.engine


class Collector:
    """A sink for one EngineRequest: records events, and ``wait`` blocks (bounded) until the row finished."""

    def __init__(self) -> None:
        self.events: list[Any] = []
        self.done = threading.Event()

    def __call__(self, event: Any) -> None:
        from tinygpt.serving.engine import Finish

        self.events.append(event)
        if isinstance(event, Finish):
            self.done.set()

    def wait(self, timeout: float = 60.0) -> "Collector":
        if not self.done.wait(timeout):
            raise TimeoutError(f"no Finish event within {timeout} s")
        return self

    @property
    def tokens(self) -> list[int]:
        from tinygpt.serving.engine import Step

        return [e.token.id for e in self.events if isinstance(e, Step)]

    @property
    def text(self) -> str:
        from tinygpt.serving.engine import Finish, Step

        return "".join(e.text for e in self.events if isinstance(e, (Step, Finish)))

    @property
    def finish(self) -> Any:
        return self.events[-1]


def wait_until(condition: Any, timeout: float = 30.0, message: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{message} not reached within {timeout} s")
        time.sleep(0.005)
