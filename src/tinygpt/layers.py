"""The building blocks of the GPT, each written from scratch as the seeds describe them.

LayerNorm (seed 000 §6.2), GELU and the feed-forward network (§6.3), causal multi-head attention (seed 002), and
the transformer block in its pre-LN and post-LN orders (§6.5, seed 002).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from .config import GPTConfig
from .kv_cache import KVCache


class LayerNorm(nn.Module):
    """Normalise each position over its last axis only: [..., D] -> [..., D].

    LN(x)_j = scale_j * (x_j - mean) / sqrt(var + eps) + shift_j, with the *biased* variance (divide by D, not
    D - 1): for x = [1, 3] this gives [-1, 1]. Positions and batch rows never mix.
    """

    def __init__(self, emb_dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.scale = nn.Parameter(torch.ones(emb_dim))
        self.shift = nn.Parameter(torch.zeros(emb_dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mean = x.mean(dim=-1, keepdim=True)  # [..., 1]
        var = x.var(dim=-1, keepdim=True, unbiased=False)  # [..., 1], divides by D
        return self.scale * (x - mean) / torch.sqrt(var + self.eps) + self.shift


def gelu_tanh_formula(x: torch.Tensor) -> torch.Tensor:
    """GELU(x) ~= x/2 * (1 + tanh(sqrt(2/pi) * (x + 0.044715 x^3))), written out (seed 000 §6.3).

    The constant is a Python float, so it is exact in float64 too (the upstream builds it as a float32 tensor,
    which is the known source of its ~1e-9 float64 difference).
    """
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x * x * x)))


class GELU(nn.Module):
    """The tanh approximation of GELU, as GPT-2 uses it. [...] -> [...].

    The forward runs torch's fused kernel for the very same formula (``approximate="tanh"``): one pass over memory
    instead of seven. ``gelu_tanh_formula`` is the formula written out; the tests hold the two together.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(x, approximate="tanh")


class FeedForward(nn.Module):
    """Position-wise FFN(x) = GELU(x W1 + b1) W2 + b2, widths D -> 4D -> D. [B, T, D] -> [B, T, D]."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        d = config.emb_dim
        self.layers = nn.Sequential(nn.Linear(d, 4 * d), GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


class MultiHeadAttention(nn.Module):
    """Causal multi-head self-attention with one fused QKV projection. [B, T, D] -> [B, T, D].

    Query i may only look at keys j <= i (its own absolute position and earlier). The causal mask is a boolean
    [C, C] buffer registered once and kept out of the state dict (it is derived from C, not learned).
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_heads = config.n_heads
        self.head_dim = config.head_dim
        d = config.emb_dim
        self.qkv = nn.Linear(d, 3 * d, bias=config.qkv_bias)
        self.out_proj = nn.Linear(d, d)
        self.dropout_p = config.attn_dropout
        self.dropout = nn.Dropout(config.attn_dropout)
        causal = torch.tril(torch.ones(config.context_length, config.context_length, dtype=torch.bool))
        self.register_buffer("causal_mask", causal, persistent=False)  # [C, C], True = may attend

    def forward(
        self,
        x: torch.Tensor,
        *,
        cache: KVCache | None = None,
        layer: int = 0,
        start_pos: int = 0,
        key_mask: torch.Tensor | None = None,
        return_weights: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """x: [B, T, D] at absolute positions start_pos .. start_pos+T-1.

        ``cache``: keys/values of earlier positions are read from it and this call's are written into it.
        ``key_mask``: [B, S] booleans over all S = start_pos + T key positions, False for padding.
        ``return_weights``: also return the attention weights [B, H, T, S] (the explicit path; the default path
        runs ``scaled_dot_product_attention``, which computes the same thing without materialising them).
        """
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=2)  # 3 x [B, T, D]
        q = q.view(b, t, self.n_heads, self.head_dim).transpose(1, 2)  # [B, H, T, hd]
        k = k.view(b, t, self.n_heads, self.head_dim).transpose(1, 2)  # [B, H, T, hd]
        v = v.view(b, t, self.n_heads, self.head_dim).transpose(1, 2)  # [B, H, T, hd]
        if cache is not None:
            k, v = cache.update(layer, start_pos, k, v)  # [B, H, S, hd], S = start_pos + T
        s = k.shape[2]

        allowed = None  # [T, S] or [B, 1, T, S]; None means plain causal with S == T
        if start_pos != 0 or key_mask is not None or return_weights:
            allowed = self.causal_mask[start_pos : start_pos + t, :s]  # query at start_pos+i sees keys <= it
            if key_mask is not None:
                allowed = allowed & key_mask[:, None, None, :]  # [B, 1, T, S]

        if return_weights:
            scores = q @ k.transpose(-2, -1) / math.sqrt(self.head_dim)  # [B, H, T, S]
            scores = scores.masked_fill(~allowed, float("-inf"))
            weights = torch.softmax(scores, dim=-1)
            # A padded query row may have no allowed key at all: its weights are NaN; make them 0.
            weights = torch.nan_to_num(weights, nan=0.0)
            context = self.dropout(weights) @ v  # [B, H, T, hd]
        else:
            dropout_p = self.dropout_p if self.training else 0.0
            if allowed is None:
                context = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=t > 1)
            else:
                context = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, dropout_p=dropout_p)
        out = self.out_proj(context.transpose(1, 2).reshape(b, t, d))  # [B, T, D]
        return (out, weights) if return_weights else out


class TransformerBlock(nn.Module):
    """Attention and feed-forward, each with a residual connection. [B, T, D] -> [B, T, D].

    pre-LN (GPT-2, the default):  u = x + drop(attn(ln1(x)));  y = u + drop(ffn(ln2(u)))
    post-LN (original Transformer, GPT-1):  u = ln1(x + drop(attn(x)));  y = ln2(u + drop(ffn(u)))
    The FFN's residual adds the *updated* u, not the block input (seed 000 §6.5).
    """

    def __init__(self, config: GPTConfig, pre_ln: bool | None = None) -> None:
        super().__init__()
        self.pre_ln = config.pre_ln if pre_ln is None else pre_ln
        self.att = MultiHeadAttention(config)
        self.ff = FeedForward(config)
        self.norm1 = LayerNorm(config.emb_dim)
        self.norm2 = LayerNorm(config.emb_dim)
        self.drop_shortcut = nn.Dropout(config.shortcut_dropout)

    def forward(
        self,
        x: torch.Tensor,
        *,
        cache: KVCache | None = None,
        layer: int = 0,
        start_pos: int = 0,
        key_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        attn_kwargs = dict(cache=cache, layer=layer, start_pos=start_pos, key_mask=key_mask)
        if self.pre_ln:
            u = x + self.drop_shortcut(self.att(self.norm1(x), **attn_kwargs))
            return u + self.drop_shortcut(self.ff(self.norm2(u)))
        u = self.norm1(x + self.drop_shortcut(self.att(x, **attn_kwargs)))
        return self.norm2(u + self.drop_shortcut(self.ff(u)))
