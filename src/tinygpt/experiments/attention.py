"""The block lesson's exercise 3: every head's attention weights in one layer, and the check that the future is masked.

The weights come from the model itself: the embedding and the blocks before the chosen layer run as usual, and at
the chosen layer the block's own ``MultiHeadAttention`` is called with ``return_weights=True`` on exactly the input
the block gives it (``norm1(x)`` for pre-LN, ``x`` for post-LN). Causality means every entry above the diagonal
(key j > query i) is exactly 0 after the softmax -- not small, zero, because the masked scores are -inf.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.nn.functional as F

from .. import checks
from ..config import GPTConfig
from ..figures import integer_ticks
from ..model import GPTModel
from ..tokenizer import CharTokenizer
from .anatomy import resolve_config
from .prepost_training import random_windows
from .report import ExperimentReport, check_seed, finish, format_table, new_figure, output_dir

DEFAULT_PROMPT = "Every effort moves you forward"


@torch.no_grad()
def attention_weights(model: GPTModel, idx: torch.Tensor, layer: int) -> tuple[torch.Tensor, float]:
    """The attention weights [B, H, T, T] of block ``layer`` for ids ``idx`` [B, T] (dropout off), and the largest
    |difference| between that attention's output on the explicit-weights path and on the default fused path."""
    n_layers = len(model.trf_blocks)
    checks.int_in_range("layer", layer, 0, n_layers - 1, note=f"(the model has {n_layers} blocks)")
    model.check_input(idx)
    was_training = model.training
    model.eval()
    try:
        x, rope = model.embed(idx.long())  # [B, T, D]
        for block in model.trf_blocks[:layer]:
            x = block(x, rope)
        block = model.trf_blocks[layer]
        att_input = block.norm1(x) if block.pre_ln else x  # what the block itself feeds its attention
        out, weights = block.att(att_input, rope, return_weights=True)  # [B, T, D], [B, H, T, T]
        fused_gap = (out - block.att(att_input, rope)).abs().max().item()
    finally:
        model.train(was_training)
    return weights, fused_gap


