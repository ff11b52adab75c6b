"""PPO: GAE and the clipped losses against hand computations, and on a toy reward (a rule that pays for one
token) the mean reward rises while the per-token KL penalty keeps the policy near the reference."""

from __future__ import annotations

import json

import re

import pytest
import torch

from conftest import INSTRUCTION_DATA
from tinygpt import GPTConfig, GPTModel
from tinygpt.alignment import FinetuneOptions
from tinygpt.training import run_stage
from tinygpt.alignment.ppo import PPOConfig, gae, policy_loss, token_rewards, value_loss, whiten
from tinygpt.alignment.ppo_trainer import PPOStage, action_logprobs_values, build_batch
from tinygpt.alignment.reward import RewardModel, save_reward_model
from tinygpt.cli import main

pytestmark = pytest.mark.usefixtures("one_thread")


def test_token_rewards_put_the_score_on_the_last_action_and_the_kl_everywhere():
    mask = torch.tensor([[True, True, True], [True, False, False]])
    logp_old = torch.tensor([[-1.0, -2.0, -1.5], [-0.5, -9.0, -9.0]])
    logp_ref = torch.tensor([[-1.5, -2.0, -1.0], [-1.0, -1.0, -1.0]])
    rewards, kl = token_rewards(torch.tensor([2.0, -1.0]), logp_old, logp_ref, mask, kl_coef=0.1)
    assert torch.allclose(kl, torch.tensor([[0.5, 0.0, -0.5], [0.5, 0.0, 0.0]]))
    assert torch.allclose(rewards, torch.tensor([[-0.05, 0.0, 2.05], [-1.05, 0.0, 0.0]]))


def test_gae_matches_a_hand_computation():
    rewards = torch.tensor([[1.0, 0.0, 2.0], [3.0, 0.0, 0.0]])
    values = torch.tensor([[0.5, 1.0, 1.5], [2.0, 7.0, 7.0]])
    mask = torch.tensor([[True, True, True], [True, False, False]])
    gamma, lam = 0.9, 0.8
    adv, ret = gae(rewards, values, mask, gamma, lam)
    d2 = 2.0 - 1.5
    d1 = 0.0 + gamma * 1.5 - 1.0
    d0 = 1.0 + gamma * 1.0 - 0.5
    a2, a1 = d2, d1 + gamma * lam * d2
    a0 = d0 + gamma * lam * a1
    assert torch.allclose(adv[0], torch.tensor([a0, a1, a2]))
    assert torch.allclose(adv[1], torch.tensor([3.0 - 2.0, 0.0, 0.0]))  # V after the last action is 0
    assert torch.allclose(ret, (adv + values) * mask)
    # gamma = lam = 1: the advantage is the sum of the rewards to come minus the value.
    adv1, _ = gae(rewards, values, mask, 1.0, 1.0)
    assert torch.allclose(adv1[0], torch.tensor([3.0 - 0.5, 2.0 - 1.0, 2.0 - 1.5]))
    w = whiten(adv, mask)
    assert w[mask].mean().abs() < 1e-6 and torch.all(w[~mask] == 0)


def test_clipped_losses():
    mask = torch.ones(1, 3, dtype=torch.bool)
    old = torch.zeros(1, 3)
    adv = torch.tensor([[1.0, -1.0, 1.0]])
    loss, frac = policy_loss(old, old, adv, mask, 0.2)
    assert loss.item() == pytest.approx(-adv.mean().item()) and frac.item() == 0.0  # ratio 1 at the first update
    new = torch.log(torch.tensor([[1.5, 1.5, 0.5]]))
    loss, frac = policy_loss(new, old, adv, mask, 0.2)
    # ratio 1.5 with A > 0 is clipped to 1.2; ratio 1.5 with A < 0 keeps its (worse) 1.5; 0.5 with A > 0 stays.
    assert loss.item() == pytest.approx((-1.2 + 1.5 - 0.5) / 3) and frac.item() == pytest.approx(1.0)
    v = value_loss(torch.tensor([[3.0]]), torch.tensor([[1.0]]), torch.tensor([[0.0]]), mask[:, :1], 0.5)
    assert v.item() == pytest.approx(0.5 * 9.0)  # max of (3 - 0)^2 and (1.5 - 0)^2


def test_build_batch_places_actions_after_each_prompt():
    inputs, index, actions, mask = build_batch([[1, 2, 3], [4]], [[5, 6], [7, 8, 9]], pad_id=0)
    assert inputs.tolist() == [[1, 2, 3, 5], [4, 7, 8, 0]]
    assert index.tolist() == [[2, 3, 0], [0, 1, 2]] and actions.tolist() == [[5, 6, 0], [7, 8, 9]]
    assert mask.tolist() == [[True, True, False], [True, True, True]]


