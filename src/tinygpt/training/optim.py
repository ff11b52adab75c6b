"""How the weights move: AdamW with weight decay on matrices only, the warmup + cosine learning-rate schedule, and
the clipped step that refuses a non-finite loss -- shared by pretraining and every fine-tuning stage."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from .lifecycle import Diverged


def build_optimizer(
    model: nn.Module,
    *,
    lr: float,
    weight_decay: float = 0.1,
    betas: tuple[float, float] = (0.9, 0.95),
    eps: float = 1e-8,
) -> torch.optim.AdamW:
    """AdamW over two groups: 2-D weights (linear and embedding matrices) decay, vectors (biases, LayerNorm
    scale/shift) do not -- decaying a LayerNorm scale towards 0 or a bias towards 0 only fights the data.

    A tied head/embedding weight is one ``Parameter`` and appears once (``named_parameters`` de-duplicates).
    """
    if not lr > 0:
        raise ValueError(f"lr={lr!r} must be > 0")
    if weight_decay < 0:
        raise ValueError(f"weight_decay={weight_decay!r} must be >= 0")
    decay, no_decay = [], []
    for _, param in model.named_parameters():
        if param.requires_grad:
            (decay if param.dim() >= 2 else no_decay).append(param)
    groups = [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps)


def lr_at(step: int, *, lr: float, min_lr: float, warmup_steps: int, max_steps: int) -> float:
    """The learning rate for optimizer step ``step`` (0-based).

    Linear warmup lr * (step + 1) / warmup_steps for the first ``warmup_steps`` steps, then a half cosine from
    ``lr`` down to ``min_lr`` at ``max_steps``; constant ``min_lr`` after that.
    """
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    if step >= max_steps:
        return min_lr
    progress = (step - warmup_steps) / max(1, max_steps - warmup_steps)  # in [0, 1)
    return min_lr + 0.5 * (lr - min_lr) * (1.0 + math.cos(math.pi * progress))


def set_lr(optimizer: torch.optim.Optimizer, value: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = value


@dataclass(frozen=True)
class Schedule:
    """The warmup + cosine schedule of one run (``lr_at``); ``min_lr`` None = lr / 10."""

    lr: float
    min_lr: float | None
    warmup_steps: int
    max_steps: int

    def apply(self, optimizer: torch.optim.Optimizer, step: int) -> float:
        """Set the learning rate of 0-based ``step`` on every group; returns it."""
        min_lr = self.lr / 10 if self.min_lr is None else self.min_lr
        value = lr_at(step, lr=self.lr, min_lr=min_lr, warmup_steps=self.warmup_steps, max_steps=self.max_steps)
        set_lr(optimizer, value)
        return value


def optimizer_step(optimizer: torch.optim.Optimizer, loss: float, grad_clip: float, step: int) -> float:
    """Clip the global gradient norm of the optimizer's parameters (``grad_clip`` 0 = measure only), refuse a
    non-finite ``loss`` or norm (``Diverged``, gradients dropped, weights untouched), step, zero the gradients.
    ``step`` is the 0-based step being taken; returns the gradient norm before clipping."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    norm = float(torch.nn.utils.clip_grad_norm_(params, grad_clip if grad_clip > 0 else math.inf))
    if not (math.isfinite(loss) and math.isfinite(norm)):
        optimizer.zero_grad(set_to_none=True)
        raise Diverged(step + 1, loss, norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return norm
