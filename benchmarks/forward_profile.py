"""Where tinygpt's forward spends its time: self CPU time by operator group, per shape (``torch.profiler``).

The forward of the suite's forward case (gpt2-small, full logits, float32, inference mode), profiled over
``repeats`` calls after one warm-up call; the groups are those of the decode profile in ``benchmarks.generation``
(``common.OP_GROUPS``). Per group: its share of the self CPU time and its milliseconds per forward; then the
operators that took the most. The profiler adds a little time of its own, so these are shares, not the suite's
timings.

    python -m benchmarks.forward_profile [--shapes 1x128,1x1024,8x256] [--repeats 3] [--quick] [--json F]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Sequence

import torch

from .common import format_table, parse_shapes, pin_threads, run_and_report, self_cpu_shares
from .models import build_tinygpt, gpt2_small, quick_config


def run(shapes: list[tuple[int, int]], repeats: int, quick: bool) -> dict[str, Any]:
    """Profile ``repeats`` forwards per shape; per shape the ``common.self_cpu_shares`` of one forward."""
    from torch.profiler import ProfilerActivity, profile

    if repeats < 1:
        raise ValueError(f"repeats={repeats} must be >= 1")
    config = quick_config() if quick else gpt2_small()
    model = build_tinygpt(config)
    result: dict[str, Any] = {"repeats": repeats, "shapes": {}}
    for batch, tokens in shapes:
        if tokens > config.context_length:
            raise ValueError(f"shape {batch}x{tokens}: tokens must be <= context_length={config.context_length}")
        idx = torch.randint(0, config.vocab_size, (batch, tokens), generator=torch.Generator().manual_seed(5))
        with torch.inference_mode():
            model(idx)
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                for _ in range(repeats):
                    model(idx)
        shares = self_cpu_shares(prof)
        shares["self_cpu_s"] /= repeats  # per forward
        result["shapes"][f"{batch}x{tokens}"] = shares
    return result


def table(result: dict[str, Any]) -> str:
    shapes = result["shapes"]
    groups = list(next(iter(shapes.values()))["shares"])
    rows = [{"group": group, **{f"{key} %": 100 * prof["shares"][group] for key, prof in shapes.items()},
             **{f"{key} ms": 1e3 * prof["shares"][group] * prof["self_cpu_s"] for key, prof in shapes.items()}}
            for group in groups]
    columns = [("group", "self CPU time, per forward")]
    columns += [(f"{key} %", f"{key} %") for key in shapes] + [(f"{key} ms", f"{key} ms") for key in shapes]
    lines = [format_table(rows, columns)]
    for key, prof in shapes.items():
        ops = ", ".join(f"{o['op']} {o['share']:.1%}" for o in prof["top_ops"][:5])
        lines.append(f"{key}: {prof['self_cpu_s'] * 1e3:.0f} ms self CPU per forward; top operators: {ops}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.forward_profile", description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", type=parse_shapes, default=None,
                        help="comma-separated BxT (default: 1x128,1x1024,8x256; quick: 2x16)")
    parser.add_argument("--repeats", type=int, default=3, help="profiled forwards per shape (default: %(default)s)")
    parser.add_argument("--quick", action="store_true", help="tiny model: checks that the script works")
    parser.add_argument("--json", type=Path, help="also write the result here (atomically)")
    args = parser.parse_args(argv)
    shapes = args.shapes or ([(2, 16)] if args.quick else [(1, 128), (1, 1024), (8, 256)])
    pin_threads()
    return run_and_report(parser, lambda: run(shapes, args.repeats, args.quick), table, args.json)


if __name__ == "__main__":
    sys.exit(main())
