"""Weights in fewer bytes for inference: bfloat16 and int8 weight-only linears, swapped in after the model is built.

A decode step reads every weight once, so on a CPU its time is the weights' bytes over the memory bandwidth: half
the bytes, close to half the time. The model file never sees this: ``convert_weights`` replaces the ``nn.Linear``
modules of the blocks and the output head by modules that keep their weight in fewer bytes (gpt-fast's
``quantize.py`` does the same on GPUs). Embeddings, norms, biases, the cache and every activation stay float32;
only the products read the smaller weights.

- ``bfloat16``: the weight rounded to bfloat16 (8 bits of mantissa) and, where torch has oneDNN with bf16 support
  (AVX512_BF16 or AMX), stored in oneDNN's own packed layout and multiplied by its bf16 kernel, which reads the
  two-byte weights directly; the input is rounded to bf16, the sum accumulated in float32, the result rounded to
  bf16 and the bias added in float32. Elsewhere the product is ``F.linear`` on bf16 tensors (correct, not faster).
- ``int8``: each output channel's weights scaled by absmax / 127 and rounded to int8 (symmetric, per channel), the
  product torch's ``_weight_int8pack_mm`` (x [M, in] bf16 @ int8 weight^T, times the channel's scale): one byte per
  weight. The input is rounded to bf16 first (that kernel is fastest with bf16 input on CPU).

A GGUF file's f16 / bf16 / q8_0 tensors are read straight into these types, never as a float32 model
(``interop.gguf_weights``), and so are a checkpoint's float tensors (``checkpoint.model_from_tensors``). Inside a
compiled decode step a one-row product is ``fast.one_row``'s loop over the stored weight instead of these kernels
(``plain_weights`` first lays packed bf16 weights out plain for it). Inference only: a converted model refuses to
train (its linears have no float weight to update). Measured by ``python -m benchmarks.weights`` (and beside
llama.cpp by ``python -m benchmarks.llamacpp``; the products alone by ``python -m benchmarks.decode_bound``).
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from torch import nn

from . import row_kernels
from .one_row import one_row_compiled, one_row_linear

WEIGHT_TYPES = ("float32", "bfloat16", "int8")
_WARNED: set[str] = set()


def _say_once(key: str, message: str) -> None:
    if key not in _WARNED:
        _WARNED.add(key)
        print(f"tinygpt: {message}", file=sys.stderr)


def onednn_bf16() -> bool:
    """Whether this torch and CPU run oneDNN's bf16 linear (the fast route for ``bfloat16`` weights)."""
    try:
        return (torch.backends.mkldnn.is_available() and bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
                and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))
    except (AttributeError, RuntimeError):
        return False


def check_weight_type(weight_type: str) -> None:
    if weight_type not in WEIGHT_TYPES:
        raise ValueError(f"weights={weight_type!r} is not a weight type: use one of {', '.join(WEIGHT_TYPES)}")


