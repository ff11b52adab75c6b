"""RLHF with PPO (stage four; Schulman et al. 2017, as used by InstructGPT): the math, free of any data handling.

Per sampled response (actions a_0..a_{n-1} after the prompt), with the policy's and the frozen reference's
log-probabilities at sampling time:

- reward per token: r_t = -kl_coef * (log pi_old(a_t) - log pi_ref(a_t)), plus the scalar score of the whole
  response at its last token (the per-token KL penalty keeps the policy near the reference, InstructGPT eq. 2);
- GAE (Schulman et al. 2016): delta_t = r_t + gamma V_{t+1} - V_t, A_t = delta_t + gamma lambda A_{t+1}, with
  V_n = 0 after the last token; returns R_t = A_t + V_t; advantages are whitened over the batch;
- clipped policy loss: mean max(-A ratio, -A clip(ratio, 1 - eps, 1 + eps)), ratio = pi_new / pi_old;
- clipped value loss: mean 0.5 max((V - R)^2, (V_old + clip(V - V_old, -eps_v, eps_v) - R)^2).

All tensors are [B, N]: row i's n_i actions left-aligned, ``mask`` true on them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import checks
from ..checks import option
from .logprobs import masked_mean


@dataclass(frozen=True)
class PPOConfig:
    """PPO's settings; the defaults are common small-model values (TRL's / InstructGPT's order of magnitude)."""

    max_new_tokens: int = option(32, "longest sampled response")
    temperature: float = option(1.0, "sampling temperature")
    top_k: int | None = option(None, "sample among the K most likely tokens", metavar="K", default_help="all")
    kl_coef: float = option(0.05, "per-token KL penalty")
    gamma: float = option(1.0, "discount")
    lam: float = option(0.95, "GAE lambda")
    clip_range: float = option(0.2, "policy ratio clip")
    value_clip_range: float = option(0.2, "value clip")
    value_coef: float = option(0.5, "value loss weight")
    entropy_coef: float = option(0.0, "entropy bonus")
    ppo_epochs: int = option(4, "passes over each rollout batch")
    minibatch_size: int | None = option(None, "rows per update", default_help="the whole rollout batch")

    def __post_init__(self) -> None:
        for name in ("max_new_tokens", "ppo_epochs"):
            checks.positive_int(name, getattr(self, name))
        for name in ("top_k", "minibatch_size"):
            checks.positive_int(name, getattr(self, name), optional=True)
        checks.positive_number("temperature", self.temperature, note="(PPO needs sampled responses)")
        for name in ("kl_coef", "value_coef", "entropy_coef"):
            checks.non_negative_number(name, getattr(self, name))
        for name in ("gamma", "lam"):
            checks.number_in_range(name, getattr(self, name), 0, 1)
        for name in ("clip_range", "value_clip_range"):
            checks.positive_number(name, getattr(self, name))


def token_rewards(scores: torch.Tensor, logp_old: torch.Tensor, logp_ref: torch.Tensor, mask: torch.Tensor,
                  kl_coef: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rewards [B, N], per-token KL estimate [B, N]): -kl_coef * KL everywhere, + the score [B] at each row's
    last action. The KL estimate is log pi_old - log pi_ref (its mean over samples is KL(pi_old || pi_ref))."""
    kl = (logp_old - logp_ref) * mask
    rewards = -kl_coef * kl
    last = mask.long().sum(dim=1) - 1  # [B]
    rows = torch.arange(scores.shape[0], device=scores.device)
    rewards[rows, last] += scores.to(rewards.dtype)
    return rewards, kl


def gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float
        ) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages, returns), [B, N] each, zero outside ``mask`` (which must be a prefix of every row)."""
    mask = mask.to(values.dtype)
    values = values * mask
    advantages = torch.zeros_like(values)
    running = torch.zeros_like(values[:, 0])
    n = values.shape[1]
    for t in reversed(range(n)):
        next_mask = mask[:, t + 1] if t + 1 < n else torch.zeros_like(running)
        next_value = values[:, t + 1] * next_mask if t + 1 < n else torch.zeros_like(running)
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        running = (delta + gamma * lam * running * next_mask) * mask[:, t]
        advantages[:, t] = running
    return advantages, (advantages + values) * mask


def whiten(values: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """(values - mean) / std over the masked entries; zero outside the mask."""
    mean = masked_mean(values, mask)
    var = masked_mean((values - mean) ** 2, mask)
    return (values - mean) * torch.rsqrt(var + eps) * mask


def policy_loss(logp_new: torch.Tensor, logp_old: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
                clip_range: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(clipped surrogate loss, fraction of masked tokens whose ratio was clipped)."""
    ratio = torch.exp(logp_new - logp_old)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_range, 1.0 + clip_range)
    loss = masked_mean(torch.maximum(unclipped, clipped), mask)
    clip_fraction = masked_mean(((ratio - 1.0).abs() > clip_range).float(), mask)
    return loss, clip_fraction.detach()


def value_loss(values_new: torch.Tensor, values_old: torch.Tensor, returns: torch.Tensor, mask: torch.Tensor,
               clip_range: float) -> torch.Tensor:
    """Clipped value loss (PPO2's): the larger of the plain and the clipped squared error, halved."""
    clipped = values_old + (values_new - values_old).clamp(-clip_range, clip_range)
    return 0.5 * masked_mean(torch.maximum((values_new - returns) ** 2, (clipped - returns) ** 2), mask)
