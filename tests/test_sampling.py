"""The logits processors: exact filters, the penalty formula, and draws that follow the tempered softmax."""

import pytest
import torch

from tinygpt.sampling import apply_repetition_penalty, next_tokens, top_k_filter, top_p_filter


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    yield


def test_top_k_keeps_exactly_k_tokens_even_when_values_tie():
    logits = torch.tensor([[1.0, 3.0, 3.0, 3.0, 0.5, 3.0], [5.0, 4.0, 3.0, 2.0, 1.0, 0.0]])
    kept = torch.isfinite(top_k_filter(logits, 2))
    assert kept.sum(dim=-1).tolist() == [2, 2]
    assert not kept[0, [0, 4]].any()  # only tied maxima were kept
    assert kept[1].tolist() == [True, True, False, False, False, False]
    assert torch.equal(top_k_filter(logits, 6), logits)


def test_top_p_keeps_the_smallest_nucleus_reaching_p():
    probs = torch.tensor([[0.05, 0.5, 0.2, 0.25]])
    logits = probs.log()
    kept = lambda p: torch.isfinite(top_p_filter(logits, p))[0].tolist()  # noqa: E731
    assert kept(0.5) == [False, True, False, False]  # 0.5 alone reaches 0.5
    assert kept(0.51) == [False, True, False, True]
    assert kept(0.95) == [False, True, True, True]
    assert kept(0.96) == [True, True, True, True]
    assert kept(1e-9) == [False, True, False, False]  # the most likely token always stays
    assert torch.equal(top_p_filter(logits, 1.0), logits)


def test_repetition_penalty_is_ctrls_formula():
    logits = torch.tensor([[2.0, -2.0, 2.0, -2.0]])
    seen = torch.tensor([[True, True, False, False]])
    assert apply_repetition_penalty(logits, seen, 2.0).tolist() == [[1.0, -4.0, 2.0, -2.0]]


def _draw(logits, n, **settings):
    defaults = dict(temperature=1.0, top_k=None, top_p=1.0, repetition_penalty=1.0, seen=None)
    gen = torch.Generator().manual_seed(0)
    return next_tokens(logits.expand(n, -1), generator=gen, **{**defaults, **settings})


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_draws_follow_the_tempered_softmax(temperature):
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, 0.5]])
    n = 40_000
    counts = torch.bincount(_draw(logits, n, temperature=temperature), minlength=5).double() / n
    expected = torch.softmax(logits[0].double() / temperature, dim=-1)
    assert (counts - expected).abs().max().item() < 0.015  # ~4 standard errors at n = 40k


def test_filters_restrict_the_draws_and_zero_temperature_is_argmax():
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0, 0.5]])
    assert set(_draw(logits, 2000, top_k=2).tolist()) == {0, 1}
    assert set(_draw(logits, 2000, top_p=0.6).tolist()) == {0, 1}  # softmax: 0.48, 0.18, ...
    assert set(_draw(logits, 50, temperature=0.0).tolist()) == {0}
    seen = torch.tensor([[True, False, False, False, False]])
    assert set(_draw(logits, 50, temperature=0.0, repetition_penalty=3.0, seen=seen.expand(50, -1)).tolist()) == {1}


def test_sampling_probs_is_the_distribution_next_tokens_draws_from():
    from tinygpt.sampling import sampling_probs

    logits = torch.randn(4, 9, generator=torch.Generator().manual_seed(0))
    seen = torch.zeros(4, 9, dtype=torch.bool)
    seen[:, :3] = True
    for settings in (dict(temperature=0.7, top_k=5, top_p=0.8, repetition_penalty=1.5),
                     dict(temperature=1.3, top_k=None, top_p=1.0, repetition_penalty=1.0)):
        probs = sampling_probs(logits, seen=seen, **settings)
        assert torch.allclose(probs.sum(-1), torch.ones(4))
        drawn = next_tokens(logits, seen=seen, generator=torch.Generator().manual_seed(3), **settings)
        again = torch.multinomial(probs, 1, generator=torch.Generator().manual_seed(3)).squeeze(-1)
        assert torch.equal(drawn, again)  # same distribution, same draws
    greedy = dict(temperature=0.0, top_k=None, top_p=1.0, repetition_penalty=2.0)
    one_hot = sampling_probs(logits, seen=seen, **greedy)
    assert torch.equal(one_hot.argmax(-1), next_tokens(logits, seen=seen, generator=None, **greedy))
    assert torch.equal(one_hot.sum(-1), torch.ones(4)) and int((one_hot > 0).sum()) == 4
