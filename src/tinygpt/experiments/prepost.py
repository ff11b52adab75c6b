"""Seed 002: pre-LN against post-LN -- same weights, different order, different outputs and gradients.

Part 1 (exercises 4 and 5): stacks of 6 and 12 ``TransformerBlock``s, pre-LN and post-LN, where the post-LN stack
is loaded with the pre-LN stack's weights (same init, dropout 0). One input [2, 16, 384] ~ N(0, 1), H = 6. The
outputs must differ; then one backward pass and the gradient norm at the input of every block. The loss is a fixed
random readout, mean(out * R): ``out.sum()`` or ``out.pow(2).mean()`` would be (nearly) constant under a post-LN
stack's final LayerNorm and give its input a zero gradient for a trivial reason.

Part 2: the seed's claim that pre-LN trains without warmup at lr 3e-4 where post-LN struggles at depth 12. Two
12-layer ``GPTModel``s (post-LN loaded with the pre-LN init) train on the same character-level batches with AdamW at
a constant learning rate, no warmup and no gradient clipping (clipping would hide exactly the instability looked
for). The loop is a plain one written here: an experiment, not the product training loop.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .. import checks
from ..config import GPTConfig
from ..corpus import embedded_corpus_text
from ..layers import TransformerBlock
from ..model import GPTModel
from ..tokenizer import CharTokenizer
from .anatomy import resolve_config
from .report import ExperimentReport, check_seed, finish, format_table, new_figure, output_dir

STACK_SHAPE = (2, 16, 384)  # [B, T, D] of seed 002 exercise 4
STACK_HEADS = 6
STACK_DEPTHS = (6, 12)
DEFAULT_TRAIN = dict(context_length=64, emb_dim=64, n_heads=4, n_layers=12, drop_rate=0.0)


# ------------------------------------------------------------------------------------------- block stacks
def block_stacks(depth: int, emb_dim: int, n_heads: int, tokens: int, seed: int) -> tuple[nn.ModuleList, nn.ModuleList]:
    """A pre-LN stack (torch's default init under ``seed``) and a post-LN stack holding the very same weights."""
    config = GPTConfig(vocab_size=1, context_length=tokens, emb_dim=emb_dim, n_heads=n_heads, n_layers=depth)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        pre = nn.ModuleList(TransformerBlock(config, pre_ln=True) for _ in range(depth))
    post = nn.ModuleList(TransformerBlock(config, pre_ln=False) for _ in range(depth))
    post.load_state_dict(pre.state_dict())
    return pre.eval(), post.eval()


def stack_gradients(stack: nn.ModuleList, x: torch.Tensor, readout: torch.Tensor) -> tuple[torch.Tensor, list[float]]:
    """Run ``stack`` on x [B, T, D], backward mean(out * readout); return the output and ||dL/dh_i|| for the input
    h_i of every block i (h_0 = x, the stack's input)."""
    h = x.detach().clone().requires_grad_(True)
    inputs = []
    for block in stack:
        h.retain_grad()
        inputs.append(h)
        h = block(h)
    (h * readout).mean().backward()
    return h.detach(), [t.grad.norm().item() for t in inputs]


def compare_stacks(depths: Sequence[int], shape: Sequence[int], n_heads: int, seed: int) -> dict:
    b, t, d = shape
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed + 1)  # the data draws are independent of the weight draws
        x = torch.randn(b, t, d)
        readout = torch.randn(b, t, d)
    results = {}
    for depth in depths:
        pre, post = block_stacks(depth, d, n_heads, t, seed)
        out_pre, g_pre = stack_gradients(pre, x, readout)
        out_post, g_post = stack_gradients(post, x, readout)
        results[str(depth)] = {
            "outputs_allclose": torch.allclose(out_pre, out_post),
            "outputs_max_abs_diff": (out_pre - out_post).abs().max().item(),
            "output_std": {"pre_ln": out_pre.std().item(), "post_ln": out_post.std().item()},
            "input_grad_norm_per_block": {"pre_ln": g_pre, "post_ln": g_post},
            "input_grad_ratio_pre_over_post": g_pre[0] / g_post[0],
        }
    return results


# ------------------------------------------------------------------------------------------- training
def training_config(config: str | GPTConfig | None, vocab_size: int) -> GPTConfig:
    """The given preset/file/config (or the small 12-layer default) with the character vocabulary's size."""
    if config is None:
        return GPTConfig(vocab_size=vocab_size, **DEFAULT_TRAIN)
    return resolve_config(config)[1].replace(vocab_size=vocab_size)


