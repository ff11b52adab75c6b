"""The GPT model: token ids [B, T] -> logits [B, T, V] (the chapter's full route; LLMs-from-scratch ch04).

tok_emb(idx) + pos_emb(positions) -> dropout -> L transformer blocks -> final LayerNorm -> bias-free head D -> V.
The blocks live in a ``ModuleList`` (not ``Sequential``) because each call also passes RoPE's tables and the
layer's KV cache (``inference.kv_cache``: the caches, and the attention over what they hold, live with the engine). With ``pos_emb="rope"`` there is no position table: the blocks rotate q and k instead (``rope.py``).
The head and the training loss come from ``tinygpt.fast`` (same values, faster kernels; plain PyTorch inside
``with tinygpt.fast.disabled():``).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from .config import GPTConfig
from .fast import OutputHead, head_cross_entropy
from .layers import LayerNorm, RMSNorm, TransformerBlock, make_norm
from .rope import RotaryEmbedding


def _skip_init_draws(numel: int, chunk: int = 1 << 20) -> None:
    """Advance torch's CPU RNG exactly as ``uniform_`` (nn.Linear's init) on ``numel`` values would, in small chunks."""
    for start in range(0, numel, chunk):
        torch.empty(min(chunk, numel - start)).uniform_()


class GPTModel(nn.Module):
    """A decoder-only transformer of the GPT-2 family.

    Weight init follows GPT-2: every linear and embedding weight ~ N(0, 0.02), biases 0, LayerNorm scale 1 / shift
    0, and the two projections that write into the residual stream (attention ``out_proj`` and the FFN's second
    linear) ~ N(0, 0.02 / sqrt(2L)), so that the residual sum of 2L branches keeps its scale at init (or 0 with
    ``config.zero_init_proj``).
    With ``tie_weights`` the head and the token embedding are one ``Parameter`` (the chapter's point): not a copy.
    """

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        if not isinstance(config, GPTConfig):
            raise TypeError(f"config must be a GPTConfig, got {type(config).__name__}")
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.emb_dim)
        self.pos_emb: nn.Embedding | None = None
        self.rope: RotaryEmbedding | None = None
        if config.pos_emb == "rope":
            self.rope = RotaryEmbedding(config.head_dim, config.rope_theta)
        else:
            self.pos_emb = nn.Embedding(config.context_length, config.emb_dim)
        self.drop_emb = nn.Dropout(config.emb_dropout)
        self.trf_blocks = nn.ModuleList(TransformerBlock(config) for _ in range(config.n_layers))
        self.final_norm = make_norm(config)
        if config.tie_weights and torch.get_default_device().type == "cpu":
            # The head *is* the embedding: build it without a [V, D] weight of its own, which would exist only to be
            # dropped (150 MB for gpt2-small, the build's peak memory), but draw the RNG as its init would, so that
            # a seed gives exactly the weights it gave before (reset_parameters redraws everything afterwards).
            self.out_head = OutputHead(config.emb_dim, config.vocab_size, bias=False, device="meta")
            _skip_init_draws(config.vocab_size * config.emb_dim)
        else:
            self.out_head = OutputHead(config.emb_dim, config.vocab_size, bias=False)
        if config.tie_weights:
            self.out_head.weight = self.tok_emb.weight
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Re-draw every weight with the GPT-2 init (uses torch's global RNG)."""
        residual_std = 0.02 / math.sqrt(2 * self.config.n_layers)
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if isinstance(module, nn.Linear) and module.bias is not None:
                nn.init.zeros_(module.bias)
            if isinstance(module, (LayerNorm, RMSNorm)):
                nn.init.ones_(module.scale)
            if isinstance(module, LayerNorm) and module.shift is not None:
                nn.init.zeros_(module.shift)
        for block in self.trf_blocks:
            for projection in (block.att.out_proj.weight, block.ff.layers[2].weight):
                if self.config.zero_init_proj:  # every block starts as the identity (modded-nanogpt)
                    nn.init.zeros_(projection)
                else:
                    nn.init.normal_(projection, mean=0.0, std=residual_std)

    def num_parameters(self) -> int:
        """Unique trainable parameters (a tied weight counts once)."""
        return sum(p.numel() for p in self.parameters() if p.requires_grad)

    def check_input(self, idx: torch.Tensor, start_pos: int = 0) -> None:
        """Raise ``ValueError``/``TypeError`` unless idx is an integer [B, T] with start_pos + T <= C and 0 <= id < V."""
        check_ids(idx, self.config, start_pos)

    def embed(self, idx: torch.Tensor, positions: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor] | None]:
        """The blocks' input [B, T, D] for checked ids idx [B, T] at ``positions`` [T] (default 0 .. T - 1),
        embedding dropout applied, and RoPE's (cos, sin) tables [T, hd] for every block (None with learned
        positions; computed here, once per forward)."""
        if positions is None:
            positions = torch.arange(idx.shape[1], device=idx.device)  # [T]
        x = self.tok_emb(idx)  # [B, T, D]
        rope = None
        if self.rope is not None:
            rope = self.rope(positions, x.dtype)  # (cos, sin), each [T, hd]
        else:
            x = x + self.pos_emb(positions)  # [B, T, D]
        return self.drop_emb(x), rope

    def hidden_states(self, idx: torch.Tensor, *, cache: Any = None, pos: Any = None) -> torch.Tensor:
        """ids [B, T] -> embeddings -> blocks -> final norm: [B, T, D], the head's input. Arguments as for ``forward``."""
        if cache is None:
            start = 0 if pos is None else pos
            if isinstance(start, bool) or not isinstance(start, int):
                raise TypeError(f"without a cache pos must be an int position, got {type(pos).__name__}")
            self.check_input(idx, start)
            positions = torch.arange(start, start + idx.shape[1], device=idx.device)  # [T]
        else:  # the cache checks that the call fits it and says where the tokens sit
            positions = cache.begin(idx, pos)  # [T]
        if idx.dtype not in (torch.int64, torch.int32):  # nn.Embedding indexes with int32/int64 only
            idx = idx.long()
        x, rope = self.embed(idx, positions)  # [B, T, D]
        for layer, block in enumerate(self.trf_blocks):
            x = block(x, rope, None if cache is None else cache.layers[layer])  # [B, T, D]
        return self.final_norm(x)  # [B, T, D]

    def forward(self, idx: torch.Tensor, *, targets: torch.Tensor | None = None, last_only: bool = False,
                cache: Any = None, pos: Any = None) -> torch.Tensor:
        """Token ids [B, T] -> logits [B, T, V] (or [B, 1, V] with ``last_only``), or with ``targets`` the loss.

        Without the keyword arguments this is the plain full-sequence forward. ``targets`` [B, T] (the next token
        of each position; -100 = ignore) returns the scalar mean cross-entropy instead, equal to
        ``F.cross_entropy(logits.flatten(0, 1), targets.flatten())``; ``fast.head_cross_entropy`` computes it
        without materialising the [B, T, V] logits. ``last_only`` applies the head to the last position only, which
        is all that generation needs.

        ``cache`` (``inference.kv_cache``) holds the keys/values of earlier positions and receives this call's;
        ``pos`` says where the call's tokens sit: for a ``KVCache``, the position of the first (an int, default 0);
        for the engine's ``PagedKVCache``, its ``inference.batch.Batch`` (idx [1, N]: the scheduled rows' tokens
        packed; the logits are [1, M, V], the M tokens ``Batch.logits_at`` names). Without a cache an int ``pos``
        shifts the positions (the attention stays plain causal).
        """
        if targets is not None and last_only:
            raise ValueError("targets and last_only=True exclude each other: the loss needs every position's logits")
        x = self.hidden_states(idx, cache=cache, pos=pos)
        if cache is not None:
            x = cache.head_input(x)  # the paged cache keeps only the packed tokens whose logits a row needs
        if targets is not None:
            return head_cross_entropy(x, self.out_head.weight, targets)  # checks targets: type, shape, id range
        if last_only:
            x = x[:, -1:, :]  # [B, 1, D]
        return self.out_head(x)  # [B, T, V]


