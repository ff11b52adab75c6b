"""Next-token cross-entropy fused with the output head: hidden states and targets -> the mean loss, without logits.

The plain route, ``F.cross_entropy(out_head(h), targets)``, materialises [N, V] logits, then a [N, V] log-softmax,
then in the backward pass a [N, V] one-hot gradient, a [N, V] log-softmax gradient and a [N, V] logits gradient: five
tensors of N x V floats (1.6 GB each for gpt2-small at 8 x 1024 tokens) and as many passes over memory. For the loss
L = mean_i (logsumexp(z_i) - z_i[t_i]) with z_i = W h_i, the gradient is known in closed form,

    dL/dz_i = (softmax(z_i) - onehot(t_i)) / N,    dL/dh_i = W^T dL/dz_i,    dL/dW = sum_i dL/dz_i h_i^T,

so ``head_cross_entropy`` walks the rows in chunks, computes each chunk's logits, its softmax (one pass, into a
reused buffer), its loss and its two gradient products, and keeps only dL/dh [N, D] and dL/dW [V, D] for the
backward pass. Same FLOPs (three products), one exp pass instead of two, no [N, V] tensor at all, so the peak
memory of a training step no longer grows with N x V. Rows whose target is ignored (-100: SFT's prompt tokens,
most of an instruction example) never reach the head, so there the products shrink to the answer's rows.
Measured by ``python -m benchmarks --only train`` (against the plain route and the references) and
``python -m benchmarks.ab train`` (its chunks on oneDNN or BLAS).

``with tinygpt.fast.disabled("loss"):`` computes the plain route instead.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .onednn import applies as onednn_applies, onednn_linear
from .switch import is_enabled

IGNORE_INDEX = -100  # F.cross_entropy's default: targets equal to it add nothing to the loss or its gradient

# Rows per chunk: about 2^24 logits (64 MB in float32) per chunk, whatever V is.
_CHUNK_LOGITS = 1 << 24


def head_cross_entropy(
    h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *, ignore_index: int = IGNORE_INDEX
) -> torch.Tensor:
    """Mean cross-entropy of the logits ``h @ weight.T`` against ``targets``, ignoring ``ignore_index`` targets.

    h [..., D] hidden states, weight [V, D] (the bias-free head), targets [...] integer ids; returns a scalar equal
    to ``F.cross_entropy(h @ weight.T, targets, ignore_index=ignore_index)`` (NaN when every target is ignored, as
    there), differentiable in h and weight. Under autocast, ``torch.compile`` or ``disabled("loss")`` it is that
    plain expression.
    """
    if torch.compiler.is_compiling():  # the whole expression to the compiler, without the host-side checks
        return F.cross_entropy(F.linear(h, weight).flatten(0, -2).float(), targets.flatten(), ignore_index=ignore_index)
    if not isinstance(targets, torch.Tensor):
        raise TypeError(f"targets must be a torch.Tensor of token ids, got {type(targets).__name__}")
    if targets.shape != h.shape[:-1]:
        raise ValueError(f"targets must have shape {list(h.shape[:-1])} (one per position), got {list(targets.shape)}")
    if targets.dtype.is_floating_point or targets.dtype.is_complex or targets.dtype == torch.bool:
        raise TypeError(f"targets must hold integer token ids, got dtype {targets.dtype}")
    v = weight.shape[0]
    flat_h, flat_t = h.reshape(-1, h.shape[-1]), targets.reshape(-1).long()
    keep = flat_t != ignore_index  # [N]
    real = flat_t[keep]
    lo, hi = (int(real.min()), int(real.max())) if real.numel() else (0, 0)
    if lo < 0 or hi >= v:
        bad = lo if lo < 0 else hi
        raise ValueError(f"target id {bad} is out of range: targets must satisfy 0 <= id < vocab_size={v} "
                         f"(or equal ignore_index={ignore_index})")
    if torch.is_autocast_enabled(h.device.type) or h.dtype != weight.dtype or not is_enabled("loss"):
        return F.cross_entropy(F.linear(flat_h, weight).float(), flat_t, ignore_index=ignore_index)
    if 0 < real.numel() < flat_t.numel():
        # Only the rows with a target reach the head: an ignored row adds nothing to the loss or to any gradient, and
        # SFT ignores every prompt token (most of an instruction example). The [N, D] gradient of the dropped rows
        # is zero (index_select's backward scatters into zeros).
        rows = keep.nonzero().squeeze(1)  # [N'], the kept rows in order
        flat_h, flat_t = flat_h.index_select(0, rows), real
    return _HeadCrossEntropy.apply(flat_h, weight, flat_t, ignore_index)


class _HeadCrossEntropy(torch.autograd.Function):
    """The chunked loss; the forward pass also computes both gradients (see the module docstring)."""

    @staticmethod
    def forward(ctx, h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, ignore_index: int) -> torch.Tensor:
        n, v = h.shape[0], weight.shape[0]
        need_grad = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        # Each gradient only where it is wanted: a frozen head (LoRA) skips the [V, D] product and buffer.
        grad_h = torch.empty_like(h) if ctx.needs_input_grad[0] else None  # [N, D], unscaled: sum over the rows
        grad_w = torch.zeros_like(weight) if ctx.needs_input_grad[1] else None  # [V, D]
        rows = max(1, min(n, _CHUNK_LOGITS // max(v, 1)))
        # grad mode is off in here: CPU float32 takes oneDNN's product (the training loss keeps it at every size)
        onednn = onednn_applies(h, weight, min_weight=0)
        logits_buf = None if onednn else h.new_empty(rows, v)
        prob_buf = h.new_empty(rows, v)
        total = torch.zeros((), dtype=torch.float64, device=h.device)
        for start in range(0, n, rows):
            hc, tc = h[start : start + rows], targets[start : start + rows]  # [m, D], [m]
            m = hc.shape[0]
            if onednn:  # a fresh [m, V] (no out= there), still faster than torch.mm into the buffer (ab train)
                logits = onednn_linear(hc, weight)
            else:
                logits = torch.mm(hc, weight.t(), out=logits_buf[:m])  # [m, V]
            prob = torch.softmax(logits, dim=1, out=prob_buf[:m])  # [m, V]
            keep = tc != ignore_index  # [m]
            safe_t = torch.where(keep, tc, 0)[:, None]  # [m, 1], any valid id where ignored
            p_t = prob.gather(1, safe_t).squeeze(1)  # [m]
            # -log p_t is the loss; where p_t under- or nearly underflows, logsumexp - z_t keeps it exact.
            row_loss = -torch.log(p_t)
            tiny = keep & (p_t < 1e-30)
            if bool(tiny.any()):
                lse = torch.logsumexp(logits[tiny], dim=1)
                row_loss[tiny] = lse - logits[tiny].gather(1, safe_t[tiny]).squeeze(1)
            total += torch.where(keep, row_loss, 0.0).sum(dtype=torch.float64)
            if need_grad:
                prob.scatter_add_(1, safe_t, torch.where(keep, -1.0, 0.0).to(prob.dtype)[:, None])  # p - onehot
                if not bool(keep.all()):
                    prob[~keep] = 0.0  # ignored rows: no gradient at all
                if grad_h is not None and onednn:  # prob @ W as a linear with the transposed weight (a view)
                    grad_h[start : start + m] = onednn_linear(prob, weight.t())  # [m, D]
                elif grad_h is not None:
                    torch.mm(prob, weight, out=grad_h[start : start + m])  # [m, D]
                if grad_w is not None:
                    grad_w.addmm_(prob.t(), hc)  # [V, D]
        count = (targets != ignore_index).sum()
        ctx.save_for_backward(grad_h, grad_w, count)
        return (total / count).to(h.dtype)  # 0 / 0 = NaN when every target is ignored, as F.cross_entropy gives

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        grad_h, grad_w, count = ctx.saved_tensors
        scale = grad_loss / count  # d(mean)/d(row loss) = 1 / N, times the incoming gradient
        return (grad_h * scale if grad_h is not None and ctx.needs_input_grad[0] else None,
                grad_w * scale if grad_w is not None and ctx.needs_input_grad[1] else None, None, None)
