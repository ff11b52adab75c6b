"""The chapter's shortcut experiment: shortcuts give the gradient a direct path, dy/dx = I + df/dx.

The upstream ch04 example network: five layers of widths 3->3->3->3->3->1, each ``Linear`` followed by GELU, with
a shortcut ``x + layer(x)`` only where the input and output shapes match (not in the last layer, 3 -> 1). One input
[[1., 0., -1.]], target [[0.]], MSE loss, one backward pass; the measure is the mean absolute gradient of each
layer's weight. Both networks are built right after the same ``torch.manual_seed``, so their weights are identical
and the shortcut is the only difference (the chapter's condition for reading the comparison).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from ..layers import GELU
from .report import ExperimentReport, check_seed, finish, format_table, new_figure, output_dir

LAYER_SIZES = (3, 3, 3, 3, 3, 1)
SAMPLE_INPUT = ((1.0, 0.0, -1.0),)
TARGET = ((0.0,),)


class ExampleDeepNeuralNetwork(nn.Module):
    """Five ``Linear -> GELU`` layers; with ``use_shortcut`` each layer whose output shape equals its input's
    adds its input back. [B, 3] -> [B, 1]."""

    def __init__(self, layer_sizes: tuple[int, ...] = LAYER_SIZES, use_shortcut: bool = False) -> None:
        super().__init__()
        self.use_shortcut = use_shortcut
        self.layers = nn.ModuleList(
            nn.Sequential(nn.Linear(n_in, n_out), GELU()) for n_in, n_out in zip(layer_sizes[:-1], layer_sizes[1:])
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            y = layer(x)
            x = x + y if self.use_shortcut and y.shape == x.shape else y
        return x


def weight_gradients(model: ExampleDeepNeuralNetwork) -> list[float]:
    """Mean |dL/dW| of each layer's weight after one MSE backward pass on the example input (grads zeroed first)."""
    model.zero_grad(set_to_none=True)
    loss = nn.functional.mse_loss(model(torch.tensor(SAMPLE_INPUT)), torch.tensor(TARGET))
    loss.backward()
    return [layer[0].weight.grad.abs().mean().item() for layer in model.layers]


def build_pair(seed: int) -> tuple[ExampleDeepNeuralNetwork, ExampleDeepNeuralNetwork]:
    """The networks without and with shortcuts, each built right after ``torch.manual_seed(seed)`` (the caller's
    global RNG state is restored afterwards)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        plain = ExampleDeepNeuralNetwork(use_shortcut=False)
        torch.manual_seed(seed)
        shortcut = ExampleDeepNeuralNetwork(use_shortcut=True)
    return plain, shortcut


def run_residual(out: str | Path | None = None, seed: int = 123) -> ExperimentReport:
    """Gradients per layer with and without shortcuts; writes ``residual.png`` (log-scale bars) and the JSON."""
    check_seed(seed)
    directory = output_dir("residual", out)
    plain, shortcut = build_pair(seed)
    same_init = all(torch.equal(a, b) for a, b in zip(plain.state_dict().values(), shortcut.state_dict().values()))
    grads_plain = weight_gradients(plain)
    grads_shortcut = weight_gradients(shortcut)
    # Gradients are zeroed inside weight_gradients: a second pass must reproduce the first exactly.
    repeatable = weight_gradients(shortcut) == grads_shortcut and weight_gradients(plain) == grads_plain

    n = len(grads_plain)
    rows = []
    for i, (g0, g1) in enumerate(zip(grads_plain, grads_shortcut)):
        w = plain.layers[i][0].weight
        has_shortcut = LAYER_SIZES[i] == LAYER_SIZES[i + 1]
        rows.append([f"layers.{i}.0.weight", f"{w.shape[1]}->{w.shape[0]}", "yes" if has_shortcut else "no",
                     g0, g1, f"{g1 / g0:,.0f}x"])
    table = format_table(["weight", "width", "shortcut", "mean|grad| plain", "mean|grad| shortcut", "ratio"], rows)

    first_ratio = grads_shortcut[0] / grads_plain[0]
    spread_plain = grads_plain[-1] / grads_plain[0]
    spread_shortcut = grads_shortcut[-1] / grads_shortcut[0]
    findings = [
        f"identical initial weights in both networks: {same_init}; gradients zeroed between passes "
        f"(a repeated pass gives identical values: {repeatable})",
        f"first layer: {grads_shortcut[0]:.3e} with shortcuts vs {grads_plain[0]:.3e} without "
        f"({first_ratio:,.0f}x larger)",
        f"last/first layer gradient ratio: {spread_plain:,.1f} without shortcuts (the gradient shrinks towards the "
        f"input), {spread_shortcut:,.1f} with shortcuts",
        "agrees with the chapter: the identity term keeps the early layers' gradients from vanishing"
        if first_ratio > 1 else
        "DISAGREES with the chapter: the shortcut did not enlarge the first layer's gradient for this seed",
    ]

    fig = new_figure(7.5, 4.2)
    ax = fig.add_subplot()
    xs = range(n)
    ax.bar([x - 0.2 for x in xs], grads_plain, width=0.4, label="without shortcuts", color="#c44e52")
    ax.bar([x + 0.2 for x in xs], grads_shortcut, width=0.4, label="with shortcuts", color="#4c72b0")
    ax.set_yscale("log")
    ax.set_xticks(list(xs), [f"layer {i}\n{LAYER_SIZES[i]}->{LAYER_SIZES[i + 1]}" for i in xs])
    ax.set_xlabel("layer (input -> output width)")
    ax.set_ylabel("mean |dL/dW| (log scale)")
    ax.set_title(f"Residual shortcuts: weight gradients of the 5-layer example (seed {seed})")
    ax.legend()
    ax.grid(axis="y", which="both", alpha=0.3)

    data = {
        "seed": seed,
        "setup": {"layer_sizes": list(LAYER_SIZES), "activation": "tinygpt.GELU (tanh approximation)",
                  "input": SAMPLE_INPUT, "target": TARGET, "loss": "MSE", "dtype": "float32"},
        "same_init": same_init,
        "repeatable": repeatable,
        "mean_abs_weight_grad": {"without_shortcut": grads_plain, "with_shortcut": grads_shortcut},
    }
    return finish("residual", directory, "Residual shortcuts: mean |weight gradient| per layer", [table], data,
                  findings, {"residual": fig})
