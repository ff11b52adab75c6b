"""The PPO stage: sample responses with the cached engine, score them, then several epochs of clipped updates.

One loop step = one rollout batch of ``batch_size`` prompts:

1. sample a response per prompt (``tinygpt.generation.generate``, KV cache, temperature sampling with the stage's
   own ``torch.Generator``, stopping at end-of-text);
2. score each (prompt, response) with ``reward_fn`` (a reward model, or any rule) -> [B];
3. with no gradient: the policy's log-probabilities and values, the reference's log-probabilities, the per-token
   rewards, GAE advantages and returns (``ppo``);
4. ``ppo_epochs`` passes over the batch (in minibatches) with the clipped policy + value losses.

The policy runs with dropout off throughout (eval mode; gradients still flow), so that pi_new / pi_old is exactly
1 at the first update and the ratio measures only what the updates changed. The value head is a linear layer on the
policy's own final hidden states (a shared trunk, as in InstructGPT's setup).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Sequence

import torch
from torch import nn

from ..config import DEFAULT_SEED
from ..generation import generate
from ..model import GPTModel
from ..tokenizer import Tokenizer
from .batches import batch_for_step, batches_per_epoch, encode_prompt, end_of_text_id, split_indices
from .data import load_prompts
from .logprobs import entropy, masked_mean
from ..training.loop import TrainingResult, run_stage
from ..lora import is_adapted
from .finetune import FinetuneStage, adapt, load_start_model, reference_model
from .options import FinetuneOptions
from .reward import scalar_head
from .ppo import PPOConfig, gae, policy_loss, token_rewards, value_loss, whiten

if TYPE_CHECKING:  # matplotlib is imported only when a plot is drawn
    from matplotlib.figure import Figure

RewardFn = Callable[[Sequence[Sequence[int]], Sequence[Sequence[int]]], torch.Tensor]  # (prompts, responses) -> [B]


@dataclass
class Rollout:
    """A scored batch, ready for the updates. [B, L-1] inputs; [B, N] per-action tensors (see ``ppo``)."""

    inputs: torch.Tensor
    action_index: torch.Tensor  # [B, N] where action k of row i is predicted: prompt_len_i - 1 + k
    actions: torch.Tensor  # [B, N] the sampled token ids
    mask: torch.Tensor  # [B, N] bool
    logp_old: torch.Tensor
    values_old: torch.Tensor
    advantages: torch.Tensor
    returns: torch.Tensor
    scores: torch.Tensor  # [B]
    kl: torch.Tensor  # [B] summed per-token KL estimate
    entropy: float


def build_batch(prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]], pad_id: int
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(inputs [B, L-1], action_index [B, N], actions [B, N], mask [B, N]) for prompt + response rows, right-
    padded (causal attention: padding after a row's tokens never changes them)."""
    seqs = [list(p) + list(r) for p, r in zip(prompts, responses)]
    width = max(len(s) for s in seqs) - 1
    n = max(len(r) for r in responses)
    inputs = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    action_index = torch.zeros((len(seqs), n), dtype=torch.long)
    actions = torch.full((len(seqs), n), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), n), dtype=torch.bool)
    for i, (p, r, s) in enumerate(zip(prompts, responses, seqs)):
        inputs[i, : len(s) - 1] = torch.tensor(s[:-1])
        action_index[i, : len(r)] = torch.arange(len(p) - 1, len(p) - 1 + len(r))
        actions[i, : len(r)] = torch.tensor(list(r))
        mask[i, : len(r)] = True
    return inputs, action_index, actions, mask


