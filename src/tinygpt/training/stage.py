"""What a training stage is: how it makes its batches, its loss and its metrics -- and nothing else.

Pretraining (``training.pretrain``), SFT, the reward model, DPO and PPO (``tinygpt.alignment``) are stages; the one
loop (``training.loop.run_stage``) does the rest for all of them: seeding, distributed setup, the optimizer and its
schedule, gradient accumulation and clipping, evaluation, samples, checkpoints and resume, signals, logging.

A stage plugs in by setting ``name``, ``policy`` (the GPT saved as the model of every ``step-N/`` checkpoint),
``heads`` (further trainable modules, saved in the training state) and ``tokenizer``, and implementing:

- ``batches(step)``: the optimizer updates of 0-based step ``step``, each a list of micro-batches whose gradients are
  accumulated (pretraining: one update of ``grad_accum`` micro-batches; PPO: ``ppo_epochs`` x minibatches);
- ``loss(batch)``: ``(scalar loss, extra metrics)`` for one micro-batch (the loop logs ``loss`` itself);
- ``evaluate()``: held-out metrics (``val_loss`` makes the loop keep the best checkpoint).

What it may override: ``trainable()`` (which parameters train: the modules the optimizer and DDP see, default the
policy and the heads), ``state_dict``/``load_state_dict`` (extra state a resume needs: generator positions),
``export`` (the finished model's files), ``setup``/``build`` (data and model), ``sample``/``report`` (what an
evaluation prints), ``plot`` and ``summary``. A frozen reference model (DPO, PPO) is simply an attribute the stage
keeps in eval mode with ``requires_grad_(False)``: it is neither trained nor saved.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from ..config import GPTConfig
    from ..model import GPTModel
    from ..tokenizer import Tokenizer
    from .distributed import DistContext
    from .options import LoopOptions


class Stage:
    """One kind of training run; see the module docstring for what a subclass sets and implements."""

    name: str = "stage"
    policy: GPTModel
    heads: nn.ModuleDict
    tokenizer: Tokenizer | None
    steps_per_epoch: int = 1  # max_steps None in the options = epochs * this
    postfix_keys: tuple[str, ...] = ("loss",)  # the metrics shown on the progress bar
    data_parallel: bool = False  # True: batches() gives this rank's share, so the stage may run under torchrun
    tokens_per_step: int | None = None  # set: the loop logs tokens/s (and with the two below TFLOP/s and MFU)
    flops_per_token: float | None = None
    peak_flops: float | None = None
    inputs: tuple[str, ...] = ()  # files the run reads, which its --out must not overwrite
    forward: Any = None  # the trainable module as the loop wraps it (DDP / torch.compile); set before any step
    # The checkpoint's config when setup read it to build the model from it (pretraining's resume): the loop then
    # checks the weights against it instead of reading config.json a second time.
    resumed_config: GPTConfig | None = None

    # ----------------------------------------------------------------------------------------- setup
    def setup(self, options: LoopOptions, ctx: DistContext, resume_from: Path | None) -> None:
        """Data and checks, before the loop seeds the RNGs (default: nothing to do)."""

    def build(self, ctx: DistContext) -> None:
        """Create ``policy`` and ``heads`` on ``ctx.device``, called right after the loop has seeded torch, numpy and
        Python's RNGs from the run's seed (default: a stage built by its caller already has them)."""

    @property
    def device(self) -> torch.device:
        return next(self.policy.parameters()).device

    def trainable(self) -> nn.Module:
        """The module the optimizer trains and DDP/FSDP wrap: the policy, with the heads when there are any."""
        return self.policy if len(self.heads) == 0 else nn.ModuleDict({"policy": self.policy, "heads": self.heads})

    # ----------------------------------------------------------------------------------------- steps
    def batches(self, step: int) -> list[list[Any]]:
        """The optimizer updates of 0-based ``step``: each a list of micro-batches (run under autocast)."""
        raise NotImplementedError

    def loss(self, batch: Any) -> tuple[torch.Tensor, dict[str, float]]:
        """(scalar loss to minimise, extra metrics to log) of one micro-batch (under autocast)."""
        raise NotImplementedError

    def step_metrics(self) -> dict[str, float]:
        """Metrics of the step just taken beyond the losses (PPO: its rollout's reward and KL)."""
        return {}

    def evaluate(self) -> dict[str, float]:
        """Held-out metrics; the trainable modules are in eval mode and autocast is on."""
        return {}

    def sample(self) -> str | None:
        """A text to show after an evaluation (pretraining: a continuation), or None."""
        return None

    def report(self, record: dict[str, Any], sample: str | None) -> str | None:
        """The line(s) printed after an evaluation, or None for nothing."""
        return None

    # ----------------------------------------------------------------------------------------- state and files
    def state_dict(self) -> dict[str, Any]:
        """Extra state to resume exactly (tensors and plain values only)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass

    def plot(self, records: list[dict[str, Any]], run_dir: Path) -> None:
        """Draw the run's curves into ``run_dir`` (after an evaluation, at most once a minute, and at the end)."""

    def summary(self) -> dict[str, Any]:
        """Stage-specific entries of ``summary.json``."""
        return {}

    def export(self, model: GPTModel, run_dir: Path) -> None:
        """Write the finished model (``model``: the policy as last checkpointed, unsharded) into ``run_dir``."""
        from .checkpointing import export_model_files

        export_model_files(model, self.tokenizer, run_dir)
