"""Runs the model on a scheduled batch, then each row's own sampling.

``ModelRunner.forward`` packs the plan's tokens into one sequence, builds its ``Batch`` and runs one forward; it
returns each row's logits (only the positions the row needs: its last one, a draft's k + 1, a scoring row's scored
ones), or for an embedding row (``Row.pooling``) the final hidden states the head would read at its positions.
``draw`` turns one row's logits into its next token with the row's own settings and generator, so a row's tokens
never depend on its neighbours; ``verify`` checks a row's draft (speculative decoding).

With ``compile``, a forward whose rows all decode in one group (one token each, keys padded to one length, no
padding tokens, no LoRA adapters) runs the model through ``torch.compile`` (inductor; ``dynamic=True``, so a row's
growing key count and the batch size do not recompile). A forward of one row, the batch-1 step, runs instead
through ``aot_step.AotStep``: the same inductor code compiled ahead of time and called without Python between its
kernels (its products are ``fast.one_row``'s loops, or ``fast.row_kernels`` for large bf16 and int8 weights, its
attention ``kv_cache.one_query_attention``'s sums); where that step cannot be built or run, it says so once and
one-row forwards go through ``torch.compile`` too. Other layouts stay eager: each count of decode groups or padding
spans would be a graph of its own, compiled when first met (seconds to a minute each, in the middle of serving), and
prompts vary too much to pay for compiling. On a small model a decode step's time is mostly the fixed cost of
some 15 operations per layer, which inductor fuses; at batch 1 on a large one, the bytes of the weights, which the
one-row loops read faster than the library kernels. Where compiling a model fails (no C++ compiler, a weight type
inductor cannot lower), it says why once on stderr and that model decodes eager from then on, in every engine.
Before compiling, the weights move into huge pages (``fast.pages``): the one-row products read them at the
memory's pace only without a page-table walk every 4 KiB.
"""

from __future__ import annotations

import contextlib
import sys
import weakref
from typing import Any, ContextManager, Sequence

import torch
from torch import nn

from .aot_step import AotStep
from .kv_cache import PagedKVCache
from ..fast.pages import huge_pages
from ..fast import row_kernels
from ..fast.weights import Bf16Linear, Int8Linear, plain_weights
from ..multi_lora import use_adapters
from ..sampling import next_tokens
from .batch import RowSlice, build_batch, pack_order
from .blocks import SCRATCH_BLOCK
from .row import Row
from .acceptance import verify as speculative_verify


def feed_of(row: Row, n: int) -> list[int]:
    """The n tokens the row feeds this step: its next window tokens, or its last token and its draft."""
    if row.draft:
        return [row.window[-1]] + row.draft
    return row.window[row.computed:row.computed + n]


def logit_offsets(row: Row, n: int) -> list[int]:
    """Which of the row's n fed tokens need logits."""
    if row.config is None:  # scoring: every scored position in this chunk (embedding: every pooled one)
        return [j for j in range(n) if row.computed + j >= row.first_logit]
    if row.draft:
        return list(range(n))
    last = [n - 1] if row.computed + n == row.window_length else []
    if not (row.want_logits and row.constraint is not None):
        return last
    # a constrained row that reports log-probabilities: also the positions before its forced tokens, which no
    # forward had scored when they were appended (the head on a few more positions; ``Row.forced_after``)
    return [j for j in range(n - len(last)) if row.forced_after(row.computed + j)] + last


def adapters_of(model: nn.Module, packed: Sequence[tuple[Row, int]], num_tokens: int) -> ContextManager[None]:
    """The forward's LoRA adapters (``multi_lora``): each packed token takes its row's adapter (``packed`` in token
    order; the idle padding up to ``num_tokens`` takes the base), an index built on the host. Nothing to do for a
    model without adapters or a batch of base rows only."""
    if getattr(model, "adapter_names", None) is None or all(row.adapter < 0 for row, _ in packed):
        return contextlib.nullcontext()
    index = [row.adapter for row, n in packed for _ in range(n)]
    return use_adapters(model, [index + [-1] * (num_tokens - len(index))])  # [1, N], as the packed ids


