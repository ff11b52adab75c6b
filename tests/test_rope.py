"""tinygpt.rope: rotary position embeddings, alone and inside the model (cached decoding, per-row positions)."""

import pytest
import torch

from tinygpt import GPTModel, KVCache, get_config
from tinygpt.rope import RotaryEmbedding, apply_rope


def llama_config(**overrides):
    return get_config("llama-tiny", **overrides)


def test_rope_rotates_pairs_and_scores_depend_on_offsets_only():
    rope = RotaryEmbedding(8, theta=100.0)
    q, k = torch.randn(1, 2, 1, 8, dtype=torch.float64), torch.randn(1, 2, 1, 8, dtype=torch.float64)

    def rotated(x, pos):
        cos, sin = rope(torch.tensor([pos]), torch.float64)
        return apply_rope(x, cos, sin)

    torch.testing.assert_close(rotated(q, 0), q, rtol=0, atol=0)  # position 0: no rotation
    torch.testing.assert_close(rotated(q, 7).norm(dim=-1), q.norm(dim=-1))  # a rotation keeps lengths
    score = (rotated(q, 9) * rotated(k, 4)).sum(-1)
    torch.testing.assert_close((rotated(q, 25) * rotated(k, 20)).sum(-1), score, rtol=0, atol=1e-6)
    # Pair (0, 4) at position 1 turns by exactly 1 radian (theta^0): the rotate_half convention.
    e0 = torch.zeros(1, 1, 1, 8, dtype=torch.float64)
    e0[..., 0] = 1
    expected = torch.zeros(8, dtype=torch.float64)
    expected[0], expected[4] = torch.tensor(1.0, dtype=torch.float64).cos(), torch.tensor(1.0).double().sin()
    torch.testing.assert_close(rotated(e0, 1).flatten(), expected, rtol=0, atol=1e-7)


@pytest.mark.parametrize("prefill", [1, 4, 9])
def test_rope_with_cache_at_any_pos_equals_the_full_forward(prefill):
    config = llama_config(qkv_bias=True, bias=True)
    model = GPTModel(config).double().eval()
    idx = torch.randint(0, config.vocab_size, (2, 14))
    with torch.no_grad():
        full = model(idx)
        cache = KVCache(config, 2, dtype=torch.float64)
        parts = [model(idx[:, :prefill], cache=cache)]
        pos = prefill
        for step in (1, 3, 1):  # decode steps of several lengths
            parts.append(model(idx[:, pos:pos + step], cache=cache, pos=pos))
            pos += step
    torch.testing.assert_close(torch.cat(parts, 1), full[:, :pos], rtol=0, atol=1e-12)


