"""The inference core's proofs: random schedules (joins, cancels, chunk sizes, prefix hits, preemptions) on tiny
models of each variant give every greedy row exactly what ``generate`` gives its prompt alone, and every seeded
sampled row what it gives alone with that seed; prefix hits equal a cold prefill; the cache's accounting is all
free after every drain; a row that fails finishes alone; speculative greedy equals greedy."""

from __future__ import annotations

import random

import pytest
import torch

from inference_support import VARIANTS, unchecked, variant_model
from tinygpt import GenerationConfig, generate, generate_greedy
from tinygpt.inference.engine import InferenceEngine
from tinygpt.inference.row import Row

SAMPLED = dict(temperature=0.9, top_k=20, top_p=0.95)


def _alone(model, row: Row) -> list[int]:
    cfg = row.config
    return generate(model, [row.tokens[:row.prompt_len]], cfg, seed=cfg.seed).rows()[0]


def _schedule(model, rng: random.Random) -> tuple[InferenceEngine, list[Row]]:
    """One random schedule, run to the end: rows join at random steps (some sharing a prefix, some continuing an
    earlier row's conversation), a few are cancelled, under a random budget, block size and a small cache."""
    vocab, context = model.config.vocab_size, model.config.context_length
    max_rows = rng.choice([2, 3, 4])
    engine = InferenceEngine(model, max_rows=max_rows, token_budget=rng.choice([None, max_rows, max_rows + 3, 16]),
                             cache_tokens=rng.choice([48, 64, 128]), block_size=rng.choice([4, 8]),
                             chunk_per_decode=rng.choice([None, 3]))
    prefixes = [[rng.randrange(vocab) for _ in range(rng.randint(8, 20))] for _ in range(2)]
    rows: list[Row] = []
    for step in range(3000):
        if len(rows) < 10 and rng.random() < 0.4:
            done = [r for r in rows if r.finish_reason in ("length", "eos")]
            if done and rng.random() < 0.3:  # the next turn of an earlier conversation
                prompt = done[-1].tokens + [rng.randrange(vocab) for _ in range(rng.randint(1, 4))]
            else:
                prompt = rng.choice(prefixes + [[]]) + [rng.randrange(vocab) for _ in range(rng.randint(1, 10))]
            prompt = prompt[-(context - 4):]
            sampled = rng.random() < 0.3
            cfg = GenerationConfig(max_new_tokens=rng.randint(1, min(16, context - len(prompt) + 1)),
                                   overflow="error", eos_id=rng.choice([None, 3]),
                                   **(dict(SAMPLED, seed=rng.randrange(1000)) if sampled else {}))
            generator = torch.Generator().manual_seed(cfg.seed) if sampled else None
            rows.append(engine.add(Row(prompt, cfg, generator=generator)))
        live = [r for r in rows if not r.finished]
        if live and rng.random() < 0.04:
            engine.cancel(rng.choice(live))
        engine.step()
        if len(rows) == 10 and not engine.has_work:
            break
    assert not engine.has_work, "the schedule did not drain"
    return engine, rows


@pytest.mark.parametrize("variant", VARIANTS)
def test_random_schedules_give_every_row_what_it_gives_alone(variant):
    model = variant_model(variant)
    preemptions = hits = chunked = 0
    for seed in range(4):
        engine, rows = _schedule(model, random.Random(seed))
        assert engine.blocks.all_free()  # every block back, no reference left
        for row in rows:
            assert row.finish_reason in ("length", "eos", "cancelled")
            if row.finish_reason != "cancelled":
                assert row.tokens[row.prompt_len:] == _alone(model, row)
        preemptions += engine.scheduler.preemptions
        hits += engine.blocks.hits
        chunked += engine.scheduler.token_budget is not None
    assert preemptions > 0 and hits > 0 and chunked > 0  # the schedules really exercised all three


