"""GRPO (Shao et al. 2024, DeepSeekMath; DeepSeek-R1): the math, free of any sampling or data handling.

PPO (``ppo``) needs a value model for its baseline and a reward model for its score. GRPO drops both: a verifier
scores each completion, and the baseline is the mean reward of the G completions sampled for the same prompt.

- advantage of completion i in its group: A_i = r_i - mean(r_group), divided by std(r_group) + 1e-4 when the
  rewards are scaled per group (``scale="group"``, GRPO's), by the whole batch's std (``"batch"``), or not at all
  (``"none"``, Dr. GRPO's: the std division favours groups that are almost all right or all wrong). std is the
  unbiased (n - 1) one; every token of a completion gets its completion's A;
- per token t: ratio_t = pi(a_t) / pi_old(a_t) (pi_old: the policy that sampled, so 1 at the first update and
  the importance weight of later ones), loss_t = -min(ratio_t A, clip(ratio_t, 1 - eps_low, 1 + eps_high) A)
  + beta kl_t, with kl_t = exp(ref_t - logp_t) - (ref_t - logp_t) - 1 (Schulman's k3 estimator of
  KL(pi || pi_ref): non-negative, unbiased, DeepSeekMath eq. 4);
- the mean over the tokens (``LOSS_TYPES``): ``grpo`` averages each completion's tokens, then the completions
  (long completions weigh less per token); ``dapo`` averages every token of the batch together (DAPO, Yu et al.
  2025); ``dr_grpo`` divides the batch's token sum by rows x ``max_new_tokens``, a constant (Dr. GRPO, Liu et al.
  2025: no length bias at all).

``mask`` is false on padding and on forced tool tokens: what the calculator wrote is neither credited nor blamed.
Tensors are [N, T]: N completions (the G of a prompt adjacent), T tokens, left-aligned.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

LOSS_TYPES = ("grpo", "dapo", "dr_grpo")
SCALE_REWARDS = ("group", "batch", "none")
STD_EPS = 1e-4  # added to the std, as DeepSeekMath's implementations do, so a group of equal rewards gives A = 0


def group_advantages(rewards: torch.Tensor, group_size: int, scale: str = "group") -> torch.Tensor:
    """Rewards [N] (N = prompts x ``group_size``, each group adjacent) -> advantages [N]."""
    if scale not in SCALE_REWARDS:
        raise ValueError(f"scale={scale!r} must be one of {', '.join(SCALE_REWARDS)}")
    if rewards.dim() != 1 or rewards.numel() % group_size:
        raise ValueError(f"rewards of shape {tuple(rewards.shape)} do not hold whole groups of {group_size}")
    rewards = rewards.float()
    groups = rewards.view(-1, group_size)  # [P, G]
    centred = (groups - groups.mean(dim=1, keepdim=True)).view(-1)
    if scale == "none":
        return centred
    if scale == "group":
        std = groups.std(dim=1, keepdim=True).expand_as(groups).reshape(-1) if group_size > 1 else torch.zeros_like(
            rewards)
    else:
        std = rewards.std().expand_as(rewards) if rewards.numel() > 1 else torch.zeros_like(rewards)
    return centred / (std + STD_EPS)


@dataclass(frozen=True)
class LossParts:
    """The loss and what to log about it: the mean KL and the clipped share over the masked tokens."""

    loss: torch.Tensor
    kl: float
    clip_fraction: float


def grpo_loss(logp: torch.Tensor, logp_old: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, *,
              loss_type: str = "grpo", clip_low: float = 0.2, clip_high: float | None = None, beta: float = 0.0,
              logp_ref: torch.Tensor | None = None, max_new_tokens: int | None = None) -> LossParts:
    """The clipped objective with the optional KL term: logp, logp_old, logp_ref, mask [N, T]; advantages [N].
    ``max_new_tokens``: ``dr_grpo``'s constant (default T)."""
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"loss_type={loss_type!r} must be one of {', '.join(LOSS_TYPES)}")
    if beta and logp_ref is None:
        raise ValueError("a KL term (beta > 0) needs the reference's log-probabilities")
    clip_high = clip_low if clip_high is None else clip_high
    weights = mask.to(logp.dtype)
    a = advantages.to(logp.dtype).unsqueeze(1)  # [N, 1]: one advantage per completion
    ratio = torch.exp(logp - logp_old)  # [N, T]
    clipped = ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    per_token = -torch.minimum(ratio * a, clipped * a)
    kl = torch.zeros_like(logp)
    if beta:
        log_ratio_ref = logp_ref - logp
        kl = torch.exp(log_ratio_ref) - log_ratio_ref - 1.0
        per_token = per_token + beta * kl
    if loss_type == "grpo":
        loss = ((per_token * weights).sum(dim=1) / weights.sum(dim=1).clamp(min=1.0)).mean()
    elif loss_type == "dapo":
        loss = (per_token * weights).sum() / weights.sum().clamp(min=1.0)
    else:
        loss = (per_token * weights).sum() / (logp.shape[0] * (max_new_tokens or logp.shape[1]))
    n = weights.sum().clamp(min=1.0)
    was_clipped = ((ratio < 1.0 - clip_low) & (a < 0)) | ((ratio > 1.0 + clip_high) & (a > 0))
    return LossParts(loss, float((kl.detach() * weights).sum() / n),
                     float((was_clipped.to(weights.dtype) * weights).sum() / n))
