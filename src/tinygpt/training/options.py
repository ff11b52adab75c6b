"""The settings of a training run, with their defaults (torch-free, so the CLI can show them cheaply)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from .. import checks
from ..checks import option
from ..config import DEFAULT_SEED, GPTConfig
from .sources import FORMATS

DTYPES = ("auto", "float32", "bfloat16")  # = tinygpt.devices.DTYPES (this module stays torch-free)
OPTIMIZERS = ("adamw", "muon")  # training.optim.build_for
BUDGET_CLOCKS = ("wall", "cpu")
_DURATION = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([smh]?)\s*$")


def parse_duration(name: str, text: str) -> float:
    """``"90"``/``"90s"`` -> 90.0, ``"5m"`` -> 300.0, ``"1.5h"`` -> 5400.0 seconds; anything else (or 0) a
    ``ValueError`` naming ``name``."""
    match = _DURATION.match(str(text))
    seconds = float(match.group(1)) * {"": 1, "s": 1, "m": 60, "h": 3600}[match.group(2)] if match else 0.0
    if not seconds > 0:
        raise ValueError(f"{name}={text!r} must be a positive duration: seconds, or a number with s, m or h "
                         f"(90, 90s, 5m, 1.5h)")
    return seconds

# The main job's model (vocab_size comes from the tokenizer): sized by timing runs so that the default
# ``tinygpt train`` on the embedded corpus finishes in about 5 minutes on 2 CPU cores.
DEFAULT_MODEL: dict[str, Any] = dict(context_length=128, emb_dim=128, n_heads=4, n_layers=4, drop_rate=0.0)

TOKENIZER_HELP = ("gpt2 (the pretrained GPT-2 BPE), char (one id per character seen) or bpe[:VOCAB] (a byte-level "
                   "BPE trained on the data; VOCAB >= 257, default 4096)")


@dataclass
class LoopOptions:
    """What the one training loop (``training.loop.run_stage``) reads, for every stage: the schedule, evaluation,
    checkpoints, resume, device, logging. ``TrainingOptions`` (pretraining) and ``FinetuneOptions`` (SFT, reward,
    PPO, DPO) extend it, each with its own defaults; a field's ``metadata`` holds its command-line help."""

    out_dir: str = option("runs/tinygpt", "run folder: checkpoints, metrics, plot, final model", flag="--out",
                          metavar="DIR")
    force: bool = option(False, "write the run into a folder that holds other files (they are kept)")
    resume: str | None = option(None, "continue from a step-N checkpoint or a run folder's newest one; auto = "
                                      "OUT's newest, or a fresh start when there is none", metavar="DIR|auto",
                                default_help="a fresh start")
    max_steps: int | None = option(2000, "optimizer steps in all")
    time_budget: str | None = option(None, "train until this much time is spent in the training steps (evaluation "
                                           "and checkpoints not counted), the cosine schedule running over it "
                                           "instead of --max-steps: 90s, 5m, 1.5h", metavar="DURATION",
                                     default_help="none: --max-steps")
    budget_clock: str = option("wall", "what --time-budget counts: wall-clock seconds, or this process's CPU "
                                       "seconds (steadier on a shared machine)", choices=BUDGET_CLOCKS)
    stop_after: int | None = option(None, "end this invocation after STEP (with a checkpoint) as if interrupted; "
                                          "the schedule still runs to --max-steps, and --resume continues",
                                    metavar="STEP", default_help="no stop")
    lr: float = option(1e-3, "peak learning rate")
    min_lr: float | None = option(None, "learning rate at the end of the cosine", default_help="lr/10")
    warmup_steps: int = option(100, "linear warmup steps")
    weight_decay: float = option(0.1, "AdamW weight decay on 2-D weights")
    beta1: float = 0.9
    beta2: float = 0.95
    optimizer: str = option("adamw", "adamw: AdamW on every weight; muon: torch.optim.Muon on the blocks' matrices "
                                      "(--muon-lr), AdamW (--lr) on embeddings, head, biases and norms",
                            choices=OPTIMIZERS)
    muon_lr: float = option(0.02, "Muon's peak learning rate (--optimizer muon), scheduled as --lr is")
    muon_momentum: float = option(0.95, "Muon's Nesterov momentum")
    muon_weight_decay: float = option(0.0, "Muon's decoupled weight decay on the blocks' matrices")
    grad_clip: float = option(1.0, "clip the global gradient norm to this, 0 = off")
    eval_every: int = option(250, "evaluate, plot (and print a sample) every N steps", metavar="N")
    checkpoint_every: int | None = option(None, "write step-N/ every N steps", metavar="N",
                                          default_help="--eval-every")
    keep_last: int = option(2, "step-N/ folders kept besides the best by val loss")
    seed: int | None = option(DEFAULT_SEED, "seed of init, data order and dropout")
    device: str | None = option(None, "cpu, cuda or cuda:N", default_help="cuda when available")
    dtype: str = option("auto", "bfloat16 = bf16 autocast with float32 weights; auto = bf16 on a bf16-capable GPU, "
                                "else float32", choices=DTYPES)
    grad_checkpoint: bool = option(False, "activation checkpointing: keep only each block's input and recompute "
                                          "the block in the backward pass (less memory, about one more forward)")
    tensorboard: bool = option(False, "also write the scalars as TensorBoard event files into OUT/tensorboard "
                                      "(needs the tensorboard extra)")
    progress: bool = option(True, "no progress bars", flag="--no-progress")
    # Set by the commands that offer them (no flag here): max_steps None = epochs * the stage's steps per epoch.
    epochs: int = 1
    compile: bool = False
    fsdp: bool = False

    def check(self) -> None:
        """``OptionError`` (a ``ValueError``) naming the first bad loop setting."""
        for name in ("eval_every", "epochs"):
            checks.positive_int(name, getattr(self, name))
        for name in ("max_steps", "stop_after", "checkpoint_every"):
            checks.positive_int(name, getattr(self, name), optional=True)
        for name in ("warmup_steps", "keep_last"):
            checks.non_negative_int(name, getattr(self, name))
        checks.positive_number("lr", self.lr)
        checks.number_in_range("min_lr", self.min_lr, 0, self.lr, optional=True, note="(at most lr)")
        checks.non_negative_number("weight_decay", self.weight_decay)
        checks.choice("optimizer", self.optimizer, OPTIMIZERS)
        checks.choice("budget_clock", self.budget_clock, BUDGET_CLOCKS)
        if self.time_budget is not None:
            parse_duration("time_budget", self.time_budget)
        checks.positive_number("muon_lr", self.muon_lr)
        checks.number_in_range("muon_momentum", self.muon_momentum, 0, 1, high_open=True)
        checks.non_negative_number("muon_weight_decay", self.muon_weight_decay)
        checks.non_negative_number("grad_clip", self.grad_clip, note="(0 turns clipping off)")
        checks.non_negative_int("seed", self.seed, optional=True)
        checks.choice("dtype", self.dtype, DTYPES)
        checks.boolean("grad_checkpoint", self.grad_checkpoint)
        checks.boolean("tensorboard", self.tensorboard)


