"""The Inspect view's data: exact causal attention of every head, next-token tables, a logit lens whose last row is
the model's prediction, and a size bounded by the context."""

from __future__ import annotations

import pytest
import torch

from serving_support import tiny_model, tokenizer
from tinygpt.serving.inspect import inspect_text


def test_every_head_is_causal_rows_sum_to_one_and_the_lens_ends_at_the_prediction():
    model = tiny_model(context_length=32)
    ids = tokenizer().encode("The quick brown fox jumps")
    out = inspect_text(model, tokenizer(), ids, layer=1, top=3, logit_lens=True)
    n = len(ids)
    assert [t["id"] for t in out["tokens"]] == ids and out["n_layers"] == 2 and out["n_heads"] == 2
    attention = torch.tensor(out["attention"])  # [H, T, T]
    assert attention.shape == (2, n, n)
    assert torch.equal(attention.triu(1), torch.zeros_like(attention))  # the future: exactly 0
    torch.testing.assert_close(attention.sum(-1), torch.ones(2, n), atol=1e-5, rtol=0)  # 6-decimal rounding
    with torch.no_grad():
        probs = model(torch.tensor([ids]))[0].softmax(-1)  # [T, V]
    assert [row[0]["id"] for row in out["next"]] == probs.argmax(-1).tolist()
    assert len(out["lens"]) == 2 and all(len(row) == n for row in out["lens"])
    assert [c["id"] for c in out["lens"][-1]] == probs.argmax(-1).tolist()  # after the last block: the output
    for c, p in zip(out["lens"][-1], probs.max(-1).values.tolist()):
        assert c["prob"] == pytest.approx(p, abs=1e-6)


def test_the_answer_is_bounded_by_the_context():
    model = tiny_model(context_length=8)
    ids = tokenizer().encode("The quick brown fox jumps over the lazy dog")
    assert len(ids) > 8
    with pytest.raises(ValueError, match="1 to 8 token ids"):
        inspect_text(model, tokenizer(), ids, layer=0, top=2, logit_lens=False)
    out = inspect_text(model, tokenizer(), ids[:8], layer=0, top=2, logit_lens=False)
    assert len(out["attention"][0]) == 8 and "lens" not in out