def train_losses(model: GPTModel, ids: torch.Tensor, *, steps: int, batch_size: int, seq_len: int, lr: float,
                 seed: int, progress: Callable[[str], None] | None = None, label: str = "") -> dict:
    """AdamW at a constant ``lr`` (no warmup, no clipping) on random windows of ``ids`` [N].

    Returns the loss and the token-embedding gradient norm at every step; stops early if the loss is not finite."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)  # betas (0.9, 0.999), weight_decay 0.01: torch's
    sampler = torch.Generator().manual_seed(seed)  # the same batches for both models
    model.train()
    losses, emb_grads = [], []
    for step in range(steps):
        starts = torch.randint(0, len(ids) - seq_len - 1, (batch_size,), generator=sampler)
        offsets = torch.arange(seq_len)
        x = ids[starts[:, None] + offsets]  # [B, T]
        y = ids[starts[:, None] + offsets + 1]  # [B, T], the next character
        logits = model(x)  # [B, T, V]
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        losses.append(loss.item())
        emb_grads.append(model.tok_emb.weight.grad.norm().item())
        if not math.isfinite(losses[-1]):
            break
        optimizer.step()
        if progress is not None and (step % 50 == 0 or step == steps - 1):
            progress(f"  {label} step {step:4d}/{steps}  loss {losses[-1]:.4f}")
    return {"loss": losses, "embedding_grad_norm": emb_grads, "diverged": not math.isfinite(losses[-1])}


def _tail_mean(values: list[float], fraction: float = 0.1) -> float:
    tail = values[-max(1, int(len(values) * fraction)):]
    return sum(tail) / len(tail)


def run_prepost(out: str | Path | None = None, seed: int = 123, *, config: str | GPTConfig | None = None,
                data: str | Path | None = None, max_chars: int = 400_000, steps: int = 300, batch_size: int = 16,
                seq_len: int = 64, lr: float = 3e-4, depths: Sequence[int] = STACK_DEPTHS,
                stack_shape: Sequence[int] = STACK_SHAPE, stack_heads: int = STACK_HEADS,
                progress: Callable[[str], None] | None = None) -> ExperimentReport:
    """Both parts; writes ``prepost_gradients.png``, ``prepost_training.png`` and the JSON.

    ``config``: preset name, .json file or GPTConfig for the trained models (vocab_size is replaced by the number of
    distinct characters; default: C=64, D=64, H=4, L=12). ``data``: a UTF-8 text file (default: the embedded
    corpus), cut to ``max_chars``. ``seq_len`` is capped at the config's context_length. ``steps=0`` skips the
    training part."""
    check_seed(seed)
    for name, value in (("batch_size", batch_size), ("seq_len", seq_len), ("max_chars", max_chars)):
        checks.positive_int(name, value)
    checks.non_negative_int("steps", steps)
    checks.positive_number("lr", lr)
    for depth in depths:
        checks.positive_int("depth", depth)
    directory = output_dir("prepost", out)

    stacks = compare_stacks(depths, stack_shape, stack_heads, seed)
    rows = []
    for depth, r in stacks.items():
        g_pre, g_post = r["input_grad_norm_per_block"]["pre_ln"], r["input_grad_norm_per_block"]["post_ln"]
        for i, (a, b) in enumerate(zip(g_pre, g_post)):
            rows.append([f"L={depth} block {i} input", a, b, f"{a / b:.2f}"])
    grad_table = format_table(["stack / position", "||grad|| pre-LN", "||grad|| post-LN", "pre/post"], rows)
    diff_table = format_table(
        ["stack", "outputs allclose", "max |pre - post|", "out std pre-LN", "out std post-LN", "input grad pre/post"],
        [[f"L={d}", r["outputs_allclose"], r["outputs_max_abs_diff"], r["output_std"]["pre_ln"],
          r["output_std"]["post_ln"], f"{r['input_grad_ratio_pre_over_post']:.2f}"] for d, r in stacks.items()])
    ratios = {d: r["input_grad_ratio_pre_over_post"] for d, r in stacks.items()}
    order_of_magnitude = all(v >= 10 for v in ratios.values())
    findings = [
        "pre-LN and post-LN stacks with identical weights give different outputs: "
        + ", ".join(f"L={d}: allclose={r['outputs_allclose']}" for d, r in stacks.items()),
        "seed 002 exercise 5 claims pre-LN's input (embedding) gradient is an order of magnitude larger than "
        "post-LN's: " + ("HELD here" if order_of_magnitude else "did NOT hold here")
        + " (pre/post ratio " + ", ".join(f"L={d}: {v:.2f}x" for d, v in ratios.items())
        + f"; input N(0,1) of shape {list(stack_shape)}, torch's default init, loss mean(out * R))",
    ]
    figures = {"prepost_gradients": _gradient_figure(stacks)}
    data_out: dict = {"seed": seed, "stacks": {"shape": list(stack_shape), "n_heads": stack_heads,
                                               "init": "torch default (nn.Linear), LayerNorm scale 1 / shift 0",
                                               "loss": "mean(out * R), R ~ N(0, 1) fixed", "results": stacks}}
    tables = [diff_table, grad_table]

    if steps > 0:
        text = embedded_corpus_text(max_chars=max_chars) if data is None else _read_text(data, max_chars)
        tokenizer = CharTokenizer(text)
        ids = torch.tensor(tokenizer.encode(text), dtype=torch.long)  # [N]
        cfg = training_config(config, tokenizer.vocab_size)
        seq = min(seq_len, cfg.context_length)
        if len(ids) < seq + 2:
            raise ValueError(f"the training text has {len(ids)} characters; at least seq_len + 2 = {seq + 2} needed")
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            pre_model = GPTModel(cfg.replace(pre_ln=True))
        post_model = GPTModel(cfg.replace(pre_ln=False))
        post_model.load_state_dict(pre_model.state_dict())
        runs = {}
        for label, model in (("pre_ln", pre_model), ("post_ln", post_model)):
            runs[label] = train_losses(model, ids, steps=steps, batch_size=batch_size, seq_len=seq, lr=lr,
                                       seed=seed, progress=progress, label=label)
        mid = max(steps // 2 - 1, 0)
        train_rows = [[label, r["loss"][0], r["loss"][min(mid, len(r["loss"]) - 1)], _tail_mean(r["loss"]),
                       r["embedding_grad_norm"][0], "yes" if r["diverged"] else "no"] for label, r in runs.items()]
        tables.append(format_table(["model", "loss step 0", f"loss step {mid}", "mean loss last 10%",
                                    "emb grad norm step 0", "diverged"], train_rows))
        final = {label: _tail_mean(r["loss"]) for label, r in runs.items()}
        emb0 = {label: r["embedding_grad_norm"][0] for label, r in runs.items()}
        better = "pre-LN" if final["pre_ln"] < final["post_ln"] else "post-LN"
        findings += [
            f"{cfg.n_layers}-layer GPTModel at step 0 (GPT-2 init, real cross-entropy): token-embedding gradient "
            f"norm pre-LN {emb0['pre_ln']:.3e} vs post-LN {emb0['post_ln']:.3e} "
            f"({emb0['pre_ln'] / emb0['post_ln']:.2f}x): the order-of-magnitude claim "
            + ("HELD" if emb0["pre_ln"] >= 10 * emb0["post_ln"] else "did NOT hold") + " for the full models",
            f"training at lr {lr:g}, no warmup, {steps} steps: mean loss over the last 10% pre-LN "
            f"{final['pre_ln']:.4f}, post-LN {final['post_ln']:.4f} ({better} lower); diverged: "
            + ", ".join(f"{k}={r['diverged']}" for k, r in runs.items()),
        ]
        figures["prepost_training"] = _training_figure(runs, lr, cfg)
        data_out["training"] = {
            "config": cfg.to_dict(), "data": "embedded corpus" if data is None else str(data),
            "characters": len(ids), "steps": steps, "batch_size": batch_size, "seq_len": seq, "lr": lr,
            "optimizer": "torch.optim.AdamW(lr), betas (0.9, 0.999), weight_decay 0.01, no warmup, no clipping",
            "runs": runs,
        }
    return finish("prepost", directory, "pre-LN vs post-LN", tables, data_out, findings, figures)


def _read_text(path: str | Path, max_chars: int) -> str:
    try:
        text = Path(path).read_text(encoding="utf-8", errors="replace")
    except OSError as err:
        raise ValueError(f"cannot read --data {path}: {err.strerror}") from None
    return text[:max_chars]


def _gradient_figure(stacks: dict):
    fig = new_figure(6 * len(stacks), 4.0)
    axes = fig.subplots(1, len(stacks), squeeze=False)[0]
    for ax, (depth, r) in zip(axes, stacks.items()):
        g = r["input_grad_norm_per_block"]
        xs = range(len(g["pre_ln"]))
        ax.plot(xs, g["pre_ln"], "o-", label="pre-LN")
        ax.plot(xs, g["post_ln"], "s-", label="post-LN")
        ax.set_yscale("log")
        ax.set_xlabel("block index (0 = stack input)")
        ax.set_ylabel("||dL/d input||")
        ax.set_title(f"{depth} blocks: gradient norm at each block's input")
        ax.grid(alpha=0.3, which="both")
        ax.legend()
    return fig


def _training_figure(runs: dict, lr: float, cfg: GPTConfig):
    fig = new_figure(12, 4.2)
    ax_loss, ax_grad = fig.subplots(1, 2)
    for label, r in runs.items():
        name = label.replace("_ln", "-LN")
        ax_loss.plot(r["loss"], label=name, lw=1)
        ax_grad.plot(r["embedding_grad_norm"], label=name, lw=1)
    ax_loss.set_title(f"training loss, L={cfg.n_layers} D={cfg.emb_dim}, AdamW lr {lr:g}, no warmup")
    ax_loss.set_xlabel("step")
    ax_loss.set_ylabel("cross-entropy (nats / char)")
    ax_grad.set_title("token-embedding gradient norm")
    ax_grad.set_xlabel("step")
    ax_grad.set_yscale("log")
    for ax in (ax_loss, ax_grad):
        ax.grid(alpha=0.3)
        ax.legend()
    return fig
