"""Shared fixtures: tiny configs, seeded models, the offline GPT-2 vocabulary of ../shared/data."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch

from tinygpt import GPTConfig, get_config

SHARED_DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
GPT2_VOCAB_DIR = SHARED_DATA / "gpt2"


def variant_configs(base: GPTConfig | None = None) -> list[GPTConfig]:
    """Every qkv_bias x tie_weights x pre_ln combination of a small config."""
    base = base or GPTConfig(vocab_size=37, context_length=12, emb_dim=24, n_heads=3, n_layers=2)
    return [
        base.replace(qkv_bias=q, tie_weights=t, pre_ln=p)
        for q, t, p in itertools.product((False, True), repeat=3)
    ]


@pytest.fixture
def tiny_config() -> GPTConfig:
    return get_config("tiny")


@pytest.fixture(autouse=True)
def _seed_and_threads():
    torch.manual_seed(0)
    yield


@pytest.fixture
def gpt2_vocab_dir() -> Path:
    if not (GPT2_VOCAB_DIR / "encoder.json").exists():
        pytest.skip(f"GPT-2 vocabulary files not found in {GPT2_VOCAB_DIR}")
    return GPT2_VOCAB_DIR
