"""Tokenising throughput of ``tinygpt prepare`` by worker count:
``python -m benchmarks.prepare [--mb 200] [--workers 1,2,4] [--repeats 1] [--tokenizer gpt2] [--json PATH]``.

The corpus is tinyshakespeare repeated to ``--mb`` megabytes in one text file (in a temporary folder, or
``--corpus FILE`` to reuse one). Each run is a fresh process (``prepare_corpus`` as ``tinygpt prepare --workers N``
runs it), interleaved by worker count across repeats; the table gives the wall time, MB/s and tokens/s (medians),
the speed-up over one worker, the peak resident memory of the main process and of the largest worker, and whether
``tokens.bin`` is byte-identical to the one-worker output. The load average is recorded before and after: on a
shared machine the figures need a quiet rerun.

The GPT-2 vocabulary comes from ``$TINYGPT_GPT2_VOCAB`` or the shared data folder (``common.shared_data_dir``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from .common import format_table, run_and_report, shared_data_dir

_CHILD = r"""
import json, resource, sys, time
from tinygpt.training import prepare_corpus
corpus, out, tokenizer, workers = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
start = time.perf_counter()
c = prepare_corpus([corpus], tokenizer, out, progress=False, workers=workers, overwrite=True)
seconds = time.perf_counter() - start
print(json.dumps({"seconds": seconds, "tokens": c.header["total_tokens"], "bytes": c.header["total_bytes"],
                  "self_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "worker_rss_mb": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024}))
"""


def make_corpus(path: Path, megabytes: int) -> Path:
    """tinyshakespeare repeated until the file holds at least ``megabytes`` MB."""
    source = (shared_data_dir() / "tinyshakespeare.txt").read_bytes()
    with open(path, "wb") as f:
        for _ in range(-(-megabytes * 1_000_000 // len(source))):
            f.write(source)
    return path


def _digest(path: Path) -> str:
    sha = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            sha.update(block)
    return sha.hexdigest()


def measure(megabytes: int, workers: list[int], repeats: int, tokenizer: str, corpus: str | None) -> dict[str, Any]:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if tokenizer == "gpt2" and not env.get("TINYGPT_GPT2_VOCAB"):
        env["TINYGPT_GPT2_VOCAB"] = str(shared_data_dir() / "gpt2")
    runs: dict[int, list[dict[str, Any]]] = {n: [] for n in workers}
    digests: dict[int, str] = {}
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        text = Path(corpus) if corpus else make_corpus(Path(tmp) / "corpus.txt", megabytes)
        for _ in range(repeats):
            for n in workers:  # interleaved: a busy spell hits every worker count alike
                out = Path(tmp) / f"out-{n}"
                done = subprocess.run([sys.executable, "-c", _CHILD, str(text), str(out), tokenizer, str(n)],
                                      env=env, capture_output=True, text=True, check=True)
                runs[n].append(json.loads(done.stdout.strip().splitlines()[-1]))
                digests[n] = _digest(out / "tokens.bin")
    load_after = os.getloadavg()
    rows = []
    base = statistics.median(r["seconds"] for r in runs[workers[0]])
    for n in workers:
        seconds = statistics.median(r["seconds"] for r in runs[n])
        first = runs[n][0]
        rows.append({"workers": n, "seconds": seconds, "min_s": min(r["seconds"] for r in runs[n]),
                     "max_s": max(r["seconds"] for r in runs[n]), "mb_per_s": first["bytes"] / 1e6 / seconds,
                     "tokens_per_s": first["tokens"] / seconds, "speedup": base / seconds,
                     "self_rss_mb": max(r["self_rss_mb"] for r in runs[n]),
                     "worker_rss_mb": max(r["worker_rss_mb"] for r in runs[n]),
                     "identical": digests[n] == digests[workers[0]]})
    return {"corpus_bytes": runs[workers[0]][0]["bytes"], "tokens": runs[workers[0]][0]["tokens"],
            "tokenizer": tokenizer, "repeats": repeats, "cores": os.cpu_count(), "load_before": load_before,
            "load_after": load_after, "rows": rows}


def table(result: dict[str, Any]) -> str:
    columns = [("workers", "workers"), ("seconds", "wall s"), ("mb_per_s", "MB/s"), ("tokens_per_s", "tokens/s"),
               ("speedup", "x 1 worker"), ("self_rss_mb", "main RSS MB"), ("worker_rss_mb", "worker RSS MB"),
               ("identical", "same tokens.bin")]
    head = (f"prepare --tokenizer {result['tokenizer']}: {result['corpus_bytes'] / 1e6:,.0f} MB, "
            f"{result['tokens']:,} tokens; {result['cores']} cores; load average before "
            f"{result['load_before'][0]:.1f}, after {result['load_after'][0]:.1f}")
    return head + "\n" + format_table(result["rows"], columns)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=200, help="corpus size in MB (default: 200)")
    parser.add_argument("--workers", default="1,2,4", help="worker counts, comma-separated (default: 1,2,4)")
    parser.add_argument("--repeats", type=int, default=1, help="runs per worker count (default: 1)")
    parser.add_argument("--tokenizer", default="gpt2", help="the prepare tokenizer (default: gpt2)")
    parser.add_argument("--corpus", metavar="FILE", help="an existing text file instead of the generated one")
    parser.add_argument("--json", metavar="PATH", help="also write the result as JSON")
    args = parser.parse_args(argv)
    try:
        workers = [int(n) for n in args.workers.split(",")]
    except ValueError:
        parser.error(f"--workers must be comma-separated integers, got {args.workers!r}")
    return run_and_report(parser, lambda: measure(args.mb, workers, args.repeats, args.tokenizer, args.corpus),
                          table, args.json, failed=lambda r: not all(row["identical"] for row in r["rows"]))


if __name__ == "__main__":
    raise SystemExit(main())
