"""The cache's accounting: fixed-size blocks, per-row block tables, prefix hashes, reference counts, LRU reuse.

The keys and values live in ``kv_cache.PagedKVCache`` (allocated once); this module only decides which block holds
which row's positions (vLLM's PagedAttention layout, nano-vllm's ``block_manager``). A row's table lists its blocks
in position order: position p is block ``table[p // block_size]``, offset ``p % block_size``.

Prefix reuse: once a block is full of computed keys/values, it is registered under a hash of its tokens chained to
the hash of the block before it, so the hash names the whole prefix up to the block's end (a block's keys depend on
every token before it). A row added later whose tokens begin with the same full blocks takes them (reference count
+ 1) instead of computing them again. A block nobody uses any more keeps its contents and its hash, and goes to
the back of the free list: blocks are handed out from the front, so the least recently used cached prefix is
overwritten first (blocks without a hash are put at the front: nothing is lost by reusing them).

A row served with a LoRA adapter computes other keys and values for the same tokens, so its chain starts from a
root that names the adapter (``prefix_root``): rows of different adapters never share a block, rows of the same
adapter do. A row with a cache salt (vLLM's ``cache_salt``: a tenant's secret) has the salt in its root too, so only
rows with the same salt share its blocks: another tenant cannot learn from a fast first token that a prefix was
cached.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Hashable, Sequence

NULL_BLOCK = 0  # masked key slots point into it (kept zero); never handed out
SCRATCH_BLOCK = 1  # idle padding tokens write their keys here; never read, never handed out
RESERVED = 2


def chain_hash(parent: Hashable, tokens: Sequence[int]) -> int:
    """The hash of a full block: its tokens and the hash of the prefix before it (for the first block, the root)."""
    return hash((parent, tuple(tokens)))


def prefix_root(adapter: int, salt: str | None = None) -> Hashable:
    """The root of a row's chain: None for the base model (-1) without a salt, one per (adapter, salt) otherwise."""
    if salt is not None:
        return ("salt", adapter, salt)
    return None if adapter < 0 else ("adapter", adapter)


class BlockManager:
    """``num_blocks`` blocks of ``block_size`` positions (blocks 0 and 1 reserved). Rows are represented by their tables
    (lists of block ids), owned by the caller."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks <= RESERVED:
            raise ValueError(f"num_blocks={num_blocks} must be > {RESERVED} (blocks 0 and 1 are reserved)")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.ref_count = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.block_tokens: list[tuple[int, ...] | None] = [None] * num_blocks
        self.by_hash: dict[int, int] = {}
        self.free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(RESERVED, num_blocks))
        self.hits = 0  # tokens taken from the prefix cache (for /health and the benchmarks)

    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def capacity_blocks(self) -> int:
        return self.num_blocks - RESERVED

    def blocks_for(self, length: int) -> int:
        return -(-length // self.block_size)

    def all_free(self) -> bool:
        """True when no row holds a block: the accounting after a drain."""
        return self.num_free == self.capacity_blocks and not any(self.ref_count)

    def _take_free(self) -> int:
        block, _ = self.free.popitem(last=False)
        old = self.block_hash[block]
        if old is not None and self.by_hash.get(old) == block:
            del self.by_hash[old]
        self.block_hash[block] = self.block_tokens[block] = None
        self.ref_count[block] = 1
        return block

    def lookup(self, tokens: Sequence[int], limit: int, root: Hashable = None) -> list[int]:
        """The cached blocks that hold ``tokens``' first full blocks, at most ``limit`` tokens' worth, in the chain
        that starts at ``root`` (``prefix_root``)."""
        found, parent, bs = [], root, self.block_size
        for i in range(min(limit, len(tokens)) // bs):
            chunk = tuple(tokens[i * bs:(i + 1) * bs])
            h = chain_hash(parent, chunk)
            block = self.by_hash.get(h)
            if block is None or self.block_tokens[block] != chunk:  # a miss, or a hash collision
                break
            found.append(block)
            parent = h
        return found

    def allocate(self, tokens: Sequence[int], length: int, reuse_limit: int, root: Hashable = None
                 ) -> tuple[list[int], int] | None:
        """A table covering ``length`` positions for a row whose first positions hold ``tokens``, taking cached
        blocks for at most ``reuse_limit`` tokens of the chain from ``root``; returns (table, tokens reused), or None
        when there is no room."""
        hits = self.lookup(tokens, reuse_limit, root) if reuse_limit > 0 else []
        fresh = self.blocks_for(length) - len(hits)
        if fresh > self.num_free - sum(1 for b in hits if self.ref_count[b] == 0):
            return None
        for block in hits:
            if self.ref_count[block] == 0:
                del self.free[block]
            self.ref_count[block] += 1
        table = hits + [self._take_free() for _ in range(max(fresh, 0))]
        self.hits += len(hits) * self.block_size
        return table, len(hits) * self.block_size

    def grow(self, table: list[int], length: int) -> bool:
        """Add blocks to ``table`` until it covers ``length`` positions; False (and nothing taken) if no room."""
        need = self.blocks_for(length) - len(table)
        if need > self.num_free:
            return False
        table.extend(self._take_free() for _ in range(max(need, 0)))
        return True

    def release(self, table: list[int]) -> None:
        """Drop a row's hold on its blocks (the row finished, was cancelled or preempted); empties the table."""
        for block in reversed(table):  # the row's last blocks are the least likely to be shared: evict them first
            self.ref_count[block] -= 1
            if self.ref_count[block] == 0:
                self.free[block] = None
                if self.block_hash[block] is None:
                    self.free.move_to_end(block, last=False)
        table.clear()

    def register(self, table: Sequence[int], tokens: Sequence[int], computed: int, hashes: list[int],
                 root: Hashable = None) -> None:
        """Publish the row's full blocks whose keys/values are computed (positions < ``computed``). ``hashes``: the
        row's chain so far (one per published block, from ``root``), extended here."""
        bs = self.block_size
        while (len(hashes) + 1) * bs <= computed:
            i = len(hashes)
            chunk = tuple(tokens[i * bs:(i + 1) * bs])
            h = chain_hash(hashes[-1] if hashes else root, chunk)
            hashes.append(h)
            block = table[i]
            if self.block_hash[block] is None and h not in self.by_hash:
                self.block_hash[block], self.block_tokens[block] = h, chunk
                self.by_hash[h] = block
