"""LLaMA-style variants of the config, the layers and the model: RMSNorm, SwiGLU, bias-free linears, grouped-query
attention, no position table. RoPE itself: test_rope.py; HF Llama parity: test_interop_llama.py."""

import json

import pytest
import torch
import torch.nn.functional as F

from tinygpt import GPTConfig, GPTModel, KVCache, get_config
from tinygpt.layers import FeedForward, LayerNorm, MultiHeadAttention, RMSNorm

LLAMA_FIELDS = dict(norm="rmsnorm", ffn="swiglu", bias=False, pos_emb="rope", n_kv_heads=2)


def llama_config(**overrides) -> GPTConfig:
    return get_config("llama-tiny", **overrides)


# --- config -------------------------------------------------------------------------------------------------------


def test_defaults_are_gpt2_and_old_dicts_load_unchanged():
    c = GPTConfig()
    assert (c.norm, c.ffn, c.bias, c.pos_emb, c.kv_heads, c.ffn_dim) == ("layernorm", "gelu", True, "learned", 12,
                                                                           4 * 768)
    old = {"vocab_size": 50, "context_length": 8, "emb_dim": 16, "n_heads": 4, "n_layers": 1, "qkv_bias": True}
    assert GPTConfig.from_dict(old) == GPTConfig(**old)


def test_json_round_trip_with_every_new_field():
    c = llama_config(norm_eps=1e-6, ffn_hidden=40, rope_theta=500.0, qkv_bias=True, tie_weights=True)
    assert GPTConfig.from_json(c.to_json()) == c
    assert json.loads(c.to_json())["n_kv_heads"] == 2


def test_ffn_width_defaults():
    assert GPTConfig(emb_dim=768, ffn="swiglu").ffn_dim == 2048  # 8 * 768 / 3 exactly
    assert GPTConfig(emb_dim=16, n_heads=4, ffn="swiglu").ffn_dim == 48  # 42.67 rounded up to a multiple of 8
    assert GPTConfig(emb_dim=16, n_heads=4, ffn="relu").ffn_dim == 64
    assert GPTConfig(emb_dim=16, n_heads=4, ffn="silu", ffn_hidden=10).ffn_dim == 10


@pytest.mark.parametrize("bad,fields", [
    (dict(norm="batchnorm"), "norm='batchnorm'.*layernorm, rmsnorm"),
    (dict(ffn="geglu"), "ffn='geglu'.*swiglu"),
    (dict(pos_emb="alibi"), "pos_emb='alibi'.*rope"),
    (dict(n_kv_heads=3), "n_kv_heads=3 must divide n_heads=4"),
    (dict(n_kv_heads=0), "n_kv_heads=0"),
    (dict(ffn_hidden=-1), "ffn_hidden=-1"),
    (dict(norm_eps=0.0), "norm_eps=0.0"),
    (dict(rope_theta=-1.0), "rope_theta=-1.0"),
    (dict(bias="no"), "bias='no'"),
    (dict(emb_dim=12, n_heads=4, pos_emb="rope"), "pos_emb='rope' needs an even head_dim.*emb_dim=12.*n_heads=4"),
])
def test_invalid_variants_name_the_fields(bad, fields):
    with pytest.raises(ValueError, match=fields):
        get_config("tiny", **bad)


# --- layers -------------------------------------------------------------------------------------------------------


def test_rmsnorm_keeps_the_shape_and_follows_its_formula():
    """Seed 002 exercise 2: swapping LayerNorm for RMSNorm keeps [B, T, D]."""
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    norm = RMSNorm(16, eps=1e-6).double()
    with torch.no_grad():
        norm.scale.copy_(torch.linspace(0.5, 2.0, 16))
    y = norm(x)
    assert y.shape == x.shape == LayerNorm(16).double()(x).shape and y.dtype == torch.float64
    expected = norm.scale * x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(y, expected, rtol=0, atol=1e-14)
    assert y.mean(-1).abs().max() > 1e-3  # no re-centring, unlike LayerNorm
    half = RMSNorm(16).to(torch.bfloat16)(x.to(torch.bfloat16))  # statistic in float32, result cast back
    assert half.dtype == torch.bfloat16
    torch.testing.assert_close(half.double(), x / x.pow(2).mean(-1, keepdim=True).add(1e-5).sqrt(), rtol=1e-2,
                               atol=1e-2)


