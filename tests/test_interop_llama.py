"""tinygpt.interop.llama: Hugging Face Llama checkpoints <-> GPTModel, checked logit for logit."""

import pytest
import torch

from tinygpt import GPTModel, get_config


def llama_config(**overrides):
    return get_config("llama-tiny", **overrides)


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