def test_prompts_longer_than_the_context_are_queued_once_and_slide_as_the_uncached_loop():
    """Rows whose prompts already exceed C (sliding: each step sees the last C tokens) batched with room for all:
    each is queued once (it was queued twice, ran twice at once and broke the block tables) and gives the
    chapter's uncached loop's tokens."""
    model = variant_model("gpt2")
    c = model.config.context_length
    prompts = [list(range(1, c + 2)), list(range(5, c + 12)), [7, 8, 9]]
    cfg = GenerationConfig(max_new_tokens=5)
    engine = InferenceEngine(model, max_rows=3, block_size=8)
    rows = [engine.add(Row(p, cfg)) for p in prompts]
    assert list(engine.scheduler.waiting) == rows
    engine.run_until_done()
    for prompt, row in zip(prompts, rows):
        expected = generate_greedy(model, torch.tensor([prompt]), 5, c)[0, len(prompt):].tolist()
        assert row.tokens[row.prompt_len:] == expected
    assert engine.blocks.all_free()


@pytest.mark.parametrize("variant", VARIANTS)
def test_a_prefix_hit_gives_the_logits_of_a_cold_prefill(variant):
    model = variant_model(variant, dtype=torch.float32)
    engine = InferenceEngine(model, max_rows=2, block_size=4, cache_tokens=96)
    rng = random.Random(1)
    prefix = [rng.randrange(53) for _ in range(13)]
    engine.add(Row(prefix + [1, 2], GenerationConfig(max_new_tokens=2)))
    engine.run_until_done()
    second = engine.add(Row(prefix + [4, 5, 6], GenerationConfig(max_new_tokens=1), want_logits=True))
    outputs = engine.step()
    assert engine.blocks.hits == 12  # the prefix's 3 full blocks were taken, not computed
    (out,) = [o for o in outputs if o.row is second]
    with torch.inference_mode():
        cold = model(torch.tensor([prefix + [4, 5, 6]]))[0, -1]  # [V]
    torch.testing.assert_close(out.logits[0], cold, atol=1e-5, rtol=0)
    assert engine.blocks.all_free()


@pytest.mark.parametrize("variant", VARIANTS)
def test_scoring_rows_share_a_context_and_score_what_a_full_forward_scores(variant):
    model = variant_model(variant)
    engine = InferenceEngine(model, max_rows=4, block_size=4, cache_tokens=160)
    context = list(range(5, 25))
    choices = [[30, 31], [32], [33, 34, 35]]
    first = engine.add(Row(context + choices[0], None, scored=2))
    engine.run_until_done()
    rest = [engine.add(Row(context + c, None, scored=len(c))) for c in choices[1:]]
    engine.run_until_done()
    assert engine.blocks.hits >= 2 * 16
    with torch.inference_mode():
        for row, c in zip([first] + rest, choices):
            tokens = torch.tensor([context + c])
            logp = model(tokens[:, :-1])[0].log_softmax(-1)  # [T - 1, V]
            n = len(c)
            want = sum(float(logp[-n + i, c[i]]) for i in range(n))
            assert row.score.logprob == pytest.approx(want, abs=1e-9)
            assert row.score.greedy == all(int(logp[-n + i].argmax()) == c[i] for i in range(n))
    assert engine.blocks.all_free()


def test_a_row_whose_sampling_raises_finishes_alone_and_the_others_carry_on():
    model = variant_model("gpt2", dtype=torch.float32)
    engine = InferenceEngine(model, max_rows=4, token_budget=6)
    prompts = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 10], [11, 12], [13, 14, 15, 16]]
    rows = [engine.add(Row(p, GenerationConfig(max_new_tokens=12))) for p in prompts]
    for _ in range(3):
        engine.step()
    # temperature 1e-40 (refused by GenerationConfig, set past it) turns the logits into inf: its draw raises, on a
    # running batch
    bad = engine.add(Row([20, 21, 22], unchecked(GenerationConfig(max_new_tokens=5, temperature=1.0),
                                                 temperature=1e-40)))
    engine.run_until_done()
    assert bad.finish_reason == "error" and "probability" in bad.error
    for row in rows:
        assert row.finish_reason == "length" and row.tokens[row.prompt_len:] == _alone(model, row)
    assert engine.blocks.all_free()


