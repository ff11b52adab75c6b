"""Shared machinery of the benchmark suite: thread pinning, interleaved timing, the matmul ceiling, tables, JSON.

Every case times tinygpt and its references in the same process, interleaved (A B A B ...) after a warm-up, so a
slow spell of a shared machine hits all of them alike; figures are medians with the min-max spread, and the
headline numbers are ratios, which survive noise better than absolute times.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from tinygpt.fast import onednn
from tinygpt.fileio import atomic_write_text


def shared_data_dir() -> Path:
    """The folder of public data files tests and benchmarks read: ``$TINYGPT_SHARED_DATA``, else ``shared/data``
    beside the checkout (``../shared/data``) or above it, else this workplace's ``/work/shared/data``. The product
    itself never reads it."""
    if os.environ.get("TINYGPT_SHARED_DATA"):
        return Path(os.environ["TINYGPT_SHARED_DATA"])
    checkout = Path(__file__).resolve().parents[1]
    candidates = [parent / "shared" / "data" for parent in checkout.parents] + [Path("/work/shared/data")]
    return next((c for c in candidates if c.is_dir()), candidates[0])


def machine_cores() -> int:
    """The cores this process may run on (its affinity mask where the OS has one, else ``os.cpu_count``)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def pin_threads() -> int:
    """Give torch one intra-op thread per available core (and one inter-op thread); returns the count."""
    cores = machine_cores()
    torch.set_num_threads(cores)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:  # already set once the process has run parallel work
        pass
    return cores


def summarize(times: list[float]) -> dict[str, float]:
    """Median, min and max of wall-clock seconds, plus the number of samples."""
    return {"median_s": statistics.median(times), "min_s": min(times), "max_s": max(times), "samples": len(times)}


def time_interleaved(
    fns: dict[str, Callable[[], Any]], *, warmup: int, repeats: int
) -> dict[str, dict[str, float]]:
    """Run each function ``warmup`` times, then ``repeats`` rounds of one call each, in turn (A B A B ...).

    Returns ``summarize`` of each function's times, keyed like ``fns``.
    """
    if repeats < 1 or warmup < 0:
        raise ValueError(f"repeats={repeats} must be >= 1 and warmup={warmup} >= 0")
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: summarize(t) for name, t in times.items()}


def square_products(n: int) -> dict[str, Callable[[], object]]:
    """The n x n @ n x n float32 product through each matmul torch offers here: its BLAS (``torch.mm``) and, where
    this torch has it, oneDNN (the kernel of ``tinygpt.fast.linear``); keyed "mm" and "onednn"."""
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(n, n, generator=generator)
    b = torch.randn(n, n, generator=generator)
    out = torch.empty(n, n)
    products: dict[str, Callable[[], object]] = {"mm": lambda: torch.mm(a, b, out=out)}
    if onednn.available():
        products["onednn"] = lambda: onednn.onednn_linear(a, b)
    return products


def matmul_ceiling(n: int = 2048, *, warmup: int = 2, repeats: int = 7) -> dict[str, float]:
    """The machine's float32 matmul rate: an n x n @ n x n product (2 n^3 FLOPs), in GFLOP/s.

    This is the ceiling every forward figure is compared with: a transformer forward is mostly such products,
    so a forward at ~100% of it would lose nothing to anything else (norms, softmax, copies, Python). The product
    is timed through every matmul torch offers (``square_products``) and the faster one sets the ceiling, so that
    tinygpt's own choice of kernel cannot raise its fraction; each rate is kept too.
    """
    stats = time_interleaved(square_products(n), warmup=warmup, repeats=repeats)
    flops = 2.0 * n**3
    best = min(stats, key=lambda name: stats[name]["median_s"])
    return {
        "size": n,
        "kernel": best,
        "gflops_median": flops / stats[best]["median_s"] / 1e9,
        "gflops_best": flops / stats[best]["min_s"] / 1e9,
        "gflops_median_by_kernel": {name: flops / st["median_s"] / 1e9 for name, st in stats.items()},
        **stats[best],
    }


OP_GROUPS = {
    "matmul (linear layers, head)": ("aten::addmm", "aten::mm", "aten::bmm", "aten::baddbmm",
                                     "mkldnn::_linear_pointwise"),
    "attention (sdpa)": ("aten::_scaled_dot_product", "aten::scaled_dot_product"),
    "layer norm (and elementwise arithmetic)": ("aten::native_layer_norm", "aten::var", "aten::mean", "aten::sub",
                                                "aten::div", "aten::sqrt", "aten::mul", "aten::add"),
    "gelu": ("aten::gelu",),
    "copies (cache writes, views)": ("aten::copy_", "aten::_to_copy"),
}
OTHER_OPS = "other (dispatch, python-visible small ops)"


