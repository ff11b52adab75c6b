"""The building blocks of the GPT, each written from scratch as the chapter and the block lesson describe them.

LayerNorm (biased variance), GELU (tanh) and the feed-forward network D -> 4D -> D, causal multi-head attention with
a fused QKV projection, and the transformer block in its pre-LN and post-LN orders. The LLaMA-family swaps of the
block lesson's exercises ride on the same classes: RMSNorm, SiLU/SwiGLU, bias-free linears, RoPE (``rope.py``) and
grouped-query attention, each chosen by a ``GPTConfig`` field.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .config import GPTConfig
from .fast import Linear  # nn.Linear (same parameters and init) whose inference product may run on oneDNN: fast/
from .rope import apply_rope


class LayerNorm(nn.Module):
    """Normalise each position over its last axis only: [..., D] -> [..., D].

    LN(x)_j = scale_j * (x_j - mean) / sqrt(var + eps) + shift_j, with the *biased* variance (divide by D, not
    D - 1): for x = [1, 3] this gives [-1, 1]. Positions and batch rows never mix.
    With ``bias=False`` there is no shift parameter (``shift`` is ``None``), as in bias-free models.
    """

    def __init__(self, emb_dim: int, eps: float = 1e-5, bias: bool = True) -> None:
        super().__init__()
        self.eps = eps
        self.scale = nn.Parameter(torch.ones(emb_dim))
        if bias:
            self.shift = nn.Parameter(torch.zeros(emb_dim))
        else:
            self.register_parameter("shift", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # torch's fused kernel for the very formula of ``layer_norm_formula`` (biased variance, eps inside the
        # root): one pass over memory instead of seven; the tests hold the two together. The kernel wants one
        # dtype; for mixed dtypes the formula runs, promoting as torch's arithmetic does.
        if x.dtype != self.scale.dtype:
            return layer_norm_formula(x, self.scale, self.shift, self.eps)
        return F.layer_norm(x, x.shape[-1:], self.scale, self.shift, self.eps)


def layer_norm_formula(
    x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor | None, eps: float = 1e-5
) -> torch.Tensor:
    """LayerNorm written out (biased variance), the definition ``LayerNorm.forward`` computes: [..., D] -> [..., D]."""
    mean = x.mean(dim=-1, keepdim=True)  # [..., 1]
    var = x.var(dim=-1, keepdim=True, unbiased=False)  # [..., 1], divides by D (biased)
    normed = scale * (x - mean) / torch.sqrt(var + eps)
    return normed if shift is None else normed + shift


class RMSNorm(nn.Module):
    """Root-mean-square norm (Zhang & Sennrich 2019; LLaMA): [..., D] -> [..., D], same shape (block lesson, exercise 2).

    RMS(x)_j = scale_j * x_j / sqrt(mean(x^2) + eps): LayerNorm without the mean subtraction and without a shift,
    so it rescales each position but does not re-centre it. The statistic is computed in at least float32 (half
    precision inputs are upcast, as HF Llama does; float64 stays float64) and the result cast back.
    """

    def __init__(self, emb_dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.scale = nn.Parameter(torch.ones(emb_dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.to(torch.promote_types(x.dtype, torch.float32))
        h = h * torch.rsqrt(h.pow(2).mean(dim=-1, keepdim=True) + self.eps)  # mean over D: [..., 1]
        return self.scale * h.to(x.dtype)


def make_norm(config: GPTConfig) -> LayerNorm | RMSNorm:
    """The norm ``config.norm`` names, of width D with ``config.norm_eps`` (LayerNorm's shift follows ``bias``)."""
    if config.norm == "rmsnorm":
        return RMSNorm(config.emb_dim, eps=config.norm_eps)
    return LayerNorm(config.emb_dim, eps=config.norm_eps, bias=config.bias)


def gelu_tanh_formula(x: torch.Tensor) -> torch.Tensor:
    """GELU(x) ~= x/2 * (1 + tanh(sqrt(2/pi) * (x + 0.044715 x^3))), written out (GPT-2's tanh approximation).

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


class SwiGLU(nn.Module):
    """[..., 2F] -> [..., F]: silu(gate) * up, gate and up being the two halves of one fused projection's output.

    Fusing LLaMA's gate_proj and up_proj into one D -> 2F linear is the FFN's analogue of the fused QKV projection.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)  # 2 x [..., F]
        return F.silu(gate) * up