def test_a_batched_forward_that_raises_is_retried_row_by_row_and_only_the_bad_row_fails(monkeypatch):
    model = variant_model("llama")
    forward = model.forward

    def fragile(idx, **kwargs):  # fails on any batch that holds a 17-token span: one row's prompt
        if any(span.length == 17 for span in kwargs["pos"].spans):
            raise RuntimeError("out of memory (simulated)")
        return forward(idx, **kwargs)

    monkeypatch.setattr(model, "forward", fragile)
    engine = InferenceEngine(model, max_rows=4)
    rows = [engine.add(Row(list(range(1, n + 1)), GenerationConfig(max_new_tokens=6))) for n in (5, 17, 9)]
    engine.run_until_done()
    monkeypatch.setattr(model, "forward", forward)
    assert rows[1].finish_reason == "error" and "simulated" in rows[1].error
    for row in (rows[0], rows[2]):
        assert row.tokens[row.prompt_len:] == _alone(model, row)
    assert engine.blocks.all_free()


@pytest.mark.parametrize("variant", VARIANTS)
def test_speculative_greedy_equals_greedy_whatever_the_drafts(variant):
    model = variant_model(variant)
    prompts = [[1, 2, 3, 4, 5, 6] * 3, [7, 8, 9] * 4 + [10], [11, 12, 13, 14]]
    plain = generate(model, prompts, max_new_tokens=18).rows()
    full = {tuple(p): p + out for p, out in zip(prompts, plain)}

    def oracle(tokens, k):  # the right continuation, its last token wrong every third call: partial acceptance
        row = next(seq for prompt, seq in full.items() if list(prompt) == tokens[:len(prompt)])
        draft = row[len(tokens):len(tokens) + k]
        oracle.calls += 1
        if draft and oracle.calls % 3 == 0:
            draft[-1] = (draft[-1] + 1) % 53
        return draft

    oracle.calls = 0
    engine = InferenceEngine(model, max_rows=3, speculative_tokens=4, proposer=oracle, token_budget=7)
    rows = [engine.add(Row(p, GenerationConfig(max_new_tokens=18))) for p in prompts]
    engine.run_until_done()
    assert [r.tokens[r.prompt_len:] for r in rows] == plain
    assert all(0 < r.accepted < r.drafted for r in rows)  # accepted drafts and rolled-back rejections
    assert engine.steps < 18  # fewer forwards than one per token
    assert engine.blocks.all_free()
    assert generate(model, prompts, max_new_tokens=18, speculative_tokens=3).rows() == plain  # prompt lookup


def test_prompt_lookup_by_each_rows_index_drafts_what_the_scan_drafts():
    """The default proposer (a ``LookupIndex`` per row) against ``propose_lookup`` scanning the row at every step:
    the same drafts, so the same counts of drafted and accepted tokens for every row, and the same tokens."""
    from tinygpt.inference.drafting import propose_lookup

    model = variant_model("gpt2")
    prompts = [[1, 2, 3, 4, 5, 6] * 3, [7, 8, 9] * 4 + [10], [11, 12, 13, 14], [5, 5, 5, 6, 5, 5]]
    runs = []
    for proposer in (None, propose_lookup):
        engine = InferenceEngine(model, max_rows=3, speculative_tokens=4, proposer=proposer, token_budget=7)
        rows = [engine.add(Row(p, GenerationConfig(max_new_tokens=20))) for p in prompts]
        engine.run_until_done()
        runs.append([(r.tokens, r.drafted, r.accepted) for r in rows])
        assert all(r.lookup is None for r in rows) == (proposer is not None)
    assert runs[0] == runs[1]
    assert sum(drafted for _, drafted, _ in runs[0]) > 0


def test_speculative_sampled_rows_repeat_with_their_seed_whatever_their_neighbours():
    model = variant_model("gqa")
    prompt = [1, 2, 3, 4] * 4
    cfg = GenerationConfig(max_new_tokens=14, seed=5, **SAMPLED)
    alone = generate(model, [prompt], cfg, speculative_tokens=3).rows()[0]
    mixed = generate(model, [prompt, [9, 9, 8], [1, 2, 3, 4, 5]], cfg, speculative_tokens=3,
                     token_budget=5).rows()[0]
    assert mixed == alone and len(alone) == 14