def train_char_model(text: str, *, steps: int = 600, emb_dim: int = 32, n_heads: int = 4, n_layers: int = 1,
                     context_length: int = 32, batch_size: int = 16, lr: float = 3e-3,
                     seed: int = 0) -> tuple[GPTModel, CharTokenizer, list[float]]:
    """A small character model trained on ``text`` in seconds: the trained weights whose attention the guide's
    attention page (docs/guide/04b-attention.md) and its figure take apart.

    AdamW at ``lr`` on random windows of ``context_length`` characters, dropout 0, seeded (weights and batches);
    returns the model in eval mode, its tokenizer and the loss of every step."""
    checks.positive_int("steps", steps)
    tokenizer = CharTokenizer(text)
    ids = torch.tensor(tokenizer.encode(text))  # [N]
    if len(ids) < context_length + 2:
        raise ValueError(f"the text has {len(ids)} characters; at least context_length + 2 = "
                         f"{context_length + 2} needed")
    config = GPTConfig(vocab_size=tokenizer.vocab_size, context_length=context_length, emb_dim=emb_dim,
                       n_heads=n_heads, n_layers=n_layers, drop_rate=0.0)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = GPTModel(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    batches = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(steps):
        x, y = random_windows(ids, batch_size, context_length, batches)  # [B, T] each
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return model.eval(), tokenizer, losses


def _byte_ids(prompt: str, vocab_size: int) -> list[int]:
    """The prompt's UTF-8 bytes, each taken modulo vocab_size (a random model has no tokenizer)."""
    return [b % vocab_size for b in prompt.encode("utf-8")]


def _load(model_dir: str | Path | None, config: str | GPTConfig | None, seed: int, prompt: str):
    """(model, token ids, token labels, description) from a checkpoint or a seeded random model."""
    if (model_dir is None) == (config is None):
        raise ValueError("give exactly one of model_dir (a saved checkpoint) or config (a random model)")
    if model_dir is not None:
        from ..checkpoint import load_checkpoint_tokenizer, load_model

        model = load_model(model_dir)
        tokenizer = load_checkpoint_tokenizer(model_dir)
        if tokenizer is not None:
            ids = list(tokenizer.encode(prompt))
            labels = [tokenizer.decode([i]) for i in ids]
            return model, ids, labels, f"checkpoint {model_dir} with its tokenizer"
        ids = _byte_ids(prompt, model.config.vocab_size)
        return model, ids, _byte_labels(prompt, ids), f"checkpoint {model_dir} (no tokenizer saved: UTF-8 bytes mod V)"
    label, cfg = resolve_config(config)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = GPTModel(cfg)
    ids = _byte_ids(prompt, cfg.vocab_size)
    return model, ids, _byte_labels(prompt, ids), f"random {label} model (seed {seed}), ids = UTF-8 bytes mod V"


def _byte_labels(prompt: str, ids: list[int]) -> list[str]:
    raw = prompt.encode("utf-8")
    return ["\u2423" if b == 32 else chr(b) if 32 < b < 127 else f"\\x{b:02x}" for b in raw[: len(ids)]]


def run_attention(out: str | Path | None = None, seed: int = 123, *, model_dir: str | Path | None = None,
                  config: str | GPTConfig | None = None, prompt: str = DEFAULT_PROMPT,
                  layer: int = 0) -> ExperimentReport:
    """Heatmaps of every head of block ``layer`` (``attention.png``) and the causality check.

    ``model_dir``: a checkpoint loaded with ``tinygpt.checkpoint.load_model`` and its tokenizer. ``config``: a preset
    name, .json file or GPTConfig for a random model seeded with ``seed``; its ids are the prompt's UTF-8 bytes
    modulo vocab_size (byte b -> b % V), since a random model comes with no tokenizer."""
    check_seed(seed)
    if not isinstance(prompt, str) or not prompt:
        raise ValueError("prompt must be a non-empty string")
    model, ids, labels, source = _load(model_dir, config, seed, prompt)
    c = model.config.context_length
    if len(ids) > c:
        raise ValueError(f"the prompt is {len(ids)} tokens but context_length={c}: shorten the prompt")
    directory = output_dir("attention", out)
    idx = torch.tensor([ids], dtype=torch.long)  # [1, T]
    weights, fused_gap = attention_weights(model, idx, layer)
    w = weights[0].float()  # [H, T, T]
    n_heads, t = w.shape[0], w.shape[1]
    upper = torch.triu(torch.ones(t, t, dtype=torch.bool), diagonal=1)  # key j > query i
    above = w[:, upper]  # [H, T(T-1)/2]
    upper_max = above.abs().max().item() if above.numel() else 0.0
    upper_zero = bool((above == 0).all())
    row_sum_err = (w.sum(dim=-1) - 1).abs().max().item()

    rows = []
    for h in range(n_heads):
        head = w[h]
        entropy = -(head.clamp_min(1e-30).log() * head).sum(-1).mean().item()
        rows.append([f"head {h}", head[upper].abs().max().item() if t > 1 else 0.0,
                     head.diagonal().mean().item(), head[:, 0].mean().item(), entropy])
    table = format_table(["head", "max above diagonal", "mean on diagonal", "mean on first token",
                          "mean row entropy (nats)"], rows)
    findings = [
        f"source: {source}; layer {layer} of {len(model.trf_blocks)}, {n_heads} heads, {t} tokens",
        f"causal mask: every weight above the diagonal is exactly zero: {upper_zero} (max {upper_max:.1e}); "
        f"rows sum to 1 within {row_sum_err:.1e}",
        f"the explicit-weights attention output matches the fused default path within {fused_gap:.1e}",
    ]
    if model_dir is None:
        findings.append("a random model's heads are close to uniform over the allowed keys (scores ~ 0 at init): "
                        "structure appears only after training")

    cols = math.ceil(math.sqrt(n_heads))
    rows_n = math.ceil(n_heads / cols)
    size = 2.6 if t <= 24 else 3.2
    fig = new_figure(cols * size + 1.0, rows_n * size + 0.6, layout="constrained")
    axes = fig.subplots(rows_n, cols, squeeze=False)
    image = None
    for h in range(rows_n * cols):
        ax = axes[h // cols][h % cols]
        if h >= n_heads:
            ax.axis("off")
            continue
        image = ax.imshow(w[h].numpy(), vmin=0.0, vmax=1.0, cmap="viridis")
        ax.set_title(f"head {h}", fontsize=9)
        ax.set_xlabel("key position", fontsize=7)
        ax.set_ylabel("query position", fontsize=7)
        if t <= 40:
            ax.set_xticks(range(t), labels, fontsize=5, rotation=90)
            ax.set_yticks(range(t), labels, fontsize=5)
        else:  # too many to name: positions, at whole numbers
            integer_ticks(ax.xaxis)
            integer_ticks(ax.yaxis)
    fig.suptitle(f"Attention weights, layer {layer} (rows: queries, columns: keys)", fontsize=10)
    fig.colorbar(image, ax=axes.ravel().tolist(), shrink=0.8, label="attention weight (softmax)")

    data = {
        "seed": seed,
        "source": source,
        "config": model.config.to_dict(),
        "prompt": prompt,
        "token_ids": ids,
        "tokens": labels,
        "layer": layer,
        "upper_triangle_all_zero": upper_zero,
        "upper_triangle_max_abs": upper_max,
        "row_sum_max_error": row_sum_err,
        "fused_path_max_abs_diff": fused_gap,
        "weights": w.tolist(),  # [H, T, T]
    }
    return finish("attention", directory, "Attention maps", [table], data, findings, {"attention": fig})
