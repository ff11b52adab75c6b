"""What bounds a batch-1 decode step: the products of one row by every weight, timed route by route.

A decode step at batch 1 reads each weight of the blocks and the head once, so its products cost at least the
weights' bytes over the rate a loop can read them. For each weight type this times, on the step's own weights
(gpt2-small's shapes by default: 48 block linears and the head, 494 MB in float32, far beyond any cache, read in
the step's order):

- ``read``: a plain sum over every weight's bytes (seen as float32), torch's own reduction: the rate a loop that
  only reads reaches;
- ``library``: the products the eager step runs (``tinygpt.fast``: oneDNN for float32, oneDNN's packed bf16
  kernel, torch's ``_weight_int8pack_mm``), one call per weight;
- ``compiled``: the one-row products of the compiled decode step (``tinygpt.fast.one_row``), all of a step's
  products in one ``torch.compile`` graph, as the compiled step runs them;
- ``read, huge pages`` and ``compiled, huge pages``: the same on a copy of the weights in 2 MiB pages
  (``tinygpt.fast.pages``, where the compiled step's weights live), which spares a page-table walk every 4 KiB;
- ``kernels, huge pages`` (bf16 and int8, where ``tinygpt.fast.row_kernels`` builds): the one-row kernels that a
  compiled step calls for its large weights, here on every weight, one call each.

Each row gives ms per step, GB/s and the tok/s ceiling the products alone put on a step (1 / their time); with
``--llama-tok-s TYPE=N,...`` (llama.cpp's tg128 on the paired GGUF file, e.g. from ``benchmarks.llamacpp``) also
the rate llama.cpp reads the same weights at and the ceiling as a share of it.

    python -m benchmarks.decode_bound --threads 1
    python -m benchmarks.decode_bound --threads 1 --llama-tok-s f32=53.5,bf16=100,int8=150
"""

from __future__ import annotations

import argparse
from typing import Any, Callable, Sequence

import torch

from benchmarks.common import comma_list, format_table, run_and_report, time_interleaved
from benchmarks.weights import QUICK, SHAPES
from tinygpt.config import GPTConfig
from tinygpt.fast.one_row import one_row_linear
from tinygpt.fast import row_kernels
from tinygpt.fast.pages import huge_pages
from tinygpt.fast.weights import Bf16Linear, Int8Linear
from tinygpt.inference.runner import COMPILE_OPTIONS

TYPES = {"f32": "float32", "bf16": "bfloat16", "int8": "int8"}


def step_shapes(config: GPTConfig) -> list[tuple[int, int]]:
    """The (out, in) of every product a GPT-2 decode step runs, in order: per block qkv, out_proj, fc, proj; the
    head last."""
    d, f = config.emb_dim, 4 * config.emb_dim
    return [(3 * d, d), (d, d), (f, d), (d, f)] * config.n_layers + [(config.vocab_size, d)]


