"""The runner's LoRA adapters: rows of the base and of several adapters decode in one packed forward, and each
row's greedy tokens are its merged model's (``lora.merged_model``), with the prefix cache on."""

from __future__ import annotations

import random

import pytest
import torch

from inference_support import VARIANTS, variant_model
from lora_support import clone, trained_adapter
from tinygpt import GenerationConfig, GPTModel, generate, lora
from tinygpt.inference.engine import InferenceEngine
from tinygpt.inference.row import Row
from tinygpt.multi_lora import attach_adapters

TARGETS = {"gpt2": ("qkv", "out_proj", "ffn_in", "ffn_out"), "llama": ("qkv", "gate", "down"),
           "gqa": ("qkv", "out_proj", "up")}


def _adapter(base: GPTModel, config: lora.LoRAConfig, seed: int):
    """An adapter (its B random) and its merged model."""
    adapted, parts = trained_adapter(base, config, seed, scale=0.5)
    return parts, lora.merged_model(adapted).eval()


def _served(variant: str):
    """(the base with adapters "a" and "b" attached, {adapter index: the model its rows must equal})."""
    base = variant_model(variant)
    a, merged_a = _adapter(base, lora.LoRAConfig(r=4, alpha=8, targets=TARGETS[variant]), seed=1)
    b, merged_b = _adapter(base, lora.LoRAConfig(r=2, alpha=4, targets=TARGETS[variant][:1]), seed=2)
    served = clone(base)
    attach_adapters(served, {"a": a, "b": b})
    return served, {-1: base, 0: merged_a, 1: merged_b}


def _offline(model: GPTModel, prompt: list[int], n: int) -> list[int]:
    return generate(model, [prompt], max_new_tokens=n).rows()[0]


@pytest.mark.parametrize("variant", VARIANTS)
def test_base_and_adapter_rows_decode_in_one_forward_each_equal_to_its_merged_model(variant, monkeypatch):
    served, merged = _served(variant)
    rng = random.Random(0)
    prompts = [[rng.randrange(53) for _ in range(rng.randint(3, 9))] for _ in range(6)]
    adapters = [-1, 0, 1, 1, 0, -1]
    assert len({tuple(_offline(merged[k], prompts[0], 8)) for k in merged}) == 3  # the adapters change the output
    engine = InferenceEngine(served, max_rows=6, block_size=4)
    seen: list[set[int]] = []
    forward = engine.runner.forward
    monkeypatch.setattr(engine.runner, "forward", lambda plan: seen.append({r.adapter for r, _ in plan}) or
                        forward(plan))
    rows = [engine.add(Row(p, GenerationConfig(max_new_tokens=8), adapter=k)) for p, k in zip(prompts, adapters)]
    engine.run_until_done()
    assert {-1, 0, 1} in seen and engine.max_rows_seen == 6  # they did share forwards
    for row, prompt, k in zip(rows, prompts, adapters):
        assert row.tokens[row.prompt_len:] == _offline(merged[k], prompt, 8), (k, prompt)


def test_a_shared_prompt_under_two_adapters_takes_no_prefix_of_the_other_adapter():
    served, merged = _served("gpt2")
    prompt = [random.Random(1).randrange(53) for _ in range(14)]
    engine = InferenceEngine(served, max_rows=2, block_size=4)
    # one after another: each finished row's full blocks are published; only the second row of adapter a finds
    # its 3 full prompt blocks (12 tokens), the cache being on
    for k, reused in ((0, 0), (1, 0), (-1, 0), (0, 12)):
        hits = engine.blocks.hits
        row = engine.add(Row(prompt, GenerationConfig(max_new_tokens=6), adapter=k))
        engine.run_until_done()
        assert row.tokens[row.prompt_len:] == _offline(merged[k], prompt, 6), k
        assert engine.blocks.hits - hits == reused, k
    # at once in one batch too
    rows = [engine.add(Row(prompt, GenerationConfig(max_new_tokens=6), adapter=k)) for k in (1, -1)]
    engine.run_until_done()
    for row, k in zip(rows, (1, -1)):
        assert row.tokens[row.prompt_len:] == _offline(merged[k], prompt, 6)


def test_a_bad_adapter_index_is_refused_when_the_row_is_added():
    served, _ = _served("gpt2")
    engine = InferenceEngine(served, max_rows=2)
    with pytest.raises(ValueError, match=r"0\.\.1: a, b"):
        engine.add(Row([1, 2], GenerationConfig(max_new_tokens=2), adapter=2))
    with pytest.raises(ValueError, match="no adapters attached"):
        InferenceEngine(variant_model("gpt2"), max_rows=1).add(Row([1], GenerationConfig(max_new_tokens=1),
                                                                   adapter=0))
