"""The building blocks of the GPT, each written from scratch as the chapter and the block lesson describe them.

LayerNorm (biased variance), GELU (tanh) and the feed-forward network D -> 4D -> D, causal multi-head attention with
a fused QKV projection, and the transformer block in its pre-LN and post-LN orders. The LLaMA-family swaps of the
block lesson's exercises ride on the same classes: RMSNorm, SiLU/SwiGLU, bias-free linears, RoPE (``rope.py``) and
grouped-query attention, each chosen by a ``GPTConfig`` field.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .config import GPTConfig
from .fast import Linear  # nn.Linear (same parameters and init) whose inference product may run on oneDNN: fast/
from .inference.batch import Batch
from .kv_cache import LayerCache, PagedLayerCache
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


@dataclass(frozen=True)
class Positions:
    """Where one forward's T tokens sit, built once per forward (``GPTModel.embed``) and shared by every block.

    ``start``: absolute position of the first token; with a cache, this call's keys are written there and the S =
    start + T keys so far are attended to. ``rope``: RoPE's (cos, sin) tables of the tokens' positions, [T, hd] or
    [B, T, hd] (``RotaryEmbedding``); None with learned positions. ``key_mask``: [B, S] booleans over the key
    positions, False for padding. The default, ``Positions()``, is a plain forward from position 0.
    """

    start: int = 0
    rope: tuple[torch.Tensor, torch.Tensor] | None = None
    key_mask: torch.Tensor | None = None


FROM_START = Positions()


def causal_mask(
    query_start: int, t: int, s: int, key_mask: torch.Tensor | None = None, *, explicit: bool = False,
    device: torch.device | str | None = None,
) -> torch.Tensor | None:
    """Which of S keys each of T queries may attend to (True = allowed); the queries sit at key positions
    query_start .. query_start + T - 1.

    Query query_start + i sees key j iff j <= query_start + i, and with ``key_mask`` [B, S] also key_mask[b, j]:
    bool [T, S], or [B, 1, T, S] with ``key_mask``. Returns None where no tensor is needed and ``explicit`` is false:
    every query sees every key up to itself, which is plain causal attention when query_start == 0 (S == T) and
    all S keys for a single query (a cached decode step).
    """
    if key_mask is None and not explicit and (query_start == 0 or t == 1):
        return None
    query_pos = torch.arange(query_start, query_start + t, device=device)[:, None]  # [T, 1]
    key_pos = torch.arange(s, device=device)  # [S]
    allowed = key_pos <= query_pos  # [T, S]
    if key_mask is not None:
        # A left-padding query sees no real key at all; softmax over an empty set is NaN (SDPA may return it), and
        # NaN hidden states become NaN keys/values that 0 * NaN leaks into real rows. Letting every query also see
        # its own key keeps the padding rows finite; real queries see themselves anyway, so they are unchanged.
        allowed = (allowed & key_mask[:, None, None, :]) | (key_pos == query_pos)  # [B, 1, T, S]
    return allowed


class MultiHeadAttention(nn.Module):
    """Causal multi-head self-attention with one fused QKV projection. [B, T, D] -> [B, T, D].

    Query i may only look at keys j <= i (its own absolute position and earlier): ``causal_mask``. A plain causal
    forward hands that rule to ``scaled_dot_product_attention`` (``is_causal``) with no mask tensor at all; where a
    mask is needed (padding, the attention weights, a cached multi-token step) it is built for the call's [T, S]
    positions. There is no [C, C] mask buffer per layer, as LLMs-from-scratch's chapter 4 keeps (L * C^2 values: 48 MiB of
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
        self, x: torch.Tensor, pos: Positions | Batch = FROM_START, cache: LayerCache | PagedLayerCache | None = None,
        *, return_weights: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """x: [B, T, D] at absolute positions pos.start .. pos.start + T - 1 -> [B, T, D].

        ``cache``: this layer's keys/values of earlier positions are read from it and this call's written into it.
        ``return_weights``: also return the attention weights [B, H, T, S] (written out; the default path runs
        ``scaled_dot_product_attention``, which computes the same thing without materialising them).
        With a ``Batch`` (the inference engine's packed rows, x [1, N, D]) and its paged cache: ``attend_batch``.
        """
        b, t, d = x.shape
        kv_dim = self.n_kv_heads * self.head_dim
        q, k, v = self.qkv(x).split((d, kv_dim, kv_dim), dim=2)  # [B, T, D], 2 x [B, T, Hkv*hd]
        q = q.view(b, t, self.n_heads, self.head_dim).transpose(1, 2)  # [B, H, T, hd]
        k = k.view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)  # [B, Hkv, T, hd]
        v = v.view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)  # [B, Hkv, T, hd]
        if self.qk_norm_eps is not None:  # QK-norm: each head's q and k to unit RMS over hd (no parameters)
            q, k = (F.rms_norm(t, (self.head_dim,), eps=self.qk_norm_eps) for t in (q, k))
        if pos.rope is not None:  # rotate before k enters the cache: a cached key keeps its position
            q, k = apply_rope(q, *pos.rope), apply_rope(k, *pos.rope)
        if isinstance(pos, Batch):
            context = self.attend_batch(q, k, v, pos, cache)  # [1, H, N, hd]
            return self.out_proj(context.transpose(1, 2).reshape(b, t, d))  # [1, N, D]
        if cache is not None:
            k, v = cache.update(pos.start, k, v)  # [B, Hkv, S, hd], S = start + T
        s = k.shape[2]  # S = start + T keys with a cache, T without (positions alone let no query see more)
        allowed = causal_mask(s - t, t, s, pos.key_mask, explicit=return_weights, device=x.device)
        groups = self.n_heads // self.n_kv_heads
        if return_weights:
            if groups > 1:  # share each key/value head with its group of queries: [B, Hkv, S, hd] -> [B, H, S, hd]
                k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
            scores = q @ k.transpose(-2, -1) / math.sqrt(self.head_dim)  # [B, H, T, S]
            weights = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)  # >= 1 key per row: no NaN
            context = self.dropout(weights) @ v  # [B, H, T, hd]
        else:
            context = F.scaled_dot_product_attention(  # [B, H, T, hd]
                q, k, v, attn_mask=allowed, dropout_p=self.dropout.p if self.training else 0.0,
                is_causal=allowed is None and t > 1, enable_gqa=groups > 1,
            )
        out = self.out_proj(context.transpose(1, 2).reshape(b, t, d))  # merge the heads: [B, T, D]
        return (out, weights) if return_weights else out

    def attend_batch(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: Batch,
                     cache: PagedLayerCache) -> torch.Tensor:
        """Attention for packed rows: q [1, H, N, hd], k/v [1, Hkv, N, hd] -> context [1, H, N, hd].

        Every token's key/value is written to its slot first; then the decode rows (one query each) attend, a group
        of rows of similar length at a time, to their gathered keys under a padding mask, and each span attends causally to its own: query ``start + i``
        sees the span's keys 0 .. start + i, as in a forward over the row alone.
        """
        cache.write(batch.write_slots, k, v)
        gqa, parts, offset = self.n_heads > self.n_kv_heads, [], 0
        for group in batch.decode_groups:
            keys, values = cache.read(group.keys)  # [G, Hkv, L, hd]
            queries = q[0, :, offset:offset + group.rows].transpose(0, 1).unsqueeze(2)  # [G, H, 1, hd]
            mask = None if group.mask is None else group.mask[:, None, None, :]  # [G, 1, 1, L]
            out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask, enable_gqa=gqa)
            parts.append(out.squeeze(2).transpose(0, 1).unsqueeze(0))  # [1, H, G, hd]
            offset += group.rows
        for span in batch.spans:
            queries = q[:, :, offset:offset + span.length]  # [1, H, T, hd]
            if span.start == 0:  # the row's first tokens: its keys are this call's, plain causal attention
                keys, values = k[:, :, offset:offset + span.length], v[:, :, offset:offset + span.length]
                mask = None
            else:
                keys, values = cache.read(span.keys[None])  # [1, Hkv, start + T, hd]
                mask = causal_mask(span.start, span.length, span.start + span.length, device=q.device)  # [T, S]
            parts.append(F.scaled_dot_product_attention(queries, keys, values, attn_mask=mask,
                                                        is_causal=mask is None and span.length > 1, enable_gqa=gqa))
            offset += span.length
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)  # [1, H, N, hd]


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

    def forward(self, x: torch.Tensor, pos: Positions | Batch = FROM_START,
                cache: LayerCache | PagedLayerCache | None = None) -> torch.Tensor:
        """x [B, T, D] -> [B, T, D]; ``pos`` and ``cache`` (this layer's) go to the attention."""
        if self.pre_ln:
            u = x + self.drop_shortcut(self.att(self.norm1(x), pos, cache))
            return u + self.drop_shortcut(self.ff(self.norm2(u)))
        u = self.norm1(x + self.drop_shortcut(self.att(x, pos, cache)))
        return self.norm2(u + self.drop_shortcut(self.ff(u)))
