"""Speculative decoding's pieces: lookup drafts, greedy and sampled verification (a chi-square test against the
exact distribution), the draft model's rollback, the per-row controller, and the reference loop == generate."""

from __future__ import annotations

import itertools
import math
import random

import pytest
import torch

from tinygpt import GPTConfig, GPTModel, generate
from tinygpt.generation import GenerationConfig
from tinygpt.inference import acceptance, drafting
from tinygpt.inference.acceptance import accept_greedy, accept_sampled, target_probs
from tinygpt.inference.drafting import DraftController, DraftModel, propose_lookup
from tinygpt.sampling import sampling_probs

from speculative_reference import speculative_generate


# ------------------------------------------------------------------------------------------------ lookup
def test_lookup_copies_what_followed_the_latest_match_of_the_longest_ngram():
    assert propose_lookup([1, 2, 3, 9, 8, 1, 2, 3], 2) == [9, 8]
    assert propose_lookup([5, 1, 2, 7, 1, 2, 8, 1, 2], 3) == [8, 1, 2]  # the latest earlier occurrence
    # the trigram [1, 2, 3] beats the later unigram match of 3
    assert propose_lookup([1, 2, 3, 4, 9, 3, 5, 1, 2, 3], 2) == [4, 9]
    assert propose_lookup([1, 2, 3, 4, 9, 3, 5, 1, 2, 3], 2, max_ngram=1) == [5, 1]
    assert propose_lookup([4, 4, 4], 5) == [4]  # overlapping match; only what exists is proposed
    assert propose_lookup([1, 2, 3, 4], 3) == [] and propose_lookup([7], 3) == [] and propose_lookup([], 2) == []


def test_lookup_against_a_brute_force_search():
    rng = random.Random(0)
    for _ in range(300):
        tokens = [rng.randrange(4) for _ in range(rng.randint(0, 30))]
        k, n_max = rng.randint(1, 5), rng.randint(1, 4)
        expected = []
        for n in range(n_max, 0, -1):
            starts = [s for s in range(len(tokens) - n) if tokens[s:s + n] == tokens[len(tokens) - n:]]
            if starts:
                expected = tokens[starts[-1] + n:starts[-1] + n + k]
                break
        assert propose_lookup(tokens, k, n_max) == expected


def test_lookup_index_proposes_what_the_scan_does_as_a_row_grows():
    rng = random.Random(1)
    for _ in range(60):
        n_max, tokens = rng.randint(1, 4), []
        index = drafting.LookupIndex(n_max)
        for _ in range(rng.randint(1, 10)):
            tokens += [rng.randrange(3) for _ in range(rng.randint(0, 5))]
            index.update(tokens)
            for k in (1, 4):
                assert index.propose(k) == propose_lookup(tokens, k, n_max), (tokens, k)
    with pytest.raises(ValueError, match="only grow"):
        index.update([7] * (len(tokens) + 1))


def test_lookup_bad_arguments():
    with pytest.raises(ValueError, match="k=0"):
        propose_lookup([1, 2], 0)
    with pytest.raises(ValueError, match="max_ngram"):
        propose_lookup([1, 2], 2, max_ngram=0)


# ------------------------------------------------------------------------------------------------ greedy
def test_greedy_acceptance_is_plain_greedy_on_random_logits():
    gen = torch.Generator().manual_seed(0)
    rng = random.Random(0)
    for _ in range(300):
        k, vocab = rng.randint(0, 6), rng.randint(2, 9)
        logits = torch.randn(k + 1, vocab, generator=gen)
        best = logits.argmax(-1).tolist()
        agree = rng.randint(0, k)  # drafts equal to greedy's for a while, then (maybe) anything
        draft = best[:agree] + [rng.randrange(vocab) for _ in range(k - agree)]
        plain = []  # what greedy decoding writes, one token at a time, as long as the drafts were its tokens
        for i in range(k + 1):
            plain.append(best[i])
            if i == k or draft[i] != best[i]:
                break
        assert accept_greedy(draft, logits) == plain
        assert accept_greedy(draft, target_probs(logits, [], draft, temperature=0.0)) == plain  # one-hot rows


