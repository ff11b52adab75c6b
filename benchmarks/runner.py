"""The suite's runner: ``python -m benchmarks [--quick] [--json PATH] [--only CASES]``.

Pins torch's threads to the machine's cores, measures the fp32 matmul ceiling, runs the chosen cases (each one
interleaving tinygpt and its references), prints one table per case with the ratios against the targets of
issue 9, and writes everything to JSON.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import inspect
import platform
import sys
import time
from typing import Any, Sequence

import torch

from . import bf16, forward, memory, train_step
from .common import format_table, matmul_ceiling, pin_threads, write_json_atomic

CASES = ("forward", "train", "generation", "memory", "bf16")

# Issue 9's targets: (case, shape or None, reference, minimum tinygpt speedup).
SPEED_TARGETS = [
    ("forward", "1x128", "hf", 1.3), ("forward", "1x1024", "hf", 1.0), ("forward", "8x256", "hf", 1.05),
    ("forward", "1x128", "upstream", 1.5), ("forward", "1x1024", "upstream", 1.5),
    ("forward", "8x256", "upstream", 1.5), ("train", None, "hf", 1.1),
]
CEILING_TARGET = ("1x1024", 0.90)
MEMORY_TARGET = 0.8  # tinygpt peak RSS <= 0.8 x HF's, per work


def generation_module():
    """``benchmarks.generation`` (written for the generation issue) if it exists, else None."""
    if importlib.util.find_spec("benchmarks.generation") is None:
        return None
    module = importlib.import_module("benchmarks.generation")
    return module if callable(getattr(module, "run", None)) else None


def _generation_table(module, result: Any) -> str:
    if callable(getattr(module, "table", None)):
        return module.table(result)
    if isinstance(result, dict) and isinstance(result.get("table"), str):
        return result["table"]
    if isinstance(result, dict) and isinstance(result.get("rows"), list) and result["rows"]:
        keys = list(result["rows"][0])
        return format_table(result["rows"], [(k, k) for k in keys])
    return repr(result)


def check_targets(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Each issue-9 target the run can judge: what was measured, what is needed, met or not."""
    checks = []
    for case, shape, reference, needed in SPEED_TARGETS:
        rows = results.get(case, {}).get("rows", [])
        row = next((r for r in rows if r["impl"] == reference and (shape is None or r["shape"] == shape)), None)
        if row is not None:
            label = f"{case} {shape + ' ' if shape else ''}tinygpt / {reference} speed"
            checks.append({"target": label, "measured": row["tinygpt_speedup"], "needed": f">= {needed}",
                           "met": row["tinygpt_speedup"] >= needed})
    shape, needed = CEILING_TARGET
    row = next((r for r in results.get("forward", {}).get("rows", [])
                if r["impl"] == "tinygpt" and r["shape"] == shape), None)
    if row is not None:
        checks.append({"target": f"forward {shape} tinygpt fraction of the matmul ceiling",
                       "measured": row["ceiling_fraction"], "needed": f">= {needed}",
                       "met": row["ceiling_fraction"] >= needed})
    for row in results.get("memory", {}).get("rows", []):
        if row["impl"] == "tinygpt" and row["ratio_to_hf"] is not None and row["work"] != "import":
            checks.append({"target": f"peak RSS {row['work']} tinygpt / hf", "measured": row["ratio_to_hf"],
                           "needed": f"<= {MEMORY_TARGET}", "met": row["ratio_to_hf"] <= MEMORY_TARGET})
    return checks


def run_suite(quick: bool = False, only: Sequence[str] = CASES, *, repeats: int | None = None,
              log=print) -> dict[str, Any]:
    """Run the chosen cases; returns the JSON-able results. ``log`` receives each printed table.

    ``repeats`` overrides each timed case's number of interleaved rounds (default: 7 full, 2 quick).
    """
    unknown = sorted(set(only) - set(CASES))
    if unknown:
        raise ValueError(f"unknown case(s) {', '.join(unknown)}; allowed: {', '.join(CASES)}")
    cores = pin_threads()
    results: dict[str, Any] = {
        "quick": quick, "cases": list(only), "repeats": repeats,
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": {"cores": cores, "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
                    "python": platform.python_version(), "processor": platform.processor() or platform.machine()},
    }
    log(f"torch {torch.__version__}, {torch.get_num_threads()} threads on {cores} cores"
        f"{' (quick mode: tiny sizes, figures mean nothing)' if quick else ''}")
    ceiling = matmul_ceiling(256 if quick else 2048, repeats=3 if quick else 9)
    results["ceiling"] = ceiling
    kernels = ", ".join(f"{k} {g:.1f}" for k, g in ceiling["gflops_median_by_kernel"].items())
    log(f"\n== fp32 matmul ceiling ({ceiling['size']}^2 @ {ceiling['size']}^2): {ceiling['gflops_median']:.1f} GFLOP/s "
        f"median, {ceiling['gflops_best']:.1f} best, the faster kernel ({kernels} GFLOP/s)")
    sections = {
        "forward": ("forward, full logits, float32, inference mode", forward,
                    lambda: forward.run(quick, ceiling["gflops_median"], repeats=repeats,
                                        ceiling_size=ceiling["size"])),
        "train": ("training step (forward + backward + AdamW), float32", train_step,
                  lambda: train_step.run(quick, repeats=repeats)),
        "memory": ("peak RSS, each in a fresh process", memory, lambda: memory.run(quick)),
        "bf16": ("bf16 autocast vs float32, tinygpt forward", bf16, lambda: bf16.run(quick, repeats=repeats)),
    }
    for case in CASES:
        if case not in only:
            continue
        if case == "generation":
            module = generation_module()
            if module is None:
                log("\n== generation: not available (benchmarks/generation.py with run(quick) not found)")
                results["generation"] = {"not_available": True}
                continue
            accepts_repeats = "repeats" in inspect.signature(module.run).parameters
            result = module.run(quick, repeats=repeats) if accepts_repeats and repeats else module.run(quick)
            results["generation"] = result
            log(f"\n== generation\n{_generation_table(module, result)}")
            continue
        title, module, call = sections[case]
        result = call()
        results[case] = result
        log(f"\n== {title}\n{module.table(result)}")
    results["targets"] = check_targets(results)
    if results["targets"]:
        note = " -- quick mode: tiny sizes, not the targets' sizes" if quick else ""
        log(f"\n== issue 9 targets (ratios from this run{note})\n" + format_table(
            [{**t, "met": "yes" if t["met"] else "NO"} for t in results["targets"]],
            [("target", "target"), ("measured", "measured"), ("needed", "needed"), ("met", "met")]))
    return results


def _parse_cases(text: str) -> list[str]:
    cases = [c.strip() for c in text.split(",") if c.strip()]
    unknown = [c for c in cases if c not in CASES]
    if unknown or not cases:
        raise argparse.ArgumentTypeError(f"unknown case(s) {', '.join(unknown) or '(none)'}; "
                                         f"allowed: {', '.join(CASES)} (comma-separated)")
    return cases


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes: checks the runner works in seconds")
    parser.add_argument("--json", metavar="PATH", help="write the results here (default: do not write)")
    parser.add_argument("--repeats", type=_positive, metavar="N",
                        help="interleaved timed rounds per case (default 7; quick: 2)")
    parser.add_argument("--only", type=_parse_cases, default=list(CASES), metavar="CASES",
                        help=f"comma-separated subset of: {', '.join(CASES)}")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    results = run_suite(args.quick, args.only, repeats=args.repeats)
    if args.json:
        write_json_atomic(args.json, results)
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