def test_action_logprobs_are_the_tempered_policy_at_each_action():
    torch.manual_seed(0)
    model = GPTModel(GPTConfig(vocab_size=16, context_length=16, emb_dim=16, n_heads=2, n_layers=1)).eval()
    prompts, responses = [[1, 2, 3], [4]], [[5, 6], [7, 8, 9]]
    inputs, index, actions, mask = build_batch(prompts, responses, pad_id=0)
    with torch.no_grad():
        logp, _, _ = action_logprobs_values(model, None, inputs, index, actions, temperature=0.5)
        for i, (p, r) in enumerate(zip(prompts, responses)):
            full = torch.log_softmax(model(torch.tensor([p + r]))[0] / 0.5, dim=-1)  # [T, V], row i alone
            expected = torch.stack([full[len(p) - 1 + k, tok] for k, tok in enumerate(r)])
            assert torch.allclose(logp[i, : len(r)], expected, atol=1e-5)


TARGET = 7


def _toy_stage(kl_coef: float) -> PPOStage:
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=16, context_length=16, emb_dim=32, n_heads=2, n_layers=2, drop_rate=0.0)
    prompts = torch.randint(1, 16, (40, 3), generator=torch.Generator().manual_seed(0)).tolist()

    def reward_fn(prompts, responses):  # the fraction of response tokens that are TARGET
        return torch.tensor([sum(t == TARGET for t in r) / len(r) for r in responses])

    return PPOStage(GPTModel(config), prompts, reward_fn, config=PPOConfig(max_new_tokens=8, kl_coef=kl_coef),
                    batch_size=16, val_fraction=0.1, seed=0)


def _toy_run(tmp_path, kl_coef: float, name: str):
    stage = _toy_stage(kl_coef)
    options = FinetuneOptions(out_dir=str(tmp_path / name), max_steps=24, lr=2e-3, eval_every=12, progress=False)
    return stage, run_stage(stage, options).records


def test_ppo_raises_a_toy_reward_while_the_kl_penalty_bounds_the_drift(tmp_path):
    stage, records = _toy_run(tmp_path, 0.05, "penalized")
    _, free = _toy_run(tmp_path, 0.0, "free")
    first, last = records[0]["reward"], sum(r["reward"] for r in records[-6:]) / 6
    assert first < 0.1 and last > 3 * first  # 1/16 of the tokens are TARGET at the start
    assert records[0]["kl"] == pytest.approx(0.0, abs=1e-5)  # the policy starts as the reference
    kl_penalized = sum(r["kl"] for r in records[-6:]) / 6
    kl_free = sum(r["kl"] for r in free[-6:]) / 6
    assert max(r["kl"] for r in records) < 8.0 and kl_free > 2 * kl_penalized
    for key in ("entropy", "clip_fraction", "policy_loss", "value_loss", "response_length"):
        assert all(key in r for r in records)
    assert "val_reward" in records[11]
    run = tmp_path / "penalized"
    assert (run / "ppo.png").is_file() and (run / "step-24").is_dir()
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 24


def test_ppo_resume_continues_the_same_rollouts_and_updates(tmp_path):
    options = dict(max_steps=4, lr=2e-3, eval_every=100, progress=False)
    straight = _toy_stage(0.05)
    expected = run_stage(straight, FinetuneOptions(out_dir=str(tmp_path / "a"), **options)).records
    run_stage(_toy_stage(0.05), FinetuneOptions(out_dir=str(tmp_path / "b"), stop_after=2, **options))
    resumed = _toy_stage(0.05)
    records = run_stage(resumed, FinetuneOptions(out_dir=str(tmp_path / "b"), resume="auto", **options)).records
    assert [r["reward"] for r in records] == [r["reward"] for r in expected]  # same sampled responses
    assert torch.equal(resumed.heads["value"].weight, straight.heads["value"].weight)
    for (name, a), b in zip(straight.policy.state_dict().items(), resumed.policy.state_dict().values()):
        assert torch.equal(a, b), name


def test_cli_ppo_with_a_reward_model(tmp_path, alignment_model_dir, alignment_tokenizer, alignment_config, capsys):
    torch.manual_seed(1)
    save_reward_model(RewardModel(GPTModel(alignment_config)), tmp_path / "rm", alignment_tokenizer)
    code = main(["ppo", "--policy", str(alignment_model_dir), "--reward", str(tmp_path / "rm"), "--data",
                 str(INSTRUCTION_DATA), "--limit", "8", "--out", str(tmp_path / "ppo"), "--max-steps", "2",
                 "--batch-size", "3", "--max-new-tokens", "4", "--ppo-epochs", "2", "--no-progress"])
    done = capsys.readouterr()
    assert code == 0 and "val_reward" in done.out
    assert re.search(r"^step 2: reward -?\d+\.\d{4}  kl -?\d+\.\d{4}  val reward -?\d+\.\d{4}$", done.err, re.M)
    records = [json.loads(line) for line in (tmp_path / "ppo" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2] and all(1 <= r["response_length"] <= 4 for r in records)
    assert main(["ppo", "--policy", str(alignment_model_dir), "--reward", str(alignment_model_dir), "--data",
                 str(INSTRUCTION_DATA)]) == 2
    assert "is not a reward model" in capsys.readouterr().err
