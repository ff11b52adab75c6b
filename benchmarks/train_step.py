"""One training step (forward + cross-entropy + backward + AdamW), float32, CPU: tinygpt vs HF GPT-2, same dims.

A 4-layer, 256-wide model with C=256 and the GPT-2 vocabulary at batch 8 (quick: tiny). All start from the same
weights and take the same loss (mean cross-entropy over every position of externally shifted targets), each the way
its library offers it: tinygpt ``model(idx, targets=...)`` (the head fused with the loss, ``tinygpt.fast.head_loss``),
Hugging Face ``model(idx, labels=..., shift_labels=...).loss``. A third row, tinygpt's logits +
``F.cross_entropy``, shows what the fused loss is worth. Dropout is off so that no random masks enter the timing.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F

from tinygpt import GPTConfig, GPTModel

from .common import format_table, spread, time_interleaved
from .models import available, build_hf, build_tinygpt, logits_of, quick_config


def train_config(quick: bool) -> GPTConfig:
    if quick:
        return quick_config()
    return GPTConfig(vocab_size=50257, context_length=256, emb_dim=256, n_heads=4, n_layers=4,
                     qkv_bias=True, tie_weights=True)


def loss_of(model: torch.nn.Module, *, own_loss: bool = True) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """``(idx, targets) -> mean cross-entropy``: the library's own loss call, or (``own_loss=False``) its logits
    followed by ``F.cross_entropy``. Targets are already shifted (target[t] is the token after idx[t])."""
    if not own_loss:
        call = logits_of(model)
        return lambda idx, targets: F.cross_entropy(call(idx).flatten(0, 1), targets.flatten())
    if isinstance(model, GPTModel):
        return lambda idx, targets: model(idx, targets=targets)
    return lambda idx, targets: model(input_ids=idx, labels=targets, shift_labels=targets, use_cache=False).loss


def make_step(model: torch.nn.Module, idx: torch.Tensor, targets: torch.Tensor, *,
              own_loss: bool = True) -> Callable[[], float]:
    """A closure doing one AdamW step of ``model`` on (idx, targets) [B, T]; returns the loss."""
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)
    loss_fn = loss_of(model, own_loss=own_loss)

    def step() -> float:
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(idx, targets)
        loss.backward()
        optimizer.step()
        return loss.item()

    return step


def run(quick: bool, *, repeats: int | None = None) -> dict[str, Any]:
    config = train_config(quick)
    batch = 2 if quick else 8
    repeats = repeats or (2 if quick else 7)
    generator = torch.Generator().manual_seed(2)
    data = torch.randint(0, config.vocab_size, (batch, config.context_length + 1), generator=generator)
    idx, targets = data[:, :-1].contiguous(), data[:, 1:].contiguous()  # HF views labels flat
    ours = build_tinygpt(config)
    logits_route = build_tinygpt(config)  # same seed: the same weights, a model of its own to step
    steps = {}
    skipped = []
    if available("hf"):
        steps["hf"] = make_step(build_hf(config, ours), idx, targets)  # copy before ours takes a step
    else:
        skipped.append("hf")
    steps = {"tinygpt": make_step(ours, idx, targets), **steps,
             "tinygpt-logits+F.cross_entropy": make_step(logits_route, idx, targets, own_loss=False)}
    first_losses = {name: step() for name, step in steps.items()}  # also the warm-up step
    stats = time_interleaved(steps, warmup=1, repeats=repeats)
    tokens = batch * config.context_length
    rows = []
    for name, s in stats.items():
        rows.append({"impl": name, **s, "time_ms": spread(s), "tokens_per_s": tokens / s["median_s"],
                     "first_loss": first_losses[name],
                     "tinygpt_speedup": s["median_s"] / stats["tinygpt"]["median_s"]})
    return {"config": config.to_dict(), "batch": batch, "repeats": repeats, "rows": rows, "not_available": skipped}


def table(result: dict[str, Any]) -> str:
    columns = [("impl", "impl"), ("time_ms", "ms/step median [min-max]"), ("tokens_per_s", "tokens/s"),
               ("tinygpt_speedup", "tinygpt speedup"), ("first_loss", "first loss")]
    text = format_table(result["rows"], columns)
    for name in result["not_available"]:
        text += f"\n{name}: not available (package not installed)"
    return text
