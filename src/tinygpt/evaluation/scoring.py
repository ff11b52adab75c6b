"""Batched log-likelihood of token windows: the one primitive behind perplexity and lm-eval's requests.

A *row* is a token window ``tokens`` and a count ``n``: the model reads ``tokens[:-1]`` and the last ``n`` of the
targets ``tokens[1:]`` are scored (log p(tokens[i] | tokens[:i]) summed over the last n positions). This is exactly
what lm-eval's HF class computes for a (context, continuation) pair, ``(context + continuation)[-(C+1):]`` with
n = len(continuation), and what a sliding-window perplexity computes for one window.

Three things keep the work to what is needed (``python -m benchmarks.eval`` measures it against lm-eval's HF class):

- Rows whose unscored prefix ``tokens[:-1-n]`` is the same (the choices of a multiple-choice question) run that
  prefix once into a KV cache, copied to each row, and then only their own n tokens.
- Rows are sorted by length and batched with their neighbours, right-padded: with causal attention a real
  position never sees the padding after it, so no mask is needed and sorting keeps the padding small.
- The output head (D x V, the largest matmul of a small GPT) and the log-softmax run on the scored positions only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F
from tqdm import tqdm

from ..kv_cache import KVCache
from ..model import GPTModel

HEAD_CHUNK = 1024  # scored positions per head matmul: bounds the [M, V] float32 logits (200 MB at V = 50257)


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

    ``batch_size``: rows per forward call. The model runs in eval mode and goes back to its mode afterwards.
    """
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size} must be >= 1")
    check_rows(rows, model.config.context_length)
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, (tokens, n) in enumerate(rows):
        groups.setdefault(tuple(tokens[: len(tokens) - 1 - n]), []).append(i)
    shared = [(prefix, members) for prefix, members in groups.items() if prefix and len(members) > 1]
    alone = [i for prefix, members in groups.items() if not (prefix and len(members) > 1) for i in members]
    results: list[RowScore | None] = [None] * len(rows)
    was_training = model.training
    model.eval()
    try:
        with tqdm(total=len(rows), desc=desc, disable=not progress, unit="row") as bar:
            alone.sort(key=lambda i: -len(rows[i][0]))
            for start in range(0, len(alone), batch_size):
                batch = alone[start:start + batch_size]
                for i, score in zip(batch, _score_plain(model, [rows[i] for i in batch])):
                    results[i] = score
                bar.update(len(batch))
            shared.sort(key=lambda g: -len(g[0]))
            for batch_groups in _pack_groups(shared, rows, batch_size, model.config.context_length):
                members = [i for _, group in batch_groups for i in group]
                scores = _score_shared(model, [prefix for prefix, _ in batch_groups],
                                       [[rows[i] for i in group] for _, group in batch_groups])
                for i, score in zip(members, scores):
                    results[i] = score
                bar.update(len(members))
    finally:
        model.train(was_training)
    return results  # type: ignore[return-value]


def _pack_groups(groups: list[tuple[tuple[int, ...], list[int]]], rows: Sequence[tuple[Sequence[int], int]],
                 batch_size: int, context_length: int):
    """Consecutive groups (longest prefix first) with at most ``batch_size`` member rows in all (a larger group goes
    alone), and whose longest prefix + longest scored part fits the context (the shared forward's width)."""
    batch: list[tuple[tuple[int, ...], list[int]]] = []
    count = width = suffix = 0
    for group in groups:
        n = max(rows[i][1] for i in group[1])
        if batch and (count + len(group[1]) > batch_size or width + max(suffix, n) > context_length):
            yield batch
            batch, count, width, suffix = [], 0, 0, 0
        batch.append(group)
        count += len(group[1])
        width, suffix = max(width, len(group[0])), max(suffix, n)
    if batch:
        yield batch


def _device(model: GPTModel) -> torch.device:
    return next(model.parameters()).device


def _right_padded(seqs: list[Sequence[int]], device: torch.device) -> torch.Tensor:
    """[B, T_max] ids, each row right-padded with id 0 (never seen by a real position under causal attention)."""
    width = max(len(s) for s in seqs)
    return torch.tensor([list(s) + [0] * (width - len(s)) for s in seqs], dtype=torch.long, device=device)