def _draft_model(variant: str, seed: int, **fields):
    """Another random tiny model (one layer)."""
    torch.manual_seed(seed)
    from tinygpt import GPTModel

    return GPTModel(VARIANTS[variant].replace(n_layers=1, **fields)).to(torch.float64).eval()


def _noisy_copy(target, context: int, noise: float = 0.3, seed: int = 7):
    """A draft model that differs from the target: its weights plus noise (``noise`` x each tensor's std), a
    shorter context. Its greedy drafts are right often enough to be accepted and wrong often enough to be rolled
    back (two unrelated random models almost never agree)."""
    from tinygpt import GPTModel

    torch.manual_seed(seed)
    draft = GPTModel(target.config.replace(context_length=context)).to(torch.float64).eval()
    own = draft.state_dict()
    state = {}
    for name, value in target.state_dict().items():
        value = value[:own[name].shape[0]] if value.shape != own[name].shape else value  # positions: the first C'
        state[name] = value + noise * value.std() * torch.randn_like(value) if value.numel() > 1 else value
    draft.load_state_dict(state)
    return draft


@pytest.mark.parametrize("variant", VARIANTS)
def test_a_draft_model_gives_greedy_rows_exactly_the_plain_greedy_tokens(variant):
    """Drafts from another model (some accepted, many rolled back; a shorter context, so long rows show it only
    their tail) and from the target itself (every draft accepted): the same tokens as plain greedy, under a
    small budget that trims drafts and a slide past the context."""
    model = variant_model(variant)
    prompts = [[1, 2, 3, 4, 5, 6] * 3, [7, 8, 9] * 4 + [10], [11, 12, 13, 14]]
    cfg = GenerationConfig(max_new_tokens=30)  # the first row slides past C = 40
    plain = generate(model, prompts, cfg).rows()
    other = _noisy_copy(model, context=24)
    for draft, everything_accepted in ((other, False), (model, True)):
        engine = InferenceEngine(model, max_rows=3, speculative_tokens=4, draft_model=draft, token_budget=7)
        rows = [engine.add(Row(p, cfg)) for p in prompts]
        engine.run_until_done()
        assert [r.tokens[r.prompt_len:] for r in rows] == plain
        accepted, drafted = sum(r.accepted for r in rows), sum(r.drafted for r in rows)
        if everything_accepted:
            assert accepted == drafted > 30
        else:
            assert 0 < accepted < drafted
        assert len(engine.drafts) == 0 and engine.blocks.all_free()  # every row gave its draft cache back
        assert generate(model, prompts, cfg, draft_model=draft).rows() == plain


def test_drafting_turns_itself_off_for_a_row_whose_draft_model_is_always_wrong():
    model = variant_model("gpt2")
    draft = _draft_model("gpt2", seed=1)
    with torch.no_grad():
        draft.out_head.weight.zero_()
        draft.out_head.weight[0, 0] = 1.0  # the draft's argmax is always token 0 or 1 ...
    prompt = [11, 12, 13, 14]
    cfg = GenerationConfig(max_new_tokens=30)
    plain = generate(model, [prompt], cfg).rows()[0]
    assert plain.count(0) + plain.count(1) <= 2  # ... which the target hardly ever writes
    engine = InferenceEngine(model, max_rows=1, speculative_tokens=4, draft_model=draft)
    row = engine.add(Row(prompt, cfg))
    engine.run_until_done()
    assert row.tokens[row.prompt_len:] == plain
    assert row.drafted <= 10 and row.drafter.paused + row.drafter.pause > 16  # paused, not 4 per step


def test_sampled_rows_with_a_draft_model_repeat_with_their_seed_whatever_their_neighbours():
    model = variant_model("gqa")
    draft = _draft_model("gqa", seed=2)
    prompt = [1, 2, 3, 4] * 4
    cfg = GenerationConfig(max_new_tokens=14, seed=5, speculative_tokens=3, **SAMPLED)
    alone = generate(model, [prompt], cfg, draft_model=draft).rows()[0]
    mixed = generate(model, [prompt, [9, 9, 8], [1, 2, 3, 4, 5]], cfg, token_budget=5, draft_model=draft).rows()[0]
    assert mixed == alone and len(alone) == 14


