"""scoring.score_rows: the batched window scores equal a plain full forward's log-softmax, row by row."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tinygpt import GPTConfig, GPTModel, generate_greedy
from tinygpt.evaluation.scoring import score_rows


def _rows(vocab: int, seed: int) -> list[tuple[list[int], int]]:
    """Questions with 3 choices each (a shared context of varied length) and rows of their own, mixed together."""
    g = torch.Generator().manual_seed(seed)

    def ids(n: int) -> list[int]:
        return torch.randint(0, vocab, (n,), generator=g).tolist()

    rows = []
    for length in (2, 5, 9, 13, 3):
        context = ids(length)
        rows += [(context + ids(k), k) for k in (1, 4, 2)]
    rows += [(ids(t), n) for t, n in ((25, 24), (7, 1), (12, 5), (2, 1))]
    g2 = torch.Generator().manual_seed(seed + 1)
    order = torch.randperm(len(rows), generator=g2).tolist()
    return [rows[i] for i in order]


def _reference(model: GPTModel, tokens: list[int], n: int) -> tuple[float, bool]:
    with torch.no_grad():
        logp = F.log_softmax(model(torch.tensor([tokens[:-1]]))[0], dim=-1)  # [T, V]
    positions = range(len(tokens) - 1 - n, len(tokens) - 1)
    return (sum(logp[i, tokens[i + 1]].item() for i in positions),
            all(int(logp[i].argmax()) == tokens[i + 1] for i in positions))


@pytest.mark.parametrize("pos_emb", ["learned", "rope"])
@pytest.mark.parametrize("batch_size", [1, 4, 64])
def test_scores_equal_a_full_forward(pos_emb, batch_size):
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=11, context_length=24, emb_dim=16, n_heads=2, n_layers=2, pos_emb=pos_emb)
    model = GPTModel(config).eval()
    rows = _rows(config.vocab_size, seed=3)
    context = rows[0][0][:-rows[0][1]]
    greedy_row = generate_greedy(model, torch.tensor([context]), 3)[0].tolist()  # its 3 new tokens are all argmax
    rows.insert(2, (greedy_row, 3))
    scores = score_rows(model, rows, batch_size=batch_size)
    greedy_seen = set()
    for (tokens, n), score in zip(rows, scores):
        logprob, greedy = _reference(model, tokens, n)
        assert score.logprob == pytest.approx(logprob, abs=1e-5)
        assert score.greedy == greedy
        greedy_seen.add(greedy)
    assert greedy_seen == {True, False}


def test_model_mode_is_restored_and_dropout_is_off():
    torch.manual_seed(0)
    model = GPTModel(GPTConfig(vocab_size=11, context_length=24, emb_dim=16, n_heads=2, n_layers=1, drop_rate=0.5))
    model.train()
    rows = _rows(11, seed=5)
    first, second = score_rows(model, rows), score_rows(model, rows)
    assert model.training
    assert [s.logprob for s in first] == [s.logprob for s in second]


@pytest.mark.parametrize("rows, message", [
    ([([1, 2, 3], 3)], "at least 4 tokens"),
    ([([1, 2], 0)], "at least 1 tokens"),
    ([(list(range(11)) * 3, 2)], "more than its context_length=24"),
])
def test_bad_rows_are_value_errors(rows, message):
    model = GPTModel(GPTConfig(vocab_size=11, context_length=24, emb_dim=16, n_heads=2, n_layers=1))
    with pytest.raises(ValueError, match=message):
        score_rows(model, rows)
