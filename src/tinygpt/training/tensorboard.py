"""``--tensorboard``: the run's scalars as TensorBoard event files in ``RUN_DIR/tensorboard`` (beside, not instead of,
``metrics.jsonl`` and ``loss.png``).

Each ``metrics.jsonl`` record becomes one scalar per numeric key, tagged with the key itself (``loss``, ``lr``,
``grad_norm``, ``tokens_per_second``, ``mfu``, ``val_loss``, a stage's own such as ``margin`` or ``kl``) at the
record's step. A resumed run opens the writer with ``purge_step`` = the resume step, so TensorBoard hides what an
interrupted invocation wrote after that checkpoint, as ``metrics.jsonl`` drops those records. ``tensorboard`` is an
extra (``pip install 'tinygpt[tensorboard]'``), never a core dependency.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

INSTALL = "pip install 'tinygpt[tensorboard]'"


def require_tensorboard() -> None:
    """``ValueError`` saying how to install it when the tensorboard package is missing."""
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        raise ValueError(f"--tensorboard needs the tensorboard package: {INSTALL}") from None


class TensorBoardLog:
    """A ``SummaryWriter`` on ``log_dir``; ``append`` takes a metrics record as ``MetricsLog.append`` does."""

    def __init__(self, log_dir: Path, resume_step: int | None) -> None:
        require_tensorboard()
        from torch.utils.tensorboard import SummaryWriter

        purge = None if resume_step is None else resume_step + 1  # the resume step itself was written before its checkpoint
        self.writer = SummaryWriter(str(log_dir), purge_step=purge)

    def append(self, record: dict[str, Any]) -> None:
        step = int(record["step"])
        for key, value in record.items():
            if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                self.writer.add_scalar(key, value, step)

    def close(self) -> None:
        self.writer.close()
