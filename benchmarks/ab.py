"""A/B measurements behind the performance edits of model.py / layers.py: the old path vs the current one.

    python -m benchmarks.ab layernorm [--shapes 1x128,1x1024] [--repeats 7]
    python -m benchmarks.ab head [--shapes 1x128,1x1024,8x256]

Each experiment swaps one piece of tinygpt back to what it was before the edit (A) and times the gpt2-small
forward, full logits, float32, inference mode, against the current code (B), interleaved A B A B after a warm-up,
with the logits compared so that the edit is also shown to preserve the result.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.nn.functional as F

from tinygpt.layers import LayerNorm, layer_norm_formula

from .common import format_table, pin_threads, spread, time_interleaved
from .models import build_tinygpt, gpt2_small


@contextlib.contextmanager
def _layernorm_formula() -> Iterator[None]:
    """A: LayerNorm as the seven-op formula (the code before the edit)."""
    fused = LayerNorm.forward
    LayerNorm.forward = lambda self, x: layer_norm_formula(x, self.scale, self.shift, self.eps)
    try:
        yield
    finally:
        LayerNorm.forward = fused


def _plain_head(model: torch.nn.Module) -> Callable[[], contextlib.AbstractContextManager]:
    """A: the head as a plain ``F.linear`` into a [.., V] buffer (the code before the edit)."""

    @contextlib.contextmanager
    def swap() -> Iterator[None]:
        model.head_logits = lambda h: F.linear(h, model.out_head.weight)
        try:
            yield
        finally:
            del model.head_logits

    return swap


def run(experiment: str, shapes: list[tuple[int, int]], repeats: int) -> dict[str, Any]:
    config = gpt2_small()
    model = build_tinygpt(config)
    old = _layernorm_formula if experiment == "layernorm" else _plain_head(model)
    rows = []
    for batch, tokens in shapes:
        idx = torch.randint(0, config.vocab_size, (batch, tokens), generator=torch.Generator().manual_seed(5))

        def a() -> torch.Tensor:
            with old():
                return model(idx)

        with torch.inference_mode():
            diff = (a() - model(idx)).abs().max().item()
            stats = time_interleaved({"A (before)": a, "B (now)": lambda: model(idx)}, warmup=1, repeats=repeats)
        for name, s in stats.items():
            rows.append({"shape": f"{batch}x{tokens}", "variant": name, **s, "time_ms": spread(s),
                         "speedup": stats["A (before)"]["median_s"] / s["median_s"], "max_abs_logit_diff": diff})
    return {"experiment": experiment, "repeats": repeats, "rows": rows}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.ab", description=__doc__.splitlines()[0])
    parser.add_argument("experiment", choices=["layernorm", "head"])
    parser.add_argument("--shapes", default="1x128,1x1024,8x256", help="comma-separated BxT (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args(argv)
    try:
        shapes = [tuple(int(n) for n in s.split("x")) for s in args.shapes.split(",")]
        if any(len(s) != 2 or min(s) < 1 for s in shapes):
            raise ValueError
    except ValueError:
        parser.error(f"--shapes must look like 1x128,8x256, got {args.shapes!r}")
    pin_threads()
    result = run(args.experiment, shapes, args.repeats)
    print(format_table(result["rows"], [("shape", "B x T"), ("variant", "variant"), ("time_ms", "ms median [min-max]"),
                                        ("speedup", "speedup vs A"), ("max_abs_logit_diff", "max |dlogit| A-B")]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
