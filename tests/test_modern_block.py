"""The modern block's switches (``GPTConfig.qk_norm``, ``ffn="relu2"``, ``zero_init_proj``) and the ``modern``
preset: each off by default, each equal to the computation written out here (float64, 1e-12)."""

import math

import pytest
import torch
import torch.nn.functional as F

from tinygpt import FeedForward, GPTConfig, GPTModel, MultiHeadAttention, get_config
from tinygpt.config import MODERN_BLOCK

SMALL = dict(vocab_size=40, context_length=12, emb_dim=24, n_heads=3, n_layers=2, drop_rate=0.0)


def test_the_switches_are_off_by_default_and_the_preset_turns_them_on():
    default = GPTConfig()
    assert (default.qk_norm, default.zero_init_proj, default.ffn) == (False, False, "gelu")
    modern = get_config("modern")
    assert all(getattr(modern, k) == v for k, v in MODERN_BLOCK.items())
    assert (modern.emb_dim, modern.n_layers, modern.qk_norm, modern.ffn) == (768, 12, True, "relu2")
    assert GPTConfig.from_dict(modern.to_dict()) == modern
    with pytest.raises(ValueError, match="qk_norm"):
        GPTConfig(qk_norm="yes")
    with pytest.raises(ValueError, match="relu2"):
        GPTConfig(ffn="relu3")


def test_qk_norm_is_attention_over_rms_normalised_queries_and_keys():
    torch.manual_seed(0)
    config = GPTConfig(**SMALL, qk_norm=True, norm_eps=1e-6)
    attention = MultiHeadAttention(config).double()
    x = torch.randn(2, 7, 24, dtype=torch.float64)
    b, t, d, h, hd = 2, 7, 24, 3, 8
    q, k, v = (part.view(b, t, h, hd).transpose(1, 2) for part in attention.qkv(x).split(d, dim=-1))
    q = q / torch.sqrt((q * q).mean(dim=-1, keepdim=True) + 1e-6)  # each head's query to unit RMS
    k = k / torch.sqrt((k * k).mean(dim=-1, keepdim=True) + 1e-6)
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(hd)  # [B, H, T, T]
    scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    context = torch.softmax(scores, dim=-1) @ v  # [B, H, T, hd]
    expected = attention.out_proj(context.transpose(1, 2).reshape(b, t, d))
    torch.testing.assert_close(attention(x), expected, rtol=0, atol=1e-12)
    plain = MultiHeadAttention(GPTConfig(**SMALL)).double()
    plain.load_state_dict(attention.state_dict())  # QK-norm adds no parameter: the same weights load
    assert not torch.allclose(plain(x), expected)


def test_relu_squared_ffn_is_the_written_out_formula():
    torch.manual_seed(1)
    ffn = FeedForward(GPTConfig(**SMALL, ffn="relu2")).double()
    x = torch.randn(2, 5, 24, dtype=torch.float64)
    first, _, second = ffn.layers
    assert first.weight.shape == (96, 24)  # 4D, as the other non-gated activations
    hidden = x @ first.weight.T + first.bias
    expected = (torch.clamp(hidden, min=0) ** 2) @ second.weight.T + second.bias
    torch.testing.assert_close(ffn(x), expected, rtol=0, atol=1e-12)


def test_zero_init_projections_make_every_block_the_identity_at_init():
    torch.manual_seed(2)
    model = GPTModel(GPTConfig(**SMALL, zero_init_proj=True)).double()
    for block in model.trf_blocks:
        assert not block.att.out_proj.weight.any() and not block.ff.layers[2].weight.any()
    idx = torch.randint(0, 40, (2, 9))
    x = model.tok_emb(idx) + model.pos_emb(torch.arange(9))  # no block changes the residual stream
    expected = model.final_norm(x) @ model.out_head.weight.T
    torch.testing.assert_close(model(idx), expected, rtol=0, atol=1e-12)
    torch.manual_seed(2)
    default = GPTModel(GPTConfig(**SMALL))
    assert default.trf_blocks[0].att.out_proj.weight.abs().sum() > 0
    # only the two projections differ: every other weight is drawn from the same RNG stream alike
    same = {n for n, p in default.named_parameters() if torch.equal(p.double(), dict(model.named_parameters())[n])}
    assert {n for n, _ in default.named_parameters()} - same == {
        f"trf_blocks.{i}.{w}.weight" for i in range(2) for w in ("att.out_proj", "ff.layers.2")}


def test_the_modern_block_trains_caches_and_refuses_gpt2_export(tmp_path):
    from tinygpt import generate
    from tinygpt.interop.hf import tinygpt_config_to_hf

    torch.manual_seed(3)
    config = get_config("modern", **SMALL)
    model = GPTModel(config)
    idx = torch.randint(0, 40, (2, 12))
    loss = model(idx[:, :-1], targets=idx[:, 1:])
    loss.backward()
    assert torch.isfinite(loss) and all(p.grad is not None for p in model.parameters())
    model = GPTModel(config.replace(zero_init_proj=False)).eval()  # blocks that attend: the cache matters
    cached = generate(model, [[1, 2, 3]], max_new_tokens=5, temperature=0.0).tokens[0].tolist()
    ids = [1, 2, 3]
    for _ in range(5):  # uncached greedy: the full forward each time
        ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    assert cached[:5] == ids[3:]
    with pytest.raises(ValueError, match="qk_norm"):
        tinygpt_config_to_hf(config.replace(ffn="gelu", norm="layernorm", pos_emb="learned", bias=True,
                                             tie_weights=True))
