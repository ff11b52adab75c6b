"""How the weights move: AdamW with weight decay on matrices only, or Muon on the blocks' matrices with AdamW on the
rest; the warmup + cosine learning-rate schedule; and the clipped step that refuses a non-finite loss -- shared by
pretraining and every fine-tuning stage."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from .lifecycle import Diverged
from .options import LoopOptions


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
    return _adamw_groups([p for p in model.parameters() if p.requires_grad], lr=lr, weight_decay=weight_decay,
                         betas=betas, eps=eps)


def _adamw_groups(params: list[torch.Tensor], *, lr: float, weight_decay: float, betas: tuple[float, float],
                  eps: float) -> torch.optim.AdamW:
    """AdamW with 2-D weights decaying and vectors not (see ``build_optimizer``)."""
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay, "peak_lr": lr},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0, "peak_lr": lr},
    ]
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps)


def is_hidden_matrix(name: str, param: torch.Tensor) -> bool:
    """Whether Muon moves this parameter: a 2-D weight inside a transformer block (the QKV, output and FFN
    projections; a fused QKV or gate/up matrix is orthogonalised as one). The embeddings, the head, a reward or
    value head, and every vector (biases, norm scales) are AdamW's, as in Keller Jordan's Muon and nanochat."""
    return param.dim() == 2 and ".trf_blocks." in f".{name}"


class MuonWithAdamW:
    """Two optimizers stepped as one: ``torch.optim.Muon`` on the hidden matrices, ``torch.optim.AdamW`` on the
    rest. ``param_groups`` is both lists (Muon's first), so the schedule sets every group's rate; ``parts`` is what
    a checkpoint saves (``distributed.full_state`` keys both by parameter name)."""

    def __init__(self, muon: torch.optim.Optimizer, adamw: torch.optim.Optimizer) -> None:
        self.muon, self.adamw = muon, adamw
        self.parts = [muon, adamw]

    @property
    def param_groups(self) -> list[dict]:
        return self.muon.param_groups + self.adamw.param_groups

    def step(self) -> None:
        for part in self.parts:
            part.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for part in self.parts:
            part.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict:
        return {"muon": self.muon.state_dict(), "adamw": self.adamw.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.muon.load_state_dict(state["muon"])
        self.adamw.load_state_dict(state["adamw"])


def build_muon(
    model: nn.Module,
    *,
    lr: float,
    muon_lr: float,
    muon_momentum: float = 0.95,
    muon_weight_decay: float = 0.0,
    weight_decay: float = 0.1,
    betas: tuple[float, float] = (0.9, 0.95),
    eps: float = 1e-8,
) -> MuonWithAdamW:
    """Muon (``muon_lr``, Nesterov momentum ``muon_momentum``, 5 Newton-Schulz steps, torch's default shape
    adjustment sqrt(max(1, out/in)), decoupled decay ``muon_weight_decay``) on ``is_hidden_matrix`` parameters;
    AdamW (``lr``, ``build_optimizer``'s two groups) on the others. Each group remembers its peak rate
    (``peak_lr``), which the schedule scales."""
    if not muon_lr > 0:
        raise ValueError(f"muon_lr={muon_lr!r} must be > 0")
    hidden = [p for n, p in model.named_parameters() if p.requires_grad and is_hidden_matrix(n, p)]
    if not hidden:
        raise ValueError("--optimizer muon found no trainable matrix inside a transformer block to move")
    rest = [p for n, p in model.named_parameters() if p.requires_grad and not is_hidden_matrix(n, p)]
    muon = torch.optim.Muon([{"params": hidden, "peak_lr": muon_lr}], lr=muon_lr, momentum=muon_momentum,
                            weight_decay=muon_weight_decay)
    adamw = _adamw_groups(rest, lr=lr, weight_decay=weight_decay, betas=betas, eps=eps)
    return MuonWithAdamW(muon, adamw)


def build_for(model: nn.Module, options: LoopOptions) -> torch.optim.Optimizer | MuonWithAdamW:
    """The optimizer ``options.optimizer`` names, with the options' rates, betas and weight decays."""
    betas = (options.beta1, options.beta2)
    if options.optimizer == "muon":
        return build_muon(model, lr=options.lr, muon_lr=options.muon_lr, muon_momentum=options.muon_momentum,
                          muon_weight_decay=options.muon_weight_decay, weight_decay=options.weight_decay, betas=betas)
    return build_optimizer(model, lr=options.lr, weight_decay=options.weight_decay, betas=betas)


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


def lr_at_fraction(step: int, spent: float, *, lr: float, min_lr: float, warmup_steps: int) -> float:
    """``lr_at`` over a time budget: the same linear warmup over the first ``warmup_steps`` steps, then the half
    cosine from ``lr`` to ``min_lr`` over the fraction ``spent`` (0..1) of the budget used so far."""
    if step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    return min_lr + 0.5 * (lr - min_lr) * (1.0 + math.cos(math.pi * min(1.0, max(0.0, spent))))


def set_lr(optimizer: torch.optim.Optimizer | MuonWithAdamW, value: float, base_lr: float | None = None) -> None:
    """Every group's rate: ``value``, scaled for a group whose peak rate (``peak_lr``) differs from ``base_lr``
    (Muon's matrices: value * muon_lr / lr)."""
    for group in optimizer.param_groups:
        peak = group.get("peak_lr", base_lr)
        group["lr"] = value if base_lr is None or peak == base_lr else value * peak / base_lr


@dataclass(frozen=True)
class Schedule:
    """The warmup + cosine schedule of one run (``lr_at``, or ``lr_at_fraction`` over a time budget: then
    ``max_steps`` is None); ``min_lr`` None = lr / 10."""

    lr: float
    min_lr: float | None
    warmup_steps: int
    max_steps: int | None

    def apply(self, optimizer: torch.optim.Optimizer | MuonWithAdamW, step: int, spent: float = 0.0) -> float:
        """Set the learning rate of 0-based ``step`` (with a budget: after the fraction ``spent`` of it) on every
        group (a group with its own peak rate, Muon's, gets the same fraction of it); returns the base rate."""
        min_lr = self.lr / 10 if self.min_lr is None else self.min_lr
        if self.max_steps is None:
            value = lr_at_fraction(step, spent, lr=self.lr, min_lr=min_lr, warmup_steps=self.warmup_steps)
        else:
            value = lr_at(step, lr=self.lr, min_lr=min_lr, warmup_steps=self.warmup_steps, max_steps=self.max_steps)
        set_lr(optimizer, value, self.lr)
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
