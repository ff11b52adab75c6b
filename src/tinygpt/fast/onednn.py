"""The linear layers' product on oneDNN, where it computes what ``F.linear`` computes.

``F.linear`` runs on the BLAS torch was built with (MKL on x86). torch also ships oneDNN (mkldnn), whose linear
kernel fuses the bias and is faster for inference on a CPU, most of all for the one-row products of decoding, for
training through a frozen weight (LoRA's base: the forward's product and the backward's dL/dx), and for the large
products of training a weight (the forward, dL/dx and dL/dW; the rule is ``TRAINED_MIN_MACS``).
It is a private torch op, so it is taken only where it is known to be right: x86-64, a self-check at import, and
``applies``' rules. The values are the same dot products, up to float32 summation order.

Measured by ``python -m benchmarks.ab linear`` (one-row products and a cached decode) and
``python -m benchmarks.ab onednn`` (the forward) and ``python -m benchmarks.ab trained`` (trained weights, by shape).
"""

from __future__ import annotations

import platform
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.autograd.function import once_differentiable
from torch.utils._python_dispatch import _get_current_dispatch_mode

from .one_row import one_row_compiled, one_row_linear
from .switch import is_enabled


def _find_onednn_linear() -> Any:
    """torch's oneDNN (mkldnn) linear kernel, on x86-64 builds that have it and where it computes a small product
    exactly as ``F.linear`` does (integers: exact in any summation order); None elsewhere."""
    if platform.machine().lower() not in ("x86_64", "amd64") or not torch.backends.mkldnn.is_available():
        return None
    try:
        kernel = torch.ops.mkldnn._linear_pointwise
        x, weight, bias = torch.arange(6.0).view(2, 3), torch.arange(12.0).view(4, 3), torch.arange(4.0)
        with torch.no_grad():
            if torch.equal(kernel(x, weight, bias, "none", [], ""), F.linear(x, weight, bias)):
                return kernel
    except (AttributeError, RuntimeError):
        pass
    return None


# Found once; None where this torch has no usable kernel. Switched off with ``tinygpt.fast.disabled("onednn")``.
KERNEL = _find_onednn_linear()

_PLAIN = (torch.Tensor, nn.Parameter)


def available() -> bool:
    """Whether this torch has the oneDNN linear kernel (x86-64, and it passed the self-check)."""
    return KERNEL is not None


def _plain_cpu_float32(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Plain CPU float32 tensors, no autocast (which would want the product in bf16), no torch.compile trace (which
    picks its own kernels), no dispatch mode, tensor subclass or ``torch.func`` transform (``FlopCounterMode``, fake
    or distributed tensors, ``vmap`` and the like know ``aten`` products, not this one), and not switched off."""
    return (KERNEL is not None and type(x) is torch.Tensor and type(weight) in _PLAIN
            and x.device.type == "cpu" and x.dtype == torch.float32
            and weight.dtype == torch.float32 and (bias is None or bias.dtype == torch.float32)
            and not torch.is_autocast_enabled("cpu") and not torch.compiler.is_compiling()
            and _get_current_dispatch_mode() is None and not torch._C._functorch.is_functorch_wrapped_tensor(x)
            and is_enabled("onednn"))


# The rule for trained weights, from ``python -m benchmarks.ab trained`` (forward + backward of one linear, oneDNN
# against BLAS, by shape) on the 2-core AMD EPYC this was written on: at gpt2-small's block shapes (1,024 rows,
# 768 x 768 .. 768 x 3072, >= 6e8 multiply-adds per product) oneDNN's three products beat BLAS's; at nanoGPT's
# shakespeare-char shapes (768 rows, 128 x 512, ~5e7) they tie or lose, the fixed cost of each call dominating.
# A fixed rule rather than a timing at start-up: a run and its resume must pick the same kernels, or the float32
# sums (and a bit-identical resume) would differ.
TRAINED_MIN_MACS = 1 << 28  # rows * in * out of the forward's product (each of the three products has as many)


# The rule for inference, from ``python -m benchmarks.ab inference`` (one product per weight shape and row count,
# oneDNN against BLAS) on the 2-core AMD EPYC this was written on: a oneDNN call has a fixed cost of tens of
# microseconds, so on a small model's weights (the default ``tinygpt train`` model: 128 x 512 at most) BLAS's
# product is several times faster at 1 and 16 rows and no slower at 128, while from about gpt2-small's weights
# oneDNN ties or wins (docs/performance.md). A rule on the weight alone (not the rows), so a weight's prompt and
# decode products take one kernel.
INFERENCE_MIN_WEIGHT = 1 << 19  # weight.numel() (in * out) from which inference products run on oneDNN


def applies(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
            min_weight: int | None = None) -> bool:
    """Whether ``linear`` runs x @ weight.T + bias on oneDNN as a plain product: nothing needs a gradient, the
    weight has at least ``min_weight`` values (default ``INFERENCE_MIN_WEIGHT``), and the tensors are plain CPU
    float32 ones under none of the modes that must see ``aten`` products."""
    return (not (torch.is_grad_enabled()
                 and (x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)))
            and weight.numel() >= (INFERENCE_MIN_WEIGHT if min_weight is None else min_weight)
            and _plain_cpu_float32(x, weight, bias))


def frozen_applies(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> bool:
    """Whether ``linear`` runs through ``_FrozenLinear``: the input needs a gradient and the weight and bias do not
    (a LoRA base, a frozen layer), otherwise as ``applies``."""
    return (torch.is_grad_enabled() and x.requires_grad and not weight.requires_grad
            and (bias is None or not bias.requires_grad) and _plain_cpu_float32(x, weight, bias))


def trained_applies(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> bool:
    """Whether ``linear`` runs through ``_TrainedLinear``: the weight trains (needs a gradient), the product is at
    least ``TRAINED_MIN_MACS`` multiply-adds, ``tinygpt.fast.disabled("train")`` is not in force, otherwise as
    ``applies``."""
    return (torch.is_grad_enabled() and weight.requires_grad and is_enabled("train")
            and x.numel() * weight.shape[0] >= TRAINED_MIN_MACS and _plain_cpu_float32(x, weight, bias))


class _FrozenLinear(torch.autograd.Function):
    """y = x W^T + b with W and b frozen: both products on oneDNN, the forward's and the backward's dL/dx = dL/dy W
    (a linear with the transposed weight, a view: no copy of W is kept). Only dL/dx exists, so autograd's own
    route would be two BLAS products too; oneDNN's are faster on a CPU (``python -m benchmarks.lora_speed``)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(weight)
        return onednn_linear(x, weight, bias)  # [..., out]

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: torch.Tensor):
        (weight,) = ctx.saved_tensors
        return onednn_linear(grad, weight.t()), None, None  # [..., out] -> [..., in]


