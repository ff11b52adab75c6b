"""Where a batch-1 decode step's wall time goes: the model's call, the runner's packing, the engine, ``generate``.

    python -m benchmarks.decode_split [--shape gpt2-small] [--weights bfloat16] [--compile] [--new-tokens 64]

One greedy row of an 8-token prompt decodes ``--new-tokens`` tokens through ``tinygpt.generate`` (a warm-up call
first, so a compile falls outside). Wall-clock timers around three nested layers split each token's time into:

- ``model``: the model's forward (``ModelRunner._run_model``; compiled: dynamo's guards, the compiled graph's
  Python wrapper and its kernels; eager: the modules);
- ``runner``: the rest of ``ModelRunner.forward`` (the batch's tensors, the logits per row);
- ``engine``: the rest of ``InferenceEngine.step`` (scheduling, the greedy draw, the rows' bookkeeping);
- ``generate``: the rest of ``generate`` (its loop, the result).

No profiler runs (``torch.profiler`` inflates the Python-heavy parts several times over). With ``--llama-tok-s``
(llama.cpp's tg on the paired file, from ``benchmarks.llamacpp``) it also gives llama.cpp's whole time per token.
"""

from __future__ import annotations

import argparse
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Sequence

import torch

from benchmarks.common import comma_list, format_table, run_and_report
from benchmarks.weights import QUICK, SHAPES
from tinygpt import GPTModel, generate
from tinygpt.config import GPTConfig
from tinygpt.fast.pages import huge_pages
from tinygpt.fast.weights import WEIGHT_TYPES, convert_weights
from tinygpt.inference.engine import InferenceEngine
from tinygpt.inference.runner import ModelRunner

LAYERS = (("model", ModelRunner, "_run_model"), ("runner", ModelRunner, "forward"),
          ("engine", InferenceEngine, "step"))


@contextmanager
def timers() -> Iterator[dict[str, float]]:
    """Seconds spent inside each of ``LAYERS``' methods (inclusive) while the block runs."""
    spent = {name: 0.0 for name, _, _ in LAYERS}
    saved = [(cls, attr, getattr(cls, attr)) for _, cls, attr in LAYERS]

    def timed(name: str, method: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                spent[name] += time.perf_counter() - start
        return run

    for name, cls, attr in LAYERS:
        setattr(cls, attr, timed(name, getattr(cls, attr)))
    try:
        yield spent
    finally:
        for cls, attr, method in saved:
            setattr(cls, attr, method)


def split(config: GPTConfig, weights: str, *, compile: bool, new_tokens: int, repeats: int) -> dict[str, Any]:
    """us per token in each layer (exclusive), median over ``repeats`` calls of ``generate``."""
    torch.manual_seed(0)
    model = GPTModel(config).eval()
    convert_weights(model, weights)
    huge_pages(model)  # as interop.load_pretrained leaves a loaded model
    prompt = list(range(1, 9))
    runs = []
    with torch.inference_mode():
        generate(model, [prompt], max_new_tokens=8, compile=compile)
        for _ in range(repeats):
            with timers() as spent:
                start = time.perf_counter()
                generate(model, [prompt], max_new_tokens=new_tokens, compile=compile)
                total = time.perf_counter() - start
            runs.append({"total": total, "model": spent["model"], "runner": spent["runner"] - spent["model"],
                         "engine": spent["engine"] - spent["runner"], "generate": total - spent["engine"]})
    runs.sort(key=lambda r: r["total"])
    middle = runs[len(runs) // 2]
    return {name: seconds / new_tokens * 1e6 for name, seconds in middle.items()}


def run(config: GPTConfig, *, types: list[str], compile: bool, new_tokens: int, repeats: int,
        llama: float | None) -> dict[str, Any]:
    torch.set_num_threads(1)
    rows = []
    for weights in types:
        row = {"weights": weights, **split(config, weights, compile=compile, new_tokens=new_tokens,
                                           repeats=repeats)}
        row["tok_s"] = 1e6 / row["total"]
        if llama:
            row["llama_us"] = 1e6 / llama
        rows.append(row)
    return {"compile": compile, "new_tokens": new_tokens, "rows": rows}


def table(result: dict[str, Any]) -> str:
    columns = [("weights", "weights"), ("total", "us/token"), ("tok_s", "tok/s"), ("model", "model"),
               ("runner", "runner"), ("engine", "engine"), ("generate", "generate")]
    if "llama_us" in result["rows"][0]:
        columns.append(("llama_us", "llama.cpp us/token"))
    mode = "compiled" if result["compile"] else "eager"
    return f"1 thread, batch 1, {mode}; us per token (exclusive)\n" + format_table(result["rows"], columns)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.decode_split", description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="gpt2-small")
    parser.add_argument("--weights", default="float32", help=f"comma-separated, of {', '.join(WEIGHT_TYPES)}")
    parser.add_argument("--compile", action="store_true", help="decode through the compiled step")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--llama-tok-s", type=float, help="llama.cpp's decode tok/s on the paired file")
    parser.add_argument("--quick", action="store_true", help="a tiny shape: checks the benchmark runs, in seconds")
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)

    def compute() -> dict[str, Any]:
        types = comma_list(args.weights, WEIGHT_TYPES, "--weights")
        if args.new_tokens < 1 or args.repeats < 1:
            raise ValueError("--new-tokens and --repeats must be >= 1")
        config = QUICK["quick"] if args.quick else SHAPES[args.shape]
        new_tokens = min(args.new_tokens, config.context_length - 9)
        return run(config, types=types, compile=args.compile, new_tokens=new_tokens,
                   repeats=1 if args.quick else args.repeats, llama=args.llama_tok_s)

    return run_and_report(parser, compute, table, args.json)


if __name__ == "__main__":
    raise SystemExit(main())