class ReLUSquared(nn.Module):
    """relu(x)^2, elementwise (Primer; modded-nanogpt and nanochat's FFN activation). [...] -> [...]."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(x).square()


_ACTIVATIONS = {"gelu": GELU, "relu": nn.ReLU, "relu2": ReLUSquared, "silu": nn.SiLU}


class FeedForward(nn.Module):
    """Position-wise FFN(x) = GELU(x W1 + b1) W2 + b2, widths D -> 4D -> D. [B, T, D] -> [B, T, D].

    ``config.ffn`` swaps the activation (ReLU, SiLU) or makes it gated: with ``swiglu`` the first linear is
    D -> 2F (gate and up fused) and FFN(x) = (silu(x W_gate) * (x W_up)) W_down. F = ``config.ffn_dim``; the
    biases follow ``config.bias``. ``layers[2]`` is always the projection back into the residual stream.
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        d, f, bias = config.emb_dim, config.ffn_dim, config.bias
        if config.ffn == "swiglu":
            self.layers = nn.Sequential(Linear(d, 2 * f, bias=bias), SwiGLU(), Linear(f, d, bias=bias))
        else:
            activation = _ACTIVATIONS[config.ffn]()
            self.layers = nn.Sequential(Linear(d, f, bias=bias), activation, Linear(f, d, bias=bias))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


def causal_mask(query_start: int, t: int, s: int, *, explicit: bool = False,
                device: torch.device | str | None = None) -> torch.Tensor | None:
    """Which of S keys each of T queries may attend to (True = allowed); the queries sit at key positions
    query_start .. query_start + T - 1.

    Query query_start + i sees key j iff j <= query_start + i: bool [T, S]. Returns None where no tensor is needed
    and ``explicit`` is false: every query sees every key up to itself, which is plain causal attention when
    query_start == 0 (S == T) and all S keys for a single query (a cached decode step).
    """
    if not explicit and (query_start == 0 or t == 1):
        return None
    query_pos = torch.arange(query_start, query_start + t, device=device)[:, None]  # [T, 1]
    key_pos = torch.arange(s, device=device)  # [S]
    return key_pos <= query_pos  # [T, S]