def test_verification_shapes_are_checked():
    with pytest.raises(ValueError, match=r"\[k \+ 1, V\] = \[3, V\]"):
        accept_greedy([1, 2], torch.zeros(2, 5))
    with pytest.raises(ValueError, match="outside"):
        accept_greedy([7], torch.zeros(2, 5))
    with pytest.raises(ValueError, match="draft_probs"):
        accept_sampled([1], torch.zeros(2, 5), torch.full((2, 5), 0.2))


# ------------------------------------------------------------------------------------------------ sampled
def _chi_square_critical(df: int, z: float = 3.719) -> float:
    """The chi-square quantile at 1 - 1e-4 (z = the normal quantile): scipy's when installed, else the
    Wilson-Hilferty approximation (within about 1% at these degrees of freedom)."""
    try:
        from scipy.stats import chi2

        return float(chi2.ppf(1 - 1e-4, df))
    except ImportError:
        return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def _chi_square(counts: dict, probs: dict, n: int) -> float:
    return sum((counts.get(cell, 0) - n * p) ** 2 / (n * p) for cell, p in probs.items())


# A tiny "language model": the next token's distribution depends on the previous token (a Markov chain over 3
# tokens), for the target (P) and for a deliberately different draft model (Q).
P = torch.tensor([[0.6, 0.3, 0.1], [0.1, 0.2, 0.7], [0.3, 0.4, 0.3]])
Q = torch.tensor([[0.2, 0.5, 0.3], [0.5, 0.4, 0.1], [0.1, 0.1, 0.8]])
LENGTH, START = 3, 0  # sequences of 3 tokens after token 0: 27 outcomes


def _speculative_sequence(gen: torch.Generator, k: int, deterministic: bool) -> tuple[int, ...]:
    """One LENGTH-token sequence by rounds of draft + ``accept_sampled``, as an engine would run them."""
    seq = [START]
    while len(seq) <= LENGTH:
        drafts, qs = [], []
        for _ in range(k):
            q = Q[(drafts or seq)[-1]]
            drafts.append(int(q.argmax()) if deterministic else int(torch.multinomial(q, 1, generator=gen)))
            qs.append(q)
        context = seq + drafts
        p = torch.stack([P[context[len(seq) - 1 + i]] for i in range(k + 1)])  # [k + 1, V]: after each prefix
        seq += accept_sampled(drafts, None if deterministic else torch.stack(qs), p, gen)
    return tuple(seq[1:LENGTH + 1])


def _exact() -> dict:
    probs = {}
    for seq in itertools.product(range(3), repeat=LENGTH):
        prev, prob = START, 1.0
        for t in seq:
            prob, prev = prob * float(P[prev, t]), t
        probs[seq] = prob
    return probs


def _statistic(k: int, deterministic: bool, n: int = 4000, seed: int = 0) -> float:
    gen = torch.Generator().manual_seed(seed)
    counts: dict = {}
    for _ in range(n):
        seq = _speculative_sequence(gen, k, deterministic)
        counts[seq] = counts.get(seq, 0) + 1
    return _chi_square(counts, _exact(), n)


@pytest.mark.parametrize("deterministic", [False, True], ids=["sampled-drafts", "deterministic-drafts"])
def test_speculative_sampling_reproduces_the_target_distribution(deterministic):
    # 4,000 sequences over 27 cells (the rarest expects ~24): a wrong rule shifts whole cells by far more (below).
    assert _statistic(k=2, deterministic=deterministic) < _chi_square_critical(26)


def test_the_chi_square_test_fails_with_a_wrong_residual(monkeypatch):
    """Resampling from p itself (not norm(max(0, p - q))) biases the output: the same test must reject it."""
    monkeypatch.setattr(acceptance, "residual_distribution", lambda p, q: p)
    assert _statistic(k=2, deterministic=False) > 3 * _chi_square_critical(26)
    monkeypatch.setattr(acceptance, "residual_distribution", lambda p, q: q)
    assert _statistic(k=2, deterministic=True) > 3 * _chi_square_critical(26)


def test_residual_distribution():
    p, q = torch.tensor([0.5, 0.3, 0.2]), torch.tensor([0.2, 0.5, 0.3])
    assert torch.equal(acceptance.residual_distribution(p, q), torch.tensor([1.0, 0.0, 0.0]))
    assert torch.equal(acceptance.residual_distribution(p, p), p)  # nothing left: p itself, never 0/0


