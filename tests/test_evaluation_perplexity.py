"""Sliding-window perplexity: each token scored once, and the same loss as Hugging Face's own recipe on the export."""

from __future__ import annotations

import math

import pytest
import torch

from tinygpt import GPTConfig, GPTModel, load_checkpoint_tokenizer, load_model
from tinygpt.evaluation import perplexity, sliding_windows, text_tokens
from tinygpt.tokenizer import CharTokenizer

from conftest import VERDICT


@pytest.mark.parametrize("n, window, stride", [(100, 16, 5), (100, 16, 16), (16, 16, 4), (37, 10, 9)])
def test_windows_score_each_token_once_with_the_promised_context(n, window, stride):
    scored = []
    for k, (begin, end, count) in enumerate(sliding_windows(n, window, stride)):
        assert end - begin <= window and end - count > begin  # a scored token has context inside its window
        if k > 0 and stride < window:
            assert end - count - begin >= window - stride  # at least window - stride tokens of context
        scored += range(end - count, end)
    assert len(scored) == len(set(scored))
    if stride < window:
        assert scored == list(range(1, n))  # every token but the first (which only gives context)


def test_windows_reject_a_text_shorter_than_one_window():
    with pytest.raises(ValueError, match="shorter than one window of 16"):
        sliding_windows(15, 16, 8)
    with pytest.raises(ValueError, match="stride=17"):
        sliding_windows(40, 16, 17)


def _hf_sliding_window_loss(hf_model, ids: list[int], window: int, stride: int) -> float:
    """Hugging Face's "Perplexity of fixed-length models" loop; each window's mean loss is weighted by the labels
    it really scored: the model shifts them by one, so the first label of a window never counts."""
    encodings = torch.tensor([ids])
    seq_len = encodings.size(1)
    nll_sum, n_tokens, prev_end_loc = 0.0, 0, 0
    for begin_loc in range(0, seq_len, stride):
        end_loc = min(begin_loc + window, seq_len)
        trg_len = end_loc - prev_end_loc
        input_ids = encodings[:, begin_loc:end_loc]
        target_ids = input_ids.clone()
        target_ids[:, :-trg_len] = -100
        with torch.no_grad():
            loss = hf_model(input_ids, labels=target_ids).loss
        num_valid = (target_ids[:, 1:] != -100).sum().item()
        nll_sum += loss.item() * num_valid
        n_tokens += num_valid
        prev_end_loc = end_loc
        if end_loc == seq_len:
            break
    return nll_sum / n_tokens


@pytest.fixture(scope="module")
def hf_model(eval_model_dirs):
    transformers = pytest.importorskip("transformers")
    return transformers.GPT2LMHeadModel.from_pretrained(eval_model_dirs[1]).eval()


@pytest.mark.parametrize("window, stride", [(64, 16), (64, 64), (40, 25)])
def test_equals_hugging_face_sliding_window_on_the_export(eval_model_dirs, hf_model, window, stride):
    ours_dir = eval_model_dirs[0]
    model, tokenizer = load_model(ours_dir), load_checkpoint_tokenizer(ours_dir)
    text = VERDICT.read_text(encoding="utf-8")[:2500]
    ids, n_bytes = text_tokens(tokenizer, text)
    assert ids[0] == tokenizer.eot_id and n_bytes == len(text.encode("utf-8"))
    result = perplexity(model, ids, window=window, stride=stride, n_bytes=n_bytes, batch_size=3)
    expected = _hf_sliding_window_loss(hf_model, ids, window, stride)
    assert result.loss == pytest.approx(expected, abs=1e-5)
    assert result.perplexity == pytest.approx(math.exp(result.loss))
    assert result.bits_per_byte == pytest.approx(result.tokens * result.loss / (math.log(2) * n_bytes))
    if stride < window:
        assert result.tokens == len(ids) - 1


def test_a_tokenizer_without_end_of_text_scores_all_but_the_first_token():
    torch.manual_seed(0)
    tokenizer = CharTokenizer("abcdefgh ")
    model = GPTModel(GPTConfig(vocab_size=tokenizer.vocab_size, context_length=16, emb_dim=16, n_heads=2,
                               n_layers=1))
    ids, n_bytes = text_tokens(tokenizer, "abc defgh " * 4)
    assert n_bytes == 39 and len(ids) == 40
    result = perplexity(model, ids, window=16, stride=8, n_bytes=n_bytes)
    assert result.tokens == 39 and result.window == 16 and result.stride == 8
    assert result.loss == pytest.approx(-math.log(1 / 9), rel=0.2)  # near-uniform at init: ln V
    with pytest.raises(ValueError, match="longer than the model's context_length=16"):
        perplexity(model, ids, window=17)
