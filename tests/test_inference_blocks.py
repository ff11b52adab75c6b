"""The cache's accounting: tables, reference counts, the prefix hash chain, LRU reuse of unreferenced blocks."""

from __future__ import annotations

import pytest

from tinygpt.inference.blocks import RESERVED, BlockManager


def test_allocate_grow_release_return_every_block():
    blocks = BlockManager(10, 4)
    assert blocks.capacity_blocks == 8 and blocks.all_free()
    table, reused = blocks.allocate(list(range(10)), 10, reuse_limit=9)
    assert reused == 0 and len(table) == 3 and min(table) >= RESERVED  # 10 positions: 3 blocks, none reserved
    assert blocks.grow(table, 13) and len(table) == 4
    assert not blocks.grow(table, 100) and len(table) == 4  # no room: nothing taken
    assert blocks.num_free == 4
    blocks.release(table)
    assert table == [] and blocks.all_free()
    assert blocks.allocate(list(range(40)), 40, 0) is None  # 10 blocks needed, 8 exist


def test_full_computed_blocks_are_shared_by_a_later_row_with_the_same_prefix():
    blocks = BlockManager(12, 4)
    tokens = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14]
    first, _ = blocks.allocate(tokens, 10, 9)
    hashes: list[int] = []
    blocks.register(first, tokens, 10, hashes)  # 2 full blocks published; the third (2 tokens) is not full
    assert len(hashes) == 2
    second, reused = blocks.allocate(tokens[:8] + [1, 2, 3], 11, 10)
    assert reused == 8 and second[:2] == first[:2] and second[2] != first[2]
    assert blocks.ref_count[first[0]] == 2
    # a prefix that differs in its first block shares nothing: the hash of block 2 names the whole prefix
    third, reused = blocks.allocate([0] + tokens[1:], 10, 9)
    assert reused == 0 and not set(third) & set(first)
    for t in (first, second, third):
        blocks.release(t)
    assert blocks.all_free()


def test_reuse_stops_at_the_limit_and_needs_computed_blocks():
    blocks = BlockManager(12, 4)
    tokens = list(range(12))
    table, _ = blocks.allocate(tokens, 12, 11)
    hashes: list[int] = []
    blocks.register(table, tokens, 5, hashes)  # only positions < 5 computed: one block published
    assert len(hashes) == 1
    blocks.register(table, tokens, 12, hashes)
    assert len(hashes) == 3
    other, reused = blocks.allocate(tokens, 12, 11)  # the last token must be computed: 2 blocks, not 3
    assert reused == 8
    blocks.release(table)
    blocks.release(other)


def test_unreferenced_cached_blocks_are_kept_until_needed_least_recently_used_first():
    blocks = BlockManager(2 + 4, 2)  # 4 usable blocks of 2
    a, b = [1, 2, 3, 4], [7, 8, 9, 10]
    for tokens in (a, b):  # each row: 2 blocks, published, then released (kept as cached)
        table, _ = blocks.allocate(tokens, 4, 3)
        blocks.register(table, tokens, 4, [])
        blocks.release(table)
    assert blocks.all_free()
    assert len(blocks.lookup(a, 4)) == 2 and len(blocks.lookup(b, 4)) == 2
    fresh, _ = blocks.allocate([0, 0], 2, 0)  # needs one block: the least recently freed one goes (a's tail)
    assert len(blocks.lookup(a, 4)) == 1 and len(blocks.lookup(b, 4)) == 2
    blocks.release(fresh)
    hit, reused = blocks.allocate(b + [5], 5, 4)
    assert reused == 4
    blocks.release(hit)
    assert blocks.all_free()


def test_a_hash_collision_is_not_a_hit(monkeypatch):
    import tinygpt.inference.blocks as module

    monkeypatch.setattr(module, "chain_hash", lambda parent, tokens: 42)  # every block collides
    blocks = BlockManager(8, 2)
    table, _ = blocks.allocate([1, 2, 3], 3, 2)
    blocks.register(table, [1, 2, 3], 3, [])
    other, reused = blocks.allocate([4, 5, 6], 3, 2)
    assert reused == 0  # same hash, other tokens: computed again
    blocks.release(table)
    blocks.release(other)
    assert blocks.all_free()


def test_too_few_blocks_is_a_value_error():
    with pytest.raises(ValueError, match="num_blocks=2"):
        BlockManager(2, 4)


def test_rows_of_different_adapters_never_share_a_block_and_rows_of_one_adapter_do():
    from tinygpt.inference.blocks import prefix_root

    blocks = BlockManager(20, 4)
    tokens = list(range(10, 22))
    tables = {}
    for adapter in (-1, 0):
        table, reused = blocks.allocate(tokens, 12, 11, prefix_root(adapter))
        assert reused == 0  # the other adapter's blocks hold other keys for the same tokens
        blocks.register(table, tokens, 12, [], prefix_root(adapter))
        tables[adapter] = table
    for adapter in (-1, 0):
        again, reused = blocks.allocate(tokens, 12, 11, prefix_root(adapter))
        assert reused == 8 and again[:2] == tables[adapter][:2]
        blocks.release(again)
    assert blocks.allocate(tokens, 12, 11, prefix_root(1))[1] == 0
