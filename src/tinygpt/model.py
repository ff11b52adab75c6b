"""The GPT model: token ids [B, T] -> logits [B, T, V] (the chapter's full route; LLMs-from-scratch ch04).

tok_emb(idx) + pos_emb(positions) -> dropout -> L transformer blocks -> final LayerNorm -> bias-free head D -> V.
The blocks live in a ``ModuleList`` (not ``Sequential``) because each call also passes the positions and the
layer's KV cache. With ``pos_emb="rope"`` there is no position table: the blocks rotate q and k instead (``rope.py``).
The head and the training loss come from ``tinygpt.fast`` (same values, faster kernels; plain PyTorch inside
``with tinygpt.fast.disabled():``).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from .config import GPTConfig
from .fast import OutputHead, head_cross_entropy
from .inference.batch import Batch
from .kv_cache import KVCache, PagedKVCache
from .layers import LayerNorm, Positions, RMSNorm, TransformerBlock, make_norm
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
        c, v = self.config.context_length, self.config.vocab_size
        if not isinstance(idx, torch.Tensor):
            raise TypeError(f"idx must be a torch.Tensor of token ids, got {type(idx).__name__}")
        if idx.dtype.is_floating_point or idx.dtype.is_complex or idx.dtype == torch.bool:
            raise TypeError(f"idx must hold integer token ids, got dtype {idx.dtype}")
        if idx.dim() != 2:
            raise ValueError(f"idx must have shape [batch, tokens], got {list(idx.shape)}")
        t = idx.shape[1]
        if t < 1:
            raise ValueError("idx has 0 tokens; at least 1 is needed")
        if start_pos < 0 or start_pos + t > c:
            raise ValueError(
                f"positions {start_pos}..{start_pos + t - 1} do not fit the context: start_pos + tokens must be "
                f"<= context_length={c} (got start_pos={start_pos}, tokens={t})"
            )
        lo, hi = int(idx.min()), int(idx.max())
        if lo < 0 or hi >= v:
            bad = lo if lo < 0 else hi
            raise ValueError(f"token id {bad} is out of range: ids must satisfy 0 <= id < vocab_size={v}")

    def embed(
        self, idx: torch.Tensor, *, start_pos: int = 0, positions: torch.Tensor | None = None,
        key_mask: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, Positions]:
        """The blocks' input [B, T, D] for checked ids idx [B, T] (embedding dropout applied), and ``Positions``:
        where the tokens sit, which every block is handed (RoPE's tables are computed here, once per forward)."""
        if positions is None:
            positions = torch.arange(start_pos, start_pos + idx.shape[1], device=idx.device)  # [T]
        x = self.tok_emb(idx)  # [B, T, D]
        rope = None
        if self.rope is not None:
            rope = self.rope(positions, x.dtype)  # (cos, sin), each [T, hd] or [B, T, hd]
        else:
            x = x + self.pos_emb(positions)  # [B, T, D]
        return self.drop_emb(x), Positions(start_pos, rope, key_mask)

    def hidden_states(
        self,
        idx: torch.Tensor,
        *,
        cache: KVCache | PagedKVCache | None = None,
        start_pos: int = 0,
        positions: torch.Tensor | None = None,
        key_mask: torch.Tensor | None = None,
        batch: Batch | None = None,
    ) -> torch.Tensor:
        """ids [B, T] -> embeddings -> blocks -> final norm: [B, T, D], the head's input. Arguments as for ``forward``."""
        if batch is None:
            self.check_input(idx, start_pos)
        elif cache is None or idx.shape != (1, batch.num_tokens):
            # ids were checked when their rows were added to the engine: no value is read back from the device here
            raise ValueError(f"a Batch of {batch.num_tokens} tokens needs idx [1, {batch.num_tokens}] and its "
                             f"PagedKVCache, got idx {list(idx.shape)}" + (" and no cache" if cache is None else ""))
        if idx.dtype not in (torch.int64, torch.int32):  # nn.Embedding indexes with int32/int64 only
            idx = idx.long()
        if batch is not None:
            x, pos = self.embed(idx, positions=batch.positions)  # [1, N, D]
            pos = batch.with_rope(pos.rope)
        else:
            x, pos = self.embed(idx, start_pos=start_pos, positions=positions, key_mask=key_mask)  # [B, T, D]
        for layer, block in enumerate(self.trf_blocks):
            x = block(x, pos, None if cache is None else cache.layers[layer])  # [B, T, D]
        return self.final_norm(x)  # [B, T, D]

    def forward(
        self,
        idx: torch.Tensor,
        *,
        cache: KVCache | PagedKVCache | None = None,
        start_pos: int = 0,
        positions: torch.Tensor | None = None,
        key_mask: torch.Tensor | None = None,
        last_only: bool = False,
        targets: torch.Tensor | None = None,
        batch: Batch | None = None,
    ) -> torch.Tensor:
        """Token ids [B, T] -> logits [B, T, V] (or [B, 1, V] with ``last_only``), or with ``targets`` the loss.

        Without the keyword arguments this is the plain full-sequence forward. For cached decoding,
        ``cache`` holds the keys/values of positions < ``start_pos`` and receives this call's; ``positions``
        [B, T] overrides the position ids per row (left-padded batches); ``key_mask`` [B, start_pos + T] marks
        real (True) vs padding (False) key positions. ``last_only`` applies the head to the last position only,
        which is all that generation needs.

        ``targets`` [B, T] (the next token of each position; -100 = ignore) returns the scalar mean cross-entropy
        instead, equal to ``F.cross_entropy(logits.flatten(0, 1), targets.flatten())``; ``fast.head_cross_entropy``
        computes it without materialising the [B, T, V] logits.

        ``batch`` (``inference.batch.Batch``, with ``cache`` a ``PagedKVCache``): the inference engine's packed rows,
        idx [1, N]; returns the logits [1, M, V] of the M tokens ``batch.logits_at`` names.
        """
        if targets is not None and last_only:
            raise ValueError("targets and last_only=True exclude each other: the loss needs every position's logits")
        x = self.hidden_states(idx, cache=cache, start_pos=start_pos, positions=positions, key_mask=key_mask,
                               batch=batch)
        if batch is not None:
            return self.out_head(x[:, batch.logits_at])  # [1, M, V]
        if targets is not None:
            return head_cross_entropy(x, self.out_head.weight, targets)  # checks targets: type, shape, id range
        if last_only:
            x = x[:, -1:, :]  # [B, 1, D]
        return self.out_head(x)  # [B, T, V]


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