def self_cpu_shares(prof: Any, top: int = 12, groups: dict[str, tuple[str, ...]] | None = None) -> dict[str, Any]:
    """A finished ``torch.profiler.profile``'s self CPU time: the total in seconds, the share of each group of
    ``groups`` (default ``OP_GROUPS``; by operator-name prefix, the first group that matches; the rest is
    ``OTHER_OPS``) and the ``top`` operators' shares."""
    groups = OP_GROUPS if groups is None else groups
    events = [(e.key, e.self_cpu_time_total) for e in prof.key_averages()]  # microseconds
    total = sum(t for _, t in events) or 1.0
    shares: dict[str, float] = {name: 0.0 for name in groups}
    shares[OTHER_OPS] = 0.0
    for key, t in events:
        name = next((g for g, prefixes in groups.items() if key.startswith(prefixes)), OTHER_OPS)
        shares[name] += t / total
    ops = sorted(events, key=lambda e: -e[1])[:top]
    return {"self_cpu_s": total / 1e6, "shares": shares,
            "top_ops": [{"op": k, "share": t / total} for k, t in ops]}


def parse_shapes(text: str) -> list[tuple[int, int]]:
    """'1x128,8x256' -> [(1, 128), (8, 256)] (batch x tokens, each >= 1); an ``argparse`` type."""
    try:
        shapes = [tuple(int(n) for n in part.split("x")) for part in text.split(",")]
    except ValueError:
        shapes = []
    if not shapes or any(len(s) != 2 or min(s) < 1 for s in shapes):
        raise argparse.ArgumentTypeError(f"shapes must look like 1x128,8x256 (batch x tokens, each >= 1), got {text!r}")
    return shapes  # type: ignore[return-value]


def comma_list(text: str, allowed: Sequence[str], flag: str) -> list[str]:
    """``text`` split at commas, each item one of ``allowed``; a ``ValueError`` naming ``flag`` otherwise."""
    items = text.split(",")
    bad = [item for item in items if item not in allowed]
    if bad:
        raise ValueError(f"{flag} {','.join(bad)}: allowed {', '.join(allowed)}")
    return items


def run_and_report(parser: argparse.ArgumentParser, compute: Callable[[], dict[str, Any]],
                   table: Callable[[dict[str, Any]], str], json_path: str | Path | None, *,
                   failed: Callable[[dict[str, Any]], bool] = lambda result: False) -> int:
    """A benchmark script's last step: ``compute()`` (a ``ValueError`` becomes the parser's usage error), print its
    table, write its JSON to ``json_path`` when given; returns the exit status (1 where ``failed(result)``)."""
    try:
        result = compute()
    except ValueError as err:
        parser.error(str(err))
    print(table(result))
    if json_path:
        write_json_atomic(json_path, result)
    return 1 if failed(result) else 0


def format_table(rows: list[dict[str, Any]], columns: list[tuple[str, str]]) -> str:
    """A plain-text table: ``columns`` is [(key, header)]; floats get 3 significant-ish digits."""

    def cell(value: Any) -> str:
        if value is None:
            return "-"
        if isinstance(value, float):
            if abs(value) >= 100:
                return f"{value:,.0f}"
            if abs(value) >= 1:
                return f"{value:.2f}"
            return f"{value:.3g}"
        return str(value)

    body = [[cell(row.get(key)) for key, _ in columns] for row in rows]
    headers = [header for _, header in columns]
    widths = [max(len(h), *(len(r[i]) for r in body)) if body else len(h) for i, h in enumerate(headers)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in body]
    return "\n".join(lines)


def spread(stats: dict[str, float]) -> str:
    """'median [min-max]' in milliseconds."""
    return f"{stats['median_s'] * 1e3:.1f} [{stats['min_s'] * 1e3:.1f}-{stats['max_s'] * 1e3:.1f}]"


def run_json_process(module: str, args: list[str], what: str) -> dict[str, Any]:
    """Run ``python -m benchmarks.<module> ARGS`` in a fresh process (from the repository root) and return the JSON
    object its last stdout line holds; a failure is a ``RuntimeError`` with the end of its stderr."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-m", f"benchmarks.{module}", *args], capture_output=True, text=True,
                          check=False, cwd=root)
    if done.returncode != 0:
        raise RuntimeError(f"{what} failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def write_json_atomic(path: str | Path, data: Any) -> None:
    """Write ``data`` as JSON, atomically and with the umask's permissions (``tinygpt.fileio``)."""
    atomic_write_text(path, json.dumps(data, indent=2, sort_keys=True) + "\n")
