"""Peak memory (RSS: ``VmHWM`` on Linux, else ``ru_maxrss``): import, build gpt2-small, build + forward 1x1024, each in a fresh process.

A fresh process per measurement because the peak is a high-water mark that never goes down. ``import`` alone is
recorded too, so the cost of the library imports can be told apart from the model's own.

Run one measurement directly: ``python -m benchmarks.memory --impl tinygpt --work forward [--quick]``
(prints one JSON line).
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
from pathlib import Path
from typing import Any

from .common import format_table, run_json_process

WORKS = ("import", "build", "forward")
IMPLS = ("tinygpt", "hf")


def _peak_mib() -> float:
    # Linux: VmHWM is the peak of this process image alone. ru_maxrss would do, except that Linux carries it across
    # fork + exec, so a child of a large parent (the suite after its forward case) would report the parent's peak.
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024  # kB
    except OSError:
        pass
    # Elsewhere ru_maxrss: KiB on Linux, bytes on macOS.
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 1024**2 if sys.platform == "darwin" else peak / 1024


def measure(impl: str, work: str, quick: bool) -> dict[str, Any]:
    """In this process: import, optionally build and run; return the peak RSS in MiB."""
    import torch

    from .common import pin_threads
    from .models import build_hf, build_tinygpt, gpt2_small, logits_of, quick_config

    pin_threads()
    if impl == "hf":
        import transformers  # noqa: F401  (the import is part of the measured cost)
    config = quick_config() if quick else gpt2_small()
    if work != "import":
        model = build_tinygpt(config) if impl == "tinygpt" else build_hf(config)
        if work == "forward":
            tokens = config.context_length if quick else 1024
            idx = torch.randint(0, config.vocab_size, (1, tokens), generator=torch.Generator().manual_seed(3))
            with torch.inference_mode():
                logits_of(model)(idx)
    return {"impl": impl, "work": work, "peak_rss_mib": _peak_mib()}


def run(quick: bool, works: tuple[str, ...] = WORKS, impls: tuple[str, ...] = IMPLS) -> dict[str, Any]:
    """A fresh process per work and implementation (``impls``: a subset of ``IMPLS``, default both)."""
    from .models import available

    rows = []
    skipped = [] if available("hf") or "hf" not in impls else ["hf"]
    impls = [impl for impl in IMPLS if impl in impls and impl not in skipped]
    for work in works:
        for impl in impls:  # interleaved, as everywhere
            args = ["--impl", impl, "--work", work, *(["--quick"] if quick else [])]
            rows.append(run_json_process("memory", args, f"memory measurement {impl}/{work}"))
    for row in rows:
        hf = next((r for r in rows if r["work"] == row["work"] and r["impl"] == "hf"), None)
        row["ratio_to_hf"] = row["peak_rss_mib"] / hf["peak_rss_mib"] if hf else None
    return {"rows": rows, "not_available": skipped}


def table(result: dict[str, Any]) -> str:
    columns = [("work", "work"), ("impl", "impl"), ("peak_rss_mib", "peak RSS MiB"), ("ratio_to_hf", "/ HF")]
    text = format_table(result["rows"], columns)
    for name in result["not_available"]:
        text += f"\n{name}: not available (package not installed)"
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.memory", description=__doc__.splitlines()[0])
    parser.add_argument("--impl", choices=IMPLS, required=True)
    parser.add_argument("--work", choices=WORKS, required=True)
    parser.add_argument("--quick", action="store_true", help="tiny model instead of gpt2-small")
    args = parser.parse_args(argv)
    print(json.dumps(measure(args.impl, args.work, args.quick)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
