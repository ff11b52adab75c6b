"""Pre-LN against post-LN: same weights, different order, different outputs, gradients and training.

The transformer-block lesson (the one LLMs-from-scratch's chapter 4 builds on): pre-LN trains without a warmup
where post-LN, the 2017 Transformer's order, needs one. Four parts:

1. Stacks of 6 and 12 ``TransformerBlock``s, pre-LN and post-LN, the post-LN stack loaded with the pre-LN stack's
   weights (dropout 0), one input [2, 16, 384] ~ N(0, 1), H = 6: the outputs differ, and the gradient at every
   block's input after one backward pass. The loss is a fixed random readout, mean(out * R): ``out.sum()`` or
   ``out.pow(2).mean()`` would be (nearly) constant under a post-LN stack's final LayerNorm and give its input a
   zero gradient for a trivial reason.
2. The mechanism at initialisation, under both inits of ``prepost_training``: the gradient norm of each block's
   FFN W2 (Xiong et al. 2020, their Fig. 3) and how far one Adam step moves the output distribution (Liu et al.
   2020), for models of several depths.
3. Training (``prepost_training``): pre-LN and post-LN, each without and with a warmup, at 12 layers on several
   seeds under the original Transformer's init; the 6-layer contrast; one control cell under GPT-2's init.
4. ``sweep=True``: the four variants at every depth x learning rate of a grid, one seed.
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
from ..tokenizer import CharTokenizer
from . import prepost_figures as figs
from .anatomy import resolve_config
from .prepost_training import (INITS, STALL_GAP, VARIANT_NAMES, VARIANTS, final_loss, lesson_verdict, model_pair,
                               graded_verdict_lines, one_step_change, random_windows, run_sweep, spread, stall_line,
                               train_variants, unigram_entropy)
from .report import ExperimentReport, check_seed, finish, format_table, output_dir

STACK_SHAPE = (2, 16, 384)  # [B, T, D] of the block lesson's exercise 4
STACK_HEADS = 6
STACK_DEPTHS = (6, 12)
PROFILE_DEPTHS = (2, 6, 12, 24)
DEFAULT_TRAIN = dict(context_length=64, emb_dim=64, n_heads=4, n_layers=12, drop_rate=0.0)
CONTRAST_DEPTHS = (6,)
SWEEP_DEPTHS = (6, 12)
SWEEP_LRS = (3e-4, 1e-3, 3e-3)
PAIR = ("pre_ln", "post_ln")  # the variants of the contrast and control cells: no warmup


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


# ------------------------------------------------------------------------------------------- the init
def training_config(config: str | GPTConfig | None, vocab_size: int) -> GPTConfig:
    """The given preset/file/config (or the small 12-layer default) with the character vocabulary's size."""
    if config is None:
        return GPTConfig(vocab_size=vocab_size, **DEFAULT_TRAIN)
    return resolve_config(config)[1].replace(vocab_size=vocab_size)


def init_gradient_profile(config: GPTConfig, ids: torch.Tensor, depths: Sequence[int], *, batch_size: int,
                          seq_len: int, seed: int, init: str = "gpt2") -> dict:
    """||dL/dW2|| of every block (W2: the FFN's second linear, Xiong et al.'s Fig. 3) at initialisation, for
    pre-LN and post-LN models of each depth built from the same init; L = cross-entropy on one batch of ``ids``."""
    x, y = random_windows(ids, batch_size, seq_len, torch.Generator().manual_seed(seed))
    profile = {}
    for depth in depths:
        norms = {}
        for label, model in zip(PAIR, model_pair(config.replace(n_layers=depth), seed, init)):
            model.eval()  # no dropout: the gradient of the init itself
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
            loss.backward()
            norms[label] = [block.ff.layers[2].weight.grad.norm().item() for block in model.trf_blocks]
        profile[str(depth)] = norms
    return profile


# ------------------------------------------------------------------------------------------- training cells
def train_cell(config: GPTConfig, ids: torch.Tensor, *, init: str, seeds: Sequence[int],
               variants: Sequence[str], **train: object) -> dict:
    """The ``variants`` on every seed: final losses per variant (one per seed), their spread and every run."""
    runs = {str(s): train_variants(config, ids, seed=s, init=init, variants=variants, **train) for s in seeds}
    final = {v: [final_loss(runs[str(s)][v]) for s in seeds] for v in variants}
    step0 = sum(runs[str(s)][variants[0]]["loss"][0] for s in seeds) / len(seeds)
    cell = {"init": init, "depth": config.n_layers, "seeds": list(seeds), "variants": list(variants),
            "step0_loss": step0, "final_loss": final, "spread": {v: spread(f) for v, f in final.items()}}
    if set(variants) == set(VARIANTS):
        cell["verdict"] = lesson_verdict(final, step0)
    else:
        gap = cell["spread"]["post_ln"]["mean"] - cell["spread"]["pre_ln"]["mean"]
        cell["post_ln_fails"] = not math.isfinite(gap) or gap > STALL_GAP
        cell["gap_post_minus_pre"] = gap
        cell["stall_per_seed"] = [p - q for p, q in zip(final["post_ln"], final["pre_ln"])]
    cell["runs"] = runs
    return cell


