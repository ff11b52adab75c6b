"""The parameter formula of seed 000 §6.7, computed from the config alone (no tensor is allocated).

Per block: attention 3D^2 (fused QKV) + D^2 + D (output projection with bias) = 4D^2 + D, plus 3D with qkv_bias;
feed-forward D*4D + 4D + 4D*D + D = 8D^2 + 5D; two LayerNorms 4D. Together 12D^2 + 10D.
Model: token embedding VD + position embedding CD + L blocks + final LayerNorm 2D + head VD (0 when tied):
    N = 2VD + CD + L(12D^2 + 10D) + 2D.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from .config import GPTConfig


@dataclass(frozen=True)
class ParameterCount:
    """Trainable parameters by part; ``total`` counts a tied weight once."""

    token_embedding: int
    position_embedding: int
    attention_per_block: int
    feed_forward_per_block: int
    norms_per_block: int
    n_layers: int
    final_norm: int
    head: int

    @property
    def embeddings(self) -> int:
        return self.token_embedding + self.position_embedding

    @property
    def per_block(self) -> int:
        return self.attention_per_block + self.feed_forward_per_block + self.norms_per_block

    @property
    def attention(self) -> int:
        return self.n_layers * self.attention_per_block

    @property
    def feed_forward(self) -> int:
        return self.n_layers * self.feed_forward_per_block

    @property
    def norms(self) -> int:
        return self.n_layers * self.norms_per_block + self.final_norm

    @property
    def total(self) -> int:
        return self.embeddings + self.n_layers * self.per_block + self.final_norm + self.head

    def to_dict(self) -> dict[str, int]:
        """Every field and derived total, for JSON output."""
        parts = asdict(self)
        for name in ("embeddings", "attention", "feed_forward", "norms", "per_block", "total"):
            parts[name] = getattr(self, name)
        return parts


def count_parameters(config: GPTConfig) -> ParameterCount:
    """The number of trainable parameters of ``GPTModel(config)``, with its breakdown, from the formula."""
    if not isinstance(config, GPTConfig):
        raise TypeError(f"config must be a GPTConfig, got {type(config).__name__}")
    v, c, d = config.vocab_size, config.context_length, config.emb_dim
    attention = 4 * d * d + d + (3 * d if config.qkv_bias else 0)
    return ParameterCount(
        token_embedding=v * d,
        position_embedding=c * d,
        attention_per_block=attention,
        feed_forward_per_block=8 * d * d + 5 * d,
        norms_per_block=4 * d,
        n_layers=config.n_layers,
        final_norm=2 * d,
        head=0 if config.tie_weights else v * d,
    )