def test_layernorm_without_bias_has_no_shift():
    norm = LayerNorm(8, bias=False)
    assert [n for n, _ in norm.named_parameters()] == ["scale"]
    x = torch.randn(3, 8)
    torch.testing.assert_close(norm(x), F.layer_norm(x, (8,), eps=1e-5))


@pytest.mark.parametrize("kind,act", [("relu", F.relu), ("silu", F.silu)])
def test_non_gated_ffn_activations(kind, act):
    ff = FeedForward(GPTConfig(emb_dim=8, n_heads=2, ffn=kind, ffn_hidden=12, bias=False))
    w1, w2 = ff.layers[0].weight, ff.layers[2].weight
    assert (w1.shape, w2.shape, ff.layers[0].bias) == ((12, 8), (8, 12), None)
    x = torch.randn(2, 3, 8)
    torch.testing.assert_close(ff(x), act(x @ w1.T) @ w2.T)


def test_swiglu_ffn_is_gate_silu_times_up():
    ff = FeedForward(GPTConfig(emb_dim=8, n_heads=2, ffn="swiglu", ffn_hidden=12, bias=True))
    gate_w, up_w = ff.layers[0].weight.split(12)
    gate_b, up_b = ff.layers[0].bias.split(12)
    x = torch.randn(2, 3, 8)
    expected = (F.silu(x @ gate_w.T + gate_b) * (x @ up_w.T + up_b)) @ ff.layers[2].weight.T + ff.layers[2].bias
    torch.testing.assert_close(ff(x), expected)


def test_gqa_equals_multi_head_attention_with_repeated_kv_heads():
    """Sharing each kv head across its query group == MHA whose k/v heads are copies (query h reads kv h // 2)."""
    gqa_cfg = GPTConfig(vocab_size=10, context_length=8, emb_dim=16, n_heads=4, n_kv_heads=2, n_layers=1)
    gqa, mha = MultiHeadAttention(gqa_cfg), MultiHeadAttention(gqa_cfg.replace(n_kv_heads=None))
    assert gqa.qkv.weight.shape == ((4 + 2 * 2) * 4, 16)
    q, k, v = gqa.qkv.weight.split((16, 8, 8))
    repeat = lambda w: w.view(2, 4, 16).repeat_interleave(2, dim=0).reshape(16, 16)  # noqa: E731
    with torch.no_grad():
        mha.qkv.weight.copy_(torch.cat((q, repeat(k), repeat(v))))
        mha.out_proj.load_state_dict(gqa.out_proj.state_dict())
    x = torch.randn(2, 6, 16)
    torch.testing.assert_close(gqa(x), mha(x))
    out, weights = gqa(x, return_weights=True)  # the explicit path expands the kv heads itself
    torch.testing.assert_close(out, mha(x))
    assert weights.shape == (2, 4, 6, 6)


# --- model --------------------------------------------------------------------------------------------------------


def test_llama_tiny_has_no_position_table_no_bias_and_a_kv_heads_cache():
    config = llama_config()
    model = GPTModel(config)
    names = [n for n, _ in model.named_parameters()]
    assert "pos_emb.weight" not in model.state_dict()
    assert not [n for n in names if n.endswith(("bias", "shift"))]
    assert model.trf_blocks[0].att.qkv.weight.shape == ((4 + 2 * 2) * 8, 32)
    cache = KVCache(config, batch_size=3)
    assert cache.keys[0].shape == (3, 2, 32, 8)  # [B, Hkv, C, hd]: only the shared heads are stored
    assert model(torch.zeros(2, 5, dtype=torch.long)).shape == (2, 5, 64)


def test_a_few_adamw_steps_lower_the_loss_of_llama_tiny():
    torch.manual_seed(0)
    config = llama_config()
    model = GPTModel(config).train()
    data = torch.randint(0, config.vocab_size, (4, config.context_length + 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(25):
        logits = model(data[:, :-1])
        loss = F.cross_entropy(logits.flatten(0, 1), data[:, 1:].flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert all(p.grad is not None for p in model.parameters())
    assert losses[-1] < 0.7 * losses[0], losses
