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
from typing import Iterator, Mapping, Sequence

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
        # set by ``use_adapters``: the index's shape S, and per adapter k the positions (flat over S) that take it
        self.index: tuple[torch.Size, list[tuple[int, torch.Tensor]]] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)  # [..., out]
        if self.index is None:
            return y
        shape, groups = self.index
        lead = x.shape[:len(shape)]
        if lead != shape or len(shape) >= x.dim():
            raise ValueError(f"the adapter index has shape {list(shape)}; this forward needs [{x.shape[0]}] (one per "
                             f"row) or {list(x.shape[:-1])} (one per position)")
        if not groups:
            return y
        # flat over the index's dims: [B, in] (per position) or [B, T, in] (per row); the positions of each
        # adapter were found on the host, so nothing here waits on the device
        xf = x.reshape(-1, *x.shape[len(shape):])
        yf = y.reshape(-1, *y.shape[len(shape):]).clone()
        for k, where in groups:
            xs = xf[where]  # [n, ..., in]: only the positions of this adapter
            for lo, hi, a, b, scaling in self.updates[k]:
                yf[where, ..., lo:hi] += scaling * ((xs @ a.T.to(xs.dtype)) @ b.T.to(xs.dtype))
        return yf.view(y.shape)


def attach_adapters(model: nn.Module, adapters: Mapping[str, tuple[LoRAConfig, Mapping[str, torch.Tensor]]]
                    ) -> list[str]:
    """Wrap ``model`` (a plain ``GPTModel``) with every adapter of ``adapters`` (name -> (config, tensors by
    ``lora.lora_state_dict``'s names)), in place; returns the names in index order (``use_adapters``' k)."""
    names = list(adapters)
    if not names:
        raise ValueError("no adapters given")
    device = next(model.parameters()).device
    for name in names:  # every adapter's settings first: a refused one leaves the model as it was
        config, _ = adapters[name]
        if config.quantize is not None:
            raise ValueError(f"adapter {name!r} was trained on an NF4 base: merge it (tinygpt merge) to serve it")
        check_targets(config, model.config)
    wrapped: dict[str, MultiLoRALinear] = {}
    for k, name in enumerate(names):
        config, state = adapters[name]
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


def adapter_groups(index: torch.Tensor | Sequence[int], count: int, device: torch.device | str
                   ) -> tuple[torch.Size, list[tuple[int, torch.Tensor]]]:
    """(the index's shape, [(k, the flat positions taking adapter k)] for each adapter used) of an index that is a
    host list or tensor; ``ValueError`` for a value outside -1 .. count - 1."""
    host = torch.as_tensor(index, dtype=torch.long, device="cpu")  # one read back for a device tensor, none for a list
    flat = host.reshape(-1)
    if flat.numel() and (int(flat.min()) < -1 or int(flat.max()) >= count):
        raise ValueError(f"adapter index out of range: -1 (the base) or 0..{count - 1}")
    groups = [(k, (flat == k).nonzero().view(-1).to(device)) for k in sorted(set(flat.tolist()) - {-1})]
    return host.shape, groups


@contextlib.contextmanager
def use_adapters(model: nn.Module, index: torch.Tensor | Sequence[int]) -> Iterator[None]:
    """Inside the block, position p of a forward takes adapter ``index[p]`` (-1: none); see the module docstring.
    ``index`` is best a host list (or a CPU tensor): the positions of each adapter are found here, once, and the
    forward reads nothing back from the device."""
    names = getattr(model, "adapter_names", None)
    if names is None:
        raise ValueError("the model has no adapters attached (attach_adapters first)")
    try:
        chosen = adapter_groups(index, len(names), next(model.parameters()).device)
    except ValueError as err:
        raise ValueError(f"{err} ({', '.join(names)})") from None
    modules = [m for m in model.modules() if isinstance(m, MultiLoRALinear)]
    for m in modules:
        m.index = chosen
    try:
        yield
    finally:
        for m in modules:
            m.index = None
