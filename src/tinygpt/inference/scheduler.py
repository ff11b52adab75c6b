"""The whole scheduling policy: which rows run in the next forward, and how many tokens each feeds.

Every step spends at most ``token_budget`` tokens (Sarathi-Serve's stall-free batching, vLLM's chunked prefill):

1. decodes first: every running row whose prompt is in the cache feeds its one pending token (plus its draft, when
   speculative decoding proposed one: a greedy row's trimmed to what the budget leaves, a sampled row's whole),
   oldest row first; the budget is at least the number of rows, so every running row decodes at every step;
2. then chunks of the prompts being prefilled, oldest first, as many tokens as the budget still allows (and, with
   ``chunk_per_decode``, at most that many per decoding row: a step's cost grows with its chunk, a decode step's
   with its rows, so the chunk that keeps the gap between two tokens within a few decode steps grows with the
   batch), so a long prompt is prefilled over several steps between decode steps instead of stopping every stream;
3. then newcomers, first come first served, while there is budget, a free row (``max_rows``) and room in the cache
   for the newcomer's whole window (a cached prefix counts as room already taken: its blocks are shared).

When a decoding row needs a new block and none is free, the newest running row is preempted: its blocks are
released and it goes back to the front of the queue with all its tokens, to be recomputed later (its prefix blocks
usually come back from the prefix cache). Nothing fails for lack of room. Rows that finish or are cancelled leave
at once (``remove``), and their blocks are free for the same step's newcomers.
"""

from __future__ import annotations

import collections

from .blocks import BlockManager, prefix_root
from .row import Row


class Scheduler:
    """Waiting and running rows over one ``BlockManager``. ``token_budget`` None: no limit."""

    def __init__(self, blocks: BlockManager, *, max_rows: int, token_budget: int | None,
                 chunk_per_decode: int | None = None) -> None:
        self.blocks, self.max_rows, self.token_budget = blocks, max_rows, token_budget
        self.chunk_per_decode = chunk_per_decode
        self.waiting: collections.deque[Row] = collections.deque()
        self.running: list[Row] = []  # in admission order: the last is the newest
        self.preemptions = 0

    def add(self, row: Row) -> None:
        self.waiting.append(row)

    def remove(self, row: Row) -> None:
        """The row leaves (finished, cancelled, failed): its blocks are free at once."""
        if row in self.running:
            self.running.remove(row)
        elif row in self.waiting:
            self.waiting.remove(row)
        self.blocks.release(row.table)

    def requeue(self, row: Row) -> None:
        """Release the row's blocks and put it first in the queue: it is recomputed from its window's start."""
        self.blocks.release(row.table)
        row.computed, row.hashes, row.draft = 0, [], []
        row.embedding = None  # an embedding row pools its states again from the start
        if row in self.running:
            self.running.remove(row)
        elif row in self.waiting:
            self.waiting.remove(row)
        self.waiting.appendleft(row)

    def _grow(self, row: Row, n: int) -> bool:
        """Room in the row's table for n more fed tokens, preempting the newest rows when no block is free;
        False when the row itself had to give its room back."""
        while not self.blocks.grow(row.table, row.computed + n):
            victim = self.running[-1]  # the newest row gives its room back
            self.requeue(victim)
            self.preemptions += 1
            if victim is row:
                return False
        return True

    def schedule(self) -> list[tuple[Row, int]]:
        """The next forward's plan: (row, tokens it feeds), decodes first."""
        budget = float("inf") if self.token_budget is None else self.token_budget
        plan: list[tuple[Row, int]] = []
        for row in list(self.running):
            if row not in self.running or row.pending != 1:
                continue
            greedy = row.config is not None and row.config.temperature == 0  # a scoring row (no config) may come
            # here with its last prompt token pending; it has no draft
            if greedy:  # a greedy row's tokens do not depend on how much it drafts
                row.draft = row.draft[:max(0, int(min(budget, 1 << 30)) - 1)]
            # a sampled row's draft is never cut: how many random draws its verification takes must not depend on
            # its neighbours, or its seed would not repeat its tokens (so its draft may overrun the budget)
            n = 1 + len(row.draft)
            if self._grow(row, n):
                plan.append((row, n))
                budget -= n
        if plan and self.chunk_per_decode is not None:  # while rows decode, prompts wait a few decode steps at most
            budget = min(budget, max(self.chunk_per_decode * len(plan), self.chunk_per_decode))
        for row in self.running:
            # a prompt's chunk, or tokens a constraint forced after a drawn one: those may need a new block, and
            # without a free one they wait (no preemption here: the rows it would evict may be in the plan already)
            if row.pending > 1 and budget >= 1:
                n = int(min(row.pending, budget))
                if self.blocks.grow(row.table, row.computed + n):
                    plan.append((row, n))
                    budget -= n
        while self.waiting and budget >= 1 and len(self.running) < self.max_rows:
            row = self.waiting[0]
            limit = row.first_logit if row.reuse else 0
            got = self.blocks.allocate(row.window, row.window_length, limit, prefix_root(row.adapter, row.cache_salt))
            if got is None:
                break
            self.waiting.popleft()
            row.table, row.computed = got
            if row.n_new == 0:  # the prompt's first admission: what the prefix cache gave it (usage.cached_tokens)
                row.cached_tokens = row.computed
            row.hashes = [self.blocks.block_hash[b] for b in row.table[:row.computed // self.blocks.block_size]]
            row.draft = []
            self.running.append(row)
            n = int(min(row.pending, budget))
            plan.append((row, n))
            budget -= n
        return plan
