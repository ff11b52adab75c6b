"""One-row products inside a compiled decode step: the product written as a sum that inductor turns into one loop.

A batch-1 decode step multiplies one row by every weight, so its time is the weights' bytes read. Inside
``torch.compile`` a linear is otherwise an external BLAS call per weight (a fixed cost each, a weight converted to
float first where it is stored in fewer bytes); written as ``(x[:, None, :] * weight).sum(-1)`` inductor generates
one vectorised loop per weight that reads it once in its stored dtype and fuses the bias and what follows. Only for
one row: with more rows the same loop would read every weight once per row, where a matrix product reads it once.
The sum is in float32 in inductor's order, not BLAS's: equal to ``F.linear`` up to float32 rounding.
"""

from __future__ import annotations

import torch


def one_row_compiled(x: torch.Tensor) -> bool:
    """Whether ``x`` [..., in] is one row inside a ``torch.compile`` trace (a batch-1 decode step)."""
    return torch.compiler.is_compiling() and x.numel() == x.shape[-1]


def one_row_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., in] (one row) @ weight [out, in]^T + bias -> [..., out] float32, as a sum over ``in``."""
    y = (x.reshape(1, 1, -1).float() * weight.float()[None]).sum(-1)  # [1, out]
    if bias is not None:
        y = y + bias
    return y.reshape(*x.shape[:-1], weight.shape[0])