def test_a_draft_the_target_rules_out_is_always_rejected_and_one_it_certainly_writes_kept():
    gen = torch.Generator().manual_seed(0)
    p = torch.tensor([[0.0, 0.5, 0.5], [1.0, 0.0, 0.0]])
    for _ in range(50):
        assert accept_sampled([0], None, p, gen)[0] in (1, 2)
    p = torch.tensor([[1.0, 0.0, 0.0], [0.0, 0.0, 1.0]])
    assert accept_sampled([0], torch.tensor([[0.1, 0.4, 0.5]]), p, gen) == [0, 2]


# ------------------------------------------------------------------------------------------------ target_probs
def test_target_probs_count_earlier_drafts_as_seen():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 6, generator=gen)
    settings = dict(temperature=0.8, top_k=4, top_p=0.9, repetition_penalty=1.7)
    probs = target_probs(logits, [0, 1], [2, 3], **settings)
    for i, seen_ids in enumerate(([0, 1], [0, 1, 2], [0, 1, 2, 3])):
        seen = torch.zeros(1, 6, dtype=torch.bool)
        seen[0, seen_ids] = True
        expected = sampling_probs(logits[i:i + 1], seen=seen, **settings)
        torch.testing.assert_close(probs[i:i + 1], expected, rtol=0, atol=0)
    assert torch.allclose(probs.sum(-1), torch.ones(3))


# ------------------------------------------------------------------------------------------------ controller
def test_controller_grows_shrinks_pauses_and_resumes():
    c = DraftController(k_start=2, k_max=4, off_below=0.3, smoothing=0.5, cooldown=3, max_cooldown=6)
    assert c.k() == 2
    c.update(2, 2)
    assert c.k() == 3  # all accepted: one more
    c.update(3, 1)
    assert c.k() == 2  # accepted + 1
    c.update(2, 0)  # rate 1 -> 1.0, 0.67, 0.33 ... still >= 0.3
    assert c.k() == 1
    c.update(1, 0)  # rate 0.17 < 0.3: pause for 3 steps
    assert [c.k() for _ in range(4)] == [0, 0, 0, 1]
    c.update(1, 0)  # failed again: a pause twice as long
    assert [c.k() for _ in range(7)] == [0] * 6 + [1]
    c.update(1, 1)
    c.update(2, 2)  # recovered: the short pause is back for the next failure
    assert c.pause == 3 and c.acceptance_rate == pytest.approx(6 / 12)
    c.update(0, 0)  # nothing drafted: nothing changes
    assert c.k() == 3


def test_controller_bad_settings():
    with pytest.raises(ValueError, match="k_start"):
        DraftController(k_start=9, k_max=8)
    with pytest.raises(ValueError, match="accepted"):
        DraftController().update(2, 3)


# ------------------------------------------------------------------------------------------------ models
SMALL = GPTConfig(vocab_size=11, context_length=48, emb_dim=16, n_heads=2, n_layers=2, drop_rate=0.0)
VARIANTS = {
    "gpt2": SMALL.replace(qkv_bias=True, tie_weights=True),
    "llama-style": SMALL.replace(norm="rmsnorm", ffn="swiglu", bias=False, pos_emb="rope"),
    "grouped-query": SMALL.replace(n_heads=4, n_kv_heads=2, pos_emb="rope"),
}


def _model(config, seed=0):
    torch.manual_seed(seed)
    return GPTModel(config).eval()


def _prompts(seed=0, count=4):
    rng = random.Random(seed)
    out = []
    for _ in range(count):  # a phrase repeated with small edits: the copy-heavy case prompt lookup is for
        phrase = [rng.randrange(SMALL.vocab_size) for _ in range(rng.randint(2, 5))]
        out.append((phrase * 4)[: rng.randint(5, 16)] + [rng.randrange(SMALL.vocab_size)])
    return out


