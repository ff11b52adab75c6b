"""How a run starts, refuses to start, and stops (torch-free: the command line imports it cheaply), for every stage
of the one loop (``training.loop``).

- A fresh start into a folder that already holds checkpoints, and a resume of a run already at its last step, are
  refused (``checkpointing.refuse_fresh_start`` / ``refuse_finished``, beside the rest of the resume path).
- SIGINT (Ctrl-C) and SIGTERM (a cluster's preemption) are *requests*: ``StopRequests`` notes the first one, the
  loop finishes the step it is in, writes a checkpoint at that step and raises ``Interrupted`` (the command line
  prints one line and exits 128 + the signal number: 130 / 143). A second signal does not wait: it raises
  ``KeyboardInterrupt`` (SIGINT) or ``Terminated`` (SIGTERM, a ``KeyboardInterrupt`` too) at once. Every file is written atomically
  (``tinygpt.fileio``), so stopping mid-write leaves the last complete checkpoint as it was.
- A non-finite loss or gradient norm stops the run before the update (``Diverged``, raised by
  ``optim.optimizer_step``; the loop adds which checkpoint is the last good one).
"""

from __future__ import annotations

import signal
import threading
from types import FrameType
from typing import Any



class Diverged(RuntimeError):
    """The loss or the gradient norm became NaN/inf: the update was not applied (``optimizer_step``).

    ``where`` says what is kept (the run's last good checkpoint), filled in by the loop that knows the run folder."""

    def __init__(self, step: int, loss: float, norm: float, where: str = "") -> None:
        self.step, self.loss, self.norm, self.where = step, loss, norm, where
        super().__init__(f"step {step}: the loss is {loss} and the gradient norm {norm} (not finite); stopped before "
                         f"applying the update{' -- ' + where if where else ''}; try a lower --lr or more "
                         f"--warmup-steps")

    def kept(self, where: str) -> "Diverged":
        """The same error, saying what is kept."""
        return Diverged(self.step, self.loss, self.norm, where)


class Interrupted(Exception):
    """The run stopped on a signal after writing ``checkpoint`` at ``step``; ``exit_code`` = 128 + the signal."""

    def __init__(self, signum: int | None, step: int, max_steps: int | None, checkpoint: Path | None) -> None:
        signum = signal.SIGTERM if signum is None else signum  # None: another rank was signalled, not this one
        self.signum, self.step, self.max_steps, self.checkpoint = signum, step, max_steps, checkpoint
        self.exit_code = 128 + signum
        saved = f"saved {checkpoint}" if checkpoint is not None else "nothing saved"
        of = "" if max_steps is None else f" of {max_steps}"  # None: a time budget
        super().__init__(f"interrupted by {signal.Signals(signum).name} at step {step}{of}; {saved}")


class Terminated(KeyboardInterrupt):
    """SIGTERM where no loop can stop gracefully (or a second one): raised like Ctrl-C's ``KeyboardInterrupt``, so
    every ``finally`` runs (temporary files are removed); the command line exits 143."""


def raise_terminated(signum: int, frame: FrameType | None) -> None:
    """A SIGTERM handler: ``Terminated``."""
    raise Terminated()


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
        raise KeyboardInterrupt if signum == signal.SIGINT else Terminated()

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
