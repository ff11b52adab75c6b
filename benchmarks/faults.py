"""Page faults in tinygpt's forward: what fresh memory costs, with malloc as it is, keeping memory, or huge pages.

glibc serves an allocation above its mmap threshold (never more than 32 MiB; gpt2-small's logits are 196 MiB at
1x1024) with pages the process has never touched, and the heap hands freed memory back to the kernel once more than
the trim threshold of it lies at its top. The first write to each such 4 KiB page traps into the kernel, which
zeroes it. The n x n product that sets the matmul ceiling reuses its output and pays none of this, so these faults
are a part of the gap between a forward and the ceiling that no choice of kernel removes.

malloc reads its settings once, at start, so every measurement runs in a child process, in turn (A B C A B C ...):
A with glibc's defaults, B with ``MALLOC_MMAP_MAX_=0`` (no mmap: every allocation comes from the heap) and
``MALLOC_TRIM_THRESHOLD_`` of 1 TiB (freed memory stays for reuse), glibc's documented tunables (other C libraries
ignore them, and B then measures what A does), C with torch's own ``THP_MEM_ALLOC_ENABLE=1``: its allocator asks
for transparent huge pages (``madvise``) for every tensor of 2 MiB or more, so that fresh memory faults in 2 MiB at
a time where the kernel's THP setting allows it. A child builds gpt2-small, runs two warm-up forwards per shape, then
times ``repeats`` forwards per shape (full logits, float32, inference mode), counting each one's minor page faults,
and measures the matmul ceiling (``common.matmul_ceiling``). Only tinygpt runs: the question is how much of its own
forward is the kernel handing out pages, not how it compares.

    python -m benchmarks.faults [--shapes 1x1024,8x256] [--rounds 3] [--repeats 3] [--quick] [--json F]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Sequence

import torch

from .common import format_table, matmul_ceiling, parse_shapes, pin_threads, run_and_report
from .models import build_tinygpt, forward_flops, gpt2_small, quick_config

VARIANTS = {
    "A (glibc defaults)": {},
    "B (keep freed memory)": {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(1 << 40)},
    "C (torch THP)": {"THP_MEM_ALLOC_ENABLE": "1"},
}
ROOT = Path(__file__).resolve().parents[1]  # the directory holding the benchmarks package


def measure(shapes: list[tuple[int, int]], repeats: int, quick: bool) -> dict[str, Any]:
    """In this process: per shape, the seconds and the minor page faults of each of ``repeats`` forwards."""
    pin_threads()
    config = quick_config() if quick else gpt2_small()
    model = build_tinygpt(config)
    result: dict[str, Any] = {"shapes": {}}
    for batch, tokens in shapes:
        idx = torch.randint(0, config.vocab_size, (batch, tokens), generator=torch.Generator().manual_seed(5))
        times, faults = [], []
        with torch.inference_mode():
            for _ in range(2):  # warm-up: one-time set-up, then (B) the heap grown to what a forward needs
                model(idx)
            for _ in range(repeats):
                before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
                start = time.perf_counter()
                logits = model(idx)
                times.append(time.perf_counter() - start)
                faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
                del logits  # freed before the next forward, as a caller that consumes the logits would
        result["shapes"][f"{batch}x{tokens}"] = {"times_s": times, "faults": faults}
    result["ceiling_gflops"] = matmul_ceiling(256 if quick else 2048, repeats=3 if quick else 7)["gflops_median"]
    return result


def run(shapes: list[tuple[int, int]], *, rounds: int, repeats: int, quick: bool,
        variants: Sequence[str] | None = None) -> dict[str, Any]:
    """``rounds`` children per variant, in turn (A B C A B C ...); per shape and variant, medians over all forwards.
    ``variants``: names from ``VARIANTS`` to run (default all; the first one named is the speedups' baseline)."""
    if rounds < 1 or repeats < 1:
        raise ValueError(f"rounds={rounds} and repeats={repeats} must both be >= 1")
    chosen = {name: VARIANTS[name] for name in (VARIANTS if variants is None else variants)}
    if not chosen:
        raise ValueError("variants: name at least one of " + ", ".join(VARIANTS))
    spec = ",".join(f"{b}x{t}" for b, t in shapes)
    children: dict[str, list[dict[str, Any]]] = {name: [] for name in chosen}
    for _ in range(rounds):
        for name, env in chosen.items():
            cmd = [sys.executable, "-m", "benchmarks.faults", "--child", "--shapes", spec, "--repeats", str(repeats)]
            if quick:
                cmd.append("--quick")
            done = subprocess.run(cmd, capture_output=True, text=True, check=False, cwd=ROOT,
                                  env={**os.environ, **env})
            if done.returncode != 0:
                raise RuntimeError(f"faults measurement {name} failed:\n{done.stderr[-2000:]}")
            children[name].append(json.loads(done.stdout.strip().splitlines()[-1]))
    config = quick_config() if quick else gpt2_small()
    ceiling = statistics.median(child["ceiling_gflops"] for runs in children.values() for child in runs)
    rows = []
    for batch, tokens in shapes:
        key = f"{batch}x{tokens}"
        medians = {}
        for name, runs in children.items():
            times = [t for child in runs for t in child["shapes"][key]["times_s"]]
            faults = [f for child in runs for f in child["shapes"][key]["faults"]]
            medians[name] = statistics.median(times)
            gflops = forward_flops(config, batch, tokens) / medians[name] / 1e9
            rows.append({"shape": key, "variant": name, "time_ms": medians[name] * 1e3,
                         "time_range_ms": f"{min(times) * 1e3:.0f}-{max(times) * 1e3:.0f}",
                         "faults": statistics.median(faults), "fault_mib": statistics.median(faults) * 4 / 1024,
                         "gflops": gflops, "ceiling_fraction": gflops / ceiling})
        first = next(iter(chosen))
        for row in rows[-len(chosen):]:
            row["speedup"] = medians[first] / (row["time_ms"] / 1e3)
    return {"rounds": rounds, "repeats": repeats, "ceiling_gflops": ceiling, "variants": chosen, "rows": rows}


def table(result: dict[str, Any]) -> str:
    columns = [("shape", "B x T"), ("variant", "variant"), ("time_ms", "ms median"), ("time_range_ms", "min-max"),
               ("faults", "page faults"), ("fault_mib", "faulted MiB"), ("gflops", "GFLOP/s"),
               ("ceiling_fraction", "of ceiling"), ("speedup", "speedup vs A")]
    return (format_table(result["rows"], columns)
            + f"\nceiling (median of the children's): {result['ceiling_gflops']:.0f} GFLOP/s")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.faults", description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", type=parse_shapes, default=parse_shapes("1x128,1x1024,8x256"),
                        help="comma-separated BxT (default: 1x128,1x1024,8x256)")
    parser.add_argument("--rounds", type=int, default=3, help="child processes per variant (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=3, help="timed forwards per child and shape")
    parser.add_argument("--quick", action="store_true", help="tiny model: checks that the script works")
    parser.add_argument("--json", type=Path, help="also write the result here (atomically)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(measure(args.shapes, args.repeats, args.quick)))
        return 0
    return run_and_report(parser, lambda: run(args.shapes, rounds=args.rounds, repeats=args.repeats, quick=args.quick),
                          table, args.json)


if __name__ == "__main__":
    sys.exit(main())
