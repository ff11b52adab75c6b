"""The benchmark suite: `bench` (from a source checkout)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .common import CommandError


def _add_bench(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="the benchmark suite (source checkout only): python -m benchmarks")
    p.add_argument("--quick", action="store_true", help="tiny sizes: checks the runner works in seconds")
    p.add_argument("--json", metavar="PATH", help="write the results here")
    p.add_argument("--only", metavar="CASES", help="comma-separated subset of the cases")
    p.add_argument("--repeats", metavar="N", help="interleaved timed rounds per case")
    p.set_defaults(run=_run_bench)


def _run_bench(args: argparse.Namespace) -> int:
    import importlib.util
    from pathlib import Path

    if importlib.util.find_spec("benchmarks") is None:
        # The suite is not part of the installed package; an editable install finds it next to src/.
        checkout = Path(__file__).resolve().parents[3]  # src/tinygpt/cli/ -> the checkout
        if not (checkout / "benchmarks" / "runner.py").exists():
            raise CommandError("the benchmark suite lives in the source checkout's benchmarks/ package; "
                               "run `python -m benchmarks` from a checkout of tinygpt")
        sys.path.insert(0, str(checkout))
    from benchmarks.runner import main as bench_main

    argv = ["--quick"] if args.quick else []
    for flag in ("json", "only", "repeats"):
        if getattr(args, flag) is not None:
            argv += [f"--{flag}", getattr(args, flag)]
    return bench_main(argv)
