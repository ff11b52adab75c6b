"""Several adapters on one base in one batch: each row computes what its adapter's merged model computes."""

from __future__ import annotations

import pytest
import torch

from lora_support import clone as _clone
from lora_support import trained_adapter as _trained_adapter
from tinygpt import GPTConfig, GPTModel, generate_greedy, lora
from tinygpt.multi_lora import attach_adapters, use_adapters

CONFIG = GPTConfig(vocab_size=60, context_length=32, emb_dim=32, n_heads=4, n_layers=2, qkv_bias=True)


def test_rows_with_different_adapters_in_one_batch_equal_their_merged_models():
    torch.manual_seed(0)
    base = GPTModel(CONFIG).eval()
    a, a_parts = _trained_adapter(base, lora.LoRAConfig(r=4, alpha=8), seed=1)
    b, b_parts = _trained_adapter(base, lora.LoRAConfig(r=2, alpha=4, targets=("qkv", "ffn_in", "ffn_out")), seed=2)
    merged = {"a": lora.merged_model(a), "b": lora.merged_model(b), None: _clone(base)}
    served = _clone(base)
    assert attach_adapters(served, {"a": a_parts, "b": b_parts}) == ["a", "b"]
    ids = torch.randint(0, 60, (3, 7), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        with use_adapters(served, torch.tensor([1, -1, 0])):
            logits = served(ids)
        for row, name in enumerate(["b", None, "a"]):
            torch.testing.assert_close(logits[row], merged[name](ids[row : row + 1])[0], rtol=0, atol=1e-5)
        assert (merged["a"](ids) - merged[None](ids)).abs().max() > 1e-2  # the adapters do change the logits
        # per token: a packed row holding two requests, the first 4 positions of adapter a, the rest of b
        with use_adapters(served, torch.tensor([[0, 0, 0, 0, 1, 1, 1]])):
            packed = served(ids[:1])
        torch.testing.assert_close(packed[0, :4], merged["a"](ids[:1, :4])[0], rtol=0, atol=1e-5)
    # greedy generation with one adapter for the whole (uncached) loop = its merged model's; the engine's packed
    # batches carry a per-row adapter instead (tests/test_inference_runner.py)
    for k, name in [(0, "a"), (1, "b"), (-1, None)]:
        prompt = torch.tensor([[5, 9, 2]])
        with use_adapters(served, torch.tensor([k])):
            got = generate_greedy(served, prompt, max_new_tokens=8)
        assert got.tolist() == generate_greedy(merged[name], prompt, max_new_tokens=8).tolist()
    with torch.no_grad():  # outside the block: the base
        torch.testing.assert_close(served(ids), merged[None](ids), rtol=0, atol=1e-6)


def test_errors():
    base = GPTModel(CONFIG).eval()
    _, parts = _trained_adapter(base, lora.LoRAConfig(r=2), seed=0)
    served = _clone(base)
    attach_adapters(served, {"a": parts})
    with pytest.raises(ValueError, match="out of range"):
        with use_adapters(served, torch.tensor([1])):
            pass
    with pytest.raises(ValueError, match="adapter index has shape"):
        with torch.no_grad(), use_adapters(served, torch.tensor([0, 0])):
            served(torch.zeros(3, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="no adapters attached"):
        with use_adapters(base, torch.tensor([0])):
            pass
    _, q = _trained_adapter(base, lora.LoRAConfig(r=2, quantize="nf4"), seed=0)
    with pytest.raises(ValueError, match="NF4 base"):
        attach_adapters(_clone(base), {"q": q})
