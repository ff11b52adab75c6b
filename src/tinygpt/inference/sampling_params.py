"""How to generate: ``GenerationConfig`` (one request's settings), the sampling ranges and their check.

A leaf the engine imports from below (nano-vllm's ``sampling_params.py``): it imports only torch and ``checks``, so
``inference.row`` and the engine can name the settings without importing anything above them.
``tinygpt.generation`` re-exports every name here.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from .. import checks

OVERFLOW_POLICIES = ("slide", "shift", "error")

# The sampling ranges where float32 (and bf16) arithmetic stays meaningful: a logit is scaled by at most
# 1e6 (penalty) x 1e5 (1 / temperature), so any logit below 1e27 stays finite; top_p stays a normal float32 (below
# ~1e-38 it is subnormal, below ~1e-45 it rounds to 0 and the nucleus would be empty). Outside them a row's
# probabilities can become NaN (temperature 1e-300, top_p 1e-46, penalty 1e-300 did). The seed is what
# ``torch.Generator.manual_seed`` takes and what OpenAI's API calls a seed: a signed 64-bit integer.
TEMPERATURE_RANGE = (1e-5, 1e5)  # or exactly 0: greedy
TOP_P_RANGE = (1e-8, 1.0)
REPETITION_PENALTY_RANGE = (1e-6, 1e6)
SEED_RANGE = (-2 ** 63, 2 ** 63 - 1)


def check_sampling(temperature: float, top_p: float, repetition_penalty: float, seed: int | None) -> None:
    """The sampling settings' ranges (the constants above), shared by ``GenerationConfig``, the CLI and the
    server's requests; an ``OptionError`` names the first setting out of range."""
    low, high = TEMPERATURE_RANGE
    if not (checks.is_number(temperature) and (temperature == 0 or low <= temperature <= high)):
        raise checks.OptionError("temperature", temperature, f"must be 0 (greedy) or a number in [{low:g}, {high:g}]")
    checks.number_in_range("top_p", top_p, *TOP_P_RANGE, note="(1 means no nucleus filter)")
    checks.number_in_range("repetition_penalty", repetition_penalty, *REPETITION_PENALTY_RANGE, note="(1 means none)")
    if seed is not None and not (checks.is_int(seed) and SEED_RANGE[0] <= seed <= SEED_RANGE[1]):
        raise checks.OptionError("seed", seed, "must be a signed 64-bit integer: in [-2**63, 2**63 - 1] (or unset)")


@dataclass(frozen=True)
class GenerationConfig:
    """How to generate. The defaults are greedy decoding with the cache and the chapter's sliding window.

    ``temperature`` 0 means greedy (argmax); > 0 samples from softmax(logits / T), after ``top_k`` (keep exactly
    k tokens) and ``top_p`` (nucleus; 1.0 = off). ``repetition_penalty`` > 1 discourages every token already in
    the row (prompt included; also applies to greedy). ``seed`` makes sampling reproducible. A row finishes when
    it produces ``eos_id`` or its new tokens end with one of the ``stop`` sequences (both kept in its output); finished
    rows are padded with ``pad_id``. ``overflow`` / ``shift_keep``: see ``tinygpt.generation``'s docstring. ``use_cache=False``
    recomputes the whole window at each step (same policy, same tokens up to float rounding).
    ``token_budget``: at most this many tokens per forward (prompts are then prefilled in chunks; unset: each
    prompt in one piece). ``speculative_tokens`` k > 0: each row verifies up to k draft tokens per forward
    (greedy: the same tokens; sampled: the same distribution; fewer forwards when the drafts are right): drafts by
    prompt lookup (the text's own n-grams), or by the ``draft_model`` given to ``generate`` / ``stream``.
    ``compile``: run the decode steps compiled (``inference.runner``: one row through ``inference.aot_step``, several
    through ``torch.compile``; a start-up cost of seconds for a lower cost per step: docs/performance.md).
    """

    max_new_tokens: int = 64
    temperature: float = 0.0
    top_k: int | None = None
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    eos_id: int | None = None
    stop: tuple[tuple[int, ...], ...] = field(default=())
    overflow: str = "slide"
    shift_keep: int | None = None
    use_cache: bool = True
    pad_id: int = 0
    token_budget: int | None = None
    speculative_tokens: int = 0
    compile: bool = False

    def __post_init__(self) -> None:
        checks.non_negative_int("max_new_tokens", self.max_new_tokens)
        check_sampling(self.temperature, self.top_p, self.repetition_penalty, self.seed)
        checks.positive_int("top_k", self.top_k, optional=True, note="(unset: no top-k filter)")
        checks.non_negative_int("eos_id", self.eos_id, optional=True, note="(a token id)")
        checks.non_negative_int("pad_id", self.pad_id, note="(a token id)")
        if isinstance(self.stop, (str, bytes)) or not isinstance(self.stop, Sequence):
            raise ValueError(f"stop must be a list of token-id sequences, got {type(self.stop).__name__}")
        stops = []
        for seq in self.stop:
            if isinstance(seq, (str, bytes)) or not isinstance(seq, Sequence) or len(seq) == 0:
                raise ValueError(f"each stop sequence must be a non-empty list of token ids, got {seq!r}")
            if not all(checks.is_int(t) and t >= 0 for t in seq):
                raise ValueError(f"stop sequence {list(seq)} must hold token ids (integers >= 0)")
            stops.append(tuple(seq))
        object.__setattr__(self, "stop", tuple(stops))
        checks.choice("overflow", self.overflow, OVERFLOW_POLICIES)
        checks.positive_int("shift_keep", self.shift_keep, optional=True, note="(unset: C // 2)")
        checks.boolean("use_cache", self.use_cache)
        checks.positive_int("token_budget", self.token_budget, optional=True, note="(unset: no limit)")
        checks.non_negative_int("speculative_tokens", self.speculative_tokens, note="(0 means off)")
        checks.boolean("compile", self.compile)

    @property
    def greedy(self) -> bool:
        """True when every token is the argmax (temperature 0): no random draw, no generator."""
        return self.temperature == 0.0

    def row_generator(self, device: torch.device | str = "cpu", row: int = 0) -> torch.Generator | None:
        """The generator of the ``row``-th row sampled under these settings: seeded with ``seed + row`` (row i of a
        batch, choice j of a request), so a row's text never depends on its neighbours; None when greedy or
        unseeded (torch's global generator then)."""
        if self.seed is None or self.greedy:
            return None
        return torch.Generator(device=device).manual_seed(self.seed + row)

    def replace(self, **overrides: Any) -> "GenerationConfig":
        """A copy with some fields changed (validated again); an unknown name is a ``ValueError``."""
        unknown = sorted(set(overrides) - {f.name for f in dataclasses.fields(self)})
        if unknown:
            allowed = ", ".join(f.name for f in dataclasses.fields(self))
            raise ValueError(f"unknown generation setting(s) {', '.join(unknown)}; allowed: {allowed}")
        return dataclasses.replace(self, **overrides)
