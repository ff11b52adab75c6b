"""The chapter's parameter formula (12D^2 + 10D per block), computed from the config alone (no tensor is allocated).

Per block: attention 3D^2 (fused QKV) + D^2 + D (output projection with bias) = 4D^2 + D, plus 3D with qkv_bias;
feed-forward D*4D + 4D + 4D*D + D = 8D^2 + 5D; two LayerNorms 4D. Together 12D^2 + 10D.
Model: token embedding VD + position embedding CD + L blocks + final LayerNorm 2D + head VD (0 when tied):
    N = 2VD + CD + L(12D^2 + 10D) + 2D.

The LLaMA-style switches generalise each term (hd = D/H, Hkv = kv heads, F = FFN width, [x] = 1 if x else 0):
    attention   D(H + 2Hkv)hd + [qkv_bias](H + 2Hkv)hd + D^2 + [bias]D     (GQA shrinks the K and V parts)
    FFN         gDF + FD + [bias](gF + D),  g = 2 for SwiGLU (gate and up), else 1
    each norm   D + [layernorm and bias]D  (RMSNorm has a scale only)
    position    CD with pos_emb="learned", 0 with "rope"
``bias=False`` thus removes, per block, the out_proj bias D, the FFN biases gF + D and the two LayerNorm shifts 2D,
plus the final LayerNorm's shift D: for GPT-2 small (D=768, F=4D, L=12) that is 12 * (D + 5D + 2D) + D = 74,496.
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
    v, c, d, f = config.vocab_size, config.context_length, config.emb_dim, config.ffn_dim
    qkv_width = (config.n_heads + 2 * config.kv_heads) * config.head_dim  # = 3D without GQA
    attention = d * qkv_width + (qkv_width if config.qkv_bias else 0) + d * d + (d if config.bias else 0)
    gates = 2 if config.ffn == "swiglu" else 1
    feed_forward = gates * d * f + f * d + ((gates * f + d) if config.bias else 0)
    norm = d + (d if config.norm == "layernorm" and config.bias else 0)
    return ParameterCount(
        token_embedding=v * d,
        position_embedding=c * d if config.pos_emb == "learned" else 0,
        attention_per_block=attention,
        feed_forward_per_block=feed_forward,
        norms_per_block=2 * norm,
        n_layers=config.n_layers,
        final_norm=norm,
        head=0 if config.tie_weights else v * d,
    )