@pytest.mark.parametrize("name", list(VARIANTS))
def test_speculative_greedy_equals_generate_greedy(name):
    model = _model(VARIANTS[name])
    drafter = DraftModel(_model(VARIANTS["gpt2"].replace(n_layers=1), seed=1))
    total_accepted = 0
    for prompt in _prompts(count=3):
        for settings in (dict(), dict(repetition_penalty=1.3), dict(eos_id=3), dict(stop=((4, 5), (6,)))):
            cfg = GenerationConfig(max_new_tokens=24, **settings)
            expected = generate(model, [prompt], cfg)
            for draft in ("lookup", "off", drafter):
                result = speculative_generate(model, prompt, cfg, draft=draft)
                assert result.tokens == expected.rows()[0], (draft, settings)
                assert result.finish_reason == expected.finish_reasons[0]
                if draft == "off":
                    assert result.drafted == 0 and result.target_forwards == len(result.tokens)
                total_accepted += result.accepted
    assert total_accepted > 50  # the drafts really ran and were often right


def test_draft_model_rolls_back_to_what_was_accepted():
    draft_model = _model(SMALL, seed=3)
    drafter = DraftModel(draft_model)
    tokens = [1, 2, 3, 4]
    drafts, probs = drafter.propose(tokens, 4)
    assert probs is None and drafts == generate(draft_model, [tokens], max_new_tokens=4).rows()[0]
    drafter.accept(1)  # the target kept 1 draft, then wrote its own token 9
    assert drafter.cached == tokens + drafts[:1]
    again, _ = drafter.propose(tokens + drafts[:1] + [9], 3)
    fresh, _ = DraftModel(draft_model).propose(tokens + drafts[:1] + [9], 3)
    assert again == fresh  # the rolled-back cache computes what a fresh one does
    assert drafter.propose(list(range(SMALL.context_length)), 3) == ([], None)  # no room left in its context


def test_sampled_draft_model_returns_the_distributions_it_drew_from():
    drafter = DraftModel(_model(SMALL, seed=3), temperature=0.9, top_k=5, generator=torch.Generator().manual_seed(0))
    drafts, probs = drafter.propose([1, 2, 3], 3)
    assert probs.shape == (3, SMALL.vocab_size) and torch.allclose(probs.sum(-1), torch.ones(3))
    assert all(probs[i, t] > 0 for i, t in enumerate(drafts)) and int((probs[0] > 0).sum()) == 5


def test_speculative_generate_bad_arguments():
    model = _model(SMALL)
    with pytest.raises(ValueError, match="does not fit"):
        speculative_generate(model, [1] * 40, GenerationConfig(max_new_tokens=10))
    with pytest.raises(ValueError, match="draft"):
        speculative_generate(model, [1], draft="ngram")
    with pytest.raises(ValueError, match="share the tokenizer"):
        speculative_generate(model, [1], draft=DraftModel(_model(SMALL.replace(vocab_size=12))))


TINY3 = GPTConfig(vocab_size=3, context_length=8, emb_dim=8, n_heads=2, n_layers=1)
PROMPT3 = [0, 1, 0, 1]  # "0 1" recurs: prompt lookup drafts from the first step


def _exact_continuations(model, prompt, temperature):
    """The model's exact probability of each of the 27 three-token continuations of ``prompt``."""
    exact = {}
    with torch.inference_mode():
        for seq in itertools.product(range(3), repeat=3):
            logits = model(torch.tensor([prompt + list(seq[:2])]))[0, len(prompt) - 1:]  # [3, V]
            probs = (logits / temperature).softmax(-1)
            exact[seq] = math.prod(float(probs[i, t]) for i, t in enumerate(seq))
    return exact


@pytest.mark.slow
def test_speculative_sampling_with_a_model_follows_its_distribution():
    """End to end on a 3-token vocabulary: 3 new tokens sampled with lookup drafts (and with a sampled draft
    model) against the exact probabilities of the 27 continuations, from the model's own forwards."""
    model = _model(TINY3, seed=5)
    exact = _exact_continuations(model, PROMPT3, 0.9)
    cfg = GenerationConfig(max_new_tokens=3, temperature=0.9)
    gen = torch.Generator().manual_seed(0)
    drafter = DraftModel(_model(TINY3, seed=6), temperature=0.9, generator=gen)
    n = 1000
    for draft in ("lookup", drafter):
        counts: dict = {}
        drafted = 0
        for _ in range(n):
            result = speculative_generate(model, PROMPT3, cfg, draft=draft, generator=gen,
                                          controller=DraftController(k_start=2))
            counts[tuple(result.tokens)] = counts.get(tuple(result.tokens), 0) + 1
            drafted += result.drafted
        assert drafted > n // 2  # drafts were verified in most runs
        assert _chi_square(counts, exact, n) < _chi_square_critical(26)


