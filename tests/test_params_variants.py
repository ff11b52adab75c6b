"""count_parameters for the LLaMA-style switches: exact against built models, and the seed's bias exercise."""

import random

import pytest
import torch
from torch import nn

from tinygpt import GPTConfig, GPTModel, count_parameters, get_config
from test_params import unique_trainable


def random_variant(rng: random.Random) -> GPTConfig:
    heads = rng.choice([1, 2, 4, 6])
    pos_emb = rng.choice(["learned", "rope"])
    head_dim = 2 * rng.randint(1, 4) if pos_emb == "rope" else rng.randint(1, 6)
    return GPTConfig(
        vocab_size=rng.randint(2, 60), context_length=rng.randint(1, 20), emb_dim=heads * head_dim, n_heads=heads,
        n_layers=rng.randint(1, 3), n_kv_heads=rng.choice([None] + [k for k in range(1, heads + 1) if heads % k == 0]),
        norm=rng.choice(["layernorm", "rmsnorm"]), ffn=rng.choice(["gelu", "relu", "silu", "swiglu"]),
        ffn_hidden=rng.choice([None, rng.randint(1, 30)]), bias=rng.random() < 0.5, qkv_bias=rng.random() < 0.5,
        tie_weights=rng.random() < 0.5, pre_ln=rng.random() < 0.5, pos_emb=pos_emb,
    )


def test_formula_equals_built_model_for_random_variants():
    rng = random.Random(11)
    for _ in range(60):
        config = random_variant(rng)
        model = GPTModel(config)
        counts = count_parameters(config)
        assert unique_trainable(model) == counts.total, config
        block = model.trf_blocks[0]
        assert counts.attention_per_block == sum(p.numel() for p in block.att.parameters()), config
        assert counts.feed_forward_per_block == sum(p.numel() for p in block.ff.parameters()), config
        assert counts.final_norm == sum(p.numel() for p in model.final_norm.parameters()), config
        assert counts.position_embedding == (0 if model.pos_emb is None else model.pos_emb.weight.numel())


def linear_biases(model: nn.Module) -> int:
    return sum(m.bias.numel() for m in model.trf_blocks.modules() if isinstance(m, nn.Linear) and m.bias is not None)


def test_bias_free_linears_in_the_12_layer_768_wide_model():
    """Seed 002 exercise 1. In each block the linears carry: QKV 3D (only with qkv_bias), out_proj D, FFN 4D + D.
    GPT-2 small here has qkv_bias=False, so bias=False saves L * 6D = 55,296 linear biases; with the released
    qkv_bias=True it is L * 9D = 82,944. ``bias=False`` also drops the LayerNorm shifts, (2L + 1) * D = 19,200."""
    d, layers = 768, 12
    for qkv_bias, per_block in ((False, 6 * d), (True, 9 * d)):
        config = get_config("gpt2-small", qkv_bias=qkv_bias)
        with torch.device("meta"):
            with_bias, without = GPTModel(config), GPTModel(config.replace(bias=False, qkv_bias=False))
        assert linear_biases(with_bias) == layers * per_block
        assert linear_biases(without) == 0
        saved = count_parameters(config).total - count_parameters(config.replace(bias=False, qkv_bias=False)).total
        assert saved == layers * per_block + (2 * layers + 1) * d == unique_trainable(with_bias) - unique_trainable(
            without)
    assert layers * 6 * d == 55_296 and layers * 9 * d == 82_944


def test_rmsnorm_halves_the_norm_parameters_and_rope_drops_the_position_table():
    base = get_config("gpt2-small")
    counts = count_parameters(base.replace(norm="rmsnorm"))
    assert (counts.norms_per_block, counts.final_norm) == (2 * 768, 768)
    assert count_parameters(base.replace(pos_emb="rope")).total == count_parameters(base).total - 1024 * 768


@pytest.mark.parametrize("name,sizes,expected", [
    # Published sizes: LLaMA-7B (MHA, untied) and Llama-2-70B (GQA with 8 kv heads), both V=32000, F given.
    ("llama-7b", dict(emb_dim=4096, n_heads=32, n_layers=32, ffn_hidden=11008, context_length=2048),
     6_738_415_616),
    ("llama-2-70b", dict(emb_dim=8192, n_heads=64, n_kv_heads=8, n_layers=80, ffn_hidden=28672,
                         context_length=4096), 68_976_648_192),
])
def test_published_llama_sizes(name, sizes, expected):
    config = GPTConfig(vocab_size=32000, norm="rmsnorm", ffn="swiglu", bias=False, pos_emb="rope", **sizes)
    assert count_parameters(config).total == expected
    with torch.device("meta"):
        one_block = GPTModel(config.replace(n_layers=1))
    assert unique_trainable(one_block) == count_parameters(config.replace(n_layers=1)).total


def test_swiglu_default_width_matches_the_gelu_ffn_weights():
    for d in (48, 768, 4096):
        gelu = count_parameters(GPTConfig(emb_dim=d, n_heads=4, bias=False)).feed_forward_per_block
        swiglu = count_parameters(GPTConfig(emb_dim=d, n_heads=4, bias=False, ffn="swiglu")).feed_forward_per_block
        assert gelu == 8 * d * d and 0 <= swiglu - gelu < 3 * 8 * d  # equal up to rounding F to a multiple of 8
