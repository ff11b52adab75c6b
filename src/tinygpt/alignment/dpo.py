"""Direct Preference Optimization (Rafailov et al. 2023): preference learning without a reward model or sampling.

With the policy pi, the frozen reference pi_ref (the starting model) and a pair (prompt x, chosen y_w, rejected
y_l), the implicit reward of a response is beta * log(pi(y | x) / pi_ref(y | x)) and the loss is (their eq. 7)

    -log sigmoid(beta * [(log pi(y_w|x) - log pi_ref(y_w|x)) - (log pi(y_l|x) - log pi_ref(y_l|x))])

where log pi(y | x) sums the response tokens' log-probabilities (end-of-text included; prompt and padding
excluded by the -100 targets of ``batches``). ``beta`` sets how far the policy may move from the reference: the
same role as the KL coefficient of RLHF, whose optimum this loss fits directly. Logged: the loss, the reward
margin (implicit chosen - rejected reward), the two rewards, and the preference accuracy (margin > 0).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .. import checks
from ..config import DEFAULT_SEED
from ..model import GPTModel
from ..tokenizer import Tokenizer
from .batches import collate_targets, end_of_text_id
from .data import ALPACA_CHAT_TEMPLATE, PreferenceExample, load_preference_data
from .logprobs import response_logprobs
from ..training.loop import TrainingResult, run_stage
from ..lora import is_adapted
from .finetune import SupervisedStage, adapt, load_start_model, reference_model
from .options import FinetuneOptions
from .reward import EncodedPair, encode_preferences


def dpo_loss(policy_chosen: torch.Tensor, policy_rejected: torch.Tensor, ref_chosen: torch.Tensor,
             ref_rejected: torch.Tensor, beta: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(mean loss, chosen rewards [B], rejected rewards [B]) from the four sequence log-probabilities [B]."""
    chosen_rewards = beta * (policy_chosen - ref_chosen)
    rejected_rewards = beta * (policy_rejected - ref_rejected)
    loss = -F.logsigmoid(chosen_rewards - rejected_rewards).mean()
    return loss, chosen_rewards.detach(), rejected_rewards.detach()


class DPOStage(SupervisedStage):
    """Train ``policy`` with ``dpo_loss`` against ``reference`` (a frozen copy of the starting policy by default)."""

    name = "dpo"
    answers_samples = True
    postfix_keys = ("loss", "margin", "accuracy")

    def __init__(self, policy: GPTModel, tokenizer: Tokenizer, examples: Sequence[PreferenceExample], *,
                 reference: GPTModel | None = None, beta: float = 0.1, batch_size: int = 8, val_fraction: float = 0.1,
                 seed: int = DEFAULT_SEED, source: str = "data") -> None:
        checks.positive_number("beta", beta)
        self.policy, self.beta = policy, float(beta)
        # The Alpaca chat template, as SFT saves it: the prompts DPO trains on are Alpaca prompts.
        self.tokenizer = tokenizer.with_chat_template(ALPACA_CHAT_TEMPLATE)
        self.heads = nn.ModuleDict()
        # A LoRA policy is its own reference with the adapters off (reference_model): no second copy of the base.
        self.reference = reference if reference is not None or is_adapted(policy) else copy.deepcopy(policy)
        if self.reference is not None:
            self.reference.eval().requires_grad_(False)
        self.pad_id = end_of_text_id(tokenizer)
        self._reference_logps: dict[EncodedPair, tuple[float, float]] = {}  # the reference never changes
        pairs = encode_preferences(tokenizer, examples, policy.config.context_length, source)
        super().__init__(pairs, batch_size=batch_size, val_fraction=val_fraction, seed=seed)

    def _sequence_logps(self, model: GPTModel, items: Sequence[EncodedPair]) -> tuple[torch.Tensor, torch.Tensor]:
        device = next(model.parameters()).device
        # Chosen and rejected rows in one batch of 2B: one forward instead of two.
        inputs, targets = collate_targets([p.chosen for p in items] + [p.rejected for p in items], self.pad_id)
        logps = response_logprobs(model, inputs.to(device), targets.to(device))  # [2B]
        return logps[: len(items)], logps[len(items):]

    def _reference(self, items: Sequence[EncodedPair]) -> tuple[torch.Tensor, torch.Tensor]:
        missing = [p for p in items if p not in self._reference_logps]
        if missing:
            with torch.no_grad(), reference_model(self.reference, self.policy) as reference:
                chosen, rejected = self._sequence_logps(reference, missing)
            for p, c, r in zip(missing, chosen.tolist(), rejected.tolist()):
                self._reference_logps[p] = (c, r)
        device = next(self.policy.parameters()).device
        values = torch.tensor([self._reference_logps[p] for p in items], device=device)  # [B, 2]
        return values[:, 0], values[:, 1]

    def loss(self, items: Sequence[EncodedPair]) -> tuple[torch.Tensor, dict[str, float]]:
        policy_chosen, policy_rejected = self._sequence_logps(self.policy, items)
        ref_chosen, ref_rejected = self._reference(items)
        loss, chosen, rejected = dpo_loss(policy_chosen, policy_rejected, ref_chosen, ref_rejected, self.beta)
        margin = chosen - rejected
        return loss, {"margin": float(margin.mean()),
                      "accuracy": float((margin > 0).float().mean()), "chosen_reward": float(chosen.mean()),
                      "rejected_reward": float(rejected.mean())}


def dpo(model: str | Path, data: str | Path, options: FinetuneOptions, *, beta: float = 0.1,
        limit: int | None = None, tokenizer_dir: str | Path | None = None, lora: Any = None) -> TrainingResult:
    """``tinygpt dpo``: DPO of the GPT at ``model`` (also the frozen reference) on the preference file ``data``;
    ``lora`` (a ``LoRAConfig``) trains adapters, the reference being the base with them switched off."""
    options.check()
    checks.positive_number("beta", beta)
    examples = load_preference_data(data, limit)
    policy, tokenizer = load_start_model(model, options.device, tokenizer_dir, lora=lora)
    stage = DPOStage(adapt(policy, lora, options, model), tokenizer, examples, beta=beta, source=str(data),
                     **options.stage_settings())
    return run_stage(stage, options)
