"""The building blocks of the GPT, each written from scratch as the seeds describe them.

LayerNorm (seed 000 §6.2), GELU and the feed-forward network (§6.3), causal multi-head attention (seed 002), and
the transformer block in its pre-LN and post-LN orders (§6.5, seed 002). The LLaMA-family swaps of seed 002's
exercises ride on the same classes: RMSNorm, SiLU/SwiGLU, bias-free linears, RoPE (``rope.py``) and grouped-query
attention, each chosen by a ``GPTConfig`` field.
"""

from __future__ import annotations

import math
import platform
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import _get_current_dispatch_mode

from .config import GPTConfig
from .kv_cache import KVCache
from .rope import apply_rope


def _find_onednn_linear() -> Any:
    """torch's oneDNN (mkldnn) linear kernel, on x86-64 builds that have it and where it computes a small product
    exactly as ``F.linear`` does (integers: exact in any summation order); None elsewhere."""
    if platform.machine().lower() not in ("x86_64", "amd64") or not torch.backends.mkldnn.is_available():
        return None
    try:
        kernel = torch.ops.mkldnn._linear_pointwise
        x, weight, bias = torch.arange(6.0).view(2, 3), torch.arange(12.0).view(4, 3), torch.arange(4.0)
        with torch.no_grad():
            if torch.equal(kernel(x, weight, bias, "none", [], ""), F.linear(x, weight, bias)):
                return kernel
    except (AttributeError, RuntimeError):
        pass
    return None


_PLAIN = (torch.Tensor, nn.Parameter)

# None switches the oneDNN path off (``benchmarks.ab`` does, to time F.linear against it).
ONEDNN_LINEAR = _find_onednn_linear()


