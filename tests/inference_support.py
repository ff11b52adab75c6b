"""What the inference-core tests share: tiny models of each variant and a driver for random schedules."""

from __future__ import annotations

import torch

from tinygpt import GPTConfig, GPTModel

BASE = GPTConfig(vocab_size=53, context_length=40, emb_dim=24, n_heads=4, n_layers=2)
LLAMA = BASE.replace(pos_emb="rope", norm="rmsnorm", ffn="swiglu", bias=False)
VARIANTS = {"gpt2": BASE, "llama": LLAMA, "gqa": LLAMA.replace(n_kv_heads=2)}


def variant_model(name: str, dtype: torch.dtype = torch.float64, seed: int = 0) -> GPTModel:
    torch.manual_seed(seed)
    return GPTModel(VARIANTS[name]).to(dtype).eval()


def unchecked(config, **fields):
    """``config`` with ``fields`` set past its validation: values the HTTP edge and ``GenerationConfig`` refuse, to
    show that the engine survives them anyway (isolation)."""
    for name, value in fields.items():
        object.__setattr__(config, name, value)
    return config
