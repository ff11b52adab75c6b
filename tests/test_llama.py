"""LLaMA-style variants: RMSNorm, SwiGLU, bias-free linears, RoPE, grouped-query attention, and HF Llama parity."""

import json

import pytest
import torch
import torch.nn.functional as F

from tinygpt import GPTConfig, GPTModel, KVCache, get_config
from tinygpt.layers import FeedForward, LayerNorm, MultiHeadAttention, RMSNorm
from tinygpt.rope import RotaryEmbedding, apply_rope

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


@pytest.mark.parametrize("prefill", [1, 4, 9])
def test_rope_with_cache_at_any_start_pos_equals_the_full_forward(prefill):
    config = llama_config(qkv_bias=True, bias=True)
    model = GPTModel(config).double().eval()
    idx = torch.randint(0, config.vocab_size, (2, 14))
    with torch.no_grad():
        full = model(idx)
        cache = KVCache(config, 2, dtype=torch.float64)
        parts = [model(idx[:, :prefill], cache=cache)]
        pos = prefill
        for step in (1, 3, 1):  # decode steps of several lengths
            parts.append(model(idx[:, pos:pos + step], cache=cache, start_pos=pos))
            pos += step
    torch.testing.assert_close(torch.cat(parts, 1), full[:, :pos], rtol=0, atol=1e-12)


def test_rope_uses_per_row_positions_of_a_left_padded_batch():
    config = llama_config()
    model = GPTModel(config).double().eval()
    short, long = torch.tensor([[5, 6, 7]]), torch.tensor([[1, 2, 3, 4, 9]])
    pad = long.shape[1] - short.shape[1]
    idx = torch.cat((torch.cat((torch.zeros(1, pad, dtype=torch.long), short), 1), long))  # [2, 5]
    positions = torch.stack((torch.arange(-pad, 3).clamp(min=0), torch.arange(5)))  # [2, 5]
    key_mask = torch.tensor([[False] * pad + [True] * 3, [True] * 5])
    with torch.no_grad():
        batched = model(idx, positions=positions, key_mask=key_mask)
        torch.testing.assert_close(batched[0, pad:], model(short)[0], rtol=0, atol=1e-12)
        torch.testing.assert_close(batched[1], model(long)[0], rtol=0, atol=1e-12)


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


# --- Hugging Face Llama -------------------------------------------------------------------------------------------


@pytest.fixture
def hf_llama():
    transformers = pytest.importorskip("transformers")

    def build(tied=False, dtype=torch.float32, **overrides):
        torch.manual_seed(1)
        kwargs = dict(vocab_size=80, hidden_size=32, intermediate_size=56, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=24, rope_theta=1000.0,
                      tie_word_embeddings=tied, bos_token_id=None, eos_token_id=None, pad_token_id=None)
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**kwargs, **overrides})).to(dtype).eval()
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" in name or name.endswith("bias"):
                    p.add_(0.1 * torch.randn_like(p))
        return model

    return build


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 1e-5)])
def test_verify_llama_check_passes(tied, dtype, tol):
    pytest.importorskip("transformers")
    from tinygpt import verify

    result = verify.check_hf_llama(tied, dtype, tol)
    assert result.passed and result.tokens_match, result
    assert result.max_abs_diff <= tol


def test_import_matches_hf_logits_with_biases_and_round_trips(hf_llama):
    from tinygpt.interop.llama import from_llama_state_dict, llama_to_tinygpt, tinygpt_to_llama

    ref = hf_llama(attention_bias=True, mlp_bias=True)
    ours = from_llama_state_dict(ref.config, ref.state_dict())
    assert (ours.config.bias, ours.config.qkv_bias, ours.config.kv_heads) == (True, True, 2)
    idx = torch.randint(0, 80, (2, 9))
    with torch.no_grad():
        assert (ours(idx) - ref(idx).logits).abs().max() <= 1e-5
    hf_state = ref.state_dict()
    back = tinygpt_to_llama(llama_to_tinygpt(hf_state, ours.config), ours.config)
    assert back.keys() == hf_state.keys()
    assert all(torch.equal(back[k], hf_state[k]) for k in hf_state)


