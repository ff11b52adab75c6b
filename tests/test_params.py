import random

import pytest
import torch

from tinygpt import GPTConfig, GPTModel, count_parameters, get_config
from conftest import variant_configs


def unique_trainable(model: torch.nn.Module) -> int:
    seen, total = set(), 0
    for p in model.parameters():
        if id(p) not in seen and p.requires_grad:
            seen.add(id(p))
            total += p.numel()
    return total


def test_seed_figures():
    assert count_parameters(get_config("tiny")).total == 7264
    small = GPTConfig(vocab_size=20, context_length=10, emb_dim=8, n_heads=2, n_layers=1)
    assert count_parameters(small).total == 1264
    assert count_parameters(small.replace(tie_weights=True)).total == 1104
    assert count_parameters(get_config("gpt2-small")).total == 163_009_536


@pytest.mark.parametrize("name,expected", [("gpt2-small", 124_439_808), ("gpt2-medium", 354_823_168),
                                           ("gpt2-large", 774_030_080), ("gpt2-xl", 1_557_611_200)])
def test_gpt2_as_released(name, expected):
    config = get_config(name, qkv_bias=True, tie_weights=True)
    assert count_parameters(config).total == expected


@pytest.mark.parametrize("name", ["tiny", "gpt2-small", "gpt2-medium", "gpt2-large", "gpt2-xl"])
@pytest.mark.parametrize("qkv_bias,tie", [(False, False), (True, True)])
def test_formula_equals_built_model_on_meta(name, qkv_bias, tie):
    config = get_config(name, qkv_bias=qkv_bias, tie_weights=tie)
    with torch.device("meta"):
        model = GPTModel(config)
    assert unique_trainable(model) == count_parameters(config).total == model.num_parameters()


def test_formula_equals_built_model_for_random_configs():
    rng = random.Random(7)
    for _ in range(12):
        heads = rng.randint(1, 4)
        base = GPTConfig(vocab_size=rng.randint(2, 60), context_length=rng.randint(1, 20),
                         emb_dim=heads * rng.randint(1, 6), n_heads=heads, n_layers=rng.randint(1, 3))
        for config in variant_configs(base):
            assert unique_trainable(GPTModel(config)) == count_parameters(config).total, config


def test_breakdown_parts_add_up_and_match_modules():
    config = get_config("tiny", qkv_bias=True)
    counts = count_parameters(config)
    model = GPTModel(config)
    block = model.trf_blocks[0]
    assert counts.attention_per_block == sum(p.numel() for p in block.att.parameters())
    assert counts.feed_forward_per_block == sum(p.numel() for p in block.ff.parameters())
    assert counts.norms_per_block == sum(p.numel() for m in (block.norm1, block.norm2) for p in m.parameters())
    assert counts.total == counts.embeddings + counts.attention + counts.feed_forward + counts.norms + counts.head
    d = config.emb_dim
    assert counts.per_block == 12 * d * d + 10 * d + 3 * d


def test_count_is_instant_for_xl_and_rejects_non_configs():
    assert count_parameters(get_config("gpt2-xl")).per_block == 12 * 1600**2 + 10 * 1600
    with pytest.raises(TypeError, match="GPTConfig"):
        count_parameters({"emb_dim": 3})
