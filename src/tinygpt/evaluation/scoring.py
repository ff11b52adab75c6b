"""Batched log-likelihood of token windows: the one primitive behind perplexity and lm-eval's requests.

A *row* is a token window ``tokens`` and a count ``n``: the model reads ``tokens[:-1]`` and the last ``n`` of the
targets ``tokens[1:]`` are scored (log p(tokens[i] | tokens[:i]) summed over the last n positions). This is exactly
what lm-eval's HF class computes for a (context, continuation) pair, ``(context + continuation)[-(C+1):]`` with
n = len(continuation), and what a sliding-window perplexity computes for one window.

The rows run on the inference core (``inference.engine``), as scoring rows: packed into forwards of at most
``TOKEN_BUDGET`` tokens, the output head and the log-softmax on the scored positions only. Rows whose unscored
prefix ``tokens[:-1-n]`` is the same (the choices of a multiple-choice question, a few-shot header) share it through
prefix reuse: the first row of each group runs first, publishes the prefix's full blocks, and the others take them
instead of computing them (``python -m benchmarks.eval`` measures it against lm-eval's HF class).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from tqdm import tqdm

from ..inference.engine import InferenceEngine
from ..inference.row import Row
from ..model import GPTModel

TOKEN_BUDGET = 1024  # tokens per forward, and so scored positions per head matmul: bounds the [M, V] logits


@dataclass(frozen=True)
class RowScore:
    """One row's summed log-probability (nats) of its ``n`` scored tokens, and whether each was the argmax."""

    logprob: float
    greedy: bool


def check_rows(rows: Sequence[tuple[Sequence[int], int]], context_length: int) -> None:
    """``ValueError`` unless each row's window fits the model (len - 1 <= C) and 1 <= n <= len - 1."""
    for i, (tokens, n) in enumerate(rows):
        if not 1 <= n <= len(tokens) - 1:
            raise ValueError(f"row {i}: {n} scored tokens need a window of at least {n + 1} tokens, "
                             f"got {len(tokens)}")
        if len(tokens) - 1 > context_length:
            raise ValueError(f"row {i}: a window of {len(tokens)} tokens feeds {len(tokens) - 1} to the model, "
                             f"more than its context_length={context_length}")


@torch.inference_mode()
def score_rows(
    model: GPTModel,
    rows: Sequence[tuple[Sequence[int], int]],
    *,
    batch_size: int = 16,
    progress: bool = False,
    desc: str = "scoring",
) -> list[RowScore]:
    """Score every row (see the module docstring); results in the order of ``rows``.

    ``batch_size``: rows in the engine's batch at once. The model runs in eval mode and goes back to its mode.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size} must be >= 1")
    context = model.config.context_length
    check_rows(rows, context)
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, (tokens, n) in enumerate(rows):
        groups.setdefault(tuple(tokens[: len(tokens) - 1 - n]), []).append(i)
    ordered = sorted(groups.values(), key=lambda members: -len(rows[members[0]][0]))  # longest first
    results: list[RowScore | None] = [None] * len(rows)
    # room for a batch of rows and for the prefixes they publish until the rest of their group takes them
    engine = InferenceEngine(model, max_rows=batch_size, token_budget=max(TOKEN_BUDGET, batch_size),
                             cache_tokens=2 * batch_size * (context + 1))
    was_training = model.training
    model.eval()
    try:
        with tqdm(total=len(rows), desc=desc, disable=not progress, unit="row") as bar:
            for batch in _pack_groups(ordered, batch_size):
                firsts = [members[0] for members in batch]
                rest = [i for members in batch for i in members[1:]]
                for wave in (firsts, rest):  # the rest of each group finds its prefix in the cache
                    scored = [(i, engine.add(Row(list(rows[i][0]), None, scored=rows[i][1]))) for i in wave]
                    engine.run_until_done()
                    for i, row in scored:
                        if row.finish_reason != "length":
                            raise RuntimeError(f"scoring row {i} failed: {row.error}")
                        results[i] = RowScore(logprob=row.score.logprob, greedy=row.score.greedy)
                    bar.update(len(wave))
    finally:
        model.train(was_training)
    return results  # type: ignore[return-value]


def _pack_groups(groups: list[list[int]], batch_size: int):
    """Consecutive groups with at most ``batch_size`` member rows in all (a larger group goes alone)."""
    batch: list[list[int]] = []
    count = 0
    for members in groups:
        if batch and count + len(members) > batch_size:
            yield batch
            batch, count = [], 0
        batch.append(members)
        count += len(members)
    if batch:
        yield batch
