"""The settings every fine-tuning stage shares, with their defaults (torch-free, so the CLI can show them cheaply).

Each field's ``metadata`` holds its command-line help: ``tinygpt sft``/``reward``/``dpo``/``ppo`` are built from
these fields (``tinygpt.cli.common.add_options``).
"""

from __future__ import annotations

from dataclasses import dataclass

from .. import checks
from ..checks import option, restated
from ..config import DEFAULT_SEED
from ..fileio import RUN, check_save_target
from ..training.options import LoopOptions


STAGE_SETTINGS = ("batch_size", "val_fraction", "seed")  # a stage's own, also accepted here (see FinetuneOptions)

# The learning rate and epochs ``sft`` uses when the options leave them None, by the model's parameter count: (at
# most this many parameters, lr, epochs), the first that fits. Large models keep GPT-2's fine-tuning values (LLMs-from-
# scratch's chapter 7: 5e-5); a small model trained here learns nothing in one epoch at that rate. The small row
# was chosen by measurement on the main job's BPE base (docs/assistant.md, "From the main job to an assistant").
SFT_DEFAULTS: tuple[tuple[int | None, float, int], ...] = ((20_000_000, 1e-3, 3), (None, 5e-5, 1))
# With LoRA the default rate is this many times the row's: only the low-rank updates move, from zero (measured on
# the same base: see the docs section above; docs/assistant.md's GPT-2 recipe uses 20x)
LORA_LR_FACTOR = 10
# Fewer training examples than this: a warning with the numbers (an answer format takes hundreds of examples)
FEW_EXAMPLES = 100


def sft_defaults_help() -> str:
    """``SFT_DEFAULTS`` in words, for the command line's help."""
    rows = [f"{lr:g} and {epochs} epoch{'s' if epochs != 1 else ''} " +
            (f"up to {most / 1e6:g}M parameters" if most is not None else "above") for most, lr, epochs in SFT_DEFAULTS]
    return f"by the model's size: {', '.join(rows)}; with --lora-r, {LORA_LR_FACTOR}x the rate"


@dataclass
class FinetuneOptions(LoopOptions):
    """Settings shared by every stage (``LoopOptions`` with fine-tuning's defaults, and these). ``max_steps`` None =
    ``epochs`` passes over the training examples.

    ``batch_size``, ``val_fraction`` and ``seed`` belong to the stage, which splits and batches its data with them:
    ``sft``/``dpo``/``train_reward_model``/``ppo`` build their stage from these (None: the stage's defaults, 8,
    0.1 and ``DEFAULT_SEED``); ``run_stage`` takes a stage built elsewhere as it is and refuses options that say otherwise
    (``ValueError``), so neither value is ever silently ignored."""

    # LoopOptions' fields with fine-tuning's defaults (their help is LoopOptions'); then the stage's own settings.
    out_dir: str = restated(LoopOptions, "out_dir", "runs/finetune")
    epochs: int = restated(LoopOptions, "epochs", 1, help="passes over the training examples")
    max_steps: int | None = restated(LoopOptions, "max_steps", None, default_help="from --epochs")
    lr: float = restated(LoopOptions, "lr", 5e-5)
    warmup_steps: int = restated(LoopOptions, "warmup_steps", 0)
    eval_every: int = restated(LoopOptions, "eval_every", 50)
    seed: int | None = restated(LoopOptions, "seed", None, default_help=DEFAULT_SEED,
                                help="seed of the split, data order, head initialisation, dropout and sampling")
    batch_size: int | None = option(None, "examples per step", default_help=8)
    val_fraction: float | None = option(None, "examples held out", default_help=0.1)

    def stage_settings(self) -> dict[str, int | float]:
        """The stage's settings these options give (the ones not None), for a stage's constructor."""
        return {name: getattr(self, name) for name in STAGE_SETTINGS if getattr(self, name) is not None}

    def check(self) -> None:
        """``OptionError`` (a ``ValueError``) naming the first bad setting."""
        checks.positive_int("epochs", self.epochs)
        checks.positive_int("batch_size", self.batch_size, optional=True)
        super().check()
        if self.val_fraction is not None:
            checks.fraction("val_fraction", self.val_fraction)
        # Every stage calls this first: the run folder is checked before the model is even loaded.
        check_save_target(self.out_dir, RUN, overwrite=self.force)
