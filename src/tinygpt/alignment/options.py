"""The settings every fine-tuning stage shares, with their defaults, and what each fine-tuning command reads (its
model and data: ``SFTInputs`` ... ``GRPOInputs``); torch-free, so the CLI can show them cheaply.

Each field's ``metadata`` holds its command-line help: ``tinygpt sft``/``reward``/``dpo``/``ppo``/``grpo`` and
``arithmetic-task`` are built from these fields (``tinygpt.cli.common.add_options``).
"""

from __future__ import annotations

from dataclasses import dataclass

from .. import checks
from ..checks import option, restated
from ..config import DEFAULT_SEED
from ..fileio import RUN, check_save_target
from ..training.options import LoopOptions
from .verifiers import SHIPPED


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


# ------------------------------------------------------------------------------------------ what each command reads
# The fine-tuning commands' own flags (the model and data each starts from, and a stage's setting or two); the
# shared ones are FinetuneOptions' and FinetuneInputs'.
DATA_HELP = "a JSON list or JSONL file of Alpaca-style entries (instruction, input, {})"
PROMPTS_HELP = "prompts: a JSON/JSONL file of entries with instruction (and input)"
POLICY_HELP = "the policy to start from (an SFT model)"


@dataclass
class FinetuneInputs:
    """Every fine-tuning command's: how many entries of ``--data`` to use, and the tokenizer."""

    limit: int | None = option(None, "use only the first N entries of --data", metavar="N", default_help=None)
    tokenizer_dir: str | None = option(None, "a saved tokenizer", metavar="DIR", default_help="the model's own")


@dataclass
class SFTInputs:
    """``tinygpt sft``: the model to start from and the instruction/response pairs."""

    model: str = option(None, "the model to start from", metavar="DIR|HUBNAME", required=True)
    data: str = option(None, DATA_HELP.format("output"), metavar="FILE", required=True)


@dataclass
class RewardInputs(SFTInputs):
    """``tinygpt reward``: the trunk to start from and the chosen/rejected pairs."""

    model: str = restated(SFTInputs, "model", None, help="the trunk to start from (an SFT model)")
    data: str = restated(SFTInputs, "data", None, help=DATA_HELP.format("chosen, rejected"))


@dataclass
class DPOInputs(RewardInputs):
    """``tinygpt dpo``: the policy, the chosen/rejected pairs and DPO's beta."""

    model: str = restated(SFTInputs, "model", None, help=POLICY_HELP)
    beta: float = option(0.1, "strength of the pull to the reference")


@dataclass
class PPOInputs:
    """``tinygpt ppo``: the policy, the reward model that scores it and the prompts."""

    policy: str = option(None, POLICY_HELP, metavar="DIR|HUBNAME", required=True)
    reward: str = option(None, "a reward model written by tinygpt reward", metavar="DIR", required=True)
    data: str = option(None, PROMPTS_HELP, metavar="FILE", required=True)


@dataclass
class GRPOInputs:
    """``tinygpt grpo``: the policy, the prompts, the reward functions and the held-out accuracy's entries."""

    model: str = restated(SFTInputs, "model", None, help=POLICY_HELP)
    data: str = option(None, f"{PROMPTS_HELP} and the fields the reward functions read (answer, for the shipped "
                             "exact)", metavar="FILE", required=True)
    reward_fns: list[str] | None = option(None, f"fn(prompt, completion, example) -> float; several are summed; "
                                                f"shipped: {', '.join(SHIPPED)}", flag="--reward-fn",
                                          metavar="MODULE:FUNCTION", action="append", default_help="exact")
    eval_data: str | None = option(None, "held-out entries with an answer for the accuracy", metavar="FILE",
                                   default_help="a --val-fraction share of --data")
    eval_limit: int = option(200, "evaluate on at most N entries", metavar="N")


@dataclass
class ArithmeticTaskOptions:
    """``tinygpt arithmetic-task``: the shipped GRPO task's files (``alignment.arithmetic.write_task``)."""

    out: str = option(None, "folder to write into", metavar="DIR", required=True)
    train: int = option(2000, "training problems", metavar="N")
    test: int = option(200, "test problems", metavar="N")
    levels: list[int] = option((1, 2), "operations per problem", choices=[1, 2, 3], default_help="1 2")
    seed: int = option(0, "seed of the draw")
    direct_share: float = option(0.0, "share of training solutions that give the bare answer without calculator "
                                      "calls", default_help="0")