class MultiHeadAttention(nn.Module):
    """Causal multi-head self-attention with one fused QKV projection. [B, T, D] -> [B, T, D].

    Query i may only look at keys j <= i (its own absolute position and earlier): ``causal_mask``. A plain causal
    forward hands that rule to ``scaled_dot_product_attention`` (``is_causal``) with no mask tensor at all; where a
    mask is needed (the attention weights; a cached multi-token step, in the cache's ``attend``) it is built for the
    call's [T, S] positions. There is no [C, C] mask buffer per layer, as LLMs-from-scratch's chapter 4 keeps (L * C^2 values: 48 MiB of
    float32 for gpt2-small, and it grows with the square of the context length).

    Grouped-query attention: with Hkv = ``config.kv_heads`` < H key/value heads, the fused projection is
    D -> (H + 2 Hkv) * hd and query head h reads key/value head h // (H / Hkv); the cache holds only the Hkv heads.
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_heads = config.n_heads
        self.n_kv_heads = config.kv_heads
        self.head_dim = config.head_dim
        self.qk_norm_eps = config.norm_eps if config.qk_norm else None  # QK-norm's epsilon; None = no QK-norm
        d = config.emb_dim
        self.qkv = Linear(d, (self.n_heads + 2 * self.n_kv_heads) * self.head_dim, bias=config.qkv_bias)
        self.out_proj = Linear(d, d, bias=config.bias)
        self.dropout = nn.Dropout(config.attn_dropout)  # on the weights; SDPA is given the same rate

    def forward(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None = None, cache: Any = None, *,
        return_weights: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """x: [B, T, D] -> [B, T, D]. ``rope``: RoPE's (cos, sin) tables of the tokens' positions (None with learned
        positions).

        ``cache``: this layer's cache (``inference.kv_cache``), which stores this call's keys/values and attends
        over all it holds (the contiguous cache of cached decoding, or the engine's paged one): the one call into
        the inference side. ``return_weights`` (no cache): also return the attention weights [B, H, T, T], written
        out (the default path runs ``scaled_dot_product_attention``, which computes the same thing without
        materialising them).
        """
        b, t, d = x.shape
        kv_dim = self.n_kv_heads * self.head_dim
        q, k, v = self.qkv(x).split((d, kv_dim, kv_dim), dim=2)  # [B, T, D], 2 x [B, T, Hkv*hd]
        q = q.view(b, t, self.n_heads, self.head_dim).transpose(1, 2)  # [B, H, T, hd]
        k = k.view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)  # [B, Hkv, T, hd]
        v = v.view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)  # [B, Hkv, T, hd]
        if self.qk_norm_eps is not None:  # QK-norm: each head's q and k to unit RMS over hd (no parameters)
            q, k = (F.rms_norm(t, (self.head_dim,), eps=self.qk_norm_eps) for t in (q, k))
        if rope is not None:  # rotate before k enters a cache: a cached key keeps its position
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        groups = self.n_heads // self.n_kv_heads
        if cache is not None:
            context = cache.attend(q, k, v)  # [B, H, T, hd]
        elif return_weights:
            if groups > 1:  # share each key/value head with its group of queries: [B, Hkv, T, hd] -> [B, H, T, hd]
                k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
            scores = q @ k.transpose(-2, -1) / math.sqrt(self.head_dim)  # [B, H, T, T]
            allowed = causal_mask(0, t, t, explicit=True, device=x.device)  # [T, T]
            weights = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)  # >= 1 key per row: no NaN
            context = self.dropout(weights) @ v  # [B, H, T, hd]
        else:
            context = F.scaled_dot_product_attention(  # [B, H, T, hd]
                q, k, v, dropout_p=self.dropout.p if self.training else 0.0, is_causal=t > 1, enable_gqa=groups > 1,
            )
        out = self.out_proj(context.transpose(1, 2).reshape(b, t, d))  # merge the heads: [B, T, D]
        return (out, weights) if return_weights else out


class TransformerBlock(nn.Module):
    """Attention and feed-forward, each with a residual connection. [B, T, D] -> [B, T, D].

    pre-LN (GPT-2, the default):  u = x + drop(attn(ln1(x)));  y = u + drop(ffn(ln2(u)))
    post-LN (original Transformer, GPT-1):  u = ln1(x + drop(attn(x)));  y = ln2(u + drop(ffn(u)))
    The FFN's residual adds the *updated* u, not the block input (the chapter insists on it).
    """

    def __init__(self, config: GPTConfig, pre_ln: bool | None = None) -> None:
        super().__init__()
        self.pre_ln = config.pre_ln if pre_ln is None else pre_ln
        self.att = MultiHeadAttention(config)
        self.ff = FeedForward(config)
        self.norm1 = make_norm(config)
        self.norm2 = make_norm(config)
        self.drop_shortcut = nn.Dropout(config.shortcut_dropout)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor] | None = None,
                cache: Any = None) -> torch.Tensor:
        """x [B, T, D] -> [B, T, D]; ``rope`` and ``cache`` (this layer's) go to the attention."""
        if self.pre_ln:
            u = x + self.drop_shortcut(self.att(self.norm1(x), rope, cache))
            return u + self.drop_shortcut(self.ff(self.norm2(u)))
        u = self.norm1(x + self.drop_shortcut(self.att(x, rope, cache)))
        return self.norm2(u + self.drop_shortcut(self.ff(u)))