class _TrainedLinear(torch.autograd.Function):
    """y = x W^T + b with W (and b) trained: all three products on ``product`` (oneDNN's in ``linear``):
    y = product(x, W), dL/dx = product(g, W^T), dL/dW = g^T x = product(g^T, x^T), with g = dL/dy flattened to
    [N, out] and x to [N, in]; dL/db = the sum of g over the rows. These are the formulas autograd's own route for
    ``F.linear`` evaluates on BLAS; ``product`` is an argument so the tests can check them in float64 too."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                product: Any) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.product, ctx.has_bias = product, bias is not None
        return product(x, weight, bias)  # [..., out]

    @staticmethod
    @once_differentiable
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        grad_rows = grad.reshape(-1, grad.shape[-1])  # [N, out]
        dx = ctx.product(grad, weight.t()) if ctx.needs_input_grad[0] else None  # [..., in]
        dw = ctx.product(grad_rows.t(), x.reshape(-1, x.shape[-1]).t()) if ctx.needs_input_grad[1] else None
        db = grad_rows.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None  # [out]
        return dx, dw, db, None


def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The oneDNN product itself, for callers that already know ``applies``: [..., in] -> [..., out]."""
    # The kernel reads the bias as contiguous whatever its strides (a strided bias gave wrong sums: tested).
    return KERNEL(x, weight, None if bias is None else bias.contiguous(), "none", [], "")


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias``, what ``F.linear`` computes: [..., in] -> [..., out], weight [out, in].

    On oneDNN where ``applies`` (inference on a CPU in float32), ``frozen_applies`` (training through a frozen
    weight: LoRA's base) or ``trained_applies`` (training a weight, in products large enough to gain); everything
    else (small trained products, other devices and dtypes, autocast) is plain ``F.linear``.
    """
    if one_row_compiled(x):
        return one_row_linear(x, weight, bias)
    if weight.numel() < INFERENCE_MIN_WEIGHT and not torch.is_grad_enabled():
        return F.linear(x, weight, bias)  # what the three rules below give here, without their checks per call
    if applies(x, weight, bias):
        return onednn_linear(x, weight, bias)
    if frozen_applies(x, weight, bias):
        return _FrozenLinear.apply(x, weight, bias)
    if trained_applies(x, weight, bias):
        return _TrainedLinear.apply(x, weight, bias, onednn_linear)
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    """``nn.Linear`` (same parameters, init and state dict) whose forward is ``linear`` (oneDNN where it gains)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)
