"""The model configuration: the five sizes (V, C, D, H, L), dropout rates and the architecture switches.

The chapter's first rule: the sizes constrain each other -- ``emb_dim % n_heads == 0``, token ids ``< vocab_size``,
positions ``< context_length``. The config is checked once, when it is built; everything downstream trusts it.

The block lesson notes that the same skeleton with RMSNorm and SiLU is the LLaMA family; the switches ``norm``, ``ffn``,
``bias``, ``pos_emb`` and ``n_kv_heads`` select those variants. Their defaults are GPT-2's, so a config dict written
before they existed loads unchanged.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from . import checks
from .fileio import read_json_object

DEFAULT_SEED = 1337  # the seed of every command, stage and options object that is given none: the one place it is written

_SIZE_FIELDS = ("vocab_size", "context_length", "emb_dim", "n_heads", "n_layers")
_DROPOUT_FIELDS = ("drop_rate", "drop_rate_emb", "drop_rate_attn", "drop_rate_shortcut")
_BOOL_FIELDS = ("qkv_bias", "tie_weights", "pre_ln", "bias", "qk_norm", "zero_init_proj")
_CHOICES = {
    "norm": ("layernorm", "rmsnorm"),
    "ffn": ("gelu", "relu", "relu2", "silu", "swiglu"),
    "pos_emb": ("learned", "rope"),
}


@dataclass(frozen=True)
class GPTConfig:
    """Sizes and switches of a GPT model, with LLMs-from-scratch's field names.

    ``drop_rate_emb`` / ``drop_rate_attn`` / ``drop_rate_shortcut`` fall back to ``drop_rate`` when left as
    ``None`` (the chapter: one rate by default, three independent ones in its exercise).

    Architecture variants (defaults = GPT-2):

    - ``norm``: ``layernorm`` (scale and shift) or ``rmsnorm`` (scale only, LLaMA); ``norm_eps`` for both.
    - ``ffn``: ``gelu`` (tanh GELU) / ``relu`` / ``relu2`` (ReLU squared, So et al. 2021's Primer; modded-nanogpt
      and nanochat) / ``silu`` with widths D -> F -> D, or ``swiglu`` (LLaMA):
      down(silu(gate(x)) * up(x)). ``ffn_hidden`` is F; ``None`` means 4D for the non-gated ones and, for SwiGLU,
      the smallest multiple of 8 >= 8D/3: its three F x D matrices then hold about the 8D^2 weights of the 4D
      two-matrix FFN (Shazeer's 2/3 rule, as LLaMA does; LLaMA also rounds, to 256).
    - ``bias``: the biases of the attention output projection and the FFN linears and the LayerNorm shift.
      ``qkv_bias`` alone governs the QKV projection (GPT-2 released has both; Qwen2 has only ``qkv_bias``).
      RMSNorm has no shift, so ``bias=True`` adds none there. The head is always bias-free.
    - ``pos_emb``: ``learned`` (a [C, D] table added to the token embeddings) or ``rope`` (rotary embeddings on q
      and k, base ``rope_theta``; no position parameter; needs an even head_dim).
    - ``n_kv_heads``: grouped-query attention, each key/value head shared by n_heads / n_kv_heads query heads;
      ``None`` means n_heads (plain multi-head attention). Must divide n_heads.
    - ``qk_norm``: each head's query and key RMS-normalised (no parameters, ``norm_eps``) before the scores, which
      bounds the logits of the softmax (Dehghani et al. 2023; modded-nanogpt, nanochat).
    - ``zero_init_proj``: the two projections that write into the residual stream (attention ``out_proj``, the
      FFN's second linear) start at zero instead of N(0, 0.02 / sqrt(2L)): every block starts as the identity.

    The ``modern`` preset (``MODERN_BLOCK``) turns them on together with RMSNorm, RoPE, no biases and an untied
    head; it takes ReLU^2 for the feed-forward, not SwiGLU (the two fill one slot; nanochat found SwiGLU worse).
    """

    vocab_size: int = 50257  # V
    context_length: int = 1024  # C
    emb_dim: int = 768  # D
    n_heads: int = 12  # H
    n_layers: int = 12  # L
    drop_rate: float = 0.0
    drop_rate_emb: float | None = None
    drop_rate_attn: float | None = None
    drop_rate_shortcut: float | None = None
    qkv_bias: bool = False
    tie_weights: bool = False
    pre_ln: bool = True
    norm: str = "layernorm"
    norm_eps: float = 1e-5
    ffn: str = "gelu"
    ffn_hidden: int | None = None
    bias: bool = True
    pos_emb: str = "learned"
    rope_theta: float = 10000.0
    n_kv_heads: int | None = None
    qk_norm: bool = False
    zero_init_proj: bool = False

    def __post_init__(self) -> None:
        for name in _SIZE_FIELDS:
            checks.positive_int(name, getattr(self, name))
        if self.emb_dim % self.n_heads != 0:
            raise ValueError(
                f"emb_dim={self.emb_dim} must be divisible by n_heads={self.n_heads} "
                f"(each head gets emb_dim // n_heads features)"
            )
        for name in _DROPOUT_FIELDS:
            value = getattr(self, name)
            if value is None and name != "drop_rate":
                continue
            checks.fraction(name, value)
        for name in _BOOL_FIELDS:
            checks.boolean(name, getattr(self, name))
        for name, allowed in _CHOICES.items():
            checks.choice(name, getattr(self, name), allowed)
        for name in ("norm_eps", "rope_theta"):
            checks.positive_number(name, getattr(self, name))
        for name in ("ffn_hidden", "n_kv_heads"):
            checks.positive_int(name, getattr(self, name), optional=True)
        if self.n_kv_heads is not None and self.n_heads % self.n_kv_heads != 0:
            raise ValueError(
                f"n_kv_heads={self.n_kv_heads} must divide n_heads={self.n_heads} "
                f"(each key/value head serves a whole group of query heads)"
            )
        if self.pos_emb == "rope" and self.head_dim % 2 != 0:
            raise ValueError(
                f"pos_emb='rope' needs an even head_dim, but emb_dim={self.emb_dim} // n_heads={self.n_heads} "
                f"= {self.head_dim} (rotary embeddings rotate pairs of features)"
            )

    @property
    def head_dim(self) -> int:
        return self.emb_dim // self.n_heads

    @property
    def kv_heads(self) -> int:
        """Key/value heads: ``n_kv_heads``, or ``n_heads`` when it is ``None``."""
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def ffn_dim(self) -> int:
        """The FFN's hidden width F: ``ffn_hidden``, else 4D, or for SwiGLU the multiple of 8 at or above 8D/3."""
        if self.ffn_hidden is not None:
            return self.ffn_hidden
        if self.ffn == "swiglu":
            return 8 * -(-self.emb_dim // 3)  # 8 * ceil(D / 3) == the smallest multiple of 8 >= 8D/3
        return 4 * self.emb_dim

    @property
    def emb_dropout(self) -> float:
        return self.drop_rate if self.drop_rate_emb is None else self.drop_rate_emb

    @property
    def attn_dropout(self) -> float:
        return self.drop_rate if self.drop_rate_attn is None else self.drop_rate_attn

    @property
    def shortcut_dropout(self) -> float:
        return self.drop_rate if self.drop_rate_shortcut is None else self.drop_rate_shortcut

    def replace(self, **overrides: Any) -> "GPTConfig":
        """A copy with some fields changed (validated again). Unknown keys are a ``ValueError``."""
        _check_keys(overrides, "override")
        return dataclasses.replace(self, **overrides)

    def to_dict(self) -> dict[str, Any]:
        """A plain JSON-able dict; ``GPTConfig.from_dict(c.to_dict()) == c`` exactly."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "GPTConfig":
        if not isinstance(data, dict):
            raise ValueError(f"a config must be a JSON object, got {type(data).__name__}")
        _check_keys(data, "config key")
        return cls(**data)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "GPTConfig":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            raise ValueError(f"config is not valid JSON: {err}") from None
        return cls.from_dict(data)

    @classmethod
    def from_file(cls, path: str | Path) -> "GPTConfig":
        data = read_json_object(path)  # its errors name the file
        try:
            return cls.from_dict(data)
        except ValueError as err:
            raise ValueError(f"{path}: {err}") from None


def config_field_names() -> list[str]:
    return [f.name for f in fields(GPTConfig)]


def _check_keys(data: dict[str, Any], what: str) -> None:
    allowed = config_field_names()
    unknown = sorted(set(data) - set(allowed))
    if unknown:
        raise ValueError(f"unknown {what} {', '.join(map(repr, unknown))}; allowed: {', '.join(allowed)}")


_GPT2 = dict(vocab_size=50257, context_length=1024)
# The block of the speedruns (modded-nanogpt, nanochat) as switches of this config; each is off by default.
MODERN_BLOCK: dict[str, Any] = dict(norm="rmsnorm", pos_emb="rope", ffn="relu2", bias=False, qkv_bias=False,
                                    tie_weights=False, qk_norm=True, zero_init_proj=True)

# The chapter's small check config and its four GPT-2 sizes (small/medium/large/xl, as in the GPT-2 paper).
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(vocab_size=16, context_length=16, emb_dim=16, n_heads=4, n_layers=2, drop_rate=0.0),
    "gpt2-small": dict(_GPT2, emb_dim=768, n_heads=12, n_layers=12),
    "gpt2-medium": dict(_GPT2, emb_dim=1024, n_heads=16, n_layers=24),
    "gpt2-large": dict(_GPT2, emb_dim=1280, n_heads=20, n_layers=36),
    "gpt2-xl": dict(_GPT2, emb_dim=1600, n_heads=25, n_layers=48),
    # The LLaMA recipe at test size: RMSNorm, SwiGLU, no biases, RoPE, 2 query heads per key/value head.
    "llama-tiny": dict(vocab_size=64, context_length=32, emb_dim=32, n_heads=4, n_kv_heads=2, n_layers=2,
                       drop_rate=0.0, norm="rmsnorm", ffn="swiglu", bias=False, pos_emb="rope"),
    # gpt2-small's sizes with the modern block (``MODERN_BLOCK``); override the sizes for a small model.
    "modern": dict(_GPT2, emb_dim=768, n_heads=12, n_layers=12, **MODERN_BLOCK),
}


def get_config(name: str, **overrides: Any) -> GPTConfig:
    """The preset ``name`` with ``overrides`` applied; the preset table itself never changes.

    >>> get_config("tiny").emb_dim
    16
    """
    if name not in PRESETS:
        raise ValueError(f"unknown config {name!r}; allowed: {', '.join(PRESETS)}")
    _check_keys(overrides, "override")
    return GPTConfig(**{**PRESETS[name], **overrides})