# How the runner compiles a decode step (``torch.compile(..., options=COMPILE_OPTIONS)``).
# ``realize_acc_reads_threshold=1``: inductor keeps every computed input in a buffer of its own instead of
# recomputing it inside the loop that reads it. A decode step's activations are a few rows, so the buffers cost
# nothing, while a norm's output recomputed once per output channel of the product after it made the one-row
# products compute-bound (the compiled int8 step was slower than the eager one).
# ``size_asserts`` / ``scalar_asserts`` off: the compiled step's Python wrapper otherwise re-checks the size and
# strides of every input on every call, which dynamo's guards have just checked (on a small model, a visible
# share of the step: ``benchmarks.llamacpp --shape train-default --compile``).
COMPILE_OPTIONS = {"realize_acc_reads_threshold": 1, "size_asserts": False, "scalar_asserts": False}
_COMPILE_FAILED: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()  # models whose compile failed: eager for good
# One-row steps go through ``aot_step.AotStep`` (no Python between the kernels); off, they are torch.compile's too.
AHEAD_OF_TIME = True
_AOT_FAILED: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()  # models whose ahead-of-time step failed


class ModelRunner:
    """The model and its paged cache; one ``forward`` per engine step."""

    def __init__(self, model: nn.Module, cache: PagedKVCache, *, compile: bool = False) -> None:
        self.model, self.cache = model, cache
        self.device = next(model.parameters()).device
        self.compiled: Any = None  # the decode steps' model
        if compile and model not in _COMPILE_FAILED:
            plain_weights(model)
            huge_pages(model)  # the plain weights are new tensors; a loaded model's others are there already
            if any(isinstance(m, (Bf16Linear, Int8Linear)) for m in model.modules()):
                row_kernels.load()  # built before tracing: the compiled one-row bf16 and int8 products call them
            self.compiled = torch.compile(model, dynamic=True, options=COMPILE_OPTIONS)
        self.aot: AotStep | None = None  # the one-row step, compiled ahead of time when first needed

    def _model_for(self, slices: Sequence[RowSlice], batch: Any) -> Any:
        if (self.compiled is None or getattr(self.model, "adapter_names", None) is not None
                or any(s.length != 1 for s in slices) or len(batch.decode_groups) != 1 or batch.spans):
            return self.model
        if (AHEAD_OF_TIME and self.device.type == "cpu" and AotStep.fits(batch) and self.model not in _AOT_FAILED
                and not torch.is_autocast_enabled("cpu")):  # (what was traced is what runs: no autocast)
            if self.aot is None:
                try:
                    self.aot = AotStep(self.model, self.cache, COMPILE_OPTIONS)
                except Exception as err:
                    self._aot_failed("cannot be compiled ahead of time", err)
                    return self.compiled
            return self.aot
        return self.compiled

    def _aot_failed(self, what: str, err: Exception) -> None:
        print(f"tinygpt: the one-row decode step {what}, it runs through torch.compile from now on: "
              f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}", file=sys.stderr)
        self.aot = None
        _AOT_FAILED.add(self.model)

    def _run_model(self, model: Any, idx: torch.Tensor, batch: Any) -> torch.Tensor:
        try:
            return model(idx, cache=self.cache, pos=batch)[0]
        except Exception as err:
            if model is self.aot:  # a shape it was not built for, a library that will not run; the rerun rewrites
                # the same cache slots
                self._aot_failed("failed", err)
                return self._run_model(self.compiled, idx, batch)
            if model is self.model:
                raise
            print(f"tinygpt: torch.compile failed, decoding eager from now on: {type(err).__name__}: "
                  f"{str(err).splitlines()[0] if str(err) else ''}", file=sys.stderr)
            self.compiled = None
            _COMPILE_FAILED.add(self.model)
            return self.model(idx, cache=self.cache, pos=batch)[0]  # rewrites the same cache slots

    def forward(self, plan: Sequence[tuple[Row, int]]) -> list[torch.Tensor]:
        """One forward over the plan's rows; each row's logits [m, V] (m may be 0), in plan order; an embedding
        row's hidden states [m, D] instead."""
        slices = [RowSlice(row.computed, n, row.table, logit_offsets(row, n)) for row, n in plan]
        order = pack_order(slices)
        ids = [t for i in order for t in feed_of(*plan[i])]
        batch = build_batch(slices, self.cache.block_size, self.device,
                            scratch_slot=SCRATCH_BLOCK * self.cache.block_size)
        ids += [0] * (batch.num_tokens - len(ids))  # the idle padding tokens
        idx = torch.tensor([ids], dtype=torch.long, device=self.device)  # [1, N]
        embedding = [plan[i][0].pooling is not None for i in order for _ in slices[i].logits]  # per output
        with adapters_of(self.model, [plan[i] for i in order], batch.num_tokens):
            if not any(embedding):
                model = self._model_for(slices, batch)
                logits = self._run_model(model, idx, batch)  # [M, V]: only the tokens that need them
            else:  # the forward's two halves (``GPTModel.forward``), so embedding rows keep their hidden states
                states = self.cache.head_input(self.model.hidden_states(idx, cache=self.cache, pos=batch))[0]  # [M, D]
                head = torch.tensor([not e for e in embedding], device=self.device)  # [M]
                logits = self.model.out_head(states[head])  # [M', V]: the other rows' logits only
        out: list[torch.Tensor] = [logits[:0]] * len(plan)
        start = kept = 0  # this row's first output among all, among the rows with logits
        for i in order:
            m = len(slices[i].logits)
            if plan[i][0].pooling is not None:
                if m:  # (none in a "last" row's earlier chunks)
                    out[i] = states[start:start + m]
            else:
                out[i] = logits[kept:kept + m]
                kept += m
            start += m
        return out


