"""The scheduling policy without a model: the token budget, decodes first, chunked prefill, admission by room,
preemption of the newest row, and rows that leave giving their room back at once."""

from __future__ import annotations

from tinygpt import GenerationConfig
from tinygpt.inference.blocks import BlockManager
from tinygpt.inference.row import Row
from tinygpt.inference.scheduler import Scheduler


def _row(prompt_len: int, max_new: int = 8) -> Row:
    return Row(list(range(1, prompt_len + 1)), GenerationConfig(max_new_tokens=max_new))


def _run(plan: list[tuple[Row, int]]) -> None:
    """What a step does to the rows' accounting: the fed tokens are computed; a row whose window is complete draws."""
    for row, n in plan:
        row.computed += n
        if row.pending == 0:
            row.tokens.append(7)
            row.n_new += 1


def test_decodes_first_then_a_long_prompt_in_chunks_under_the_budget():
    sched = Scheduler(BlockManager(64, 4), max_rows=4, token_budget=8)
    a, b = _row(3), _row(2)
    sched.add(a)
    sched.add(b)
    first = sched.schedule()
    assert first == [(a, 3), (b, 2)]
    _run(first)
    long = _row(30)
    sched.add(long)
    chunks = []
    for _ in range(5):
        plan = sched.schedule()
        assert plan[:2] == [(a, 1), (b, 1)]  # the running rows decode at every step, first
        assert sum(n for _, n in plan) <= 8
        chunks += [n for row, n in plan if row is long]
        _run(plan)
    assert chunks == [6, 6, 6, 6, 6]  # what the budget leaves after the two decodes
    assert long.pending == 1 and long.n_new == 1


def test_unlimited_budget_prefills_every_prompt_at_once():
    sched = Scheduler(BlockManager(64, 4), max_rows=8, token_budget=None)
    rows = [_row(n) for n in (5, 17, 9)]
    for r in rows:
        sched.add(r)
    assert sched.schedule() == [(r, r.window_length) for r in rows]


def test_admission_waits_for_rows_and_for_room_first_come_first_served():
    blocks = BlockManager(2 + 6, 4)  # 24 positions
    sched = Scheduler(blocks, max_rows=2, token_budget=None)
    a, b, c = _row(10), _row(10), _row(2)
    for r in (a, b, c):
        sched.add(r)
    plan = sched.schedule()
    assert [r for r, _ in plan] == [a, b] and list(sched.waiting) == [c]  # max_rows
    _run(plan)
    sched.remove(a)  # finished or cancelled: its blocks are free at once, for this very step's newcomers
    assert blocks.num_free == 3
    plan = sched.schedule()
    assert (c, 2) in plan and not sched.waiting


def test_a_row_that_cannot_grow_preempts_the_newest_which_is_recomputed_later():
    blocks = BlockManager(2 + 4, 4)  # 16 positions
    sched = Scheduler(blocks, max_rows=3, token_budget=None)
    old, new = _row(7, max_new=20), _row(4, max_new=20)
    sched.add(old)
    sched.add(new)
    _run(sched.schedule())  # old holds 2 blocks (7 positions + its next), new 1
    _run(sched.schedule())  # old: position 7 still fits its 2nd block; new needs its 2nd block for position 4
    assert blocks.num_free == 0
    plan = sched.schedule()  # old needs a 3rd block for position 8: none is free, so `new` gives its 2 back
    assert sched.preemptions == 1 and plan == [(old, 1)]
    assert list(sched.waiting) == [new] and new.computed == 0 and new.table == []
    assert new.window_length == 6  # its prompt and the 2 tokens it drew: all recomputed when it comes back
    sched.remove(old)
    plan = sched.schedule()
    assert plan == [(new, 6)]
    sched.remove(new)
    assert blocks.all_free()


def test_while_rows_decode_a_prompt_chunk_is_capped_per_decoding_row():
    sched = Scheduler(BlockManager(64, 4), max_rows=4, token_budget=100, chunk_per_decode=5)
    a = _row(3)
    sched.add(a)
    _run(sched.schedule())
    long = _row(40)
    sched.add(long)
    plan = sched.schedule()
    assert plan == [(a, 1), (long, 5)]  # one decoding row: 5 prompt tokens, not the 99 left
    _run(plan)
    sched.remove(a)
    assert sched.schedule() == [(long, 35)]  # nobody decodes: the whole budget
