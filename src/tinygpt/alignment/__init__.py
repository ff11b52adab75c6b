"""From pretrained model to assistant: supervised fine-tuning, a reward model, RLHF with PPO, DPO, and chat.

- ``data``: the Alpaca prompt template, JSON / JSONL loading, validation that names the bad entry.
- ``batches``: prompt + response + end-of-text, truncated to C, padded with end-of-text, prompt/pad targets -100.
- ``options``: ``FinetuneOptions``, the settings every stage shares (torch-free; the CLI's flags come from it).
- ``finetune``: what the stages share (``FinetuneStage``, ``SupervisedStage``, ``load_start_model``); each runs in
  the one training loop, ``tinygpt.training.loop.run_stage``, as pretraining does.
- ``sft``, ``reward``, ``dpo``, ``ppo`` (the math) + ``ppo_trainer`` (rollouts and updates), ``chat``.
- ``grpo`` (the math) + ``grpo_trainer`` (rollouts through the engine, updates), ``verifiers`` (rewards a program
  computes), ``arithmetic`` (the shipped word-problem task).

Names are imported on first use (PEP 562), so importing the package is cheap.
"""

from __future__ import annotations

from .._lazy import lazy_exports

_EXPORTS = {
    "EncodedExample": "batches",
    "collate_targets": "batches",
    "encode_example": "batches",
    "chat": "chat",
    "InstructionExample": "data",
    "PreferenceExample": "data",
    "format_prompt": "data",
    "load_instruction_data": "data",
    "load_preference_data": "data",
    "load_prompts": "data",
    "DPOStage": "dpo",
    "dpo": "dpo",
    "dpo_loss": "dpo",
    "token_logprobs": "logprobs",
    "FinetuneOptions": "options",
    "GRPOConfig": "grpo_trainer",
    "GRPOStage": "grpo_trainer",
    "grpo_loss": "grpo",
    "group_advantages": "grpo",
    "FinetuneStage": "finetune",
    "SupervisedStage": "finetune",
    "load_start_model": "finetune",
    "run_stage": ".training.loop",  # the one loop, tinygpt.training's, also offered here beside the stages
    "PPOConfig": "ppo",
    "gae": "ppo",
    "PPOStage": "ppo_trainer",
    "ppo": "ppo_trainer",
    "RewardModel": "reward",
    "RewardStage": "reward",
    "bradley_terry_loss": "reward",
    "load_reward_model": "reward",
    "save_reward_model": "reward",
    "train_reward_model": "reward",
    "SFTStage": "sft",
    "response_loss": "sft",
    "sft": "sft",
}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
