import math

import pytest
import torch

from tinygpt import GELU, FeedForward, GPTConfig, LayerNorm, MultiHeadAttention, TransformerBlock, get_config
from tinygpt.layers import gelu_tanh_formula


def test_layernorm_biased_variance_example():
    ln = LayerNorm(2, eps=0.0)
    out = ln(torch.tensor([[1.0, 3.0]], dtype=torch.float64))
    torch.testing.assert_close(out, torch.tensor([[-1.0, 1.0]], dtype=torch.float64))


def test_layernorm_normalises_each_position_separately():
    torch.manual_seed(0)
    x = torch.randn(3, 5, 8, dtype=torch.float64) * 4 + 2
    out = LayerNorm(8)(x)
    assert out.shape == x.shape
    torch.testing.assert_close(out.mean(-1), torch.zeros(3, 5, dtype=torch.float64), atol=1e-12, rtol=0)
    torch.testing.assert_close(out.var(-1, unbiased=False), torch.ones(3, 5, dtype=torch.float64), atol=1e-4, rtol=0)
    torch.testing.assert_close(out, torch.nn.functional.layer_norm(x, (8,), eps=1e-5))
    # changing one position leaves the others unchanged
    y = x.clone()
    y[0, 0] += 10
    torch.testing.assert_close(LayerNorm(8)(y)[0, 1:], out[0, 1:])


def test_layernorm_parameters_start_at_one_and_zero():
    ln = LayerNorm(5)
    assert torch.equal(ln.scale.data, torch.ones(5)) and torch.equal(ln.shift.data, torch.zeros(5))


def test_gelu_is_the_tanh_formula():
    x = torch.linspace(-6, 6, 1001, dtype=torch.float64)
    torch.testing.assert_close(GELU()(x), gelu_tanh_formula(x), atol=1e-14, rtol=0)
    c = math.sqrt(2 / math.pi)
    assert gelu_tanh_formula(torch.tensor(1.0, dtype=torch.float64)).item() == pytest.approx(
        0.5 * (1 + math.tanh(c * (1 + 0.044715))), abs=1e-15)
    # GELU lets small negative inputs through, unlike ReLU
    assert GELU()(torch.tensor(-0.5)).item() < 0


def test_feedforward_widths():
    ff = FeedForward(get_config("tiny"))
    assert ff.layers[0].weight.shape == (64, 16) and ff.layers[2].weight.shape == (16, 64)
    assert ff(torch.randn(2, 3, 16)).shape == (2, 3, 16)


def test_attention_keeps_no_mask_buffer():
    # The causal mask is built per call for the call's positions: no [C, C] tensor per layer, whatever C is.
    att = MultiHeadAttention(get_config("tiny", context_length=4096))
    assert list(att.buffers()) == []
    assert set(att.state_dict()) == {"qkv.weight", "out_proj.weight", "out_proj.bias"}
    assert att.qkv.weight.shape == (48, 16) and att.qkv.bias is None
    assert MultiHeadAttention(get_config("tiny", qkv_bias=True)).qkv.bias.shape == (48,)


def test_attention_weights_are_causal_and_fast_path_agrees():
    torch.manual_seed(1)
    att = MultiHeadAttention(get_config("tiny")).eval()
    x = torch.randn(2, 7, 16)
    out, weights = att(x, return_weights=True)
    assert weights.shape == (2, 4, 7, 7)
    upper = torch.triu(torch.ones(7, 7, dtype=torch.bool), diagonal=1)
    assert (weights[..., upper] == 0).all()
    torch.testing.assert_close(weights.sum(-1), torch.ones(2, 4, 7))
    torch.testing.assert_close(att(x), out, atol=1e-6, rtol=0)


def test_attention_is_causal_future_tokens_do_not_change_the_past():
    torch.manual_seed(2)
    att = MultiHeadAttention(get_config("tiny")).eval()
    x = torch.randn(1, 8, 16)
    y = x.clone()
    y[:, 5:] = torch.randn(1, 3, 16)
    torch.testing.assert_close(att(x)[:, :5], att(y)[:, :5])


def test_attention_dropout_uses_its_own_rate():
    att = MultiHeadAttention(get_config("tiny", drop_rate=0.0, drop_rate_attn=0.5))
    assert att.dropout.p == 0.5 and not hasattr(att, "dropout_p")  # one stored rate, read by both paths
    att.train()
    x = torch.randn(1, 6, 16)
    torch.manual_seed(0)
    a = att(x)
    torch.manual_seed(1)
    assert not torch.allclose(a, att(x))


