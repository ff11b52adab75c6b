import math

import numpy as np
import pytest
import torch

from tinygpt import GPTConfig, GPTModel
from tinygpt.training import flops_per_token, unigram_entropy
from tinygpt.training.metrics import peak_flops


def test_flops_per_token_is_6n_plus_attention():
    config = GPTConfig(vocab_size=100, context_length=32, emb_dim=48, n_heads=4, n_layers=3, tie_weights=True)
    model = GPTModel(config)
    embeddings = model.tok_emb.weight.numel() + model.pos_emb.weight.numel()
    matmul_weights = model.num_parameters() - embeddings + model.out_head.weight.numel()  # the tied head multiplies
    assert flops_per_token(config) == 6 * matmul_weights + 12 * 3 * 32 * 48


def test_unigram_entropy():
    assert math.isclose(unigram_entropy(np.arange(64, dtype=np.uint16) % 8, 8), math.log(8))
    assert unigram_entropy(np.zeros(10, dtype=np.uint16), 4) == 0.0
    tokens = np.array([0, 0, 0, 1], dtype=np.uint16)
    expected = -(0.75 * math.log(0.75) + 0.25 * math.log(0.25))
    assert math.isclose(unigram_entropy(tokens, 2, chunk=3), expected)  # chunked counting adds up


def test_peak_flops():
    assert peak_flops(torch.device("cpu")) is None  # no guess for CPUs
    assert peak_flops(torch.device("cpu"), 2.5) == 2.5e12
    with pytest.raises(ValueError, match="peak_tflops"):
        peak_flops(torch.device("cpu"), 0.0)
