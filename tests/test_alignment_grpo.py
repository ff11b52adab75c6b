"""GRPO's math: the advantages against a hand computation, the loss against TRL's own ``GRPOTrainer._compute_loss`` on
the same fixed rollout (every loss type both have, with and without the KL term), and the mask on forced tokens."""

from __future__ import annotations

import collections
import types

import pytest
import torch

from tinygpt.alignment.grpo import LOSS_TYPES, STD_EPS, group_advantages, grpo_loss

pytestmark = pytest.mark.usefixtures("one_thread")


def test_group_advantages_match_a_hand_computation():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0])  # two groups of 4
    # group 1: mean 0.5, unbiased std sqrt(((.5)^2 * 4) / 3) = sqrt(1/3); group 2: all equal -> A = 0
    s = (1 / 3) ** 0.5
    want = [0.5 / (s + STD_EPS), -0.5 / (s + STD_EPS), -0.5 / (s + STD_EPS), 0.5 / (s + STD_EPS), 0, 0, 0, 0]
    assert group_advantages(rewards, 4).tolist() == pytest.approx(want, abs=1e-6)
    assert group_advantages(rewards, 4, "none").tolist() == pytest.approx([.5, -.5, -.5, .5, 0, 0, 0, 0])
    batch_std = float(torch.tensor(rewards.tolist()).std())
    assert group_advantages(rewards, 4, "batch").tolist() == pytest.approx(
        [x / (batch_std + STD_EPS) for x in [.5, -.5, -.5, .5, 0, 0, 0, 0]], abs=1e-6)
    with pytest.raises(ValueError, match="whole groups of 3"):
        group_advantages(rewards, 3)
    with pytest.raises(ValueError, match="scale="):
        group_advantages(rewards, 4, "per-token")


def _rollout(seed: int = 0, n: int = 6, t: int = 7):
    g = torch.Generator().manual_seed(seed)
    logp_old = -torch.rand(n, t, generator=g, dtype=torch.float64) * 3
    logp = (logp_old + 0.3 * torch.randn(n, t, generator=g, dtype=torch.float64)).clamp(max=0)  # ratios off 1
    logp_ref = logp_old + 0.2 * torch.randn(n, t, generator=g, dtype=torch.float64)
    lengths = torch.tensor([7, 3, 5, 1, 6, 7])
    mask = torch.arange(t)[None] < lengths[:, None]
    forced = torch.zeros(n, t, dtype=torch.bool)
    forced[0, 2:4] = forced[4, 1] = True  # tool output inside two completions
    advantages = group_advantages(torch.tensor([1.0, 0.0, 1.0, 0.0, 0.0, 1.0]), 3).double()
    return logp, logp_old, logp_ref, mask, forced, advantages


def _trl_loss(loss_type: str, beta: float, logp, logp_old, logp_ref, mask, forced, advantages, eps=(0.2, 0.28)):
    """TRL's own ``GRPOTrainer._compute_loss`` (trl/trainer/grpo_trainer.py), called on an instance that holds only
    the attributes that method reads; its model forward (``_get_per_token_logps_and_entropies``) is replaced by the
    fixed log-probabilities, so what is compared is exactly TRL's objective and normalisation."""
    from trl.trainer.grpo_trainer import GRPOTrainer

    trainer = object.__new__(GRPOTrainer)
    entropies = torch.zeros_like(logp)
    trainer._get_per_token_logps_and_entropies = lambda *args, **kwargs: (logp, entropies, None)
    trainer.__dict__.update(
        top_entropy_quantile=1.0, aux_loss_enabled=False, off_policy_mask_threshold=None,
        importance_sampling_level="token", beta=beta, loss_type=loss_type, epsilon_low=eps[0],
        epsilon_high=eps[1], use_vllm=False, vllm_importance_sampling_correction=False,
        current_gradient_accumulation_steps=1, max_completion_length=logp.shape[1], _entropy_bonus_enabled=False,
        model=torch.nn.Linear(1, 1).eval(),  # only its .training is read: eval = no accumulation scaling
        args=types.SimpleNamespace(use_bias_correction_kl=False, delta=None, steps_per_generation=1),
        accelerator=types.SimpleNamespace(num_processes=1, gather=lambda x: x, gather_for_metrics=lambda x: x,
                                          reduce=lambda x, reduction: x, sync_gradients=True),
        _metrics={"train": collections.defaultdict(list), "eval": collections.defaultdict(list)},
    )
    n, t = logp.shape
    inputs = {
        "prompt_ids": torch.zeros(n, 2, dtype=torch.long), "prompt_mask": torch.ones(n, 2, dtype=torch.long),
        "completion_ids": torch.zeros(n, t, dtype=torch.long), "completion_mask": mask.long(),
        "tool_mask": (~forced).long(),  # TRL's own name for the mask that keeps tool output out of the loss
        "advantages": advantages, "old_per_token_logps": logp_old, "ref_per_token_logps": logp_ref,
        "num_items_in_batch": (mask & ~forced).sum(),
    }
    return trainer._compute_loss(None, inputs)