def block_reference(block, x):
    """The two block orders written out once more, independently of TransformerBlock.forward."""
    if block.pre_ln:
        u = x + block.att(block.norm1(x))
        return u + block.ff(block.norm2(u))
    u = block.norm1(x + block.att(x))
    return block.norm2(u + block.ff(u))


@pytest.mark.parametrize("pre_ln", [True, False])
def test_block_orders(pre_ln):
    torch.manual_seed(3)
    config = GPTConfig(vocab_size=10, context_length=8, emb_dim=16, n_heads=4, n_layers=1, pre_ln=pre_ln)
    block = TransformerBlock(config).eval()
    with torch.no_grad():
        for p in block.parameters():
            p.add_(0.1 * torch.randn_like(p))
    x = torch.randn(2, 8, 16, dtype=torch.float32)
    torch.testing.assert_close(block(x), block_reference(block, x))


def test_pre_and_post_ln_differ_with_the_same_weights():
    config = GPTConfig(vocab_size=10, context_length=16, emb_dim=384, n_heads=6, n_layers=1)
    torch.manual_seed(4)
    pre = TransformerBlock(config, pre_ln=True).eval()
    post = TransformerBlock(config, pre_ln=False).eval()
    post.load_state_dict(pre.state_dict())
    x = torch.randn(2, 16, 384)
    assert not torch.allclose(pre(x), post(x))
    # post-LN output is normalised per position; pre-LN output is not
    torch.testing.assert_close(post(x).mean(-1), torch.zeros(2, 16), atol=1e-5, rtol=0)


def test_block_dropouts_are_independent():
    block = TransformerBlock(get_config("tiny", drop_rate_shortcut=0.2, drop_rate_attn=0.4))
    assert block.drop_shortcut.p == 0.2 and block.att.dropout.p == 0.4


@pytest.mark.parametrize("bias", [True, False])
def test_layernorm_forward_is_the_written_out_formula(bias):
    from tinygpt.layers import layer_norm_formula

    torch.manual_seed(0)
    ln = LayerNorm(7, bias=bias).double()
    with torch.no_grad():
        ln.scale.add_(torch.randn(7, dtype=torch.float64))
        if bias:
            ln.shift.add_(torch.randn(7, dtype=torch.float64))
    x = (3 * torch.randn(2, 5, 7, dtype=torch.float64) + 1).requires_grad_()
    fused = ln(x)
    formula = layer_norm_formula(x, ln.scale, ln.shift, ln.eps)
    torch.testing.assert_close(fused, formula, rtol=0, atol=1e-12)
    grads = torch.autograd.grad(fused.square().sum(), [x, ln.scale])
    grads_formula = torch.autograd.grad(formula.square().sum(), [x, ln.scale])
    for g, h in zip(grads, grads_formula):
        torch.testing.assert_close(g, h, rtol=0, atol=1e-10)


def test_causal_mask_needs_no_tensor_for_a_plain_forward_or_a_decode_step():
    from tinygpt.layers import causal_mask

    assert causal_mask(0, 4, 4) is None  # plain causal: SDPA's is_causal
    assert causal_mask(5, 1, 6) is None  # one query after 5 cached keys: it sees all 6
    torch.testing.assert_close(causal_mask(0, 4, 4, explicit=True), torch.ones(4, 4, dtype=torch.bool).tril())
    assert causal_mask(5, 1, 6, explicit=True).tolist() == [[True] * 6]


def test_causal_mask_of_a_chunk_after_cached_keys_is_relative_to_absolute_positions():
    from tinygpt.layers import causal_mask

    # queries at positions 3 and 4 over keys 0..4: query 3 must not see key 4
    assert causal_mask(3, 2, 5).tolist() == [[True, True, True, True, False], [True] * 5]


def test_blocks_attend_through_their_layers_cache():
    from tinygpt import KVCache

    config = get_config("tiny")
    block = TransformerBlock(config).eval()
    x = torch.randn(1, 5, config.emb_dim)
    cache = KVCache(config, 1)
    with torch.no_grad():
        cache.layers[0].start = 0
        first = block(x[:, :3], None, cache.layers[0])
        cache.layers[0].start = 3  # what ``KVCache.begin(idx, 3)`` sets for every layer
        rest = block(x[:, 3:], None, cache.layers[0])
        whole = block(x)
    torch.testing.assert_close(torch.cat((first, rest), 1), whole, rtol=0, atol=1e-6)
    assert torch.count_nonzero(cache.keys[0][:, :, :5]) > 0 and torch.count_nonzero(cache.keys[1]) == 0
