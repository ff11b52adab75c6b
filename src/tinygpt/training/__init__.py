"""Training: the one loop every stage runs in, pretraining (corpus preparation, batches), AdamW + schedule,
checkpoints and resume, torchrun scale-out.

Names are imported on first use (PEP 562), so ``tinygpt.training.options`` -- what the CLI needs to build its
``--help`` -- loads without pulling in the loop and torch.distributed.
"""

from __future__ import annotations

from .._lazy import lazy_exports

_EXPORTS = {
    "WindowSampler": "batches",
    "list_checkpoints": "checkpointing",
    "load_training_state": "checkpointing",
    "resolve_resume": "checkpointing",
    "PreparedCorpus": "data",
    "Diverged": "lifecycle",
    "Interrupted": "lifecycle",
    "find_text_files": "data",
    "prepare_corpus": "data",
    "prepare_or_reuse": "data",
    "TrainingResult": "loop",
    "run_stage": "loop",
    "PretrainStage": "pretrain",
    "resolve_config": "pretrain",
    "train": "pretrain",
    "Stage": "stage",
    "flops_per_token": "metrics",
    "unigram_entropy": "metrics",
    "build_optimizer": "optim",
    "lr_at": "optim",
    "DEFAULT_MODEL": "options",
    "LoopOptions": "options",
    "TrainingOptions": "options",
}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