def _head_scores(model: GPTModel, hidden: torch.Tensor, targets: torch.Tensor, counts: list[int]) -> list[RowScore]:
    """hidden [M, D] of the scored positions, their targets [M] and each row's count -> one RowScore per row."""
    logprobs, greedy = [], []
    for start in range(0, hidden.shape[0], HEAD_CHUNK):
        h, t = hidden[start:start + HEAD_CHUNK], targets[start:start + HEAD_CHUNK]
        logp = F.log_softmax(model.out_head(h).float(), dim=-1)  # [m, V]
        logprobs.append(logp.gather(1, t[:, None])[:, 0])
        greedy.append(logp.argmax(dim=-1) == t)
    lp, gr = torch.cat(logprobs).tolist(), torch.cat(greedy).tolist()
    out, pos = [], 0
    for n in counts:
        out.append(RowScore(logprob=float(sum(lp[pos:pos + n])), greedy=all(gr[pos:pos + n])))
        pos += n
    return out


def _score_plain(model: GPTModel, rows: list[tuple[Sequence[int], int]]) -> list[RowScore]:
    """One forward over the rows' inputs tokens[:-1], right-padded; the head on the last n positions of each."""
    device = _device(model)
    idx = _right_padded([tokens[:-1] for tokens, _ in rows], device)  # [B, T]
    h = model.hidden_states(idx)  # [B, T, D]
    row_index, pos_index, targets = [], [], []
    for b, (tokens, n) in enumerate(rows):
        length = len(tokens) - 1
        row_index += [b] * n
        pos_index += range(length - n, length)
        targets += tokens[len(tokens) - n:]
    selected = h[torch.tensor(row_index, device=device), torch.tensor(pos_index, device=device)]  # [M, D]
    return _head_scores(model, selected, torch.tensor(targets, device=device), [n for _, n in rows])


def _score_shared(
    model: GPTModel, prefixes: list[tuple[int, ...]], groups: list[list[tuple[Sequence[int], int]]]
) -> list[RowScore]:
    """Each prefix once into a cache (left-padded to the longest, masked), the cache copied to its group's rows, then
    every row's n scored inputs tokens[-1-n:-1] in one cached forward, right-padded. Rows in group order."""
    device, config = _device(model), model.config
    dtype = next(model.parameters()).dtype
    width = max(len(p) for p in prefixes)  # P
    members = [row for group in groups for row in group]
    suffix = max(n for _, n in members)  # S
    pads = [width - len(p) for p in prefixes]
    idx = torch.tensor([[0] * pad + list(p) for pad, p in zip(pads, prefixes)], dtype=torch.long, device=device)
    positions = key_mask = None
    pad_t = torch.tensor(pads, device=device)[:, None]  # [G, 1]
    if any(pads):
        positions = (torch.arange(width, device=device) - pad_t).clamp(min=0)  # [G, P]
        key_mask = torch.arange(width, device=device) >= pad_t  # [G, P]
    prefix_cache = KVCache(config, len(prefixes), dtype=dtype, device=device, max_length=width)
    model.hidden_states(idx, cache=prefix_cache, positions=positions, key_mask=key_mask)
    owner = torch.tensor([g for g, group in enumerate(groups) for _ in group], device=device)  # [N]
    cache = KVCache(config, len(members), dtype=dtype, device=device, max_length=width + suffix)
    for layer in range(config.n_layers):
        cache.keys[layer][:, :, :width] = prefix_cache.keys[layer][owner]
        cache.values[layer][:, :, :width] = prefix_cache.values[layer][owner]
    del prefix_cache
    inputs = _right_padded([tokens[len(tokens) - 1 - n: len(tokens) - 1] for tokens, n in members], device)  # [N, S]
    positions = key_mask = None
    if any(pads):
        start = (width - pad_t[owner])  # [N, 1]: each row's real prefix length
        positions = start + torch.arange(suffix, device=device)  # [N, S]
        key_mask = torch.cat([torch.arange(width, device=device) >= pad_t[owner],
                              torch.ones(len(members), suffix, dtype=torch.bool, device=device)], dim=1)
    h = model.hidden_states(inputs, cache=cache, start_pos=width, positions=positions, key_mask=key_mask)  # [N, S, D]
    row_index, pos_index, targets = [], [], []
    for b, (tokens, n) in enumerate(members):
        row_index += [b] * n
        pos_index += range(n)
        targets += tokens[len(tokens) - n:]
    selected = h[torch.tensor(row_index, device=device), torch.tensor(pos_index, device=device)]  # [M, D]
    return _head_scores(model, selected, torch.tensor(targets, device=device), [n for _, n in members])