def action_logprobs_values(model: GPTModel, value_head: nn.Module | None, inputs: torch.Tensor,
                           action_index: torch.Tensor, actions: torch.Tensor, temperature: float = 1.0
                           ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """(log pi(a) [B, N], values [B, N] or None, entropy [B, N]) at the action positions, one trunk pass.

    pi is softmax(logits / temperature): the distribution the responses were sampled from, so that the ratio and
    the KL are about the policy that acted (as TRL does; a ``top_k`` filter is not reflected in them)."""
    h = model.hidden_states(inputs)  # [B, L-1, D]
    h = h.gather(1, action_index.unsqueeze(-1).expand(-1, -1, h.shape[-1]))  # [B, N, D]
    logits = model.out_head(h).float() / temperature  # [B, N, V]
    logp = torch.log_softmax(logits, dim=-1).gather(-1, actions.unsqueeze(-1)).squeeze(-1)  # [B, N]
    values = value_head(h).squeeze(-1).float() if value_head is not None else None
    return logp, values, entropy(logits)


class PPOStage(FinetuneStage):
    """PPO of ``policy`` on prompts (token ids) against ``reward_fn``, KL-anchored to ``reference``."""

    name = "ppo"
    postfix_keys = ("reward", "kl")

    def __init__(self, policy: GPTModel, prompts: Sequence[Sequence[int]], reward_fn: RewardFn, *,
                 tokenizer: Tokenizer | None = None, reference: GPTModel | None = None,
                 config: PPOConfig | None = None, eos_id: int | None = None, pad_id: int | None = None,
                 batch_size: int = 8, val_fraction: float = 0.1, seed: int = DEFAULT_SEED) -> None:
        self.policy, self.tokenizer, self.reward_fn = policy, tokenizer, reward_fn
        self.config = config or PPOConfig()
        # A LoRA policy is its own frozen policy with the adapters off (reference_model): no second copy of the base.
        self.reference = reference if reference is not None or is_adapted(policy) else copy.deepcopy(policy)
        if self.reference is not None:
            self.reference.eval().requires_grad_(False)
        param = next(policy.parameters())
        self.heads = nn.ModuleDict({"value": scalar_head(policy, seed)})  # seeded: same seed, same head
        self.eos_id = eos_id
        self.pad_id = pad_id if pad_id is not None else (eos_id if eos_id is not None else 0)
        c = policy.config.context_length
        for i, p in enumerate(prompts):
            if not 1 <= len(p) < c:  # the reward model reads prompt + response: at most C tokens
                raise ValueError(f"prompt {i} has {len(p)} tokens; PPO needs 1..{c - 1} (context_length={c} minus "
                                 f"room for one response token)")
        train_idx, val_idx = split_indices(len(prompts), val_fraction, seed)
        self.train_prompts = [list(prompts[i]) for i in train_idx]
        self.val_prompts = [list(prompts[i]) for i in val_idx]
        self.batch_size, self.val_fraction, self.seed = batch_size, val_fraction, seed
        self.steps_per_epoch = batches_per_epoch(len(self.train_prompts), batch_size)
        self.generator = torch.Generator(device=param.device).manual_seed(seed)

    def _sample(self, prompts: list[list[int]], greedy: bool = False) -> list[list[int]]:
        c = self.policy.config
        # prompt + response must fit one forward: the reward model reads them whole.
        room = c.context_length - max(len(p) for p in prompts)
        result = generate(self.policy, prompts, max_new_tokens=min(self.config.max_new_tokens, room),
                          temperature=0.0 if greedy else self.config.temperature, top_k=self.config.top_k,
                          eos_id=self.eos_id, pad_id=self.pad_id, generator=None if greedy else self.generator)
        return result.rows()

    @torch.no_grad()
    def rollout(self, prompts: list[list[int]]) -> Rollout:
        cfg, device = self.config, next(self.policy.parameters()).device
        responses = self._sample(prompts)
        scores = self.reward_fn(prompts, responses).detach().float().to(device)  # [B]
        inputs, action_index, actions, mask = (t.to(device) for t in build_batch(prompts, responses, self.pad_id))
        t = cfg.temperature
        logp_old, values_old, ent = action_logprobs_values(self.policy, self.heads["value"], inputs, action_index,
                                                           actions, t)
        with reference_model(self.reference, self.policy) as reference:
            logp_ref, _, _ = action_logprobs_values(reference, None, inputs, action_index, actions, t)
        rewards, kl = token_rewards(scores, logp_old, logp_ref, mask, cfg.kl_coef)
        advantages, returns = gae(rewards, values_old, mask, cfg.gamma, cfg.lam)
        return Rollout(inputs, action_index, actions, mask, logp_old, values_old * mask,
                       whiten(advantages, mask), returns, scores, kl.sum(dim=1), float(masked_mean(ent, mask)))

    def batches(self, step: int) -> list[list[torch.Tensor]]:
        """Sample and score this step's rollout, then its updates: ``ppo_epochs`` shuffles of the rollout's rows cut
        into minibatches, one optimizer update each (row indices [m])."""
        cfg = self.config
        self.policy.eval()  # dropout off: see the module docstring
        chosen = batch_for_step(len(self.train_prompts), self.batch_size, step, self.seed)
        r = self.rollout([self.train_prompts[i] for i in chosen])
        self._rollout = r
        b = r.inputs.shape[0]
        size = cfg.minibatch_size or b
        updates = []
        for _ in range(cfg.ppo_epochs):
            order = torch.randperm(b, generator=self.generator, device=self.generator.device).to(r.inputs.device)
            updates.extend([order[start : start + size]] for start in range(0, b, size))
        return updates

    def loss(self, rows: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
        """The clipped policy loss + value_coef x the clipped value loss - entropy_coef x the entropy, on the
        rollout's ``rows``."""
        cfg, r = self.config, self._rollout
        mask = r.mask[rows]
        logp, values, ent = action_logprobs_values(self.policy, self.heads["value"], r.inputs[rows],
                                                   r.action_index[rows], r.actions[rows], cfg.temperature)
        p_loss, clip_fraction = policy_loss(logp, r.logp_old[rows], r.advantages[rows], mask, cfg.clip_range)
        v_loss = value_loss(values, r.values_old[rows], r.returns[rows], mask, cfg.value_clip_range)
        loss = p_loss + cfg.value_coef * v_loss - cfg.entropy_coef * masked_mean(ent, mask)
        return loss, {"policy_loss": float(p_loss.detach()), "value_loss": float(v_loss.detach()),
                      "clip_fraction": float(clip_fraction)}

    def step_metrics(self) -> dict[str, float]:
        r = self._rollout
        return {"reward": float(r.scores.mean()), "kl": float(r.kl.mean()), "entropy": r.entropy,
                "response_length": float(r.mask.sum(dim=1).float().mean())}

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Mean reward of greedy responses to the held-out prompts (at most one batch of them)."""
        prompts = self.val_prompts[: self.batch_size]
        if not prompts:
            return {}
        responses = self._sample(prompts, greedy=True)
        return {"val_reward": float(self.reward_fn(prompts, responses).float().mean())}

    def state_dict(self) -> dict[str, Any]:
        return {"generator": self.generator.get_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.generator.set_state(state["generator"])

    def plot(self, records: list[dict[str, Any]], run_dir: Path) -> None:
        plot_reward_and_kl(records, Path(run_dir) / "ppo.png")


def reward_kl_figure(records: list[dict[str, Any]]) -> Figure:
    """Mean reward (top) and the KL estimate (bottom) per PPO step, as a two-panel ``Figure``. The KL is the
    per-step mean over the sampled responses of sum_t (log pi_old - log pi_ref) (``ppo.token_rewards``): a sample
    estimate of KL(pi_old || pi_ref) from a few responses, which, unlike the KL itself, can fall below zero -- hence
    the 0 line."""
    from ..figures import integer_ticks, new_figure

    steps = [r["step"] for r in records if "reward" in r]
    fig = new_figure(7, 5.4)
    top, bottom = fig.subplots(2, 1, sharex=True)
    top.plot(steps, [r["reward"] for r in records if "reward" in r], label="mean reward (sampled)")
    evals = [r for r in records if "val_reward" in r]
    if evals:
        top.plot([r["step"] for r in evals], [r["val_reward"] for r in evals], "o-", label="val reward (greedy)")
    top.set_ylabel("reward")
    top.legend()
    bottom.plot(steps, [r["kl"] for r in records if "kl" in r], color="tab:red",
                label="mean over sampled responses of sum (log pi_old - log pi_ref)")
    bottom.axhline(0.0, color="gray", lw=0.8)
    bottom.set_ylabel("sample estimate of KL\nto reference (nats/response)")
    bottom.legend(fontsize=8)
    for ax in (top, bottom):
        ax.set_xlabel("PPO step")
        ax.xaxis.set_tick_params(labelbottom=True)  # sharex would hide the top panel's step numbers
        integer_ticks(ax.xaxis)
        ax.grid(alpha=0.3)
    return fig


def plot_reward_and_kl(records: list[dict[str, Any]], path: Path) -> None:
    """``reward_kl_figure`` as a PNG (written atomically)."""
    from ..figures import save_png

    save_png(reward_kl_figure(records), path)


def reward_model_fn(reward_model: nn.Module, pad_id: int) -> RewardFn:
    """Score (prompt, response) pairs with a ``RewardModel`` on the concatenated ids."""
    def score(prompts: Sequence[Sequence[int]], responses: Sequence[Sequence[int]]) -> torch.Tensor:
        return reward_model.score([list(p) + list(r) for p, r in zip(prompts, responses)], pad_id)

    return score


def ppo(policy: str | Path, reward: str | Path, data: str | Path, options: FinetuneOptions,
        config: PPOConfig | None = None, *, limit: int | None = None, tokenizer_dir: str | Path | None = None,
        lora: Any = None) -> TrainingResult:
    """``tinygpt ppo``: PPO of the GPT at ``policy`` (also the frozen reference) against the reward model at
    ``reward``, on the prompts of ``data`` (an instruction or preference file; only instruction/input are read)."""
    from .reward import load_reward_model

    options.check()
    config = config or PPOConfig()
    model, tokenizer = load_start_model(policy, options.device, tokenizer_dir, lora=lora)
    reward_model, reward_tokenizer = load_reward_model(reward, device=next(model.parameters()).device)
    if reward_tokenizer is not None and (reward_tokenizer.kind, reward_tokenizer.vocab_size) != (
            tokenizer.kind, tokenizer.vocab_size):
        raise ValueError(f"the reward model's tokenizer ({reward_tokenizer!r}) differs from the policy's "
                         f"({tokenizer!r}): both must read the same token ids")
    if reward_model.trunk.config.context_length < model.config.context_length:
        raise ValueError(f"the reward model's context_length={reward_model.trunk.config.context_length} is shorter "
                         f"than the policy's {model.config.context_length}")
    eot = end_of_text_id(tokenizer)
    c = model.config.context_length
    prompts = [encode_prompt(tokenizer, p, c, f"{data}: entry {i}") for i, p in enumerate(load_prompts(data, limit))]
    stage = PPOStage(adapt(model, lora, options, policy), prompts, reward_model_fn(reward_model, eot),
                     tokenizer=tokenizer, config=config, eos_id=eot, pad_id=eot, **options.stage_settings())
    return run_stage(stage, options)