class _InferenceLinear(nn.Module):
    """What both weight types share: a float32 bias, the input's leading dimensions, no training."""

    def __init__(self, in_features: int, out_features: int, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.register_buffer("bias", None if bias is None else bias.detach().float().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., in] (any float dtype) -> [..., out] float32."""
        if torch.is_grad_enabled() and x.requires_grad:
            raise RuntimeError(f"a model with {self.weight_type} weights is for inference only: train the float32 "
                               f"model and convert it afterwards")
        y = self.product(x.reshape(-1, self.in_features).to(torch.bfloat16)).float()  # [M, out]
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class Bf16Linear(_InferenceLinear):
    """A linear layer whose weight is stored in bfloat16 (oneDNN's packed layout where it has a bf16 kernel)."""

    weight_type = "bfloat16"

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__(weight.shape[1], weight.shape[0], bias)
        w = weight.detach().to(torch.bfloat16).contiguous()  # [out, in]
        self.packed = w.device.type == "cpu" and onednn_bf16()
        if w.device.type == "cpu" and not self.packed:
            _say_once("bf16", "this CPU or torch has no oneDNN bf16 linear: bfloat16 weights use F.linear (half the "
                              "memory, not faster)")
        self.register_buffer("weight", torch.ops.mkldnn._reorder_linear_weight(w, 1) if self.packed else w)

    def unpack(self) -> None:
        """Lay the weight out plain ([out, in] bf16) again, for a compiled decode step (``plain_weights``)."""
        if self.packed:
            self.weight = self.weight.to_dense()
            self.packed = False

    def product(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, in] bf16 -> [M, out] bf16."""
        if one_row_compiled(x) and not self.packed:  # read at the memory's rate by a kernel where it is built
            if row_kernels.ready() and self.weight.numel() >= row_kernels.MIN_WEIGHTS:
                return row_kernels.bf16_row_mm(x.float(), self.weight).to(torch.bfloat16)
            return one_row_linear(x, self.weight).to(torch.bfloat16)
        if self.packed:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, None, "none", [], "")
        return F.linear(x, self.weight)


class Int8Linear(_InferenceLinear):
    """A linear layer whose weight is int8 with one float scale per output channel (weight ~ q * scale)."""

    weight_type = "int8"

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__(weight.shape[1], weight.shape[0], bias)
        q, scale = quantize_int8(weight)
        self.register_buffer("qweight", q)  # [out, in] int8
        self.register_buffer("scale", scale)  # [out] float32

    @classmethod
    def from_int8(cls, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None) -> "Int8Linear":
        """The layer of already quantised weights: q [out, in] int8, scale [out] float32 (a GGUF read row by row,
        ``interop.gguf_weights``), kept as given."""
        if q.dtype != torch.int8 or q.dim() != 2 or tuple(scale.shape) != (q.shape[0],):
            raise ValueError(f"Int8Linear.from_int8 takes q [out, in] int8 and scale [out]; got {q.dtype} "
                             f"{tuple(q.shape)} and {tuple(scale.shape)}")
        layer = cls.__new__(cls)
        _InferenceLinear.__init__(layer, q.shape[1], q.shape[0], bias)
        layer.register_buffer("qweight", q)
        layer.register_buffer("scale", scale.float())
        return layer

    def product(self, x: torch.Tensor) -> torch.Tensor:
        """x [M, in] bf16 -> [M, out] bf16: (x @ q^T) * scale, the int8 weights read as they are stored."""
        if one_row_compiled(x):  # the int8 weights read once: in integers where the kernel is built (row_kernels)
            if row_kernels.ready() and self.qweight.numel() >= row_kernels.MIN_WEIGHTS:
                return row_kernels.int8_row_mm(x.float(), self.qweight, self.scale).to(torch.bfloat16)
            return (one_row_linear(x, self.qweight) * self.scale).to(torch.bfloat16)
        scale = self.scale.to(torch.bfloat16)  # the kernel applies the scale in its input's dtype
        if x.device.type == "cpu" and self.in_features % 16 == 0:
            # torch's CPU kernel reads the input 16 values at a time: on other widths it crashed or summed wrongly
            # (seen with torch 2.13), so those take the plain route below
            if torch.compiler.is_compiling():  # inductor's own lowering of the kernel failed on rows > 1
                return int8_weight_mm(x, self.qweight, scale)
            return torch._weight_int8pack_mm(x, self.qweight, scale)
        return (F.linear(x.float(), self.qweight.float()) * scale.float()).to(torch.bfloat16)


@torch.library.custom_op("tinygpt::int8_weight_mm", mutates_args=())
def int8_weight_mm(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [M, in] bf16 @ qweight [out, in] int8 ^T * scale [out] -> [M, out] bf16: torch's ``_weight_int8pack_mm``
    as one op that a compiled step calls as it is (inductor's lowering of it failed here on a batch of rows:
    ``LoweringException: AssertionError``, torch 2.13)."""
    return torch._weight_int8pack_mm(x, qweight, scale)


@int8_weight_mm.register_fake
def _(x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return x.new_empty(x.shape[0], qweight.shape[0])


def plain_weights(model: nn.Module) -> int:
    """Before the decode step is compiled: ``Bf16Linear`` weights out of oneDNN's packed layout, which inductor cannot
    read, back into the plain [out, in] one that the compiled step's one-row loops read (``fast.one_row``; they read
    faster than the packed kernel: ``benchmarks.decode_bound``). Prompts and batched steps then run oneDNN on the
    plain weight, which it packs per call. Returns how many were laid out again."""
    layers = [m for m in model.modules() if isinstance(m, Bf16Linear) and m.packed]
    for layer in layers:
        layer.unpack()
    return len(layers)


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [out, in] float -> (q [out, in] int8, scale [out] float32): per output channel, symmetric,
    scale = absmax / 127 (1 for an all-zero channel), q = round(weight / scale) in [-127, 127]. A few rows at a time,
    so the float32 temporaries stay small beside the weight (a loader converting weight after weight would
    otherwise leave the allocator holding several copies of the largest one)."""
    q = torch.empty(weight.shape, dtype=torch.int8, device=weight.device)
    scale = torch.empty(weight.shape[0], dtype=torch.float32, device=weight.device)
    step = max(1, (1 << 16) // max(1, weight.shape[1]))  # rows per chunk: 256 KiB of float32
    for start in range(0, weight.shape[0], step):
        w = weight[start:start + step].detach().float()
        s = w.abs().amax(dim=1) / 127.0  # [rows]
        s = torch.where(s > 0, s, torch.ones_like(s))
        q[start:start + step] = torch.round(w / s[:, None]).clamp(-127, 127)
        scale[start:start + step] = s
    return q, scale


def convert_weights(model: nn.Module, weight_type: str) -> int:
    """Replace the ``nn.Linear`` modules of the model's transformer blocks and its output head by ``weight_type``
    linears, in place (a tied head gets its own small copy; the embedding stays float32). The model goes to eval
    mode. Returns how many were replaced (0 for ``float32``: nothing to do)."""
    check_weight_type(weight_type)
    if weight_type == "float32":
        return 0
    kind = Bf16Linear if weight_type == "bfloat16" else Int8Linear
    names = [f"trf_blocks.{i}.{name}" for i, block in enumerate(model.trf_blocks)
             for name, module in block.named_modules() if isinstance(module, nn.Linear)]
    if isinstance(getattr(model, "out_head", None), nn.Linear):
        names.append("out_head")
    for name in names:
        linear = model.get_submodule(name)
        if linear.weight.dtype not in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
            raise ValueError(f"{name} has {linear.weight.dtype} weights: only float weights can be converted")
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, kind(linear.weight, linear.bias))
    model.eval()
    model.weight_type = weight_type
    return len(names)
