"""The chapter's LayerNorm example: the variance convention and what the trainable scale/shift do to the statistics.

x = [1, 3]: mean 2; the biased (population) variance divides by D and is 1, giving [-1, 1]; the unbiased sample
variance divides by D - 1 and is 2, giving [-1/sqrt 2, 1/sqrt 2]. Then a batch of vectors goes through the
normalisation step and through a full layer whose scale/shift look trained (drawn around 1 and 0): only the
normalisation step produces mean 0 / variance 1 per position; the full layer's output does not (the chapter's warning).
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..layers import LayerNorm
from .report import ExperimentReport, check_seed, finish, format_table, new_figure, output_dir

EXAMPLE = (1.0, 3.0)
BATCH_SHAPE = (4, 8, 64)  # [B, T, D] for the statistics part


def normalize(x: torch.Tensor, *, unbiased: bool, eps: float) -> torch.Tensor:
    """(x - mean) / sqrt(var + eps) over the last axis, with the chosen variance convention. [..., D] -> [..., D]."""
    mean = x.mean(dim=-1, keepdim=True)
    var = x.var(dim=-1, keepdim=True, unbiased=unbiased)
    return (x - mean) / torch.sqrt(var + eps)


def _stats(x: torch.Tensor) -> tuple[float, float, float, float]:
    """Per-position mean and biased variance over D, summarised over all positions: (mean of means, max |mean|,
    mean of variances, max |variance - 1|)."""
    mean = x.mean(dim=-1)
    var = x.var(dim=-1, unbiased=False)
    return mean.mean().item(), mean.abs().max().item(), var.mean().item(), (var - 1).abs().max().item()


def run_layernorm(out: str | Path | None = None, seed: int = 123) -> ExperimentReport:
    """The [1, 3] table and the before/after statistics; writes ``layernorm.png`` and the JSON."""
    check_seed(seed)
    directory = output_dir("layernorm", out)
    x = torch.tensor([EXAMPLE], dtype=torch.float64)
    layer = LayerNorm(2).double()
    with torch.no_grad():
        variants = {
            "biased var (divide by D), eps 0": normalize(x, unbiased=False, eps=0.0),
            "unbiased var (divide by D-1), eps 0": normalize(x, unbiased=True, eps=0.0),
            "biased var, eps 1e-5 (tinygpt.LayerNorm)": layer(x),
            "torch.nn.LayerNorm (eps 1e-5)": torch.nn.functional.layer_norm(x, (2,), eps=1e-5),
        }
    example_rows = [[name, *(f"{v:+.6f}" for v in y[0].tolist())] for name, y in variants.items()]
    example_table = format_table(["x = [1, 3]", "out[0]", "out[1]"], example_rows)

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        d = BATCH_SHAPE[-1]
        h = 3.0 + 2.5 * torch.randn(BATCH_SHAPE)  # activations with an offset and a spread, as a residual stream has
        trained = LayerNorm(d)
        with torch.no_grad():
            trained.scale.copy_(1.0 + 0.4 * torch.randn(d))  # "trained-looking": spread around the init values
            trained.shift.copy_(0.2 * torch.randn(d))
    with torch.no_grad():
        normalized = normalize(h, unbiased=False, eps=trained.eps)
        full = trained(h)
    stages = {"input": h, "normalised (before scale/shift)": normalized, "after scale/shift (full layer)": full}
    stat_rows = [[name, *_stats(t)] for name, t in stages.items()]
    stat_table = format_table(
        ["stage (per position over D)", "mean of means", "max |mean|", "mean of vars", "max |var - 1|"], stat_rows)

    biased = variants["biased var (divide by D), eps 0"][0]
    unbiased = variants["unbiased var (divide by D-1), eps 0"][0]
    agrees = torch.equal(biased, torch.tensor([-1.0, 1.0], dtype=torch.float64))
    findings = [
        f"biased variance gives {biased.tolist()} and unbiased gives {[round(v, 4) for v in unbiased.tolist()]}; "
        + ("agrees with the chapter" if agrees else "DISAGREES with the chapter ([-1, 1] expected)"),
        f"with eps = 1e-5 the [1, 3] output is {variants['biased var, eps 1e-5 (tinygpt.LayerNorm)'][0][1].item():.6f}"
        " rather than 1: the normalised variance is only close to 1",
        f"normalisation alone: max |mean| {stat_rows[1][2]:.1e}, max |var - 1| {stat_rows[1][4]:.1e}; after a "
        f"trained-looking scale/shift: max |mean| {stat_rows[2][2]:.2f}, max |var - 1| {stat_rows[2][4]:.2f} -- "
        "the full layer's output is not mean 0 / variance 1, as the chapter warns",
    ]

    fig = new_figure(11, 3.8)
    ax_ex, ax_hist = fig.subplots(1, 2, gridspec_kw={"width_ratios": [1, 1.6]})
    names = list(variants)
    for i, name in enumerate(names):
        ax_ex.scatter(variants[name][0].tolist(), [i, i], s=40)
    ax_ex.set_yticks(range(len(names)), [n.replace(" (", "\n(") for n in names], fontsize=7)
    ax_ex.axvline(0, color="grey", lw=0.6)
    ax_ex.set_title("x = [1, 3] normalised")
    ax_ex.set_xlabel("normalised value")
    ax_ex.set_ylabel("variance convention")
    ax_ex.grid(alpha=0.3)
    for name, t in stages.items():
        ax_hist.hist(t.flatten().numpy(), bins=50, histtype="step", density=True, label=name)
    ax_hist.set_title(f"values over a {list(BATCH_SHAPE)} batch (seed {seed})")
    ax_hist.set_xlabel("value")
    ax_hist.set_ylabel("density")
    ax_hist.legend(fontsize=8)

    data = {
        "seed": seed,
        "example": {"x": list(EXAMPLE), "outputs": {n: y[0].tolist() for n, y in variants.items()}},
        "statistics": {
            "batch_shape": list(BATCH_SHAPE),
            "input": "3 + 2.5 * N(0, 1)",
            "scale": "1 + 0.4 * N(0, 1)", "shift": "0.2 * N(0, 1)",
            "stages": {row[0]: dict(zip(["mean_of_means", "max_abs_mean", "mean_of_vars", "max_abs_var_minus_1"],
                                        row[1:])) for row in stat_rows},
        },
    }
    return finish("layernorm", directory, "LayerNorm: variance convention and statistics",
                  [example_table, stat_table], data, findings, {"layernorm": fig})