@pytest.mark.slow  # importing trl takes several seconds
@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_the_loss_equals_trls_grpo_trainer(loss_type, beta):
    logp, logp_old, logp_ref, mask, forced, advantages = _rollout()
    want = _trl_loss(loss_type, beta, logp, logp_old, logp_ref, mask, forced, advantages)
    got = grpo_loss(logp, logp_old, advantages, mask & ~forced, loss_type=loss_type, clip_low=0.2, clip_high=0.28,
                    beta=beta, logp_ref=logp_ref).loss
    assert abs(float(got) - float(want)) < 1e-6, (float(got), float(want))
    # The comparison can fail: a flipped sign, another normalisation or a forgotten mask each move the loss.
    assert abs(float(grpo_loss(logp, logp_old, -advantages, mask & ~forced, loss_type=loss_type, clip_low=0.2,
                               clip_high=0.28, beta=beta, logp_ref=logp_ref).loss) - float(want)) > 1e-3
    assert abs(float(grpo_loss(logp, logp_old, advantages, mask, loss_type=loss_type, clip_low=0.2,
                               clip_high=0.28, beta=beta, logp_ref=logp_ref).loss) - float(want)) > 1e-4
    others = [other for other in LOSS_TYPES if other != loss_type]
    for other in others:
        assert abs(float(grpo_loss(logp, logp_old, advantages, mask & ~forced, loss_type=other, clip_low=0.2,
                                   clip_high=0.28, beta=beta, logp_ref=logp_ref).loss) - float(want)) > 1e-4


def test_the_first_update_is_the_policy_gradient_and_masked_tokens_get_none():
    logp, logp_old, logp_ref, mask, forced, advantages = _rollout()
    logp = logp_old.clone().requires_grad_(True)  # ratio 1: pi_old is the policy
    parts = grpo_loss(logp, logp_old, advantages, mask & ~forced, loss_type="grpo", beta=0.0)
    parts.loss.backward()
    keep = (mask & ~forced).double()
    # d/dlogp of -mean_i(sum_t A_i ratio_t / n_i) at ratio 1: -A_i / (n_i N) on kept tokens, exactly 0 elsewhere
    want = -advantages[:, None] * keep / keep.sum(dim=1, keepdim=True) / logp.shape[0]
    assert torch.allclose(logp.grad, want)
    assert torch.all(logp.grad[forced] == 0) and torch.all(logp.grad[~mask] == 0)
    assert parts.kl == 0.0 and parts.clip_fraction == 0.0
    with pytest.raises(ValueError, match="loss_type="):
        grpo_loss(logp, logp_old, advantages, mask, loss_type="ppo")
    with pytest.raises(ValueError, match="reference"):
        grpo_loss(logp, logp_old, advantages, mask, beta=0.1)
