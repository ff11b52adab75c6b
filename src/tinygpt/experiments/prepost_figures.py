"""The figures of ``experiment prepost``: each takes the part's raw results and returns a ``Figure``."""

from __future__ import annotations

import math

from matplotlib.figure import Figure

from ..figures import integer_ticks
from .prepost_training import INITS, VARIANT_NAMES, VARIANTS
from .report import new_figure

STYLE = {"pre_ln": ("tab:blue", "-"), "pre_ln_warmup": ("tab:blue", "--"), "post_ln": ("tab:red", "-"),
         "post_ln_warmup": ("tab:red", "--")}
INIT_MARKERS = {"gpt2": "s", "xavier": "o"}


def _label(ax, xlabel: str, ylabel: str, title: str, legend_size: float | None = 8) -> None:
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=legend_size)


def gradient_figure(stacks: dict) -> Figure:
    # The ratio on a linear axis with the claimed 10x drawn in: a 1.4x gap must look like 1.4x, not like a decade.
    fig = new_figure(6 * len(stacks), 4.0)
    axes = fig.subplots(1, len(stacks), squeeze=False)[0]
    for ax, (depth, r) in zip(axes, stacks.items()):
        g = r["input_grad_norm_per_block"]
        ratio = [a / b for a, b in zip(g["pre_ln"], g["post_ln"])]
        blocks = range(1, len(ratio) + 1)  # numbered as the profile figures number them: 1 = next to the embeddings
        ax.plot(blocks, ratio, "o-", label="measured pre-LN / post-LN")
        ax.axhline(10, color="tab:red", ls="--", label="10x (exercise 5's expectation)")
        ax.axhline(1, color="gray", ls=":", label="1x (equal)")
        ax.set_ylim(0, max(11, max(ratio) * 1.1))
        ax.set_xticks(blocks)
        _label(ax, "block (1 = next to the embeddings)", "||dL/d input|| pre-LN / post-LN",
               f"{depth} blocks, same weights: gradient ratio at each block's input")
    return fig


def _profile_lines(ax, profile: dict, depth: str) -> None:
    for init in INITS:
        for variant in ("pre_ln", "post_ln"):
            norms = profile[init][depth][variant]
            ax.plot(range(1, len(norms) + 1), norms, INIT_MARKERS[init], ls=STYLE[variant][1], ms=3,
                    color=STYLE[variant][0], alpha=1.0 if init == "xavier" else 0.55,
                    label=f"{VARIANT_NAMES[variant]}, {init} init")
    ax.set_yscale("log")
    integer_ticks(ax.xaxis)


def profile_figure(profile: dict) -> Figure:
    # A log axis: the inits differ by orders of magnitude, and a growth toward the output is a slope at any scale.
    depths = list(next(iter(profile.values())))
    fig = new_figure(4.5 * len(depths), 4.0)
    axes = fig.subplots(1, len(depths), squeeze=False)[0]
    for ax, depth in zip(axes, depths):
        _profile_lines(ax, profile, depth)
        _label(ax, "block (1 = next to the embeddings)", "||dL/dW2|| at init (log scale)", f"{depth} layers",
               legend_size=7)
    return fig


def mechanism_figure(profile: dict, moves: dict, lr: float) -> Figure:
    depths = list(next(iter(profile.values())))
    deepest = depths[-1] if "12" not in depths else "12"
    fig = new_figure(12, 4.2)
    ax_grad, ax_move = fig.subplots(1, 2)
    _profile_lines(ax_grad, profile, deepest)
    _label(ax_grad, "block (1 = next to the embeddings)", "||dL/dW2|| at init (log scale)",
           f"gradient per block at init, {deepest} layers", legend_size=7)
    xs = [int(d) for d in depths]
    for init in INITS:
        for variant in ("pre_ln", "post_ln"):
            ax_move.plot(xs, [moves[init][d][variant] for d in depths], INIT_MARKERS[init], ls=STYLE[variant][1],
                         color=STYLE[variant][0], alpha=1.0 if init == "xavier" else 0.55,
                         label=f"{VARIANT_NAMES[variant]}, {init} init")
    ax_move.set_yscale("log")
    ax_move.set_xticks(xs)
    _label(ax_move, "layers", "KL(before || after), nats (log scale)",
           f"one AdamW step (lr {lr:g}): how far the output moves", legend_size=7)
    return fig


def _finite(values: list[float]) -> list[float]:
    return [v if math.isfinite(v) else math.nan for v in values]


