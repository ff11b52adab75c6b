"""Pretraining: corpus preparation, batches, AdamW + schedule, the training loop, checkpoints, torchrun scale-out."""

from .batches import WindowSampler
from .checkpointing import list_checkpoints, load_training_state, resolve_resume
from .data import PreparedCorpus, find_text_files, prepare_corpus, prepare_or_reuse
from .loop import DEFAULT_MODEL, TrainingDiverged, TrainingOptions, TrainingResult, resolve_config, train
from .metrics import flops_per_token, unigram_entropy
from .optim import build_optimizer, lr_at

__all__ = [
    "DEFAULT_MODEL",
    "PreparedCorpus",
    "TrainingDiverged",
    "TrainingOptions",
    "TrainingResult",
    "WindowSampler",
    "build_optimizer",
    "find_text_files",
    "flops_per_token",
    "list_checkpoints",
    "load_training_state",
    "lr_at",
    "prepare_corpus",
    "prepare_or_reuse",
    "resolve_config",
    "resolve_resume",
    "train",
    "unigram_entropy",
]
