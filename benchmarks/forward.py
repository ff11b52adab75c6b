"""Forward with full logits, float32, CPU, inference mode: tinygpt vs HF GPT-2 (sdpa) vs llms_from_scratch ch04.

Same weights in all three (copied from the tinygpt model); the logits' max difference is recorded so a fast but
wrong forward cannot hide. Each figure is also put against the matmul ceiling measured in the same run.
"""

from __future__ import annotations

from typing import Any

import torch

from .common import format_table, spread, square_products, time_interleaved
from .models import (available, build_hf, build_tinygpt, build_upstream, forward_flops, gpt2_small, logits_of,
                     quick_config)

FULL_SHAPES = [(1, 128), (1, 1024), (8, 256)]
QUICK_SHAPES = [(1, 8), (1, 64), (4, 16)]
_CEILING = "matmul ceiling"


def run(
    quick: bool, ceiling_gflops: float, *, repeats: int | None = None, ceiling_size: int | None = None
) -> dict[str, Any]:
    """Time every implementation at every shape; with ``ceiling_size`` the matmul ceiling is also timed inside
    each shape's rounds (A B C M A B C M ...), so that on a loaded machine the fraction compares like moments."""
    config = quick_config() if quick else gpt2_small()
    shapes = QUICK_SHAPES if quick else FULL_SHAPES
    repeats = repeats or (2 if quick else 7)
    ours = build_tinygpt(config)
    models = {"tinygpt": ours}
    skipped = []
    for name, builder in (("hf", build_hf), ("upstream", build_upstream)):
        if available(name):
            models[name] = builder(config, ours)
        else:
            skipped.append(name)
    calls = {name: logits_of(model) for name, model in models.items()}
    squares = square_products(ceiling_size) if ceiling_size else {}

    rows = []
    for batch, tokens in shapes:
        idx = torch.randint(0, config.vocab_size, (batch, tokens), generator=torch.Generator().manual_seed(1))
        with torch.inference_mode():
            reference_logits = calls["tinygpt"](idx)
            diffs = {name: (call(idx) - reference_logits).abs().max().item() for name, call in calls.items()}
            del reference_logits
            fns = {name: (lambda c=call: c(idx)) for name, call in calls.items()}
            fns.update({f"{_CEILING} {kernel}": product for kernel, product in squares.items()})
            stats = time_interleaved(fns, warmup=1, repeats=repeats)
        flops = forward_flops(config, batch, tokens)
        by_kernel = {kernel: 2.0 * ceiling_size**3 / stats.pop(f"{_CEILING} {kernel}")["median_s"] / 1e9
                     for kernel in squares}
        ceiling_here = max(by_kernel.values()) if by_kernel else ceiling_gflops  # the faster kernel, as matmul_ceiling
        for name, s in stats.items():
            gflops = flops / s["median_s"] / 1e9
            rows.append({
                "shape": f"{batch}x{tokens}", "impl": name, **s, "time_ms": spread(s),
                "tokens_per_s": batch * tokens / s["median_s"], "gflops": gflops,
                "ceiling_gflops": ceiling_here, "ceiling_fraction": gflops / ceiling_here,
                "ceiling_gflops_by_kernel": by_kernel,
                "max_abs_logit_diff": diffs[name],
                "flops": flops,
            })
    for row in rows:
        ours_row = next(r for r in rows if r["shape"] == row["shape"] and r["impl"] == "tinygpt")
        row["tinygpt_speedup"] = row["median_s"] / ours_row["median_s"]  # > 1: tinygpt is faster than this row
    return {"config": config.to_dict(), "repeats": repeats, "rows": rows, "not_available": skipped}


def table(result: dict[str, Any]) -> str:
    columns = [("shape", "B x T"), ("impl", "impl"), ("time_ms", "ms median [min-max]"),
               ("tokens_per_s", "tokens/s"), ("gflops", "GFLOP/s"), ("ceiling_gflops", "ceiling GFLOP/s"),
               ("ceiling_fraction", "of ceiling"),
               ("tinygpt_speedup", "tinygpt speedup"), ("max_abs_logit_diff", "max |dlogit|")]
    text = format_table(result["rows"], columns)
    for name in result["not_available"]:
        text += f"\n{name}: not available (package not installed)"
    return text