def training_figure(cells: list[dict], plateau: float, lr: float, warmup: int) -> Figure:
    main = cells[0]
    fig = new_figure(15, 4.2)
    ax_loss, ax_final, ax_grad = fig.subplots(1, 3)
    seeds = [str(s) for s in main["seeds"]]
    for variant in main["variants"]:
        curves = [main["runs"][s][variant]["loss"] for s in seeds]
        grads = [main["runs"][s][variant]["embedding_grad_norm"] for s in seeds]
        n = min(len(c) for c in curves)
        mean = [sum(c[i] for c in curves) / len(curves) for i in range(n)]
        color, ls = STYLE[variant]
        ax_loss.plot(mean, color=color, ls=ls, lw=1, label=VARIANT_NAMES[variant])
        if len(curves) > 1:
            ax_loss.fill_between(range(n), [min(c[i] for c in curves) for i in range(n)],
                                 [max(c[i] for c in curves) for i in range(n)], color=color, alpha=0.12, lw=0)
        m = min(len(g) for g in grads)
        ax_grad.plot([sum(g[i] for g in grads) / len(grads) for i in range(m)], color=color, ls=ls, lw=1,
                     label=VARIANT_NAMES[variant])
    for ax in (ax_loss, ax_final):
        ax.axhline(plateau, color="gray", ls=":", lw=1, label=f"unigram entropy {plateau:.2f}")
    ax_loss.set_ylim(min(1.5, plateau - 1.5), main["step0_loss"] + 0.3)
    _label(ax_loss, "step", "cross-entropy (nats / char)",
           f"L={main['depth']} {main['init']}, lr {lr:g}, warmup {warmup} (band: {len(seeds)} seeds' min-max)",
           legend_size=7)
    labels = [f"L={c['depth']}\n{c['init']}" for c in cells]
    for x, cell in enumerate(cells):
        for k, variant in enumerate(VARIANTS):
            if variant not in cell["final_loss"]:
                continue
            color, ls = STYLE[variant]
            ys = _finite(cell["final_loss"][variant])
            ax_final.plot([x + (k - 1.5) * 0.15] * len(ys), ys, "o" if ls == "-" else "^", color=color, ms=4,
                          label=VARIANT_NAMES[variant] if x == 0 else None)
    ax_final.set_xticks(range(len(cells)), labels)
    ax_final.set_xlim(-0.6, len(cells) - 0.4)
    _label(ax_final, "cell (depth, init)", "mean loss of the last 10% of steps", "final loss per seed",
           legend_size=7)
    ax_grad.set_yscale("log")
    _label(ax_grad, "step", "||dL/d tok_emb|| (log scale)", "token-embedding gradient norm (mean over seeds)",
           legend_size=7)
    return fig


def sweep_figure(cells: list[dict], plateau: float) -> Figure:
    depths = sorted({c["depth"] for c in cells})
    fig = new_figure(5 * len(depths), 4.0)
    axes = fig.subplots(1, len(depths), squeeze=False)[0]
    top = max(c["step0_loss"] for c in cells)
    for ax, depth in zip(axes, depths):
        row = [c for c in cells if c["depth"] == depth]
        lrs = [c["lr"] for c in row]
        for variant in VARIANTS:
            ys = [c["final_loss"][variant] for c in row]
            color, ls = STYLE[variant]
            ax.plot(lrs, _finite(ys), "o", ls=ls, color=color, label=VARIANT_NAMES[variant])
            for x, y in zip(lrs, ys):
                if not math.isfinite(y):
                    ax.plot([x], [top], "x", color="black", ms=9)
        ax.axhline(top, color="gray", ls=":", lw=1, label="loss at step 0 (x: diverged)")
        ax.axhline(plateau, color="black", ls="-.", lw=1, label=f"unigram entropy {plateau:.2f}")
        ax.set_xscale("log")
        ax.set_xticks(lrs, [f"{x:g}" for x in lrs])
        ax.minorticks_off()
        # Not from 0: the runs differ by tenths of a nat, which an axis from 0 would flatten into one line.
        finite = [c["final_loss"][v] for c in row for v in VARIANTS if math.isfinite(c["final_loss"][v])]
        ax.set_ylim(min(finite + [plateau]) - 0.15, top + 0.15)
        _label(ax, "learning rate (log scale)", "mean loss, last 10% of steps (nats / char)", f"{depth} layers")
    return fig