def _cell_label(cell: dict) -> str:
    return f"L={cell['depth']} {cell['init']} init, {len(cell['seeds'])} seed{'s' if len(cell['seeds']) > 1 else ''}"


def _spread_text(s: dict | None) -> str:
    if s is None:
        return ""
    if s["min"] == s["max"]:
        return f"{s['mean']:.3f}"
    return f"{s['mean']:.3f} ({s['min']:.3f}-{s['max']:.3f})"


def _check_arguments(seed: int, seeds: int, init: str, control_init: str | None, ints: dict, depths: Sequence[int],
                     lr: float, sweep: bool, sweep_lrs: Sequence[float], sweep_steps: int | None) -> None:
    check_seed(seed)
    checks.positive_int("seeds", seeds)
    checks.choice("init", init, INITS)
    if control_init is not None:
        checks.choice("control_init", control_init, INITS)
    for name, value in ints.items():
        checks.positive_int(name, value)
    checks.positive_number("lr", lr)
    for depth in depths:
        checks.positive_int("depth", depth)
    if sweep:
        for value in sweep_lrs:
            checks.positive_number("sweep lr", value)
        checks.positive_int("sweep_steps", sweep_steps, note="(it defaults to steps)")


def run_prepost(out: str | Path | None = None, seed: int = 123, *, config: str | GPTConfig | None = None,
                data: str | Path | None = None, max_chars: int = 400_000, init: str = "xavier", seeds: int = 3,
                steps: int = 300, batch_size: int = 16, seq_len: int = 32, lr: float = 1e-3, warmup: int = 100,
                contrast_depths: Sequence[int] = CONTRAST_DEPTHS, control_init: str | None = "gpt2",
                depths: Sequence[int] = STACK_DEPTHS, stack_shape: Sequence[int] = STACK_SHAPE,
                stack_heads: int = STACK_HEADS, profile_depths: Sequence[int] = PROFILE_DEPTHS, sweep: bool = False,
                sweep_depths: Sequence[int] = SWEEP_DEPTHS, sweep_lrs: Sequence[float] = SWEEP_LRS,
                sweep_steps: int | None = None, stall_only: bool = False,
                progress: Callable[[str], None] | None = None) -> ExperimentReport:
    """All parts; writes ``prepost_gradients.png``, ``prepost_profile.png``, ``prepost_mechanism.png``,
    ``prepost_training.png`` (and ``prepost_sweep.png`` with ``sweep``) and the JSON.

    ``config``: preset name, .json file or GPTConfig for the trained models (vocab_size is replaced by the number of
    distinct characters; default: C=64, D=64, H=4, L=12). ``data``: a UTF-8 text file (default: the embedded
    corpus), cut to ``max_chars``. ``seq_len`` is capped at the config's context_length. ``init``: ``xavier`` (the
    original Transformer's) or ``gpt2``. The main cell trains the four variants (pre-/post-LN x no warmup / a
    linear warmup of ``warmup`` steps) at the config's depth on ``seeds`` seeds (``seed``, ``seed + 1``, ...); each
    of ``contrast_depths`` and the ``control_init`` cell (None: none) train pre-LN and post-LN on ``seed`` alone.
    ``steps=0`` skips training. ``sweep``: also every ``sweep_depths`` x ``sweep_lrs`` cell for ``sweep_steps``
    steps (default: ``steps``), one seed. ``stall_only``: the stall alone, nothing else: pre-LN and post-LN without
    warmup at the main cell on ``seeds`` seeds, then one graded line (about 40 s of CPU per seed, one thread)."""
    if stall_only:
        profile_depths, contrast_depths, control_init, sweep = (), (), None, False
    sweep_steps = steps if sweep_steps is None else sweep_steps
    _check_arguments(seed, seeds, init, control_init,
                     {"batch_size": batch_size, "seq_len": seq_len, "max_chars": max_chars},
                     (*depths, *profile_depths, *contrast_depths, *(sweep_depths if sweep else ())),
                     lr, sweep, sweep_lrs, sweep_steps)
    checks.non_negative_int("steps", steps)
    checks.non_negative_int("warmup", warmup)
    directory = output_dir("prepost", out)

    data_out: dict = {"seed": seed}
    findings: list[str] = []
    figures: dict = {}
    tables: list[str] = []
    # Part 1: block stacks with identical weights (exercises 4 and 5)
    if not stall_only:
        stacks = compare_stacks(depths, stack_shape, stack_heads, seed)
        rows = []
        for depth, r in stacks.items():
            g_pre, g_post = r["input_grad_norm_per_block"]["pre_ln"], r["input_grad_norm_per_block"]["post_ln"]
            for i, (a, b) in enumerate(zip(g_pre, g_post)):
                rows.append([f"L={depth} block {i} input", a, b, f"{a / b:.2f}"])
        grad_table = format_table(["stack / position", "||grad|| pre-LN", "||grad|| post-LN", "pre/post"], rows)
        diff_table = format_table(
            ["stack", "outputs allclose", "max |pre - post|", "out std pre-LN", "out std post-LN",
             "input grad pre/post"],
            [[f"L={d}", r["outputs_allclose"], r["outputs_max_abs_diff"], r["output_std"]["pre_ln"],
              r["output_std"]["post_ln"], f"{r['input_grad_ratio_pre_over_post']:.2f}"] for d, r in stacks.items()])
        ratios = {d: r["input_grad_ratio_pre_over_post"] for d, r in stacks.items()}
        order_of_magnitude = all(v >= 10 for v in ratios.values())
        findings = [
            "pre-LN and post-LN stacks with identical weights give different outputs: "
            + ", ".join(f"L={d}: allclose={r['outputs_allclose']}" for d, r in stacks.items()),
            "the block lesson's exercise 5 expects pre-LN's input (embedding) gradient to be an order of magnitude "
            "larger than post-LN's: " + ("HELD here" if order_of_magnitude else "did NOT hold here")
            + " (pre/post ratio " + ", ".join(f"L={d}: {v:.2f}x" for d, v in ratios.items())
            + f"; input N(0,1) of shape {list(stack_shape)}, torch's default init, loss mean(out * R))",
        ]
        figures = {"prepost_gradients": figs.gradient_figure(stacks)}
        data_out["stacks"] = {"shape": list(stack_shape), "n_heads": stack_heads,
                              "init": "torch default (nn.Linear), LayerNorm scale 1 / shift 0",
                              "loss": "mean(out * R), R ~ N(0, 1) fixed", "results": stacks}
        tables = [diff_table, grad_table]

    text = embedded_corpus_text(max_chars=max_chars) if data is None else _read_text(data, max_chars)
    tokenizer = CharTokenizer(text)
    ids = torch.tensor(tokenizer.encode(text), dtype=torch.long)  # [N]
    cfg = training_config(config, tokenizer.vocab_size)
    seq = min(seq_len, cfg.context_length)
    if len(ids) < seq + 2:
        raise ValueError(f"the training text has {len(ids)} characters; at least seq_len + 2 = {seq + 2} needed")
    plateau = unigram_entropy(ids)
    data_out["unigram_entropy"] = plateau

    # Part 2: the mechanism at init, under both inits (Xiong et al. 2020; Liu et al. 2020)
    if profile_depths:
        profile = {i: init_gradient_profile(cfg, ids, profile_depths, batch_size=batch_size, seq_len=seq, seed=seed,
                                            init=i) for i in INITS}
        moves = one_step_change(cfg, ids, profile_depths, batch_size=batch_size, seq_len=seq, lr=lr, seed=seed)
        tables.append(format_table(
            ["model", "||dL/dW2|| first block", "last block", "last/first", "KL after one Adam step"],
            [[f"L={d} {i} {VARIANT_NAMES[v]}", p[v][0], p[v][-1], f"{p[v][-1] / p[v][0]:.2f}", moves[i][d][v]]
             for i in INITS for d, p in profile[i].items() for v in PAIR]))
        findings.append(
            "gradient of each block's FFN W2 at init, last block / first block: " + "; ".join(
                f"{i} init L={d} pre-LN {p['pre_ln'][-1] / p['pre_ln'][0]:.2f}x, post-LN "
                f"{p['post_ln'][-1] / p['post_ln'][0]:.2f}x" for i in INITS for d, p in profile[i].items())
            + " (Xiong et al. 2020: post-LN's grow toward the output)")
        findings.append(
            f"one AdamW step at lr {lr:g} moves the output distribution (mean KL, nats), post-LN / pre-LN: " + "; ".join(
                f"{i} init L={d} {m['post_ln'] / m['pre_ln']:.2f}x" for i in INITS for d, m in moves[i].items())
            + " (Liu et al. 2020: post-LN amplifies its updates)")
        figures["prepost_profile"] = figs.profile_figure(profile)
        figures["prepost_mechanism"] = figs.mechanism_figure(profile, moves, lr)
        data_out["init_profile"] = {"config": cfg.to_dict(), "parameter": "trf_blocks[i].ff.layers[2].weight",
                                    "loss": "cross-entropy on one batch", "batch_size": batch_size,
                                    "seq_len": seq, "grad_norm_per_block": profile}
        data_out["one_step_change"] = {"lr": lr, "measure": "mean over positions of KL(p_before || p_after) after "
                                                            "one AdamW step on the same batch", "kl": moves}

    # Part 4 (optional, first: it is the long one): the sweep
    train = dict(steps=steps, batch_size=batch_size, seq_len=seq, lr=lr, warmup=warmup, progress=progress)
    if sweep:
        cells = run_sweep(cfg, ids, depths=sweep_depths, lrs=sweep_lrs, steps=sweep_steps, batch_size=batch_size,
                          seq_len=seq, warmup=warmup, seed=seed, init=init, progress=progress)
        tables.append(format_table(
            ["depth", "lr", *(VARIANT_NAMES[v] for v in VARIANTS), "stall: post - pre", "warmup removes",
             "parity: post+w - pre+w"],
            [[f"L={c['depth']}", f"{c['lr']:g}", *(c["final_loss"][v] for v in VARIANTS),
              f"{c['gap_post_minus_pre']:+.3f}", f"{c['warmup_removes']:.0%}", f"{c['gap_warmup_post_minus_pre']:+.3f}"]
             for c in cells]))
        stalls = [f"L={c['depth']} lr {c['lr']:g} ({c['gap_post_minus_pre']:+.3f} nats, the warmup removes "
                  f"{c['warmup_removes']:.0%})" for c in cells if c["post_ln_fails"]]
        findings.append(f"sweep ({init} init, {sweep_steps} steps per run, mean loss of the last 10%, warmup {warmup} "
                        f"steps): post-LN without warmup stalls (more than {STALL_GAP} nats above pre-LN) at "
                        + (", ".join(stalls) if stalls else "no cell"))
        figures["prepost_sweep"] = figs.sweep_figure(cells, plateau)
        data_out["sweep"] = {"init": init, "steps": sweep_steps, "depths": list(sweep_depths),
                             "lrs": list(sweep_lrs), "cells": cells}

    # Part 3: the lesson trained
    if steps > 0:
        main = train_cell(cfg, ids, init=init, seeds=range(seed, seed + seeds),
                          variants=PAIR if stall_only else VARIANTS, **train)
        cells = [main]
        cells += [train_cell(cfg.replace(n_layers=d), ids, init=init, seeds=[seed], variants=PAIR, **train)
                  for d in contrast_depths]
        if control_init is not None and control_init != init:
            cells.append(train_cell(cfg, ids, init=control_init, seeds=[seed], variants=PAIR, **train))
        tables.append(format_table(
            ["cell", *(VARIANT_NAMES[v] for v in VARIANTS), "post-LN fails"],
            [[_cell_label(c), *(_spread_text(c["spread"].get(v)) for v in VARIANTS),
              c["verdict"]["post_ln_fails"] if "verdict" in c else c["post_ln_fails"]] for c in cells]))
        if stall_only:
            verdict = None
            findings.append(f"{_cell_label(main)}, {steps} steps, mean loss of the last 10%: "
                            + stall_line(main["stall_per_seed"]))
        else:
            verdict = main["verdict"]
            findings.append(
                f"the lesson at {_cell_label(main)} (a {warmup}-step warmup; mean loss of the last 10% of {steps} "
                f"steps; margin {STALL_GAP} nats), graded claim by claim:")
            findings.extend("  " + line for line in graded_verdict_lines(verdict))
        for c in cells[1:]:
            findings.append(f"{_cell_label(c)}: post-LN {c['gap_post_minus_pre']:+.3f} nats against pre-LN, "
                            + ("fails" if c["post_ln_fails"] else "no failure"))
        findings.append(f"unigram entropy of the text (the loss of predicting character frequencies alone): "
                        f"{plateau:.3f} nats")
        figures["prepost_training"] = figs.training_figure(cells, plateau, lr, warmup)
        data_out["training"] = {
            "config": cfg.to_dict(), "data": "embedded corpus" if data is None else str(data),
            "characters": len(ids), "init": init, "seeds": seeds, "steps": steps, "batch_size": batch_size,
            "seq_len": seq, "lr": lr, "warmup": warmup,
            "optimizer": "torch.optim.AdamW(lr), betas (0.9, 0.999), weight_decay 0.01, no clipping; *_warmup: "
                         "linear warmup over `warmup` steps",
            "verdict": verdict, "cells": cells,
        }
    return finish("prepost", directory, "pre-LN vs post-LN", tables, data_out, findings, figures)


def _read_text(path: str | Path, max_chars: int) -> str:
    try:
        text = Path(path).read_text(encoding="utf-8", errors="replace")
    except OSError as err:
        raise ValueError(f"cannot read --data {path}: {err.strerror}") from None
    return text[:max_chars]