def draw(row: Row, logits: torch.Tensor) -> int:
    """The row's next token from its logits [V] (its settings, its own generator and seen-set)."""
    cfg = row.config
    token = next_tokens(logits[None], temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p,
                        repetition_penalty=cfg.repetition_penalty, seen=row.seen, generator=row.generator)
    return int(token[0])


def draw_together(rows: Sequence[Row], logits: Sequence[torch.Tensor]) -> list[int]:
    """Rows with the same settings sharing one generator (``generate`` given a ``generator``): one draw over their
    stacked logits [R, V], as a batch is sampled when every row is stepped together."""
    cfg = rows[0].config
    seen = None if rows[0].seen is None else torch.cat([r.seen for r in rows])
    tokens = next_tokens(torch.stack(list(logits)), temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p,
                         repetition_penalty=cfg.repetition_penalty, seen=seen, generator=rows[0].generator)
    return tokens.tolist()


def draw_greedy(rows: Sequence[Row], logits: Sequence[torch.Tensor]) -> list[int]:
    """Plain greedy rows (no draft, constraint or repetition penalty): one argmax over their stacked logits [R, V]
    and one copy to the host for all of them, instead of a draw and a read-back per row (the same tokens)."""
    return torch.stack(list(logits)).argmax(dim=-1).tolist()


def verify(row: Row, logits: torch.Tensor) -> list[int]:
    """Check the row's draft against the target's logits [k + 1, V]: 1 .. k + 1 tokens. Greedy rows keep the
    drafts equal to the argmax (exactly plain greedy's tokens); sampled rows use Leviathan et al.'s accept/resample
    rule with the row's own generator (exactly the target's distribution): ``acceptance.verify``."""
    return speculative_verify(logits.float(), row.tokens, row.draft, row.config, generator=row.generator)