def check_ids(idx: torch.Tensor, config: GPTConfig, start: int = 0) -> None:
    """Raise ``ValueError``/``TypeError`` unless idx is an integer [B, T] with start + T <= C and 0 <= id < V."""
    c, v = config.context_length, config.vocab_size
    if not isinstance(idx, torch.Tensor):
        raise TypeError(f"idx must be a torch.Tensor of token ids, got {type(idx).__name__}")
    if idx.dtype.is_floating_point or idx.dtype.is_complex or idx.dtype == torch.bool:
        raise TypeError(f"idx must hold integer token ids, got dtype {idx.dtype}")
    if idx.dim() != 2:
        raise ValueError(f"idx must have shape [batch, tokens], got {list(idx.shape)}")
    t = idx.shape[1]
    if t < 1:
        raise ValueError("idx has 0 tokens; at least 1 is needed")
    if start < 0 or start + t > c:
        raise ValueError(
            f"positions {start}..{start + t - 1} do not fit the context: start_pos + tokens must be "
            f"<= context_length={c} (got start_pos={start}, tokens={t})"
        )
    lo, hi = int(idx.min()), int(idx.max())
    if lo < 0 or hi >= v:
        bad = lo if lo < 0 else hi
        raise ValueError(f"token id {bad} is out of range: ids must satisfy 0 <= id < vocab_size={v}")


class _Placeholder(nn.Module):
    """Passes its input through unchanged; stands in for a block or a norm in ``DummyGPTModel``."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__()

    def forward(self, x: torch.Tensor, **kwargs: object) -> torch.Tensor:
        return x


class DummyGPTModel(nn.Module):
    """The chapter's interface check (its first model, as upstream): the id -> logits route with placeholder
    blocks and norm, so shapes can be checked before the real modules exist. [B, T] -> [B, T, V]."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab_size, config.emb_dim)
        self.pos_emb = nn.Embedding(config.context_length, config.emb_dim)
        self.drop_emb = nn.Dropout(config.emb_dropout)
        self.trf_blocks = nn.ModuleList(_Placeholder(config) for _ in range(config.n_layers))
        self.final_norm = _Placeholder(config.emb_dim)
        self.out_head = nn.Linear(config.emb_dim, config.vocab_size, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        GPTModel.check_input(self, idx)
        idx = idx.long()
        x = self.drop_emb(self.tok_emb(idx) + self.pos_emb(torch.arange(idx.shape[1], device=idx.device)))
        for block in self.trf_blocks:
            x = block(x)
        return self.out_head(self.final_norm(x))
