"""The options of ``tinygpt experiment NAME``, one dataclass per experiment (torch-free, so the CLI can show them
cheaply): ``ExperimentOptions`` for the ones that take only ``--out`` and ``--seed``, a subclass for each of the
others. Every field becomes a flag (``tinygpt.cli.common.add_options``); the names follow ``experiments.run_NAME``'s
parameters where they can.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from .checks import option

INITS = ("xavier", "gpt2")  # experiments.prepost_training's weight inits


def int_list(text: str) -> tuple[int, ...]:
    """``6,12`` -> ``(6, 12)`` (argparse's ``type``: an unreadable text is a usage error naming it)."""
    try:
        return tuple(int(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers") from None


def float_list(text: str) -> tuple[float, ...]:
    """``3e-4,1e-3`` -> ``(0.0003, 0.001)``."""
    try:
        return tuple(float(v) for v in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of numbers") from None


def name_list(text: str) -> tuple[str, ...]:
    """``a,b`` -> ``("a", "b")``."""
    return tuple(text.split(","))


@dataclass
class ExperimentOptions:
    """What every experiment takes: where to write, and the seed."""

    out: str | None = option(None, "output directory", metavar="DIR", default_help="runs/experiments/NAME")
    seed: int = option(123, "random seed")


@dataclass
class PrepostOptions(ExperimentOptions):
    """``experiment prepost``: pre-LN vs post-LN (``experiments.run_prepost``)."""

    config: str | None = option(None, "preset or config .json for the trained 12-layer models (vocab_size replaced "
                                      "by the character count; default C=64 D=64 H=4 L=12)", metavar="CONFIG")
    data: str | None = option(None, "UTF-8 training text", metavar="FILE", default_help="the embedded corpus")
    max_chars: int = option(400_000, "characters of text used")
    init: str = option("xavier", "weight init of the trained models: xavier (the original Transformer's: "
                                 "Xavier-uniform linears, N(0, 1) embeddings) or gpt2 (N(0, 0.02))", choices=INITS)
    seeds: int | None = option(None, "seeds of the main cell (--seed, --seed + 1, ...)", default_help="3; 1 with --stall")
    stall: bool = option(False, "the stall alone: pre-LN and post-LN without warmup at the main cell, nothing else, "
                                "and one graded line (about 40 s of CPU per seed, one thread)")
    steps: int = option(300, "training steps per model; 0 skips training")
    batch_size: int = option(16, "sequences per step")
    seq_len: int = option(32, "characters per sequence")
    lr: float = option(1e-3, "constant AdamW learning rate after the warmup", default_help="1e-3")
    warmup: int = option(100, "linear warmup steps of the two warmup runs")
    contrast_depths: tuple[int, ...] = option((6,), "shallower cells, pre-LN and post-LN without warmup, one seed; 0 "
                                                    "for none", type=int_list, metavar="N,N,...", default_help="6")
    control_init: str = option("gpt2", "the control cell's init, pre-LN and post-LN without warmup, one seed",
                               choices=("gpt2", "xavier", "none"))
    profile_depths: tuple[int, ...] = option((2, 6, 12, 24), "depths of the gradient profile and the one-step change "
                                                             "at init", type=int_list, metavar="N,N,...",
                                             default_help="2,6,12,24")
    sweep: bool = option(False, "also train the four runs at every --sweep-depths x --sweep-lrs, one seed (the "
                                "evidence in docs/experiments.md)")
    sweep_depths: tuple[int, ...] = option((6, 12), "depths of the sweep", type=int_list, metavar="N,N,...",
                                           default_help="6,12")
    sweep_lrs: tuple[float, ...] = option((3e-4, 1e-3, 3e-3), "learning rates of the sweep", type=float_list,
                                          metavar="LR,LR,...", default_help="3e-4,1e-3,3e-3")
    sweep_steps: int | None = option(None, "training steps per sweep run", default_help="--steps")


@dataclass
class AttentionOptions(ExperimentOptions):
    """``experiment attention``: the heatmaps of one layer's heads (``experiments.run_attention``)."""

    model: str | None = option(None, "a saved tinygpt checkpoint", metavar="DIR", group="source")
    config: str | None = option(None, "preset or config .json for a random model (default: gpt2-small); token ids = "
                                      "UTF-8 bytes mod vocab_size", metavar="CONFIG", group="source")
    prompt: str = option("Every effort moves you forward", "the text to attend over", default_help=None)
    layer: int = option(0, "block index")


@dataclass
class AnatomyOptions(ExperimentOptions):
    """``experiment anatomy``: parameters and training memory by part (``experiments.run_anatomy``)."""

    config: list[str] | None = option(None, "a preset or config .json, repeatable", metavar="NAME|FILE",
                                      action="append", default_help="every preset")


@dataclass
class LadderOptions(ExperimentOptions):
    """``experiment ladder``: GPT-2 block -> modern block, one change per rung (``experiments.run_ladder``)."""

    budget: str = option("20s", "CPU time per run, one thread: 90s, 5m, ...", metavar="BUDGET")
    seeds: int = option(3, "seeds per rung (--seed, --seed + 1, ...)")
    rungs: tuple[str, ...] | None = option(None, "a subset of the rungs, in ladder order", type=name_list,
                                           metavar="NAME,NAME,...",
                                           default_help="all; each keeps the changes above it")
    data: str | None = option(None, "UTF-8 training text", metavar="FILE", default_help="the embedded corpus")
    max_chars: int = option(400_000, "characters of text used")
    jobs: int = option(1, "runs trained at once, each in its own process")
    lr: float = option(1e-3, "AdamW's peak learning rate", default_help="1e-3")
    muon_lr: float = option(0.04, "Muon's peak learning rate", default_help="0.04, the best of 0.01, 0.02, 0.04 at "
                                                                            "10 s")


# experiment name -> (its options, its one-line help), in the order `tinygpt experiment --help` lists them
EXPERIMENT_OPTIONS: dict[str, tuple[type, str]] = {
    "residual": (ExperimentOptions, "gradients of the 5-layer example with/without shortcuts"),
    "prepost": (PrepostOptions, "pre-LN vs post-LN: outputs, gradients, training"),
    "activations": (ExperimentOptions, "GELU (exact, tanh) vs ReLU vs SiLU and derivatives"),
    "layernorm": (ExperimentOptions, "the x=[1,3] variance example and LayerNorm statistics"),
    "attention": (AttentionOptions, "attention heatmaps of every head of one layer"),
    "anatomy": (AnatomyOptions, "parameters and training memory by part, per preset"),
    "ladder": (LadderOptions, "GPT-2 block -> modern block, one change per rung, each trained for the same CPU time "
                              "on 3 seeds"),
}
