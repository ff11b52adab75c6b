"""The linear layers' product on oneDNN, where it computes what ``F.linear`` computes.

``F.linear`` runs on the BLAS torch was built with (MKL on x86). torch also ships oneDNN (mkldnn), whose linear
kernel fuses the bias and is faster for inference on a CPU, most of all for the one-row products of decoding.
It is a private torch op, so it is taken only where it is known to be right: x86-64, a self-check at import, and
``applies``' rules. The values are the same dot products, up to float32 summation order.

Measured by ``python -m benchmarks.ab linear`` (one-row products and a cached decode) and
``python -m benchmarks.ab onednn`` (the forward).
"""

from __future__ import annotations

import platform
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import _get_current_dispatch_mode

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


def applies(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> bool:
    """Whether ``linear`` runs x @ weight.T + bias on oneDNN: plain CPU float32 tensors, nothing that needs a
    gradient, no autocast (which would want the product in bf16), no torch.compile trace (which picks its own
    kernels), no dispatch mode, tensor subclass or ``torch.func`` transform (``FlopCounterMode``, fake or distributed
    tensors, ``vmap`` and the like know ``aten`` products, not this one), and not switched off."""
    return (KERNEL is not None and type(x) is torch.Tensor and type(weight) in _PLAIN
            and x.device.type == "cpu" and x.dtype == torch.float32
            and weight.dtype == torch.float32 and (bias is None or bias.dtype == torch.float32)
            and not (torch.is_grad_enabled()
                     and (x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)))
            and not torch.is_autocast_enabled("cpu") and not torch.compiler.is_compiling()
            and _get_current_dispatch_mode() is None and not torch._C._functorch.is_functorch_wrapped_tensor(x)
            and is_enabled("onednn"))


def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The oneDNN product itself, for callers that already know ``applies``: [..., in] -> [..., out]."""
    # The kernel reads the bias as contiguous whatever its strides (a strided bias gave wrong sums: tested).
    return KERNEL(x, weight, None if bias is None else bias.contiguous(), "none", [], "")


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias``, what ``F.linear`` computes: [..., in] -> [..., out], weight [out, in].

    On oneDNN where ``applies`` (inference on a CPU in float32); everything else (autograd, other devices and
    dtypes, autocast) is plain ``F.linear``.
    """
    if applies(x, weight, bias):
        return onednn_linear(x, weight, bias)
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    """``nn.Linear`` (same parameters, init and state dict) whose forward is ``linear`` (oneDNN for inference)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)
