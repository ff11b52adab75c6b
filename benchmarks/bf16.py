"""bf16 autocast on CPU: forward speed against float32 and the max logits deviation from float32.

The weights stay float32; ``torch.autocast("cpu", dtype=torch.bfloat16)`` runs the matmuls in bf16 (8 mantissa bits,
so deviations of order 1e-2 of the logits' scale are expected, not a bug). Whether it is faster depends on the CPU
having bf16 instructions (AVX512-BF16 / AMX); without them it is usually slower.
"""

from __future__ import annotations

from typing import Any

import torch

from .common import format_table, spread, time_interleaved
from .models import build_tinygpt, forward_flops, gpt2_small, quick_config


def run(quick: bool, *, repeats: int | None = None) -> dict[str, Any]:
    config = quick_config() if quick else gpt2_small()
    batch, tokens = (1, 32) if quick else (1, 256)
    repeats = repeats or (2 if quick else 5)
    model = build_tinygpt(config)
    idx = torch.randint(0, config.vocab_size, (batch, tokens), generator=torch.Generator().manual_seed(4))

    def bf16() -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return model(idx)

    with torch.inference_mode():
        reference = model(idx)
        low = bf16().float()
        deviation = (low - reference).abs().max().item()
        scale = reference.abs().max().item()
        same_argmax = (low.argmax(-1) == reference.argmax(-1)).float().mean().item()
        stats = time_interleaved({"float32": lambda: model(idx), "bf16 autocast": bf16}, warmup=1, repeats=repeats)
    flops = forward_flops(config, batch, tokens)
    rows = [{"mode": name, **s, "time_ms": spread(s), "gflops": flops / s["median_s"] / 1e9,
             "speedup_vs_fp32": stats["float32"]["median_s"] / s["median_s"]} for name, s in stats.items()]
    return {"config": config.to_dict(), "shape": f"{batch}x{tokens}", "rows": rows,
            "max_abs_logit_deviation": deviation, "max_abs_logit_fp32": scale, "argmax_agreement": same_argmax}


def table(result: dict[str, Any]) -> str:
    columns = [("mode", "mode"), ("time_ms", "ms median [min-max]"), ("gflops", "GFLOP/s"),
               ("speedup_vs_fp32", "speedup vs fp32")]
    return (format_table(result["rows"], columns)
            + f"\nshape {result['shape']}: max |logit_bf16 - logit_fp32| = {result['max_abs_logit_deviation']:.3g}"
            f" (max |logit| {result['max_abs_logit_fp32']:.3g}); argmax agreement"
            f" {result['argmax_agreement']:.1%}")
