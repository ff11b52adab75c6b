"""LoRA (Hu et al. 2021): fine-tune a frozen model through low-rank updates of some of its linear maps.

A targeted linear y = x W^T + b (W [out, in]) becomes y = x W^T + b + (alpha / r) * dropout(x) A^T B^T with A
[r, in] and B [out, r] the only trainable tensors: r (in + out) numbers instead of in * out. A starts as PEFT's
(Kaiming-uniform, a = sqrt(5)), B as zeros, so step 0 computes exactly the base model. The base product is the
model's own ``Linear`` (``tinygpt.fast``), or with QLoRA an ``NF4Linear`` (``quantize.py``).

``apply_lora`` wraps the chosen modules of a built ``GPTModel`` in place (gpt-fast style: ``layers.py`` and
``model.py`` know nothing of it). The targets, named after the modules they wrap:

    qkv       att.qkv        the fused query/key/value projection (PEFT on GPT-2: attn.c_attn)
    out_proj  att.out_proj   the attention's output projection    (attn.c_proj)
    ffn_in    ff.layers.0    the feed-forward's first linear      (mlp.c_fc); with SwiGLU gate and up fused
    ffn_out   ff.layers.2    the feed-forward's second linear     (mlp.c_proj)
    gate, up                 SwiGLU only: the two halves of ff.layers.0, each an adapter of its own (LLaMA's
                             gate_proj / up_proj)
    down                     SwiGLU only: ff.layers.2 (LLaMA's down_proj), the same module as ffn_out

``adapters_disabled(model)`` runs the base model (DPO's reference, PPO's frozen policy: one copy of the weights);
``merge`` folds the updates into the weights in place, ``merged_model`` returns a plain ``GPTModel``.
Measured by ``python -m benchmarks.lora``.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import asdict, dataclass, field
from typing import Any, Iterator, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from . import checks
from .fast import linear
from .quantize import BUFFER_NAMES, QUANTIZE_CHOICES, NF4Linear, is_double_quant, quantize_linears

# target -> (module path inside a block, which half of its output: None = all, 0 = first, 1 = second)
TARGETS: dict[str, tuple[str, int | None]] = {
    "qkv": ("att.qkv", None), "out_proj": ("att.out_proj", None),
    "ffn_in": ("ff.layers.0", None), "ffn_out": ("ff.layers.2", None),
    "gate": ("ff.layers.0", 0), "up": ("ff.layers.0", 1), "down": ("ff.layers.2", None),
}
_SWIGLU_ONLY = ("gate", "up", "down")
DEFAULT_TARGETS = ("qkv", "out_proj")


@dataclass(frozen=True)
class LoRAConfig:
    """Rank ``r``, ``alpha`` (the update is scaled by alpha / r), the dropout on the adapter's input, the targets
    (names of ``TARGETS``) and ``quantize`` (None, or for QLoRA every block linear in NF4: ``"nf4"``, or ``"nf4-dq"``
    with the per-block absmax values double-quantised)."""

    r: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    targets: tuple[str, ...] = field(default=DEFAULT_TARGETS)
    quantize: str | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "targets", tuple(self.targets))
        checks.positive_int("lora_r", self.r)
        checks.positive_number("lora_alpha", self.alpha)
        checks.number_in_range("lora_dropout", self.dropout, 0, 1, high_open=True)
        if not self.targets:
            raise ValueError(f"lora_targets is empty; choose from {', '.join(TARGETS)}")
        for name in self.targets:
            checks.choice("lora_targets", name, TARGETS)
        if len(set(self.targets)) != len(self.targets):
            raise ValueError(f"lora_targets {list(self.targets)} names a target twice")
        if self.quantize is not None:
            checks.choice("quantize", self.quantize, QUANTIZE_CHOICES)

    @property
    def scaling(self) -> float:
        return self.alpha / self.r

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "targets": list(self.targets)}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "LoRAConfig":
        return cls(**{k: data[k] for k in ("r", "alpha", "dropout", "targets", "quantize") if k in data})


def check_targets(config: LoRAConfig, model_config: Any) -> None:
    """``ValueError`` unless every target exists in this model and no module is adapted twice over."""
    swiglu = model_config.ffn == "swiglu"
    for name in config.targets:
        if name in _SWIGLU_ONLY and not swiglu:
            raise ValueError(f"lora target {name!r} needs a SwiGLU feed-forward (ffn='swiglu'); this model's ffn is "
                             f"{model_config.ffn!r}: use ffn_in / ffn_out")
    chosen = set(config.targets)
    for a, b in (("ffn_in", "gate"), ("ffn_in", "up"), ("ffn_out", "down")):
        if a in chosen and b in chosen:
            raise ValueError(f"lora targets {a!r} and {b!r} adapt the same weights: choose one")


class LoRALinear(nn.Module):
    """A frozen ``base`` linear (``Linear`` or ``NF4Linear``) plus low-rank updates: [..., in] -> [..., out].

    ``parts`` maps an adapter name to the rows of the output it updates (lo, hi): one part covering every row for a
    plain target, two for SwiGLU's gate and up. The parameters are ``lora_A.<name>`` [r, in] and ``lora_B.<name>``
    [hi - lo, r].
    """

    def __init__(self, base: nn.Module, config: LoRAConfig, parts: Mapping[str, tuple[int, int]],
                 generator: torch.Generator | None = None) -> None:
        super().__init__()
        self.base = base
        self.in_features, self.out_features = base.in_features, base.out_features
        self.r, self.scaling = config.r, config.scaling
        self.parts = dict(parts)
        self.dropout = nn.Dropout(config.dropout) if config.dropout > 0 else nn.Identity()
        self.enabled = True
        self.merged = False
        dtype = base.weight.dtype if isinstance(base, nn.Linear) else base.weight_dtype
        device = base.weight.device if isinstance(base, nn.Linear) else base.weight_nf4.device
        self.lora_A = nn.ParameterDict()
        self.lora_B = nn.ParameterDict()
        for name, (lo, hi) in self.parts.items():
            a = torch.empty(config.r, self.in_features, dtype=dtype)  # drawn on the CPU: any device, same numbers
            nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=generator)  # PEFT's init of lora_A (nn.Linear's)
            self.lora_A[name] = nn.Parameter(a.to(device))
            self.lora_B[name] = nn.Parameter(torch.zeros(hi - lo, config.r, dtype=dtype, device=device))

    def delta_weight(self, name: str) -> torch.Tensor:
        """scaling * B A: the update of rows lo..hi of the weight, [hi - lo, in]."""
        return self.scaling * (self.lora_B[name] @ self.lora_A[name])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)  # [..., out]
        if not self.enabled or self.merged:
            return y
        h = self.dropout(x)
        for name, (lo, hi) in self.parts.items():
            a, b = self.lora_A[name], self.lora_B[name]
            delta = linear(linear(h, a.to(h.dtype)), b.to(h.dtype)) * self.scaling  # [..., hi - lo]
            if (lo, hi) != (0, self.out_features):
                delta = F.pad(delta, (lo, self.out_features - hi))  # zeros outside this part's rows
            y = y + delta
        return y

    def merge(self) -> None:
        """Fold the updates into the base weight (a float base only); the forward then skips the adapters."""
        if self.merged:
            return
        if not isinstance(self.base, nn.Linear):
            raise ValueError("an NF4 base cannot take the update in place: use lora.merged_model")
        with torch.no_grad():
            for name, (lo, hi) in self.parts.items():
                self.base.weight[lo:hi] += self.delta_weight(name).to(self.base.weight.dtype)
        self.merged = True

    def unmerge(self) -> None:
        """Take the updates back out of the base weight (exact up to the rounding of one add and one subtract)."""
        if not self.merged:
            return
        with torch.no_grad():
            for name, (lo, hi) in self.parts.items():
                self.base.weight[lo:hi] -= self.delta_weight(name).to(self.base.weight.dtype)
        self.merged = False

    def merged_weight(self) -> torch.Tensor:
        """The weight [out, in] the map computes with now (base, dequantised, + the updates unless switched off),
        without changing anything."""
        base = self.base.weight if isinstance(self.base, nn.Linear) else self.base.dequantized_weight()
        weight = base.detach().clone()
        if self.enabled and not self.merged:
            for name, (lo, hi) in self.parts.items():
                weight[lo:hi] += self.delta_weight(name).detach().to(weight.dtype)
        return weight

    def extra_repr(self) -> str:
        return f"r={self.r}, scaling={self.scaling:g}, parts={self.parts}"


def is_adapted(model: nn.Module) -> bool:
    """Whether ``model`` carries LoRA adapters (``apply_lora``): it trains them rather than its own weights."""
    return getattr(model, "lora_config", None) is not None


def lora_modules(model: nn.Module) -> Iterator[tuple[str, LoRALinear]]:
    """(name, module) of every ``LoRALinear`` in ``model``."""
    for name, module in model.named_modules():
        if isinstance(module, LoRALinear):
            yield name, module


def apply_lora(model: nn.Module, config: LoRAConfig, *, seed: int | None = None) -> nn.Module:
    """Freeze ``model`` (a ``GPTModel``), quantise its block linears if asked, and wrap the targets, in place.

    The A matrices are drawn from a generator seeded with ``seed`` (None: torch's global RNG), so that the same
    seed gives the same adapters whatever the global RNG has been through.
    Afterwards only the ``lora_A`` / ``lora_B`` tensors require gradients; the model's ``config`` is unchanged.
    Returns the model. Call it once per model (``ValueError`` on a model that already has adapters).
    """
    check_targets(config, model.config)
    if any(True for _ in lora_modules(model)):
        raise ValueError("the model already has LoRA adapters")
    already = {m.double_quant for m in model.modules() if isinstance(m, NF4Linear)}
    if already and (config.quantize is None or already != {is_double_quant(config.quantize)}):
        kind = "nf4-dq" if True in already else "nf4"
        raise ValueError(f"the model's base is already quantised ({kind}) but the LoRA config says quantize="
                         f"{config.quantize!r}: load it with the same quantize")
    model.requires_grad_(False)
    generator = None if seed is None else torch.Generator().manual_seed(seed)
    if config.quantize is not None:  # what is still float (a model loaded with quantize= is in NF4 already)
        quantize_linears(model, double_quant=is_double_quant(config.quantize))
    for block in model.trf_blocks:
        by_module: dict[str, dict[str, tuple[int, int]]] = {}
        for name in config.targets:
            path, half = TARGETS[name]
            out = block.get_submodule(path).out_features
            rows = (0, out) if half is None else (half * out // 2, (half + 1) * out // 2)
            by_module.setdefault(path, {})[name] = rows
        for path, parts in by_module.items():
            parent_path, _, child = path.rpartition(".")
            parent = block.get_submodule(parent_path)
            setattr(parent, child, LoRALinear(parent.get_submodule(child), config, parts, generator))
    model.lora_config = config  # read by interop.peft.save_adapter
    model.lora_base = None  # the base's folder or hub name, which a saved adapter names (set by whoever knows it)
    return model


def lora_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapters' tensors by their names in ``model`` (e.g. ``trf_blocks.0.att.qkv.lora_A.qkv``)."""
    return {name: p.detach() for name, p in model.named_parameters() if ".lora_A." in name or ".lora_B." in name}


def load_lora_state_dict(model: nn.Module, state: Mapping[str, torch.Tensor], source: str = "adapter") -> None:
    """Copy ``state`` (names as ``lora_state_dict`` gives them) into the adapters: every name, exact shapes."""
    params = dict(model.named_parameters())
    expected = {name for name in params if ".lora_A." in name or ".lora_B." in name}
    missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
    if missing or unexpected:
        what = f"missing tensor {missing[0]!r}" if missing else f"unexpected tensor {unexpected[0]!r}"
        raise ValueError(f"{source}: {what} (the adapter does not fit this model's LoRA targets)")
    with torch.no_grad():
        for name, tensor in state.items():
            if tuple(tensor.shape) != tuple(params[name].shape):
                raise ValueError(f"{source}: tensor {name!r} has shape {list(tensor.shape)}, the model needs "
                                 f"{list(params[name].shape)} (another rank or model size)")
            params[name].copy_(tensor)


@contextlib.contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """Inside the block the model computes its base (the adapters are skipped; merged ones are taken back out)."""
    modules = [m for _, m in lora_modules(model)]
    before = [(m.enabled, m.merged) for m in modules]
    for m in modules:
        if m.merged:
            m.unmerge()
        m.enabled = False
    try:
        yield
    finally:
        for m, (enabled, merged) in zip(modules, before):
            m.enabled = enabled
            if merged:
                m.merge()


def merge(model: nn.Module) -> None:
    """Fold every adapter into its base weight in place (``unmerge`` takes them out again)."""
    for _, module in lora_modules(model):
        module.merge()


def unmerge(model: nn.Module) -> None:
    for _, module in lora_modules(model):
        module.unmerge()


def merged_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The plain ``GPTModel`` state dict of the adapted model: W + scaling * B A for each target, NF4 dequantised."""
    state: dict[str, torch.Tensor] = {}
    wrapped = dict(lora_modules(model))
    quantized = {name: m for name, m in model.named_modules() if isinstance(m, NF4Linear)}
    for name, tensor in model.state_dict().items():
        leaf = name.rpartition(".")[2]
        if ".lora_A." in name or ".lora_B." in name or leaf in BUFFER_NAMES:
            continue
        state[name.replace(".base.", ".")] = tensor.detach().clone()
    for name, module in quantized.items():
        state[f"{name.removesuffix('.base')}.weight"] = module.dequantized_weight()
    for name, module in wrapped.items():
        state[f"{name}.weight"] = module.merged_weight()
    return state


def merged_model(model: nn.Module) -> nn.Module:
    """A plain ``GPTModel`` (no adapters, float weights) computing what the adapted ``model`` computes (inside
    ``adapters_disabled``: its base, dequantised)."""
    from .checkpoint import model_from_state_dict

    state = merged_state_dict(model)
    if model.config.tie_weights:
        state.pop("out_head.weight", None)
    merged = model_from_state_dict(model.config, state, source="merged adapter")
    return merged.train(model.training)
