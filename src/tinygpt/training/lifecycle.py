"""How a run starts, refuses to start, and stops: shared by pretraining (``training.loop``) and fine-tuning
(``alignment.loop``).

- A fresh start into a folder that already holds checkpoints is refused (``refuse_fresh_start``), as is a resume
  of a run that is already at its last step (``refuse_finished``): neither silently overwrites nor silently does
  nothing.
- SIGINT (Ctrl-C) and SIGTERM (a cluster's preemption) are *requests*: ``StopRequests`` notes the first one, the
  loop finishes the step it is in, writes a checkpoint at that step and raises ``Interrupted`` (the command line
  prints one line and exits 128 + the signal number: 130 / 143). A second signal does not wait: it raises
  ``KeyboardInterrupt`` (SIGINT) or ``SystemExit(143)`` (SIGTERM) at once. Every file is written atomically
  (``tinygpt.fileio``), so stopping mid-write leaves the last complete checkpoint as it was.
"""

from __future__ import annotations

import signal
import threading
from pathlib import Path
from types import FrameType
from typing import Any

from .checkpointing import list_checkpoints


def refuse_fresh_start(run_dir: Path) -> None:
    """``ValueError`` when ``run_dir`` already holds ``step-N/`` checkpoints (a fresh run would mix with them)."""
    if list_checkpoints(run_dir):
        raise ValueError(f"{run_dir} already holds checkpoints: pass --resume auto to continue that run, or choose "
                         f"another --out")


def refuse_finished(step: int, max_steps: int) -> None:
    """``ValueError`` when a resumed run has nothing left to do."""
    if step >= max_steps:
        raise ValueError(f"the checkpoint is at step {step}, already >= max_steps={max_steps}: raise --max-steps to "
                         f"train further")


def last_good_checkpoint(run_dir: Path) -> str:
    """What a stopped run keeps, in words (for ``Diverged``)."""
    kept = list_checkpoints(run_dir)
    return f"the last good checkpoint is {kept[-1][1]}" if kept else "no checkpoint had been written yet"


class Interrupted(Exception):
    """The run stopped on a signal after writing ``checkpoint`` at ``step``; ``exit_code`` = 128 + the signal."""

    def __init__(self, signum: int | None, step: int, max_steps: int, checkpoint: Path | None) -> None:
        signum = signal.SIGTERM if signum is None else signum  # None: another rank was signalled, not this one
        self.signum, self.step, self.max_steps, self.checkpoint = signum, step, max_steps, checkpoint
        self.exit_code = 128 + signum
        saved = f"saved {checkpoint}" if checkpoint is not None else "nothing saved"
        super().__init__(f"interrupted by {signal.Signals(signum).name} at step {step} of {max_steps}; {saved}")


class StopRequests:
    """While active: the first SIGINT/SIGTERM sets ``signum`` (the loop stops at the end of its step); a second
    one raises at once. Outside the main thread (where Python cannot install handlers) it never fires."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signum is None:
            self.signum = signum
            return
        self._restore()
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        raise SystemExit(128 + signum)

    def _restore(self) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous = {}

    def start(self) -> "StopRequests":
        """Install the handlers (``close`` puts the previous ones back)."""
        if threading.current_thread() is threading.main_thread():
            for signum in self.SIGNALS:
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def close(self) -> None:
        self._restore()

    def __enter__(self) -> "StopRequests":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
