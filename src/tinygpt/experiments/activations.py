"""GELU against ReLU, as the chapter draws them (and SiLU, LLaMA's activation), with their derivatives.

GELU(x) = x * Phi(x) exactly (``erf``); GPT-2 uses the tanh approximation. The curves show shape only -- the seed
warns they say nothing about which trains better. The printed figures are the largest gap between the exact and
the tanh GELU, and the float64 effect of building the constant sqrt(2/pi) as a float32 tensor, as the upstream does.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from ..layers import GELU, gelu_tanh_formula
from .report import ExperimentReport, check_seed, finish, format_table, new_figure, output_dir

X_RANGE = (-4.0, 4.0)
N_POINTS = 801  # step 0.01 over [-4, 4]


def gelu_exact(x: torch.Tensor) -> torch.Tensor:
    """x * Phi(x) = x/2 * (1 + erf(x / sqrt 2))."""
    return F.gelu(x, approximate="none")


def gelu_tanh_float32_constant(x: torch.Tensor) -> torch.Tensor:
    """The tanh formula with sqrt(2/pi) taken from a float32 tensor (the upstream ``torch.tensor(2.0 / torch.pi)``
    under the default dtype): in float64 the constant then carries only float32 precision."""
    c = torch.sqrt(torch.tensor(2.0 / math.pi, dtype=torch.float32)).to(x.dtype)
    return 0.5 * x * (1.0 + torch.tanh(c * (x + 0.044715 * torch.pow(x, 3))))


FUNCTIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "GELU exact (erf)": gelu_exact,
    "GELU tanh (tinygpt.GELU)": GELU(),
    "ReLU": F.relu,
    "SiLU": F.silu,
}


def values_and_derivatives(fn: Callable[[torch.Tensor], torch.Tensor],
                           x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fn(x) and dfn/dx by autograd (the functions are elementwise, so the gradient of the sum is the derivative)."""
    x = x.detach().clone().requires_grad_(True)
    y = fn(x)
    (dy,) = torch.autograd.grad(y.sum(), x)
    return y.detach(), dy


def _upstream_gelu() -> Callable[[torch.Tensor], torch.Tensor] | None:
    """``llms_from_scratch.ch04.GELU`` when that (optional) package is installed."""
    try:
        from llms_from_scratch.ch04 import GELU as UpstreamGELU
    except ImportError:
        return None
    return UpstreamGELU()


def run_activations(out: str | Path | None = None, seed: int = 123) -> ExperimentReport:
    """Curves and derivatives over [-4, 4] (``activations.png``) and the GELU precision figures.

    Nothing here is random; ``seed`` is accepted for a uniform interface and recorded."""
    check_seed(seed)
    directory = output_dir("activations", out)
    x64 = torch.linspace(*X_RANGE, N_POINTS, dtype=torch.float64)
    curves = {name: values_and_derivatives(fn, x64) for name, fn in FUNCTIONS.items()}

    exact, tanh = curves["GELU exact (erf)"][0], curves["GELU tanh (tinygpt.GELU)"][0]
    gap = (exact - tanh).abs()
    gap_at = x64[int(gap.argmax())].item()
    d_gap = (curves["GELU exact (erf)"][1] - curves["GELU tanh (tinygpt.GELU)"][1]).abs().max().item()
    x32 = x64.float()
    gap32 = (gelu_exact(x32) - GELU()(x32)).abs().max().item()
    fused_vs_formula = (GELU()(x64) - gelu_tanh_formula(x64)).abs().max().item()
    f32_constant = (gelu_tanh_float32_constant(x64) - gelu_tanh_formula(x64)).abs().max().item()
    upstream = _upstream_gelu()
    with torch.no_grad():
        upstream_gap = None if upstream is None else (upstream(x64) - gelu_tanh_formula(x64)).abs().max().item()
    minima = {name: (float(y.min()), float(x64[int(y.argmin())])) for name, (y, _) in curves.items()}

    rows = [
        ["max |GELU exact - GELU tanh| over [-4, 4], float64", gap.max().item()],
        ["  ... attained at x =", gap_at],
        ["same, float32", gap32],
        ["max |d/dx exact - d/dx tanh|, float64", d_gap],
        ["max |fused tanh kernel - formula written out|, float64", fused_vs_formula],
        ["max |float32 sqrt(2/pi) constant - float64 constant|, float64", f32_constant],
    ]
    if upstream_gap is not None:
        rows.append(["max |llms_from_scratch ch04 GELU - formula|, float64", upstream_gap])
    table = format_table(["quantity", "value"], rows)
    min_table = format_table(["function", "minimum", "at x"], [[n, v, at] for n, (v, at) in minima.items()])
    findings = [
        f"the tanh approximation stays within {gap.max().item():.2e} of the exact GELU on [-4, 4] "
        f"(largest near x = {gap_at:+.2f})",
        f"a float32 sqrt(2/pi) in a float64 computation moves the output by up to {f32_constant:.2e}: the order of "
        "the chapter's 2.39e-9 upstream logits difference"
        + ("" if upstream_gap is None
           else f"; the installed upstream GELU differs from the formula by {upstream_gap:.2e}"),
        "GELU and SiLU let small negative inputs through (minimum below 0) while ReLU clips them to 0, as the chapter "
        "describes; the curves show shape, not training quality",
    ]

    fig = new_figure(13, 4.2)
    ax_f, ax_d, ax_gap = fig.subplots(1, 3)
    styles = {"GELU exact (erf)": "-", "GELU tanh (tinygpt.GELU)": "--", "ReLU": "-", "SiLU": "-"}
    xs = x64.numpy()
    for name, (y, dy) in curves.items():
        ax_f.plot(xs, y.numpy(), styles[name], label=name)
        ax_d.plot(xs, dy.numpy(), styles[name], label=name)
    ax_f.set_title("activation f(x)")
    ax_f.set_ylabel("f(x)")
    ax_d.set_title("derivative f'(x)")
    ax_d.set_ylabel("f'(x)")
    ax_gap.plot(xs, (exact - tanh).numpy(), color="black")
    ax_gap.set_title("GELU exact - GELU tanh")
    ax_gap.set_ylabel("difference (float64)")
    for ax in (ax_f, ax_d, ax_gap):
        ax.axhline(0, color="grey", lw=0.6)
        ax.axvline(0, color="grey", lw=0.6)
        ax.set_xlabel("x")
        ax.grid(alpha=0.3)
    ax_f.legend(fontsize=8)

    data = {
        "seed": seed,
        "x": {"start": X_RANGE[0], "stop": X_RANGE[1], "points": N_POINTS, "dtype": "float64"},
        "max_abs_gelu_exact_minus_tanh_float64": gap.max().item(),
        "argmax_x": gap_at,
        "max_abs_gelu_exact_minus_tanh_float32": gap32,
        "max_abs_derivative_gap_float64": d_gap,
        "max_abs_fused_minus_formula_float64": fused_vs_formula,
        "max_abs_float32_constant_effect_float64": f32_constant,
        "max_abs_upstream_minus_formula_float64": upstream_gap,
        "minima": {n: {"value": v, "x": at} for n, (v, at) in minima.items()},
        "curves": {n: {"y": y.tolist()[::10], "dy": dy.tolist()[::10]} for n, (y, dy) in curves.items()},
        "curves_note": "every 10th point (step 0.1) of the plotted grid",
    }
    return finish("activations", directory, "Activations: GELU (exact, tanh) vs ReLU vs SiLU",
                  [table, min_table], data, findings, {"activations": fig})
