"""Several LoRA adapters on one base, chosen per row (or per token) of a batch: what serving many fine-tunes needs.

``attach_adapters(model, {name: (config, state)})`` wraps every linear some adapter targets in a
``MultiLoRALinear`` holding all of them; the base weights stay one copy. Inside ``with use_adapters(model, index):``
each position takes the update of adapter ``index`` (-1: the base alone): ``index`` is [B] (one adapter per row,
broadcast over the positions) or of the input's leading shape [B, T] (per token: a packed batch of several
requests). Rows of different adapters run in one forward: y = x W^T + b, then for each adapter k only the
positions with index k get (alpha_k / r_k) x A_k^T B_k^T added (S-LoRA's / punica's gather-and-add, written
plainly). Each row computes what its adapter's ``merged_model`` computes, up to float rounding (tested with greedy
generation). Inference only: nothing here trains.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Mapping

import torch
from torch import nn

from .lora import TARGETS, LoRAConfig, check_targets


class MultiLoRALinear(nn.Module):
    """A frozen ``base`` linear and K adapters' updates; ``index`` (set by ``use_adapters``) picks one per position."""

    def __init__(self, base: nn.Module) -> None:
        super().__init__()
        self.base = base
        self.out_features = base.out_features
        # adapter k -> [(rows lo, hi, A [r, in], B [hi - lo, r], scaling)]; plain tensors, not parameters
        self.updates: list[list[tuple[int, int, torch.Tensor, torch.Tensor, float]]] = []
        self.index: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)  # [..., out]
        if self.index is None:
            return y
        index = self.index
        if index.dim() == 1 and x.dim() > 2 and index.shape[0] == x.shape[0]:  # one per row: for all its positions
            index = index.view(-1, *([1] * (x.dim() - 2))).expand(x.shape[:-1])
        if index.shape != x.shape[:-1]:
            raise ValueError(f"the adapter index has shape {list(self.index.shape)}; this forward needs "
                             f"[{x.shape[0]}] (one per row) or {list(x.shape[:-1])} (one per position)")
        y = y.clone()
        for k, parts in enumerate(self.updates):
            chosen = index == k  # [...]
            if not bool(chosen.any()):
                continue
            xs = x[chosen]  # [n, in]: only the positions of this adapter
            for lo, hi, a, b, scaling in parts:
                y[..., lo:hi][chosen] += scaling * ((xs @ a.T.to(xs.dtype)) @ b.T.to(xs.dtype))
        return y


def attach_adapters(model: nn.Module, adapters: Mapping[str, tuple[LoRAConfig, Mapping[str, torch.Tensor]]]
                    ) -> list[str]:
    """Wrap ``model`` (a plain ``GPTModel``) with every adapter of ``adapters`` (name -> (config, tensors by
    ``lora.lora_state_dict``'s names)), in place; returns the names in index order (``use_adapters``' k)."""
    names = list(adapters)
    if not names:
        raise ValueError("no adapters given")
    device = next(model.parameters()).device
    wrapped: dict[str, MultiLoRALinear] = {}
    for k, name in enumerate(names):
        config, state = adapters[name]
        if config.quantize is not None:
            raise ValueError(f"adapter {name!r} was trained on an NF4 base: merge it (tinygpt merge) to serve it")
        check_targets(config, model.config)
        for i, block in enumerate(model.trf_blocks):
            for target in config.targets:
                path, half = TARGETS[target]
                key = f"trf_blocks.{i}.{path}"
                if key not in wrapped:
                    parent_path, _, child = path.rpartition(".")
                    parent = block.get_submodule(parent_path)
                    wrapped[key] = MultiLoRALinear(parent.get_submodule(child))
                    setattr(parent, child, wrapped[key])
                module = wrapped[key]
                while len(module.updates) <= k:
                    module.updates.append([])
                out = module.out_features
                lo, hi = (0, out) if half is None else (half * out // 2, (half + 1) * out // 2)
                a_name, b_name = f"{key}.lora_A.{target}", f"{key}.lora_B.{target}"
                if a_name not in state or b_name not in state:
                    raise ValueError(f"adapter {name!r} has no tensor {a_name!r} (its targets: {config.targets})")
                a, b = state[a_name].to(device), state[b_name].to(device)
                if b.shape != (hi - lo, config.r) or a.shape != (config.r, module.base.in_features):
                    raise ValueError(f"adapter {name!r}: {a_name} / {b_name} do not fit this base")
                module.updates[k].append((lo, hi, a, b, config.scaling))
    for module in wrapped.values():
        while len(module.updates) < len(names):
            module.updates.append([])
    model.adapter_names = names
    return names


@contextlib.contextmanager
def use_adapters(model: nn.Module, index: torch.Tensor) -> Iterator[None]:
    """Inside the block, position p of a forward takes adapter ``index[p]`` (-1: none); see the module docstring."""
    names = getattr(model, "adapter_names", None)
    if names is None:
        raise ValueError("the model has no adapters attached (attach_adapters first)")
    index = torch.as_tensor(index, dtype=torch.long, device=next(model.parameters()).device)
    if index.numel() and (int(index.min()) < -1 or int(index.max()) >= len(names)):
        raise ValueError(f"adapter index out of range: -1 (the base) or 0..{len(names) - 1} ({', '.join(names)})")
    modules = [m for m in model.modules() if isinstance(m, MultiLoRALinear)]
    for m in modules:
        m.index = index
    try:
        yield
    finally:
        for m in modules:
            m.index = None
