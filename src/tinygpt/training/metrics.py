"""What a run reports: FLOPs per token and MFU, the unigram baseline, ``metrics.jsonl`` and the loss-curve PNG."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ..config import GPTConfig
from ..params import count_parameters

if TYPE_CHECKING:  # matplotlib is imported only when a plot is drawn
    from matplotlib.figure import Figure

# The loss plot is redrawn at an evaluation only when this long has passed since the last drawing (a drawing costs as
# much as several training steps), and always at the end: a long run's loss.png stays current, a short run draws once.
PLOT_INTERVAL_SECONDS = 60.0

# Dense bf16 peaks from the vendors' data sheets (TFLOP/s), for the MFU estimate on known GPUs. Anything else
# (CPUs included) has no default: pass --peak-tflops to get an MFU figure.
_PEAK_BF16_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0, "L4": 121.0, "A10": 125.0}


def flops_per_token(config: GPTConfig) -> float:
    """Training FLOPs per token: 6N, N = every parameter but the two embedding tables (a lookup is not a matmul;
    the head multiplies, tied or not), plus 12 L C D for attention scores and their use (forward 2 x 2 L C D,
    backward twice that), as in the PaLM paper's appendix B with sequence length C."""
    counts = count_parameters(config)
    matmul_params = counts.n_layers * counts.per_block + counts.final_norm + config.vocab_size * config.emb_dim
    return 6.0 * matmul_params + 12.0 * config.n_layers * config.context_length * config.emb_dim


def tokens_per_byte(tokenizer: Any, tokens: Any) -> float:
    """Tokens per UTF-8 byte of the text ``tokens`` (ids) decode to: the factor from bits per token to bits per
    byte. 1 for a character tokenizer on ASCII text; about 0.3 for GPT-2's BPE on English."""
    n_bytes = len(tokenizer.decode(np.asarray(tokens).tolist()).encode("utf-8"))
    return len(tokens) / max(1, n_bytes)


def peak_flops(device: torch.device, override_tflops: float | None = None) -> float | None:
    """The peak FLOP/s the MFU is measured against: ``override_tflops`` when given, else a known GPU's bf16 peak."""
    if override_tflops is not None:
        if not override_tflops > 0:
            raise ValueError(f"peak_tflops={override_tflops!r} must be > 0")
        return override_tflops * 1e12
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, tflops in _PEAK_BF16_TFLOPS.items():
            if key in name:
                return tflops * 1e12
    return None


def unigram_entropy(tokens: np.ndarray, vocab_size: int, chunk: int = 1 << 24) -> float:
    """Entropy (nats) of the token frequencies in ``tokens``: the loss of a model that ignores all context, the
    baseline a trained model must beat. Counted in chunks, so a memmap of any size stays on disk."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    for start in range(0, len(tokens), chunk):
        counts += np.bincount(np.asarray(tokens[start : start + chunk]), minlength=vocab_size)[:vocab_size]
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


class MetricsLog:
    """Appends one JSON object per line to ``metrics.jsonl`` (a log: appended, not rewritten; a resume truncates
    it back to the checkpoint's step, so the file always tells one consistent history)."""

    def __init__(self, path: Path, resume_step: int | None) -> None:
        self.path = Path(path)
        self.records: list[dict[str, Any]] = []
        if resume_step is not None and self.path.is_file():
            for line in self.path.read_text(encoding="utf-8").splitlines():
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:  # a line cut by a crash
                    continue
                if record.get("step", math.inf) <= resume_step:
                    self.records.append(record)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text("".join(json.dumps(r) + "\n" for r in self.records), encoding="utf-8")

    def append(self, record: dict[str, Any]) -> None:
        self.records.append(record)
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")


def loss_figure(records: list[dict[str, Any]], *, baseline: float | None = None) -> Figure:
    """The loss curves of ``records`` (``metrics.jsonl``'s lines): training loss per step, and train/val loss at
    each eval, as a ``matplotlib.figure.Figure``."""
    from ..figures import integer_ticks, new_figure

    steps = [r["step"] for r in records if "loss" in r]
    losses = [r["loss"] for r in records if "loss" in r]
    evals = [r for r in records if "val_loss" in r]
    fig = new_figure(7, 4)
    ax = fig.add_subplot()
    ax.plot(steps, losses, lw=0.8, alpha=0.6, label="train (step)")
    if evals:
        ax.plot([r["step"] for r in evals], [r["train_loss"] for r in evals], "o-", label="train (eval)")
        ax.plot([r["step"] for r in evals], [r["val_loss"] for r in evals], "s-", label="val (eval)")
    if baseline is not None:
        ax.axhline(baseline, color="gray", ls="--", lw=1, label=f"unigram baseline {baseline:.2f}")
    ax.set_xlabel("step")
    integer_ticks(ax.xaxis)
    ax.set_ylabel("cross-entropy loss (nats/token)")
    ax.legend()
    ax.grid(alpha=0.3)
    return fig


def plot_losses(records: list[dict[str, Any]], path: Path, *, baseline: float | None = None) -> None:
    """``loss_figure`` as a PNG (written atomically)."""
    from ..figures import save_png

    save_png(loss_figure(records, baseline=baseline), path)
