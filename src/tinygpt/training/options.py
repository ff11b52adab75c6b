"""The settings of a training run, with their defaults (torch-free, so the CLI can show them cheaply)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..config import GPTConfig

# The main job's model (vocab_size comes from the tokenizer): sized by timing runs so that the default
# ``tinygpt train`` on the embedded corpus finishes in about 5 minutes on 2 CPU cores.
DEFAULT_MODEL: dict[str, Any] = dict(context_length=128, emb_dim=128, n_heads=4, n_layers=4, drop_rate=0.0)


@dataclass
class TrainingOptions:
    """Every setting of a run. ``data=None`` and ``prepared=None`` train on the embedded corpus."""

    data: list[str] | None = None
    prepared: str | None = None
    tokenizer: str = "char"
    config: str | GPTConfig | None = None
    out_dir: str = "runs/tinygpt"
    max_steps: int = 2000
    stop_after: int | None = None
    batch_size: int = 16
    grad_accum: int = 1
    lr: float = 1e-3
    min_lr: float | None = None
    warmup_steps: int = 100
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0
    eval_every: int = 250
    eval_iters: int = 20
    checkpoint_every: int | None = None
    keep_last: int = 2
    seed: int = 1337
    device: str | None = None
    dtype: str = "auto"
    compile: bool = False
    fsdp: bool = False
    resume: str | None = None
    sample_tokens: int = 200
    sample_prompt: str | None = None
    sample_temperature: float = 0.8
    peak_tflops: float | None = None
    val_fraction: float = 0.1
    progress: bool = True

    def check(self) -> None:
        """``ValueError`` naming the first bad setting."""
        positive = ("max_steps", "batch_size", "grad_accum", "eval_every", "eval_iters")
        for name in positive:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}={value!r} must be an integer >= 1")
        for name in ("warmup_steps", "keep_last", "sample_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name}={value!r} must be an integer >= 0")
        if self.checkpoint_every is not None and self.checkpoint_every < 1:
            raise ValueError(f"checkpoint_every={self.checkpoint_every!r} must be >= 1")
        if self.stop_after is not None and self.stop_after < 1:
            raise ValueError(f"stop_after={self.stop_after!r} must be >= 1")
        if not self.lr > 0 or (self.min_lr is not None and not 0 <= self.min_lr <= self.lr):
            raise ValueError(f"need lr > 0 and 0 <= min_lr <= lr (got lr={self.lr}, min_lr={self.min_lr})")
        if not self.grad_clip >= 0:
            raise ValueError(f"grad_clip={self.grad_clip!r} must be >= 0 (0 turns clipping off)")
        if not self.sample_temperature >= 0:
            raise ValueError(f"sample_temperature={self.sample_temperature!r} must be >= 0 (0 = greedy)")
        if self.dtype not in ("auto", "float32", "bfloat16"):
            raise ValueError(f"dtype={self.dtype!r}; allowed: auto, float32, bfloat16")
        if self.data is not None and self.prepared is not None:
            raise ValueError("give either data paths or a prepared corpus, not both")
