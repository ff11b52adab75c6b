"""The GRPO stage: G completions per prompt through the inference engine, verifier rewards, group advantages, updates.

One loop step = one rollout batch of ``batch_size`` prompts:

1. each prompt is repeated ``group_size`` (G) times and the batch goes through ``tinygpt.generation.generate`` -- the
   inference engine: one paged KV cache, the G rows of a prompt sharing its cached prefix blocks -- sampled at
   ``temperature``, row i with its own generator seeded ``seed + i`` (``seed`` drawn from the stage's generator), so
   a row draws the same completion whether it is sampled with the others or alone. With the tool on, each row
   carries a ``tools.Calculator``: its output is forced into the row and flagged, and the rollout's ``mask`` leaves
   those tokens out of the loss;
2. the reward functions score each (prompt, completion, example) (``verifiers``); advantages are group-relative
   (``grpo.group_advantages``);
3. with no gradient: the policy's log-probabilities at sampling time (pi_old) and, with a KL term, the reference's
   (with LoRA: the policy's own base, its adapters off; else a frozen copy);
4. ``iterations`` passes over the completions (in minibatches), each an optimizer update of ``grpo.grpo_loss``:
   after the first update pi != pi_old and the clipped importance ratio is what keeps the step small.

The policy runs with dropout off throughout (eval mode), so that pi / pi_old is exactly 1 at the first update.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Sequence

import torch
from torch import nn

from .. import checks
from ..checks import option
from ..config import DEFAULT_SEED
from ..generation import generate
from ..lora import is_adapted
from ..model import GPTModel
from ..tokenizer import Tokenizer
from ..tools import Calculator
from ..training.loop import TrainingResult, run_stage
from .batches import batch_for_step, batches_per_epoch, encode_prompt, end_of_text_id, split_indices
from .data import format_prompt, read_records
from .finetune import FinetuneStage, adapt, load_start_model, reference_model
from .grpo import LOSS_TYPES, SCALE_REWARDS, group_advantages, grpo_loss
from .options import FinetuneOptions
from .ppo_trainer import action_logprobs_values, build_batch
from .verifiers import RewardScorer, exact_answer, load_reward_fn

if TYPE_CHECKING:
    from matplotlib.figure import Figure


@dataclass(frozen=True)
class GRPOConfig:
    """GRPO's settings. Defaults: DeepSeekMath's clip 0.2; no KL term (DAPO and Dr. GRPO drop it; ``--kl-coef``
    0.04 is DeepSeekMath's); one update per rollout (``iterations`` > 1 reuses it with the importance ratio)."""

    group_size: int = option(8, "completions sampled per prompt (G)", metavar="G")
    max_new_tokens: int = option(48, "longest completion (tool output included)")
    temperature: float = option(1.0, "sampling temperature")
    top_k: int | None = option(None, "sample among the K most likely tokens", metavar="K", default_help="all")
    loss_type: str = option("grpo", "how token losses are averaged: grpo = per completion, then over completions; "
                                    "dapo = over every token of the update; dr_grpo = token sum / (completions x "
                                    "max-new-tokens)", choices=LOSS_TYPES)
    scale_rewards: str = option("group", "divide advantages by the group's reward std, the batch's, or none "
                                         "(Dr. GRPO)", choices=SCALE_REWARDS)
    clip_range: float = option(0.2, "importance ratio clip (epsilon)")
    clip_range_high: float | None = option(None, "upper clip (DAPO's clip-higher)", default_help="--clip-range")
    kl_coef: float = option(0.0, "beta of the KL term to the reference (with LoRA: the base, adapters off)")
    iterations: int = option(1, "optimisation passes over each rollout batch (mu)")
    minibatch_size: int | None = option(None, "completions per update", default_help="the whole rollout")
    tool: bool = option(True, "no calculator: the model writes the results of its <<...=...>> calls itself",
                        flag="--no-tool")

    def __post_init__(self) -> None:
        for name in ("group_size", "max_new_tokens", "iterations"):
            checks.positive_int(name, getattr(self, name))
        if self.group_size < 2:
            raise checks.OptionError("group_size", self.group_size, "must be at least 2: the baseline is the mean "
                                                                    "reward of the group")
        for name in ("top_k", "minibatch_size"):
            checks.positive_int(name, getattr(self, name), optional=True)
        checks.positive_number("temperature", self.temperature, note="(GRPO needs sampled completions)")
        checks.positive_number("clip_range", self.clip_range)
        if self.clip_range_high is not None:
            checks.positive_number("clip_range_high", self.clip_range_high)
        checks.non_negative_number("kl_coef", self.kl_coef)
        checks.choice("loss_type", self.loss_type, LOSS_TYPES)
        checks.choice("scale_rewards", self.scale_rewards, SCALE_REWARDS)


@dataclass
class Rollout:
    """A scored batch of N = prompts x G completions. [N, L-1] inputs; [N, T] per-token tensors; ``forced`` flags
    the tool's tokens, ``mask`` the tokens the loss sees (the model's own, not padding, not forced)."""

    inputs: torch.Tensor
    action_index: torch.Tensor
    actions: torch.Tensor
    mask: torch.Tensor
    forced: torch.Tensor
    logp_old: torch.Tensor
    logp_ref: torch.Tensor | None
    rewards: torch.Tensor  # [N]
    advantages: torch.Tensor  # [N]
    correct: float | None  # share of exactly right answers, when the examples have an ``answer``
    tool_calls: float  # share of completions in which the tool answered at least one call


@dataclass(frozen=True)
class Completions:
    """Sampled (or greedy) completions: token ids, the forced flags of each, and their texts."""

    tokens: list[list[int]]
    forced: list[list[bool]]
    texts: list[str]


def complete(model: GPTModel, tokenizer: Tokenizer, prompts: Sequence[Sequence[int]], *, max_new_tokens: int,
             temperature: float = 0.0, top_k: int | None = None, seed: int | None = None, tool: bool = True,
             share_prefix: bool = True) -> Completions:
    """Completions of ``prompts`` through the engine (row i seeded ``seed + i``), stopping at end-of-text, with a
    ``Calculator`` on every row when ``tool``; texts without the end-of-text token. ``share_prefix``: admit the
    rows a prompt at a time so repeated prompts (a GRPO group) share their cached prefix blocks; the tokens are the
    same either way (the engine's rows do not depend on its schedule)."""
    eot = end_of_text_id(tokenizer)
    room = model.config.context_length - max(len(p) for p in prompts)  # prompt + completion is one training input
    if room < 1:
        raise ValueError(f"a prompt of {max(len(p) for p in prompts)} tokens leaves no room for a completion in "
                         f"context_length={model.config.context_length}")
    # A token budget of one prompt per forward: the first copy of a prompt is prefilled alone, its full blocks enter
    # the prefix cache, and its G - 1 siblings admitted at the next steps take them instead of recomputing them.
    budget = max(len(prompts), max(len(p) for p in prompts)) if share_prefix else None
    result = generate(model, [list(p) for p in prompts], max_new_tokens=min(max_new_tokens, room),
                      temperature=temperature, top_k=top_k, seed=seed if temperature > 0 else None, eos_id=eot,
                      pad_id=eot, token_budget=budget,
                      constraints=[Calculator(tokenizer) for _ in prompts] if tool else None)
    tokens = result.rows()
    forced = [list(f) for f in result.forced] if result.forced else [[False] * len(t) for t in tokens]
    texts = [tokenizer.decode([t for t in row if t != eot]) for row in tokens]
    return Completions(tokens, forced, texts)


def accuracy(model: GPTModel, tokenizer: Tokenizer, examples: Sequence[Mapping[str, Any]], *, max_new_tokens: int,
             tool: bool = True, batch_size: int = 64) -> float:
    """Share of ``examples`` (each with ``instruction`` and ``answer``) whose greedy completion's answer is right."""
    right = 0
    for start in range(0, len(examples), batch_size):
        part = examples[start:start + batch_size]
        prompts = [tokenizer.encode(format_prompt(e["instruction"], e.get("input", "") or "")) for e in part]
        done = complete(model, tokenizer, prompts, max_new_tokens=max_new_tokens, tool=tool)
        right += sum(exact_answer("", text, e) for text, e in zip(done.texts, part))
    return right / len(examples)


class GRPOStage(FinetuneStage):
    """GRPO of ``policy`` on ``examples`` (dicts with ``instruction``, optional ``input``, and whatever the reward
    functions read) against ``scorer``."""

    name = "grpo"
    postfix_keys = ("reward", "correct")

    def __init__(self, policy: GPTModel, tokenizer: Tokenizer, examples: Sequence[Mapping[str, Any]],
                 scorer: RewardScorer, *, config: GRPOConfig | None = None, reference: GPTModel | None = None,
                 eval_examples: Sequence[Mapping[str, Any]] | None = None, eval_limit: int = 200,
                 batch_size: int = 8, val_fraction: float = 0.1, seed: int = DEFAULT_SEED, source: str = "data") -> None:
        self.policy, self.tokenizer, self.scorer = policy, tokenizer, scorer
        self.config = config or GRPOConfig()
        self.heads = nn.ModuleDict()
        self.eos_id = end_of_text_id(tokenizer)
        self.reference = None
        if self.config.kl_coef > 0 and not is_adapted(policy):  # a LoRA policy's reference is its own base
            self.reference = reference if reference is not None else copy.deepcopy(policy)
            self.reference.eval().requires_grad_(False)
        c = policy.config.context_length
        encoded = []
        for i, e in enumerate(examples):
            where = f"{source}: entry {i}"
            if not isinstance(e, Mapping) or not isinstance(e.get("instruction"), str):
                raise ValueError(f"{where}: an entry needs an 'instruction' string")
            prompt = format_prompt(e["instruction"], e.get("input", "") or "")
            encoded.append((encode_prompt(tokenizer, prompt, c - 1, where), prompt, dict(e), where))
        train_idx, val_idx = split_indices(len(encoded), 0.0 if eval_examples is not None else val_fraction, seed)
        self.train = [encoded[i] for i in train_idx]
        self.val = ([dict(e) for e in eval_examples] if eval_examples is not None
                    else [encoded[i][2] for i in val_idx])[:eval_limit]
        self.batch_size, self.val_fraction, self.seed = batch_size, val_fraction, seed
        self.steps_per_epoch = batches_per_epoch(len(self.train), batch_size)
        self.generator = torch.Generator().manual_seed(seed)

    # ------------------------------------------------------------------------------------------ rollouts
    @torch.no_grad()
    def rollout(self, chosen: Sequence[int]) -> Rollout:
        cfg, device, g = self.config, self.device, self.config.group_size
        items = [self.train[i] for i in chosen for _ in range(g)]  # the G copies of a prompt adjacent
        prompts = [ids for ids, _, _, _ in items]
        seed = int(torch.randint(0, 2 ** 62, (1,), generator=self.generator))
        done = complete(self.policy, self.tokenizer, prompts, max_new_tokens=cfg.max_new_tokens,
                        temperature=cfg.temperature, top_k=cfg.top_k, seed=seed, tool=cfg.tool)
        rewards = torch.tensor(self.scorer([p for _, p, _, _ in items], done.texts, [e for _, _, e, _ in items],
                                           [w for _, _, _, w in items]), dtype=torch.float32)
        has_answer = all("answer" in e for _, _, e, _ in items)
        correct = (sum(exact_answer("", t, e) for t, (_, _, e, _) in zip(done.texts, items)) / len(items)
                   if has_answer else None)
        tokens = [row if row else [self.eos_id] for row in done.tokens]  # an empty completion: one masked token
        inputs, action_index, actions, mask = (t.to(device) for t in build_batch(prompts, tokens, self.eos_id))
        forced = torch.zeros_like(mask)
        for i, flags in enumerate(done.forced):
            forced[i, :len(flags)] = torch.tensor(flags, dtype=torch.bool)
        mask = mask & ~forced
        for i, row in enumerate(done.tokens):
            if not row:
                mask[i] = False
        t = cfg.temperature
        logp_old, _, _ = action_logprobs_values(self.policy, None, inputs, action_index, actions, t)
        logp_ref = None
        if cfg.kl_coef > 0:
            with reference_model(self.reference, self.policy) as reference:
                logp_ref, _, _ = action_logprobs_values(reference, None, inputs, action_index, actions, t)
        advantages = group_advantages(rewards, g, cfg.scale_rewards).to(device)
        calls = sum(row.count(True) > 0 for row in done.forced)  # rows that called the tool at least once
        return Rollout(inputs, action_index, actions, mask, forced, logp_old, logp_ref, rewards.to(device),
                       advantages, correct, calls / len(items))

    def batches(self, step: int) -> list[list[torch.Tensor]]:
        """Sample and score this step's rollout, then ``iterations`` shuffles of its completions cut into
        minibatches, one optimizer update each (row indices [m])."""
        cfg = self.config
        self.policy.eval()  # dropout off: see the module docstring
        chosen = batch_for_step(len(self.train), self.batch_size, step, self.seed)
        r = self._rollout = self.rollout(chosen)
        n = r.inputs.shape[0]
        size = cfg.minibatch_size or n
        updates = []
        for _ in range(cfg.iterations):
            order = torch.randperm(n, generator=self.generator).to(r.inputs.device)
            updates.extend([order[start:start + size]] for start in range(0, n, size))
        return updates

    def loss(self, rows: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
        cfg, r = self.config, self._rollout
        logp, _, _ = action_logprobs_values(self.policy, None, r.inputs[rows], r.action_index[rows], r.actions[rows],
                                            cfg.temperature)
        parts = grpo_loss(logp, r.logp_old[rows], r.advantages[rows], r.mask[rows], loss_type=cfg.loss_type,
                          clip_low=cfg.clip_range, clip_high=cfg.clip_range_high, beta=cfg.kl_coef,
                          logp_ref=None if r.logp_ref is None else r.logp_ref[rows],
                          max_new_tokens=cfg.max_new_tokens)
        return parts.loss, {"kl": parts.kl, "clip_fraction": parts.clip_fraction}

    def step_metrics(self) -> dict[str, float]:
        r = self._rollout
        metrics = {"reward": float(r.rewards.mean()), "tool_calls": r.tool_calls,
                   "completion_length": float(((r.mask | r.forced).sum(dim=1)).float().mean())}
        if r.correct is not None:
            metrics["correct"] = r.correct
        return metrics

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Greedy accuracy on the held-out examples (those with an ``answer``), the tool as in training."""
        held = [e for e in self.val if "answer" in e]
        if not held:
            return {}
        return {"val_accuracy": accuracy(self.policy, self.tokenizer, held, max_new_tokens=self.config.max_new_tokens,
                                         tool=self.config.tool)}

    def report(self, record: dict[str, Any], sample: str | None) -> str | None:
        if "val_accuracy" not in record:
            return None
        return f"step {record['step']}: val accuracy {record['val_accuracy']:.3f}, reward {record['reward']:.3f}"

    def state_dict(self) -> dict[str, Any]:
        return {"generator": self.generator.get_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.generator.set_state(state["generator"])

    def plot(self, records: list[dict[str, Any]], run_dir: Path) -> None:
        from ..figures import save_png

        save_png(accuracy_figure(records), Path(run_dir) / "grpo.png")


def accuracy_figure(records: list[dict[str, Any]]) -> Figure:
    """The share of right sampled answers per step and the held-out greedy accuracy, one panel."""
    from ..figures import integer_ticks, new_figure

    fig = new_figure(7, 3.6)
    ax = fig.subplots()
    train = [r for r in records if "correct" in r]
    ax.plot([r["step"] for r in train], [r["correct"] for r in train], label="right answers (sampled, train)")
    evals = [r for r in records if "val_accuracy" in r]
    if evals:
        ax.plot([r["step"] for r in evals], [r["val_accuracy"] for r in evals], "o-", label="held-out accuracy "
                                                                                             "(greedy)")
    ax.set_xlabel("GRPO step")
    ax.set_ylabel("share right")
    ax.set_ylim(0, 1)
    integer_ticks(ax.xaxis)
    ax.grid(alpha=0.3)
    ax.legend()
    return fig


def load_examples(path: str | Path, limit: int | None = None) -> list[dict[str, Any]]:
    """The entries of a JSON/JSONL file as dicts (each needs ``instruction``; other fields go to the rewards)."""
    records = read_records(path, limit)
    for i, record in enumerate(records):
        if not isinstance(record, dict) or not isinstance(record.get("instruction"), str):
            raise ValueError(f"{records.where(str(path), i)}: an entry must be an object with an 'instruction' string")
    return [dict(r) for r in records]


def grpo(model: str | Path, data: str | Path, options: FinetuneOptions, config: GRPOConfig | None = None, *,
         reward_fns: Sequence[str] = ("exact",), eval_data: str | Path | None = None, eval_limit: int = 200,
         limit: int | None = None, tokenizer_dir: str | Path | None = None, lora: Any = None) -> TrainingResult:
    """``tinygpt grpo``: GRPO of the model at ``model`` on the prompts of ``data`` against the summed
    ``reward_fns`` (``module:function`` or a shipped name), evaluated on ``eval_data`` (default: a held-out share)."""
    options.check()
    config = config or GRPOConfig()
    scorer = RewardScorer([load_reward_fn(spec) for spec in reward_fns])  # a bad --reward-fn before any loading
    examples = load_examples(data, limit)
    held = load_examples(eval_data) if eval_data is not None else None
    policy, tokenizer = load_start_model(model, options.device, tokenizer_dir, lora=lora)
    stage = GRPOStage(adapt(policy, lora, options, model), tokenizer, examples, scorer, config=config,
                      eval_examples=held, eval_limit=eval_limit, source=str(data), **options.stage_settings())
    return run_stage(stage, options)
