"""The output head's product: hidden states [B, T, D] -> logits [B, T, V], on the fastest kernel that gives them.

Three cases, in order:

- where ``onednn.applies`` (inference on a CPU in float32): oneDNN's product;
- otherwise, without autograd on a CPU: torch's BLAS writes into a buffer whose rows are padded to a multiple of 64
  floats, and the [B, T, V] view of its first V columns is returned. With V = 50257 every output row would start
  misaligned, which slows the BLAS down. The padding columns are never written or read: ids >= V cannot be
  sampled, enter a loss or be exported, and the weights are untouched. The view is not contiguous (row stride > V);
- everything else (autograd, other devices, autocast, mixed dtypes): the plain ``F.linear``.

Measured by ``python -m benchmarks.ab head`` (the choice against a plain ``F.linear``).
"""

from __future__ import annotations

import torch
from torch import nn

from . import onednn
from .one_row import one_row_compiled, one_row_linear
from .switch import is_enabled

_ROW_ALIGN = 64  # floats: a 256-byte row start suits the BLAS's vector loads


class OutputHead(nn.Linear):
    """``nn.Linear(D, V, bias=False)`` (same parameter and state dict) whose forward picks the head's kernel."""

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        """h [B, T, D] -> logits [B, T, V]; see the module docstring for which product runs."""
        weight = self.weight  # [V, D]
        if torch.compiler.is_compiling():  # inductor's kernels (the switch's lookup would break the graph)
            return one_row_linear(h, weight, self.bias) if one_row_compiled(h) else super().forward(h)
        if not is_enabled("head") or self.bias is not None:
            return super().forward(h)
        if onednn.applies(h, weight):
            return onednn.onednn_linear(h, weight)
        v = weight.shape[0]
        row = -(-v // _ROW_ALIGN) * _ROW_ALIGN
        if (torch.is_grad_enabled() or row == v or h.device.type != "cpu" or h.dtype != weight.dtype
                or torch.is_autocast_enabled("cpu") or h.dim() != 3):
            return super().forward(h)
        b, t, d = h.shape
        logits = torch.empty(b * t, row, dtype=h.dtype, device=h.device)[:, :v]  # [B*T, V], row stride padded
        torch.mm(h.reshape(b * t, d), weight.t(), out=logits)
        return logits.view(b, t, v)