def test_verify_is_greedy_or_sampled_acceptance_on_the_processed_distributions():
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(3, 7, generator=gen)
    greedy = GenerationConfig(repetition_penalty=1.5)
    probs = target_probs(logits, [1, 2], [3, 4], temperature=0.0, repetition_penalty=1.5)
    assert acceptance.verify(logits, [1, 2], [3, 4], greedy) == accept_greedy([3, 4], probs)
    sampled = GenerationConfig(temperature=0.7, top_k=4)
    probs = target_probs(logits, [1, 2], [3, 4], temperature=0.7, top_k=4)
    got = acceptance.verify(logits, [1, 2], [3, 4], sampled, generator=torch.Generator().manual_seed(9))
    assert got == accept_sampled([3, 4], None, probs, torch.Generator().manual_seed(9))


# ------------------------------------------------------------------------------------------------ engine wiring
def _generate_speculates() -> bool:
    import dataclasses

    return "speculative_tokens" in {f.name for f in dataclasses.fields(GenerationConfig)}


needs_engine = pytest.mark.skipif(not _generate_speculates(), reason="generate has no speculative_tokens setting")


@needs_engine
@pytest.mark.parametrize("name", list(VARIANTS))
def test_generate_with_prompt_lookup_equals_plain_greedy(name):
    model = _model(VARIANTS[name])
    prompts = _prompts(seed=1, count=4)
    for settings in (dict(), dict(eos_id=3), dict(stop=((4, 5), (6,)))):
        plain = generate(model, prompts, max_new_tokens=20, **settings)
        for k in (1, 3, 6):
            spec = generate(model, prompts, max_new_tokens=20, speculative_tokens=k, **settings)
            assert spec.rows() == plain.rows(), (k, settings)
            assert spec.finish_reasons == plain.finish_reasons
        for prompt, row in zip(prompts, plain.rows()):  # and the reference loop agrees with both
            cfg = GenerationConfig(max_new_tokens=20, **settings)
            assert speculative_generate(model, prompt, cfg, draft="lookup").tokens == row


@needs_engine
@pytest.mark.parametrize("overflow", ["slide", "shift", "error"])
def test_drafts_at_the_end_of_the_context_change_nothing(overflow):
    """Prompts that end near C (and, under slide/shift, continuations that pass it): a draft must never write past
    the context nor change which tokens come out."""
    model = _model(VARIANTS["gpt2"])
    context = SMALL.context_length
    phrase = [1, 2, 3, 4, 5]
    prompts = [(phrase * 10)[:context - 9], (phrase * 10)[:context - 2], (phrase * 10)[:context - 6] + [7]]
    new = 8 if overflow == "error" else 20
    if overflow == "error":
        prompts = [p[: context - new + 1] for p in prompts]
    plain = generate(model, prompts, max_new_tokens=new, overflow=overflow)
    for k in (2, 5):
        spec = generate(model, prompts, max_new_tokens=new, overflow=overflow, speculative_tokens=k)
        assert spec.rows() == plain.rows(), k


@needs_engine
@pytest.mark.slow
@pytest.mark.parametrize("drafts", ["lookup", "draft-model"])
def test_generate_sampling_with_drafts_follows_the_models_distribution(drafts):
    """Sampled rows that verify drafts (``accept_sampled``: prompt lookup's, or a draft model's greedy ones) must
    keep the model's distribution: 2,000 seeded rows of 3 new tokens against the exact probabilities of the 27
    continuations."""
    model = _model(TINY3, seed=5)
    draft_model = _model(TINY3, seed=6) if drafts == "draft-model" else None
    exact = _exact_continuations(model, PROMPT3, 0.9)
    counts: dict = {}
    for seed in (0, 1000, 2000, 3000):  # row i of a batch draws with seed + i: no row repeats another's seed
        for row in generate(model, [PROMPT3] * 500, max_new_tokens=3, temperature=0.9, seed=seed,
                            speculative_tokens=2, draft_model=draft_model).rows():
            counts[tuple(row)] = counts.get(tuple(row), 0) + 1
    assert _chi_square(counts, exact, 2000) < _chi_square_critical(26)
