"""The batch description: decode rows packed longest first, in groups of similar length (each padded only to its
own longest row), and a packed forward over rows of very different lengths equal to each row's own forward."""

from __future__ import annotations

import pytest
import torch

from inference_support import VARIANTS, variant_model
from tinygpt.inference.batch import RowSlice, build_batch, pack_order
from tinygpt.kv_cache import PagedKVCache


def _slice(start: int, length: int, block_size: int, first_block: int) -> RowSlice:
    blocks = -(-(start + length) // block_size)
    return RowSlice(start, length, list(range(first_block, first_block + blocks)), [length - 1])


def test_decode_rows_go_longest_first_in_groups_of_similar_length():
    bs = 4
    rows = [_slice(3, 1, bs, 2), _slice(30, 1, bs, 10), _slice(5, 3, bs, 30), _slice(20, 1, bs, 40),
            _slice(6, 1, bs, 50)]
    assert pack_order(rows) == [1, 3, 4, 0, 2]  # decode rows by keys (31, 21, 7, 4), then the span
    batch = build_batch(rows, bs, "cpu")
    assert batch.decode_rows == 4
    # 31 and 21 keys share a group (21 >= 31 / 2); 7 and 4 another (4 >= 7 / 2)
    assert [g.rows for g in batch.decode_groups] == [2, 2]
    assert [tuple(g.keys.shape) for g in batch.decode_groups] == [(2, 31), (2, 7)]
    first, second = batch.decode_groups
    assert first.mask.sum(dim=1).tolist() == [31, 21] and second.mask.sum(dim=1).tolist() == [7, 4]
    assert first.keys[0].tolist() == [10 * bs + p for p in range(31)]  # row 1's table starts at block 10
    assert first.keys[1, 21:].eq(0).all()  # padding points at the zero block
    assert batch.positions.tolist() == [30, 20, 6, 3, 5, 6, 7]


def test_equal_lengths_make_one_unmasked_group():
    rows = [_slice(9, 1, 4, 2), _slice(9, 1, 4, 10)]
    (group,) = build_batch(rows, 4, "cpu").decode_groups
    assert group.rows == 2 and group.mask is None


@pytest.mark.parametrize("variant", VARIANTS)
def test_a_packed_step_over_short_and_long_rows_equals_each_row_alone(variant):
    """Rows of 3, 5, 30 and 33 keys (two decode groups) and a span, in one forward: each row's logits equal a
    plain forward over its own tokens."""
    model = variant_model(variant)
    cfg, bs = model.config, 4
    gen = torch.Generator().manual_seed(0)
    lengths = [3, 33, 5, 30]  # decode rows: keys before the new token
    prompts = [torch.randint(cfg.vocab_size, (n + 1,), generator=gen).tolist() for n in lengths]
    span = torch.randint(cfg.vocab_size, (12,), generator=gen).tolist()  # 8 cached, 4 fed
    cache = PagedKVCache(cfg, 64, bs, dtype=torch.float64)
    tables, next_block = [], 2
    for tokens in prompts + [span]:
        blocks = -(-len(tokens) // bs)
        tables.append(list(range(next_block, next_block + blocks)))
        next_block += blocks
    with torch.inference_mode():
        # fill the cache: each row's earlier tokens as one span starting at 0
        for tokens, table, cached in zip(prompts + [span], tables, lengths + [8]):
            fill = [RowSlice(0, cached, table, [])]
            model(torch.tensor([tokens[:cached]]), cache=cache, pos=build_batch(fill, bs, "cpu"))
        step = [RowSlice(n, 1, t, [0]) for n, t in zip(lengths, tables[:4])] + [RowSlice(8, 4, tables[4], [3])]
        order = pack_order(step)
        feeds = [p[-1:] for p in prompts] + [span[8:]]
        ids = [t for i in order for t in feeds[i]]
        batch = build_batch(step, bs, "cpu")
        assert len(batch.decode_groups) == 2
        logits = model(torch.tensor([ids]), cache=cache, pos=batch)[0]  # [5, V], in packed order
        for j, i in enumerate(order):
            tokens = (prompts + [span])[i]
            torch.testing.assert_close(logits[j], model(torch.tensor([tokens]))[0, -1], rtol=1e-10, atol=1e-10)