def routes(kind: str, shapes: list[tuple[int, int]], seed: int = 0) -> tuple[int, dict[str, Callable[[], Any]]]:
    """The weight bytes of one step and the three timed routes (see the module docstring) for weight type kind."""
    g = torch.Generator().manual_seed(seed)
    weights = [torch.randn(o, i, generator=g) * 0.02 for o, i in shapes]
    inputs = {i: torch.randn(1, i, generator=g) for _, i in shapes}
    if kind == "f32":
        from tinygpt.fast.onednn import linear

        stored = weights
        library = [lambda x, w=w: linear(x, w) for w in weights]
    elif kind == "bf16":
        layers = [Bf16Linear(w) for w in weights]
        stored = [w.to(torch.bfloat16) for w in weights]
        library = [lambda x, layer=layer: layer.product(x.to(torch.bfloat16)) for layer in layers]
    else:
        int8 = [Int8Linear(w) for w in weights]
        stored = [layer.qweight for layer in int8]
        library = [lambda x, layer=layer: layer.product(x.to(torch.bfloat16)) for layer in int8]
    nbytes = sum(w.numel() * w.element_size() for w in stored)

    def one_graph(x: torch.Tensor, weights: list[torch.Tensor]) -> list[torch.Tensor]:
        return [one_row_linear(x if w.shape[1] == x.shape[1] else x.repeat(1, w.shape[1] // x.shape[1]), w)
                for w in weights]

    holder = torch.nn.Module()  # a copy of the weights, moved into huge pages as a loaded model's are
    for i, w in enumerate(stored):
        holder.register_buffer(f"w{i}", w.clone())
    huge_pages(holder)
    in_huge = list(holder.buffers())
    compiled = torch.compile(one_graph, dynamic=False, options=COMPILE_OPTIONS)  # as the runner compiles
    first = inputs[shapes[0][1]]

    def read(weights: list[torch.Tensor]) -> list[torch.Tensor]:
        return [w.view(torch.float32).sum() for w in weights]  # the bytes summed as float32 (an int8 sum is slow)

    timed = {
        "read": lambda: read(stored),
        "library": lambda: [fn(inputs[w.shape[1]]) for fn, w in zip(library, stored)],
        "compiled": lambda: compiled(first, stored),
        "read, huge pages": lambda: read(in_huge),
        "compiled, huge pages": lambda: compiled(first, in_huge),
    }
    if kind != "f32" and row_kernels.load():
        rounded = {i: x.to(torch.bfloat16).float() for i, x in inputs.items()}  # as the layers round their input
        if kind == "bf16":
            timed["kernels, huge pages"] = lambda: [row_kernels.bf16_row_mm(rounded[w.shape[1]], w) for w in in_huge]
        else:
            timed["kernels, huge pages"] = lambda: [row_kernels.int8_row_mm(rounded[w.shape[1]], w, layer.scale)
                                                    for w, layer in zip(in_huge, int8)]
    return nbytes, timed


def run(config: GPTConfig, *, threads: int, types: list[str], repeats: int,
        llama: dict[str, float]) -> dict[str, Any]:
    torch.set_num_threads(threads)
    shapes = step_shapes(config)
    rows = []
    with torch.inference_mode():
        for kind in types:
            nbytes, timed = routes(kind, shapes)
            stats = time_interleaved(timed, warmup=2, repeats=repeats)
            for name, s in stats.items():
                row = {"weights": kind, "route": name, "mb": nbytes / 1e6, "ms": s["median_s"] * 1e3,
                       "gb_s": nbytes / s["median_s"] / 1e9, "ceiling_tok_s": 1 / s["median_s"]}
                if kind in llama:
                    row.update(llama_gb_s=nbytes * llama[kind] / 1e9, ceiling_share=row["ceiling_tok_s"] / llama[kind])
                rows.append(row)
    return {"threads": threads, "config": {"emb_dim": config.emb_dim, "n_layers": config.n_layers,
                                           "vocab_size": config.vocab_size}, "llama_tok_s": llama, "rows": rows}


def table(result: dict[str, Any]) -> str:
    columns = [("weights", "weights"), ("route", "route"), ("mb", "MB per step"), ("ms", "ms per step"),
               ("gb_s", "GB/s"), ("ceiling_tok_s", "tok/s ceiling")]
    if result["llama_tok_s"]:
        columns += [("llama_gb_s", "llama.cpp GB/s"), ("ceiling_share", "ceiling / llama.cpp")]
    return f"{result['threads']} thread(s); products of one row by a decode step's weights\n" + format_table(
        result["rows"], columns)


def parse_llama(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for part in filter(None, text.split(",")):
        kind, _, value = part.partition("=")
        try:
            if kind not in TYPES:
                raise ValueError
            out[kind] = float(value)
        except ValueError:
            raise ValueError(f"--llama-tok-s {part!r}: TYPE=tok/s with TYPE one of {', '.join(TYPES)}") from None
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.decode_bound", description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="gpt2-small")
    parser.add_argument("--types", default="f32,bf16,int8", help="weight types, comma-separated (f32,bf16,int8)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--llama-tok-s", default="", metavar="TYPE=N,...",
                        help="llama.cpp's decode tok/s per type on the paired file, e.g. f32=53.5,bf16=100,int8=150")
    parser.add_argument("--quick", action="store_true", help="a tiny shape: checks the benchmark runs, in seconds")
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)

    def compute() -> dict[str, Any]:
        types = comma_list(args.types, list(TYPES), "--types")
        config = QUICK["quick"] if args.quick else SHAPES[args.shape]
        return run(config, threads=args.threads, types=types, repeats=1 if args.quick else args.repeats,
                   llama=parse_llama(args.llama_tok_s))

    return run_and_report(parser, compute, table, args.json)


if __name__ == "__main__":
    raise SystemExit(main())