def test_a_draft_model_must_share_the_vocabulary():
    model = variant_model("gpt2")
    with pytest.raises(ValueError, match="vocab_size=60 differs from the target's vocab_size=53"):
        InferenceEngine(model, speculative_tokens=4, draft_model=_draft_model("gpt2", seed=1, vocab_size=60))
    with pytest.raises(ValueError, match="speculative_tokens >= 1"):
        InferenceEngine(model, draft_model=_draft_model("gpt2", seed=1))
    with pytest.raises(ValueError, match="vocab_size=60 differs"):
        generate(model, [[1, 2]], max_new_tokens=2, draft_model=_draft_model("gpt2", seed=1, vocab_size=60))


@pytest.mark.parametrize("variant", ["gpt2", "gqa"])
def test_embedding_rows_pool_what_the_plain_forward_gives_beside_generation_and_preemption(variant):
    model = variant_model(variant)  # float64: the engine's chunks and the plain forward agree to rounding
    inputs = [list(range(3, 43)), [9, 8, 7], list(range(40, 51))]
    with torch.inference_mode():
        states = [model.hidden_states(torch.tensor([ids]))[0] for ids in inputs]  # [T, D] each
    gen = Row([1, 2, 3, 4], GenerationConfig(max_new_tokens=30))
    # 12 blocks of 4: the growing generation row preempts the long embedding row mid-prefill (it restarts)
    engine = InferenceEngine(model, max_rows=2, block_size=4, cache_tokens=48, token_budget=8)
    engine.add(gen)
    rows = [engine.add(Row(ids, None, pooling=pooling)) for ids in inputs for pooling in ("mean", "last")]
    engine.run_until_done()
    assert engine.scheduler.preemptions >= 1 and engine.blocks.all_free()
    assert gen.tokens[4:] == _alone(model, Row([1, 2, 3, 4], GenerationConfig(max_new_tokens=30)))
    for k, row in enumerate(rows):
        want = states[k // 2].mean(0) if row.pooling == "mean" else states[k // 2][-1]
        assert row.finish_reason == "length"
        torch.testing.assert_close(row.embedding, want.float(), atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match="pooling"):
        engine.add(Row([1, 2], None, pooling="max"))


@pytest.mark.parametrize("variant", ["gpt2", "gqa"])
def test_a_scoring_row_preempted_mid_prefill_scores_and_hands_out_each_position_once(variant):
    model = variant_model(variant)
    tokens = list(range(3, 43))
    scored = 30  # its scored positions span several chunks, some before the preemption and some after
    gen = Row([1, 2, 3, 4], GenerationConfig(max_new_tokens=30))
    # 12 blocks of 4: the growing generation row preempts the long scoring row mid-prefill (it restarts)
    engine = InferenceEngine(model, max_rows=2, block_size=4, cache_tokens=48, token_budget=8)
    engine.add(gen)
    row = engine.add(Row(tokens, None, scored=scored, want_logits=True, reuse=False))
    handed: list[torch.Tensor] = []
    for _ in range(200):  # bounded; the work ends long before
        if not engine.has_work:
            break
        for out in engine.step():
            if out.row is row and out.logits is not None:
                handed.append(out.logits)
    assert engine.scheduler.preemptions >= 1 and engine.blocks.all_free()
    with torch.inference_mode():
        logits = model(torch.tensor([tokens[:-1]]))[0]  # [T - 1, V]
    logp = logits.log_softmax(-1)
    want = sum(float(logp[len(tokens) - 1 - scored + i, tokens[len(tokens) - scored + i]]) for i in range(scored))
    assert row.score.logprob == pytest.approx(want, abs=1e-9)  # each scored position counted once
    got = torch.cat(handed)
    assert got.shape[0] == scored  # and its logits handed out once
    torch.testing.assert_close(got, logits[-scored:], atol=1e-9, rtol=0)
