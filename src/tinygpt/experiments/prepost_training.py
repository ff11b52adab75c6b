"""The pre-LN lesson trained: post-LN without warmup stalls where pre-LN trains, and a warmup removes most of it.

Every run starts from a model pair built under one seed (the post-LN model holds the pre-LN model's very weights)
and sees the same batches of character windows; AdamW at a constant rate after an optional linear warmup, no
gradient clipping (clipping would hide exactly the instability looked for). The loop is a plain one written here:
an experiment, not the product training loop.

Two initialisations (``INITS``):

- ``gpt2``: the model's own (every weight N(0, 0.02), the residual projections N(0, 0.02 / sqrt(2L))). Small
  weights keep post-LN's sublayers close to identity maps at the start, and post-LN trains without a warmup.
- ``xavier``: the original Transformer's as PyTorch's ``nn.Transformer`` draws it: Xavier-uniform linear weights,
  the fused QKV weight [3D, D] as one matrix (as ``nn.MultiheadAttention`` draws its ``in_proj_weight``), zero
  biases, N(0, 1) token and position embeddings. Here post-LN's
  gradients at init grow toward the output (Xiong et al. 2020) and one Adam step moves its output much more than
  pre-LN's (the amplification of Liu et al. 2020): the setting where post-LN needs its warmup.

The verdict compares like with like: post-LN against pre-LN without warmup (does it stall, by how much?) and post-LN
with warmup against pre-LN with the same warmup (how much of the stall does the warmup remove, is parity reached?),
graded: on how many seeds each claim holds and by how much, never one yes/no on a strict margin.
"""

from __future__ import annotations

import math
import statistics
from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ..config import GPTConfig
from ..model import GPTModel

INITS = ("gpt2", "xavier")
VARIANTS = ("pre_ln", "pre_ln_warmup", "post_ln", "post_ln_warmup")
VARIANT_NAMES = {"pre_ln": "pre-LN", "pre_ln_warmup": "pre-LN + warmup", "post_ln": "post-LN",
                 "post_ln_warmup": "post-LN + warmup"}
# How far (nats per character, mean of the last 10% of steps) post-LN must end above pre-LN to count as failed, and
# how close post-LN with warmup must come to pre-LN with warmup to count as recovered.
STALL_GAP = 0.1


# ------------------------------------------------------------------------------------------- models and data
def xavier_init(model: GPTModel) -> GPTModel:
    """Re-draw ``model``'s weights with the original Transformer's init (torch's global RNG); returns ``model``.

    Linear weights Xavier-uniform, U(-a, a) with a = sqrt(6 / (fan_in + fan_out)); the fused QKV weight [3D, D] is
    one matrix (a = sqrt(6 / 4D)), as in ``nn.MultiheadAttention``: drawn as three D x D matrices (a = sqrt(6 / 2D))
    its queries and keys are larger, and post-LN's warmup no longer recovers in 300 steps (docs/experiments.md has
    both tables). Biases 0; token and position embeddings N(0, 1); LayerNorm scale 1 and shift 0 (as built)."""
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.Linear):
                nn.init.xavier_uniform_(module.weight)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, mean=0.0, std=1.0)
    return model


