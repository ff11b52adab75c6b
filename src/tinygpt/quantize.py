"""4-bit NormalFloat (NF4) weights for QLoRA (Dettmers et al. 2023): a frozen base in a quarter of bfloat16's bytes.

A weight is cut into blocks of 64 consecutive values (row-major). Each block keeps its absolute maximum (float32)
and each value the index of the nearest of NF4's 16 levels to value / absmax: the levels are the quantiles of a
standard normal rescaled to [-1, 1] with an exact zero (the paper's appendix E), so that normally distributed
weights use every level about equally often. Two indices share a byte, the first in the high nibble.

These are bitsandbytes' bytes for the same tensor (``bitsandbytes.functional.quantize_4bit(w, blocksize=64,
quant_type="nf4")``: tested), so a reader can check one against the other: the same levels, the same scaling by
the reciprocal of the block's absmax, the same ties (a value exactly between two levels takes the lower one), the
same packing.

Double quantisation (``"nf4-dq"``, the paper's section 3) stores the absmax values themselves in 8 bits: their mean
is subtracted (kept as one float32), and the rest is cut into blocks of 256, each scaled by its own absmax (float32)
and rounded to the nearest of the 256 values of the signed dynamic 8-bit map (Dettmers 2015: a decimal exponent
and a fraction). That is 8 + 32 / 256 bits per 64 weights instead of 32: 0.373 fewer bits per weight. Against
bitsandbytes' ``quantize_4bit(..., compress_statistics=True)`` (tested): the same map, scales and mean, and each
code the nearest level, as bitsandbytes' pure-torch kernel takes it (its CPU kernel's approximate search picks the
neighbour for a few values in a thousand).

``NF4Linear`` stands in for a frozen ``Linear``: its product dequantises the weight (levels * absmax, float32, then
the input's dtype) and runs through ``tinygpt.fast.linear``. ``quantize_linears`` replaces a built model's block
linears; ``checkpoint.load_model(..., quantize=)`` instead quantises each of them as it is read from the file, so
the float base is never whole in memory. Measured by ``python -m benchmarks.lora``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from . import checks
from .fast import linear

BLOCK_SIZE = 64
ABSMAX_BLOCK_SIZE = 256  # double quantisation: absmax values per 8-bit block
QUANTIZE_CHOICES = ("nf4", "nf4-dq")  # NF4; NF4 with its absmax values double-quantised

# NF4's 16 levels, as bitsandbytes stores them (the float32 values of the paper's table).
NF4_LEVELS = (
    -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
    -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
    0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
)


def _levels(device: torch.device) -> torch.Tensor:
    return torch.tensor(NF4_LEVELS, dtype=torch.float32, device=device)


def quantize_nf4(weight: torch.Tensor, block_size: int = BLOCK_SIZE) -> tuple[torch.Tensor, torch.Tensor]:
    """weight (any shape, n values) -> (packed uint8 [ceil(n / 2)], absmax float32 [ceil(n / block_size)]).

    The last block may be short (its absmax is over its own values)."""
    flat = weight.detach().reshape(-1).float()
    n = flat.numel()
    blocks = -(-n // block_size)
    padded = torch.nn.functional.pad(flat, (0, blocks * block_size - n)).view(blocks, block_size)  # zeros: absmax kept
    absmax = padded.abs().amax(dim=1)  # [blocks]
    # Multiply by the reciprocal (not divide), clamped away from 0 for an all-zero block: bitsandbytes' arithmetic.
    scaled = torch.clamp(padded * (1.0 / absmax.clamp(min=1e-38))[:, None], -1, 1).reshape(-1)[:n]
    levels = _levels(flat.device)
    midpoints = (levels[:-1] + levels[1:]) / 2
    index = torch.bucketize(scaled, midpoints).to(torch.uint8)  # a tie (== midpoint) goes to the lower level
    if n % 2:
        index = torch.cat([index, index.new_full((1,), 7)])  # level 7 is 0.0: the pad nibble bitsandbytes writes
    packed = (index[0::2] << 4) | index[1::2]  # [ceil(n / 2)]
    return packed, absmax


def dynamic_levels() -> torch.Tensor:
    """The signed dynamic 8-bit map, float32 [256] ascending: for each decimal exponent e = -6 .. 0, the midpoints of
    2 ** (e + 6) equal steps of [0.1, 1] times 10 ** e, both signs, then 0 and 1 (the same float arithmetic as
    bitsandbytes' ``create_dynamic_map``, so the same float32 values)."""
    data: list[float] = []
    for i in range(7):
        boundaries = torch.linspace(0.1, 1, 2**i + 1, dtype=torch.float32)
        means = (boundaries[:-1] + boundaries[1:]) / 2.0
        data += ((10 ** (-6 + i)) * means).tolist()
        data += (-(10 ** (-6 + i)) * means).tolist()
    data += [0.0, 1.0]
    return torch.tensor(sorted(data), dtype=torch.float32)


def quantize_absmax(absmax: torch.Tensor, block_size: int = ABSMAX_BLOCK_SIZE
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Double quantisation: absmax float32 [n] -> (codes uint8 [n], scales float32 [ceil(n / block_size)], offset
    float32 []): absmax ~ levels[code] * scale of its block + offset, the offset being the mean."""
    offset = absmax.mean()
    centred = absmax - offset
    n = centred.numel()
    blocks = -(-n // block_size)
    padded = torch.nn.functional.pad(centred, (0, blocks * block_size - n)).view(blocks, block_size)
    scales = padded.abs().amax(dim=1)  # [blocks]
    scaled = torch.clamp(padded * (1.0 / scales.clamp(min=1e-38))[:, None], -1, 1).reshape(-1)[:n]
    levels = dynamic_levels().to(absmax.device)
    codes = torch.bucketize(scaled, (levels[:-1] + levels[1:]) / 2).to(torch.uint8)  # the nearest level
    return codes, scales, offset


def dequantize_absmax(codes: torch.Tensor, scales: torch.Tensor, offset: torch.Tensor,
                      block_size: int = ABSMAX_BLOCK_SIZE) -> torch.Tensor:
    """The inverse of ``quantize_absmax`` up to rounding: float32 [n]."""
    levels = dynamic_levels().to(codes.device)[codes.long()]
    return levels * scales.repeat_interleave(block_size)[: codes.numel()] + offset


def dequantize_nf4(packed: torch.Tensor, absmax: torch.Tensor, shape: torch.Size | tuple[int, ...],
                   block_size: int = BLOCK_SIZE, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The inverse of ``quantize_nf4`` up to rounding: levels[index] * absmax of the block, computed in float32."""
    n = 1
    for size in shape:
        n *= size
    index = torch.stack([packed >> 4, packed & 0xF], dim=1).reshape(-1)[:n].long()  # [n]
    values = _levels(packed.device)[index]
    blocks = absmax.float().repeat_interleave(block_size)[:n]
    return (values * blocks).view(shape).to(dtype)


class NF4Linear(nn.Module):
    """A frozen linear map whose weight [out, in] is held in NF4: buffers ``weight_nf4`` and ``weight_absmax``, or
    with ``double_quant`` ``weight_absmax_codes`` / ``weight_absmax_scales`` / ``weight_absmax_offset`` instead of
    the float32 absmax (``quantize_absmax``).

    [..., in] -> [..., out]. The bias, if any, stays in its own dtype (it is a vector: nothing to gain). Nothing
    here trains; gradients flow to the input only.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, block_size: int = BLOCK_SIZE,
                 double_quant: bool = False) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.block_size = block_size
        self.double_quant = double_quant
        self.weight_dtype = weight.dtype
        packed, absmax = quantize_nf4(weight, block_size)
        self.register_buffer("weight_nf4", packed)
        if double_quant:
            codes, scales, offset = quantize_absmax(absmax)
            self.register_buffer("weight_absmax_codes", codes)
            self.register_buffer("weight_absmax_scales", scales)
            self.register_buffer("weight_absmax_offset", offset)
        else:
            self.register_buffer("weight_absmax", absmax)
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), requires_grad=False)

    @classmethod
    def from_linear(cls, module: nn.Linear, block_size: int = BLOCK_SIZE, double_quant: bool = False
                    ) -> "NF4Linear":
        return cls(module.weight, module.bias, block_size, double_quant)

    def absmax(self) -> torch.Tensor:
        """The per-block absmax float32 [blocks] (double quantisation: as its 8-bit codes give it back)."""
        if self.double_quant:
            return dequantize_absmax(self.weight_absmax_codes, self.weight_absmax_scales, self.weight_absmax_offset)
        return self.weight_absmax

    def dequantized_weight(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The weight [out, in] as NF4 gives it back, in ``dtype`` (default: the dtype it was quantised from)."""
        return dequantize_nf4(self.weight_nf4, self.absmax(), (self.out_features, self.in_features),
                              self.block_size, dtype or self.weight_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.to(x.dtype)
        if torch.is_grad_enabled() and x.requires_grad:
            return _NF4Product.apply(x, self, bias)
        return linear(x, self.dequantized_weight(x.dtype), bias)

    def extra_repr(self) -> str:
        kind = "nf4, double-quantised absmax" if self.double_quant else "nf4"
        return f"in_features={self.in_features}, out_features={self.out_features}, {kind}, block_size={self.block_size}"


class _NF4Product(torch.autograd.Function):
    """x W^T + b whose backward dequantises W again instead of keeping it: autograd would otherwise hold every
    layer's float weight from the forward to the backward, the very memory NF4 saves (bitsandbytes' MatMul4Bit does
    the same). Gradients flow to x only: W and b are frozen."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, module: NF4Linear, bias: torch.Tensor | None) -> torch.Tensor:
        ctx.module = module
        return linear(x, module.dequantized_weight(x.dtype), bias)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        weight = ctx.module.dequantized_weight(grad.dtype)  # [out, in]
        # grad @ W, [..., out] @ [out, in] -> [..., in], as a linear with the transposed weight: oneDNN on a CPU
        return linear(grad, weight.t()), None, None


BUFFER_NAMES = ("weight_nf4", "weight_absmax", "weight_absmax_codes", "weight_absmax_scales", "weight_absmax_offset")


def check_quantize(quantize: str) -> None:
    """``ValueError`` unless ``quantize`` is one of ``QUANTIZE_CHOICES``."""
    checks.choice("quantize", quantize, QUANTIZE_CHOICES)


def is_double_quant(quantize: str | None) -> bool:
    """Whether a ``QUANTIZE_CHOICES`` value double-quantises the absmax values."""
    return quantize == "nf4-dq"


def block_linears(model: nn.Module) -> list[str]:
    """The names (in ``model``) of the ``nn.Linear`` modules inside its transformer blocks, in order: what
    ``quantize_linears`` replaces. Works on a model built on the meta device (the loader's skeleton)."""
    return [f"trf_blocks.{i}.{name}" for i, block in enumerate(model.trf_blocks)
            for name, module in block.named_modules() if isinstance(module, nn.Linear)]


def replace_linear(model: nn.Module, name: str, replacement: nn.Module) -> None:
    """Put ``replacement`` where the module ``name`` of ``model`` is."""
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, replacement)


def quantize_linears(model: nn.Module, block_size: int = BLOCK_SIZE, double_quant: bool = False) -> int:
    """Replace every ``nn.Linear`` inside the model's transformer blocks by its ``NF4Linear`` (in place, one at a
    time: each float weight is freed as soon as its NF4 copy exists, unless something else holds it); the
    embeddings, norms and the head stay as they are (the head is often the embedding itself). Returns how many."""
    names = block_linears(model)
    for name in names:
        replace_linear(model, name, NF4Linear.from_linear(model.get_submodule(name), block_size, double_quant))
    return len(names)