def onednn_applies(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> bool:
    """Whether ``linear`` runs x @ weight.T + bias on oneDNN: plain CPU float32 tensors, nothing that needs a
    gradient, no autocast (which would want the product in bf16), no torch.compile trace (which picks its own
    kernels), no dispatch mode, tensor subclass or ``torch.func`` transform (``FlopCounterMode``, fake or distributed
    tensors, ``vmap`` and the like know ``aten`` products, not this one)."""
    return (ONEDNN_LINEAR is not None and type(x) is torch.Tensor and type(weight) in _PLAIN
            and x.device.type == "cpu" and x.dtype == torch.float32
            and weight.dtype == torch.float32 and (bias is None or bias.dtype == torch.float32)
            and not (torch.is_grad_enabled()
                     and (x.requires_grad or weight.requires_grad or (bias is not None and bias.requires_grad)))
            and not torch.is_autocast_enabled("cpu") and not torch.compiler.is_compiling()
            and _get_current_dispatch_mode() is None and not torch._C._functorch.is_functorch_wrapped_tensor(x))


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias``, what ``F.linear`` computes: [..., in] -> [..., out], weight [out, in].

    ``F.linear`` runs on the BLAS torch was built with (MKL on x86). Where ``onednn_applies`` (inference on a CPU in
    float32) the same product runs on oneDNN, which torch also ships, with the bias fused. On the 2-core AMD EPYC
    reference machine that made gpt2-small's one-row products (decoding) 1.7-1.8x faster than ``F.linear``
    (``python -m benchmarks.ab linear``) and its forward 1.37x at 1x128 tokens, 1.09x at 1x1024 and 8x256
    (``python -m benchmarks.ab onednn``). The values are the same dot products, up to float32 summation order
    (~1e-6 relative). Everything else (autograd, other devices and dtypes, autocast) is plain ``F.linear``.
    """
    if onednn_applies(x, weight, bias):
        return onednn_linear(x, weight, bias)
    return F.linear(x, weight, bias)


def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``linear``'s oneDNN product itself, for callers that already know ``onednn_applies``: [..., in] -> [..., out]."""
    # The kernel reads the bias as contiguous whatever its strides (a strided bias gave wrong sums: tested).
    return ONEDNN_LINEAR(x, weight, None if bias is None else bias.contiguous(), "none", [], "")


class Linear(nn.Linear):
    """``nn.Linear`` (same parameters, init and state dict) whose forward is ``linear`` (oneDNN for inference)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


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
    """LayerNorm written out (seed 000 §6.2), the definition ``LayerNorm.forward`` computes: [..., D] -> [..., D]."""
    mean = x.mean(dim=-1, keepdim=True)  # [..., 1]
    var = x.var(dim=-1, keepdim=True, unbiased=False)  # [..., 1], divides by D (biased)
    normed = scale * (x - mean) / torch.sqrt(var + eps)
    return normed if shift is None else normed + shift


class RMSNorm(nn.Module):
    """Root-mean-square norm (Zhang & Sennrich 2019; LLaMA): [..., D] -> [..., D], same shape (seed 002, exercise 2).

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


class SwiGLU(nn.Module):
    """[..., 2F] -> [..., F]: silu(gate) * up, gate and up being the two halves of one fused projection's output.

    Fusing LLaMA's gate_proj and up_proj into one D -> 2F linear is the FFN's analogue of the fused QKV projection.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)  # 2 x [..., F]
        return F.silu(gate) * up


_ACTIVATIONS = {"gelu": GELU, "relu": nn.ReLU, "silu": nn.SiLU}


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


class MultiHeadAttention(nn.Module):
    """Causal multi-head self-attention with one fused QKV projection. [B, T, D] -> [B, T, D].

    Query i may only look at keys j <= i (its own absolute position and earlier). A plain causal forward hands that
    rule to ``scaled_dot_product_attention`` (``is_causal``) with no mask tensor at all; where a mask is needed
    (padding, the attention weights, a cached multi-token step) it is built for the call's [T, S] positions. There
    is no [C, C] mask buffer per layer, as the seeds' upstream keeps (L * C^2 values: 48 MiB of float32 for
    gpt2-small, and it grows with the square of the context length).

    Grouped-query attention: with Hkv = ``config.kv_heads`` < H key/value heads, the fused projection is
    D -> (H + 2 Hkv) * hd and query head h reads key/value head h // (H / Hkv); the cache holds only the Hkv heads.
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.n_heads = config.n_heads
        self.n_kv_heads = config.kv_heads
        self.head_dim = config.head_dim
        d = config.emb_dim
        self.qkv = Linear(d, (self.n_heads + 2 * self.n_kv_heads) * self.head_dim, bias=config.qkv_bias)
        self.out_proj = Linear(d, d, bias=config.bias)
        self.dropout_p = config.attn_dropout
        self.dropout = nn.Dropout(config.attn_dropout)

    def forward(
        self,
        x: torch.Tensor,
        *,
        cache: KVCache | None = None,
        layer: int = 0,
        start_pos: int = 0,
        key_mask: torch.Tensor | None = None,
        return_weights: bool = False,
        rope: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """x: [B, T, D] at absolute positions start_pos .. start_pos+T-1.

        ``cache``: keys/values of earlier positions are read from it and this call's are written into it.
        ``key_mask``: [B, S] booleans over all S = start_pos + T key positions, False for padding.
        ``return_weights``: also return the attention weights [B, H, T, S] (the explicit path; the default path
        runs ``scaled_dot_product_attention``, which computes the same thing without materialising them).
        ``rope``: the (cos, sin) tables of this call's positions, [T, hd] or [B, T, hd], from ``RotaryEmbedding``;
        q and k are rotated before k enters the cache.
        """
        b, t, d = x.shape
        kv_dim = self.n_kv_heads * self.head_dim
        q, k, v = self.qkv(x).split((d, kv_dim, kv_dim), dim=2)  # [B, T, D], 2 x [B, T, Hkv*hd]
        q = q.view(b, t, self.n_heads, self.head_dim).transpose(1, 2)  # [B, H, T, hd]
        k = k.view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)  # [B, Hkv, T, hd]
        v = v.view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)  # [B, Hkv, T, hd]
        if rope is not None:
            q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        if cache is not None:
            k, v = cache.update(layer, start_pos, k, v)  # [B, H, S, hd], S = start_pos + T
        s = k.shape[2]
        past = s - t  # keys before this call's: start_pos with a cache, 0 without (positions alone shift nothing)

        # allowed: [T, S] or [B, 1, T, S]; None means "every query sees every key up to itself" without a mask
        # tensor: plain causal when S == T, and all keys for the one query of a cached decode step (T == 1).
        allowed = None
        if key_mask is not None or return_weights or (past != 0 and t > 1):
            query_pos = torch.arange(past, past + t, device=x.device)[:, None]  # [T, 1]
            key_pos = torch.arange(s, device=x.device)  # [S]
            allowed = key_pos <= query_pos  # [T, S]: query past+i sees keys <= past+i
            if key_mask is not None:
                # A left-padding query sees no real key at all; softmax over an empty set is NaN (SDPA may return
                # it), and NaN hidden states become NaN keys/values that 0 * NaN leaks into real rows. Letting
                # every query also see its own key keeps the padding rows finite; real queries see themselves
                # anyway, so their result is unchanged.
                allowed = (allowed & key_mask[:, None, None, :]) | (key_pos == query_pos)  # [B, 1, T, S]

        groups = self.n_heads // self.n_kv_heads
        if return_weights:
            if groups > 1:  # share each key/value head with its group of queries: [B, Hkv, S, hd] -> [B, H, S, hd]
                k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
            scores = q @ k.transpose(-2, -1) / math.sqrt(self.head_dim)  # [B, H, T, S]
            scores = scores.masked_fill(~allowed, float("-inf"))
            weights = torch.softmax(scores, dim=-1)  # every row has >= 1 allowed key (its own), so no NaN
            context = self.dropout(weights) @ v  # [B, H, T, hd]
        else:
            dropout_p = self.dropout_p if self.training else 0.0
            if allowed is None:
                causal = t > 1  # T > 1 here only when S == T
                context = F.scaled_dot_product_attention(
                    q, k, v, dropout_p=dropout_p, is_causal=causal, enable_gqa=groups > 1
                )
            else:
                context = F.scaled_dot_product_attention(
                    q, k, v, attn_mask=allowed, dropout_p=dropout_p, enable_gqa=groups > 1
                )
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
        self.norm1 = make_norm(config)
        self.norm2 = make_norm(config)
        self.drop_shortcut = nn.Dropout(config.shortcut_dropout)

    def forward(
        self,
        x: torch.Tensor,
        *,
        cache: KVCache | None = None,
        layer: int = 0,
        start_pos: int = 0,
        key_mask: torch.Tensor | None = None,
        rope: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        attn_kwargs = dict(cache=cache, layer=layer, start_pos=start_pos, key_mask=key_mask, rope=rope)
        if self.pre_ln:
            u = x + self.drop_shortcut(self.att(self.norm1(x), **attn_kwargs))
            return u + self.drop_shortcut(self.ff(self.norm2(u)))
        u = self.norm1(x + self.drop_shortcut(self.att(x, **attn_kwargs)))
        return self.norm2(u + self.drop_shortcut(self.ff(u)))