def model_pair(config: GPTConfig, seed: int, init: str = "gpt2") -> tuple[GPTModel, GPTModel]:
    """A pre-LN ``GPTModel`` (``init`` under ``seed``) and a post-LN one holding the very same weights."""
    if init not in INITS:
        raise ValueError(f"init={init!r} is not one of {', '.join(INITS)}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        pre = GPTModel(config.replace(pre_ln=True))
        if init == "xavier":
            xavier_init(pre)
    post = GPTModel(config.replace(pre_ln=False))
    post.load_state_dict(pre.state_dict())
    return pre, post


def random_windows(ids: torch.Tensor, batch_size: int, seq_len: int,
                   generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``batch_size`` random windows of ``ids`` [N]: inputs x [B, T] and next-token targets y [B, T]."""
    starts = torch.randint(0, len(ids) - seq_len - 1, (batch_size,), generator=generator)
    offsets = torch.arange(seq_len)
    return ids[starts[:, None] + offsets], ids[starts[:, None] + offsets + 1]


def unigram_entropy(ids: torch.Tensor) -> float:
    """The entropy (nats) of the characters' frequencies: the loss of a model that has learnt only those."""
    p = torch.bincount(ids).double()
    p = p[p > 0] / p.sum()
    return float(-(p * p.log()).sum())


# ------------------------------------------------------------------------------------------- training
def warmup_factor(step: int, warmup: int) -> float:
    """Linear warmup: the learning rate at ``step`` (0-based) is lr * min(1, (step + 1) / warmup); 1 if warmup 0."""
    return 1.0 if warmup <= 0 else min(1.0, (step + 1) / warmup)


def train_losses(model: GPTModel, ids: torch.Tensor, *, steps: int, batch_size: int, seq_len: int, lr: float,
                 seed: int, warmup: int = 0, progress: Callable[[str], None] | None = None,
                 label: str = "") -> dict:
    """AdamW at ``lr`` (after a linear warmup of ``warmup`` steps; none by default; no clipping) on random windows
    of ``ids`` [N].

    Returns the loss and the token-embedding gradient norm at every step; stops early if the loss is not finite."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)  # betas (0.9, 0.999), weight_decay 0.01: torch's
    sampler = torch.Generator().manual_seed(seed)  # the same batches for every model of this seed
    model.train()
    losses, emb_grads = [], []
    for step in range(steps):
        x, y = random_windows(ids, batch_size, seq_len, sampler)  # [B, T] each
        logits = model(x)  # [B, T, V]
        loss = F.cross_entropy(logits.flatten(0, 1), y.flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        losses.append(loss.item())
        emb_grads.append(model.tok_emb.weight.grad.norm().item())
        if not math.isfinite(losses[-1]):
            break
        for group in optimizer.param_groups:
            group["lr"] = lr * warmup_factor(step, warmup)
        optimizer.step()
        if progress is not None and (step % 100 == 0 or step == steps - 1):
            progress(f"  {label} step {step:4d}/{steps}  loss {losses[-1]:.4f}")
    return {"loss": losses, "embedding_grad_norm": emb_grads, "diverged": not math.isfinite(losses[-1])}


def tail_mean(values: list[float], fraction: float = 0.1) -> float:
    """The mean of the last ``fraction`` of ``values`` (at least one)."""
    tail = values[-max(1, int(len(values) * fraction)):]
    return sum(tail) / len(tail)


def final_loss(run: dict) -> float:
    """The mean loss of the run's last 10% of steps; inf if it diverged."""
    return math.inf if run["diverged"] else tail_mean(run["loss"])


def train_variants(config: GPTConfig, ids: torch.Tensor, *, steps: int, batch_size: int, seq_len: int, lr: float,
                   warmup: int, seed: int, init: str = "gpt2", variants: Sequence[str] = VARIANTS,
                   progress: Callable[[str], None] | None = None) -> dict:
    """Each of ``variants`` from one init (``init`` under ``seed``) and on the same batches: {variant: run}."""
    runs = {}
    for variant in variants:
        pre, post = model_pair(config, seed, init)
        model = pre if variant.startswith("pre_ln") else post
        runs[variant] = train_losses(model, ids, steps=steps, batch_size=batch_size, seq_len=seq_len, lr=lr,
                                     seed=seed, warmup=warmup if variant.endswith("_warmup") else 0,
                                     progress=progress,
                                     label=f"{init} L={config.n_layers} lr={lr:g} seed {seed} {variant}")
    return runs


def spread(values: Sequence[float]) -> dict:
    """mean, min, max and (for two or more values) the sample standard deviation; inf if any value is inf."""
    if not all(math.isfinite(v) for v in values):
        return {"mean": math.inf, "min": min(values), "max": max(values), "std": math.nan}
    std = statistics.stdev(values) if len(values) > 1 else 0.0
    return {"mean": statistics.fmean(values), "min": min(values), "max": max(values), "std": std}


def lesson_verdict(final: dict[str, Sequence[float]], step0: float, gap: float = STALL_GAP) -> dict:
    """Whether final losses {variant: [one per seed]} show the lesson, judged on the means over seeds, and by how
    much on every seed.

    pre-LN trains (finite, more than ``gap`` below the step-0 loss); post-LN without warmup fails (diverges, or ends
    more than ``gap`` nats above pre-LN without warmup); post-LN with warmup recovers (within ``gap`` of pre-LN with
    the same warmup). ``per_seed`` counts the seeds on which the failure and the recovery hold one by one, and
    ``*_per_seed`` keep each seed's stall (post - pre), parity gap (post + warmup - pre + warmup) and share of the
    stall the warmup removes: the graded verdict (``graded_verdict_lines``) reports them, not a yes/no."""
    mean = {v: spread(final[v])["mean"] for v in VARIANTS}
    pre_trains = math.isfinite(mean["pre_ln"]) and mean["pre_ln"] < step0 - gap
    post_fails = not math.isfinite(mean["post_ln"]) or mean["post_ln"] > mean["pre_ln"] + gap
    recovers = math.isfinite(mean["post_ln_warmup"]) and mean["post_ln_warmup"] <= mean["pre_ln_warmup"] + gap
    seeds = len(final["pre_ln"])
    fails_per_seed = sum(not math.isfinite(p) or p > q + gap for p, q in zip(final["post_ln"], final["pre_ln"]))
    recovers_per_seed = sum(math.isfinite(p) and p <= q + gap
                            for p, q in zip(final["post_ln_warmup"], final["pre_ln_warmup"]))
    per_seed = [{v: final[v][i] for v in VARIANTS} for i in range(seeds)]
    return {"pre_ln_trains": pre_trains, "post_ln_fails": post_fails, "warmup_recovers": recovers,
            "shown": pre_trains and post_fails and recovers, "seeds": seeds, "margin": gap,
            "post_ln_fails_seeds": fails_per_seed, "warmup_recovers_seeds": recovers_per_seed,
            "gap_post_minus_pre": mean["post_ln"] - mean["pre_ln"],
            "gap_warmup_post_minus_pre": mean["post_ln_warmup"] - mean["pre_ln_warmup"],
            "warmup_removes": _removed(mean),
            "stall_per_seed": [m["post_ln"] - m["pre_ln"] for m in per_seed],
            "parity_gap_per_seed": [m["post_ln_warmup"] - m["pre_ln_warmup"] for m in per_seed],
            "warmup_removes_per_seed": [_removed(m) for m in per_seed]}


def _removed(mean: dict[str, float]) -> float:
    """The share of post-LN's excess over pre-LN that the warmup removes (1: all of it; nan without an excess)."""
    excess = mean["post_ln"] - mean["pre_ln"]
    if not math.isfinite(excess):
        return 1.0 if math.isfinite(mean["post_ln_warmup"]) else 0.0
    return 1 - (mean["post_ln_warmup"] - mean["pre_ln_warmup"]) / excess if excess > 0 else math.nan


def _range(values: Sequence[float], fmt: str) -> str:
    """'a to b' over seeds (min to max), or the one value; 'n/a' where a value is not a number."""
    if any(math.isnan(v) for v in values):
        return "n/a on some seed"
    lo, hi = min(values), max(values)
    return format(lo, fmt) if len(values) == 1 else f"{format(lo, fmt)} to {format(hi, fmt)}"


def stall_line(stall_per_seed: Sequence[float], gap: float = STALL_GAP) -> str:
    """The graded stall claim from each seed's post-LN - pre-LN final loss (both without warmup)."""
    n = len(stall_per_seed)
    shown = sum(not math.isfinite(s) or s > gap for s in stall_per_seed)
    mean = statistics.fmean(stall_per_seed) if all(math.isfinite(s) for s in stall_per_seed) else math.inf
    head = f"the stall (post-LN without warmup ends more than {gap} nats above pre-LN): shown on {shown} of {n} seed"
    if n == 1:
        return f"{head}, by {mean:+.3f} nats"
    return f"{head}s, by {mean:+.3f} nats on average ({_range(stall_per_seed, '+.3f')} over seeds)"


def graded_verdict_lines(verdict: dict) -> list[str]:
    """One line per claim of the lesson, each with how many seeds show it and by how much (min to max over seeds):
    the stall, the share of it the warmup removes, and parity with pre-LN under the same warmup."""
    n, gap = verdict["seeds"], verdict.get("margin", STALL_GAP)
    removes = verdict["warmup_removes_per_seed"]
    parity = verdict["parity_gap_per_seed"]
    return [
        stall_line(verdict["stall_per_seed"], gap),
        f"the warmup: removes {verdict['warmup_removes']:.0%} of that gap on average "
        f"({_range(removes, '.0%')} over seeds)",
        f"parity with pre-LN under the same warmup (within {gap} nats): reached on {verdict['warmup_recovers_seeds']}"
        f" of {n} seed{'s' if n > 1 else ''}; post-LN + warmup ends {verdict['gap_warmup_post_minus_pre']:+.3f} nats"
        f" from pre-LN + warmup on average ({_range(parity, '+.3f')} over seeds)",
        f"pre-LN trains: {'yes' if verdict['pre_ln_trains'] else 'NO'}",
    ]


def run_sweep(config: GPTConfig, ids: torch.Tensor, *, depths: Sequence[int], lrs: Sequence[float], steps: int,
              batch_size: int, seq_len: int, warmup: int, seed: int, init: str = "gpt2",
              progress: Callable[[str], None] | None = None) -> list[dict]:
    """The four variants at every depth x learning rate, one seed: one row per cell with final losses and verdict."""
    rows = []
    for depth in depths:
        for lr in lrs:
            runs = train_variants(config.replace(n_layers=depth), ids, steps=steps, batch_size=batch_size,
                                  seq_len=seq_len, lr=lr, warmup=warmup, seed=seed, init=init, progress=progress)
            final = {v: final_loss(r) for v, r in runs.items()}
            rows.append({"depth": depth, "lr": lr, "final_loss": final, "step0_loss": runs["pre_ln"]["loss"][0],
                         **lesson_verdict({v: [f] for v, f in final.items()}, runs["pre_ln"]["loss"][0])})
    return rows


# ------------------------------------------------------------------------------------------- one Adam step
def one_step_change(config: GPTConfig, ids: torch.Tensor, depths: Sequence[int], *, inits: Sequence[str] = INITS,
                    batch_size: int, seq_len: int, lr: float, seed: int) -> dict:
    """How far one AdamW step at ``lr`` moves each model's output distribution (Liu et al. 2020's amplification).

    For every init, depth and variant: the mean over the batch's positions of KL(p_before || p_after), p the
    next-character distribution on one batch of ``ids``, after one step on that same batch's cross-entropy. Adam's
    first step moves every weight by about lr whatever its gradient's scale, so the change measures how strongly the
    architecture amplifies equal-sized weight changes. {init: {depth: {"pre_ln": kl, "post_ln": kl}}}."""
    x, y = random_windows(ids, batch_size, seq_len, torch.Generator().manual_seed(seed))
    result: dict = {}
    for init in inits:
        result[init] = {}
        for depth in depths:
            kls = {}
            for label, model in zip(("pre_ln", "post_ln"), model_pair(config.replace(n_layers=depth), seed, init)):
                model.eval()  # no dropout: the step itself
                optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
                logits = model(x)  # [B, T, V]
                F.cross_entropy(logits.flatten(0, 1), y.flatten()).backward()
                optimizer.step()
                with torch.no_grad():
                    before = F.log_softmax(logits.detach(), dim=-1)
                    after = F.log_softmax(model(x), dim=-1)
                    kls[label] = F.kl_div(after, before, log_target=True, reduction="none").sum(-1).mean().item()
            result[init][str(depth)] = kls
    return result