@dataclass
class TrainingOptions(LoopOptions):
    """Every setting of a pretraining run (``LoopOptions`` and these). ``data=None`` and ``prepared=None`` train on
    the embedded corpus. ``tinygpt train`` is built from these fields."""

    data: list[str] | None = option(None, "text files or folders, prepared into OUT/data (default: the Python "
                                          "standard library's .py sources, which every Python installation carries)",
                                    nargs="+", metavar="PATH", group="data")
    prepared: str | None = option(None, "a folder written by `tinygpt prepare`", metavar="DIR", group="data")
    tokenizer: str = option("char", f"{TOKENIZER_HELP}; ignored with --prepared")
    config: str | GPTConfig | None = option(
        None, "a preset name or a config .json file; a file without vocab_size takes the tokenizer's",
        metavar="NAME|FILE.json",
        default_help=", ".join(f"{k}={v}" for k, v in DEFAULT_MODEL.items()) + ", vocab_size from the tokenizer")
    n_layers: int | None = option(None, "override the config's number of blocks L", metavar="L",
                                  default_help="the config's")
    n_heads: int | None = option(None, "override the config's attention heads H", metavar="H",
                                 default_help="the config's")
    emb_dim: int | None = option(None, "override the config's embedding width D", metavar="D",
                                 default_help="the config's")
    context_length: int | None = option(None, "override the config's context length C", metavar="C",
                                        default_help="the config's")
    max_steps: int = option(2000, "optimizer steps in all")
    seed: int = option(DEFAULT_SEED, "seed of init, data order and dropout")
    batch_size: int = option(16, "windows per micro-batch per process")
    grad_accum: int = option(1, "micro-batches per optimizer step")
    eval_iters: int = option(20, "batches per split in each evaluation")
    compile: bool = option(False, "torch.compile the model")
    fsdp: bool = option(False, "shard with FSDP2 fully_shard (under torchrun) instead of DDP")
    sample_tokens: int = option(200, "tokens of the sample printed at each eval")
    sample_prompt: str | None = option(None, "prompt of that sample", default_help="the start of the val text")
    sample_temperature: float = option(0.8, "temperature of that sample, 0 = greedy")
    peak_tflops: float | None = option(None, "peak TFLOP/s for the MFU estimate",
                                       default_help="known GPUs' bf16 peak; none on CPU")
    val_fraction: float = option(0.1, "the last fraction of the tokens held out for validation (with --data)")

    def check(self) -> None:
        """``OptionError`` (a ``ValueError``) naming the first bad setting."""
        for name in ("max_steps", "batch_size", "grad_accum", "eval_every", "eval_iters"):
            checks.positive_int(name, getattr(self, name))
        for name in ("warmup_steps", "keep_last", "sample_tokens"):
            checks.non_negative_int(name, getattr(self, name))
        for name in ("checkpoint_every", "stop_after", "n_layers", "n_heads", "emb_dim", "context_length"):
            checks.positive_int(name, getattr(self, name), optional=True)
        super().check()
        checks.non_negative_number("sample_temperature", self.sample_temperature, note="(0 = greedy)")
        checks.fraction("val_fraction", self.val_fraction)
        if self.data is not None and self.prepared is not None:
            raise ValueError("give either data paths or a prepared corpus, not both")


@dataclass
class PrepareOptions:
    """``tinygpt prepare``: text into a memmapped token file with a train/val split (``training.prepare_corpus``)."""

    data: list[str] = option(None, "text files, JSON Lines (.jsonl), Parquet (.parquet), folders saved by datasets' "
                                   "save_to_disk, or folders of these (searched recursively; hidden and other binary "
                                   "files skipped)", metavar="PATH", required=True, default_help=None)
    format: str = option("auto", "how to read every file; auto = by suffix and folder contents", choices=FORMATS)
    text_field: str = option("text", "the field (JSON Lines) or column (Parquet, datasets) holding each record's text",
                             metavar="NAME")
    split: str = option("train", "the split of a saved DatasetDict")
    workers: int = option(1, "processes that encode the text, the same tokens as one")
    tokenizer: str = option("char", TOKENIZER_HELP)
    out: str = option(None, "output folder (prepared.json, tokens.bin, tokenizer/)", required=True)
    val_fraction: float = option(0.1, "the last fraction of the tokens held out for validation")
    no_progress: bool = option(False, "no progress bar")
    force: bool = option(False, "write into a folder that holds other files (kept)")
