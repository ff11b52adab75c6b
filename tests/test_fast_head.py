"""tinygpt.fast.head: the output head's kernel choice gives the plain linear's logits."""

import contextlib

import pytest
import torch

from tinygpt import GPTConfig, GPTModel, fast


@pytest.mark.parametrize("onednn", [True, False], ids=["onednn", "blas"])
def test_inference_head_gives_the_same_logits(onednn):
    # With oneDNN the head is fast.linear's product; without it, the BLAS product into 64-float-aligned rows.
    if onednn and not fast.onednn.available():
        pytest.skip("this torch has no oneDNN linear")
    switch = contextlib.nullcontext() if onednn else fast.disabled("onednn")
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=321, context_length=48, emb_dim=32, n_heads=4, n_layers=2)
    model = GPTModel(config).eval()
    idx = torch.randint(0, 321, (3, 48))
    trained = model(idx)  # autograd on: the plain linear, contiguous [B, T, V]
    with torch.inference_mode(), switch:
        logits = model(idx)
        last = model(idx, last_only=True)
        plain = torch.nn.functional.linear(model.hidden_states(idx), model.out_head.weight)
    assert logits.shape == (3, 48, 321) and last.shape == (3, 1, 321)
    if not onednn:
        assert logits.stride(1) % 64 == 0 and logits.stride(1) >= 321  # rows padded; only V columns visible
    assert trained.is_contiguous()
    torch.testing.assert_close(logits, plain, rtol=0, atol=1e-5)
    torch.testing.assert_close(logits, trained.detach(), rtol=0, atol=1e-5)
    torch.testing.assert_close(last, plain[:, -1:], rtol=0, atol=1e-5)