def test_export_a_tinygpt_model_into_hf_llama():
    transformers = pytest.importorskip("transformers")
    from tinygpt.interop.llama import llama_config_to_tinygpt, tinygpt_to_llama, tinygpt_to_llama_config

    config = llama_config(rope_theta=500.0, norm_eps=1e-6, tie_weights=True)
    ours = GPTModel(config).eval()
    hf_config = transformers.LlamaConfig(**tinygpt_to_llama_config(config))
    assert llama_config_to_tinygpt(hf_config) == config.replace(ffn_hidden=config.ffn_dim)
    ref = transformers.LlamaForCausalLM(hf_config).eval()
    result = ref.load_state_dict(tinygpt_to_llama(ours.state_dict(), config), strict=True)
    assert not result.missing_keys and not result.unexpected_keys
    idx = torch.randint(0, config.vocab_size, (2, 10))
    with torch.no_grad():
        assert (ours(idx) - ref(idx).logits).abs().max() <= 1e-5


def test_a_wrong_mapping_is_detected(hf_llama):
    """The comparison can fail: swapping gate and up (or k and v) changes the logits far beyond the tolerance."""
    from tinygpt.interop.llama import llama_config_to_tinygpt, llama_to_tinygpt

    ref = hf_llama()
    config = llama_config_to_tinygpt(ref.config)
    idx = torch.randint(0, 80, (1, 8))
    with torch.no_grad():
        expected = ref(idx).logits
    for src, dst in (("mlp.gate_proj", "mlp.up_proj"), ("self_attn.k_proj", "self_attn.v_proj")):
        state = dict(ref.state_dict())
        a, b = f"model.layers.0.{src}.weight", f"model.layers.0.{dst}.weight"
        state[a], state[b] = state[b], state[a]
        model = GPTModel(config).eval()
        model.load_state_dict(llama_to_tinygpt(state, config))
        with torch.no_grad():
            assert (model(idx) - expected).abs().max() > 1e-3


def test_load_a_saved_hf_folder(hf_llama, tmp_path):
    from tinygpt.interop.llama import load_llama_folder

    ref = hf_llama(tied=True)
    ref.save_pretrained(tmp_path)
    ours = load_llama_folder(tmp_path)
    assert ours.config.tie_weights and ours.out_head.weight is ours.tok_emb.weight
    idx = torch.randint(0, 80, (2, 7))
    with torch.no_grad():
        assert (ours(idx) - ref(idx).logits).abs().max() <= 1e-5
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="no model.safetensors"):
        load_llama_folder(tmp_path)


def test_converter_refuses_what_the_skeleton_cannot_express(hf_llama):
    from tinygpt.interop.llama import llama_config_to_tinygpt, llama_to_tinygpt, tinygpt_to_llama_config

    base = hf_llama().config.to_dict()
    for change, message in [
        (dict(hidden_act="gelu"), "hidden_act='gelu'"),
        (dict(head_dim=16), "head_dim=16"),
        (dict(attention_bias=True), "attention_bias=True with mlp_bias=False"),
        (dict(rope_parameters={"rope_type": "llama3", "rope_theta": 1e4}), "RoPE scaling 'llama3'"),
        (dict(model_type="gpt2"), "not a Llama"),
    ]:
        with pytest.raises(ValueError, match=message):
            llama_config_to_tinygpt({**base, **change})
    config = llama_config_to_tinygpt(base)
    state = dict(hf_llama().state_dict())
    state["model.layers.0.mlp.extra.weight"] = torch.zeros(1)
    with pytest.raises(ValueError, match="does not use: 'model.layers.0.mlp.extra.weight'"):
        llama_to_tinygpt(state, config)
    del state["model.norm.weight"]
    with pytest.raises(ValueError, match="lacks 'model.norm.weight'"):
        llama_to_tinygpt(state, config)
    with pytest.raises(ValueError, match="norm='layernorm'.*pos_emb='learned'"):
        tinygpt_to_llama_config(get_config("tiny"))
