"""Supervised fine-tuning (stage two of the chapter overview's four): next-token loss on the response tokens only.

Each example is the Alpaca prompt + the response + end-of-text (``data``, ``batches``). The loss is the usual
cross-entropy of the pretraining loop, but prompt and padding targets are -100, so they contribute nothing -- not a
small weight, exactly zero gradient -- and the model is taught to answer, not to reproduce instructions.
"""

from __future__ import annotations

import warnings
from dataclasses import replace
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ..config import DEFAULT_SEED
from ..model import GPTModel
from ..tokenizer import Tokenizer
from .batches import IGNORE_INDEX, EncodedExample, collate_targets, encode_example, end_of_text_id
from .data import ALPACA_CHAT_TEMPLATE, InstructionExample, load_instruction_data
from ..training.loop import TrainingResult, run_stage
from .finetune import SupervisedStage, adapt, load_start_model
from .options import FEW_EXAMPLES, LORA_LR_FACTOR, SFT_DEFAULTS, FinetuneOptions


def response_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over the non-ignored targets: logits [B, T, V], targets [B, T] (-100 = ignore)."""
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX)


def encode_instructions(tokenizer: Tokenizer, examples: Sequence[InstructionExample], context_length: int,
                        source: str = "data") -> list[EncodedExample]:
    """Tokenize every example (prompt + output + end-of-text, truncated to C + 1); errors name the entry."""
    return [encode_example(tokenizer, e.prompt, e.output, context_length, f"{source}: entry {i}", "output")
            for i, e in enumerate(examples)]


class SFTStage(SupervisedStage):
    """Fine-tune ``model`` on instruction examples with ``response_loss``. Its checkpoints carry the Alpaca chat
    template in their tokenizer (``tokenizer_config.json``): the format the model is taught, which ``serve`` and
    ``chat`` read back."""

    name = "sft"
    answers_samples = True

    def __init__(self, model: GPTModel, tokenizer: Tokenizer, examples: Sequence[InstructionExample], *,
                 batch_size: int = 8, val_fraction: float = 0.1, seed: int = DEFAULT_SEED, source: str = "data") -> None:
        self.policy, self.tokenizer = model, tokenizer.with_chat_template(ALPACA_CHAT_TEMPLATE)
        self.heads = nn.ModuleDict()
        self.pad_id = end_of_text_id(tokenizer)
        encoded = encode_instructions(tokenizer, examples, model.config.context_length, source)
        super().__init__(encoded, batch_size=batch_size, val_fraction=val_fraction, seed=seed)

    def loss(self, items: Sequence[EncodedExample]) -> tuple[torch.Tensor, dict[str, float]]:
        device = next(self.policy.parameters()).device
        inputs, targets = (t.to(device) for t in collate_targets(items, self.pad_id))
        # = response_loss(self.policy(inputs), targets), through the head-fused loss: no [B, T, V] logits
        return self.policy(inputs, targets=targets), {}


def sft_defaults(config: Any, lora: bool = False) -> tuple[float, int]:
    """(learning rate, epochs) for fine-tuning a model of ``config`` (a ``GPTConfig``): ``SFT_DEFAULTS``' row, the
    rate times ``LORA_LR_FACTOR`` with ``lora``."""
    from ..params import count_parameters

    total = count_parameters(config).total
    lr, epochs = next((lr, epochs) for most, lr, epochs in SFT_DEFAULTS if most is None or total <= most)
    return (lr * LORA_LR_FACTOR if lora else lr), epochs


def warn_if_few(stage: SFTStage, options: FinetuneOptions, source: str) -> None:
    """A ``UserWarning`` with the numbers when ``stage`` has fewer than ``FEW_EXAMPLES`` training examples."""
    train, val = len(stage.train_items), len(stage.val_items)
    if train >= FEW_EXAMPLES:
        return
    steps = options.max_steps or options.epochs * stage.steps_per_epoch
    warnings.warn(f"{source}: {train + val} examples ({train} to train, {val} held out) make {steps} step"
                  f"{'s' if steps != 1 else ''} of {stage.batch_size}: fewer than {FEW_EXAMPLES} training examples "
                  f"rarely teach an answer format (LLMs-from-scratch's instruction data has 1,100)", stacklevel=3)


def sft(model: str | Path, data: str | Path, options: FinetuneOptions, *, limit: int | None = None,
        tokenizer_dir: str | Path | None = None, lora: Any = None) -> TrainingResult:
    """``tinygpt sft``: fine-tune the model at ``model`` on the instruction file ``data``; the result (and its
    tokenizer) lands in ``options.out_dir``, loadable by ``load_model`` / ``tinygpt generate`` / ``tinygpt chat``.
    ``lora`` (a ``LoRAConfig``) trains adapters instead; the run folder then holds the adapter (PEFT's format).
    ``options.lr`` / ``options.epochs`` None: ``sft_defaults`` for the model's size. A model whose tokenizer has no
    end-of-text token (a character tokenizer) is refused with the command that trains a fitting base."""
    unset = {k: v for k, v in (("lr", 1.0), ("epochs", 1)) if getattr(options, k) is None}
    replace(options, **unset).check()  # everything but the two set below, before the model is loaded
    examples = load_instruction_data(data, limit)
    base, tokenizer = load_start_model(model, options.device, tokenizer_dir, lora=lora)
    end_of_text_id(tokenizer)  # a char tokenizer: its error names the command that makes a bpe base
    options = replace(options, **{k: v for k, v in zip(("lr", "epochs"), sft_defaults(base.config, lora is not None))
                                 if k in unset})
    stage = SFTStage(adapt(base, lora, options, model), tokenizer, examples, source=str(data),
                     **options.stage_settings())
    warn_if_few(stage, options, str(data))
    return run_stage(stage, options)
