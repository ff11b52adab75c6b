"""What the multi-adapter tests share: a copy of a model and a LoRA adapter of it whose updates are not zero."""

from __future__ import annotations

import torch

from tinygpt import GPTModel, lora


def clone(model: GPTModel) -> GPTModel:
    """A separate model with the same weights (and dtype)."""
    copy = GPTModel(model.config).to(next(model.parameters()).dtype).eval()
    copy.load_state_dict(model.state_dict())
    return copy


def trained_adapter(base: GPTModel, config: lora.LoRAConfig, seed: int, scale: float = 0.3):
    """(the adapted copy of ``base``, (config, its tensors) as ``attach_adapters`` takes them): B random (a fresh
    adapter's B is zero, which would change nothing)."""
    adapted = lora.apply_lora(clone(base), config, seed=seed)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, module in lora.lora_modules(adapted):
            for b in module.lora_B.values():
                b.copy_(torch.randn(b.shape, generator=g, dtype=torch.float64) * scale)
    return adapted, (config, lora.lora_state_dict(adapted))
