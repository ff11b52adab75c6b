"""Training batches: random windows of C + 1 tokens from a flat token array, inputs and targets shifted by one."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch


class WindowSampler:
    """Draws ``n`` random windows of ``context_length + 1`` tokens from ``tokens`` (a 1-D array or memmap).

    The start offsets come from the sampler's own ``torch.Generator``, seeded once: the same seed gives the same
    batches, and ``state_dict`` / ``load_state_dict`` carry the position in that stream across a resume.
    Under data parallelism every rank holds the same sampler, draws the *global* batch and keeps its own slice, so
    N ranks see exactly the windows that one process with an N-times larger batch sees.
    """

    def __init__(self, tokens: np.ndarray, context_length: int, seed: int) -> None:
        if tokens.ndim != 1:
            raise ValueError(f"tokens must be a 1-D array, got shape {tokens.shape}")
        if len(tokens) < context_length + 1:
            raise ValueError(
                f"{len(tokens)} tokens are fewer than one window of context_length + 1 = {context_length + 1}"
            )
        self.tokens = tokens
        self.context_length = context_length
        self.generator = torch.Generator().manual_seed(seed)
        self.batches_drawn = 0

    def sample(self, n: int, *, rows: slice | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Draw ``n`` windows; return (inputs, targets), each int64 [len(rows), C] (all n rows by default)."""
        c = self.context_length
        starts = torch.randint(0, len(self.tokens) - c, (n,), generator=self.generator)  # [n], start + c + 1 <= len
        self.batches_drawn += 1
        chosen = starts.tolist() if rows is None else starts[rows].tolist()
        windows = np.stack([np.asarray(self.tokens[s : s + c + 1], dtype=np.int64) for s in chosen])  # [n', C+1]
        windows = torch.from_numpy(windows)
        return windows[:, :-1], windows[:, 1:]

    def state_dict(self) -> dict[str, Any]:
        return {"generator": self.generator.get_state(), "batches_drawn": self.batches_drawn}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.generator.set_state(state["generator"])
        self.batches_drawn = int(state["batches_drawn"])
