"""A small model trained here on the speculative workload's copy task, for measuring prompt lookup on a model that
really copies (the serving benchmark's default weights are random and copy nothing on purpose).

    python -m benchmarks.copy_model [--out runs/copy-model] [--examples 4000] [--max-steps 1000]
    python -m benchmarks.serve --model runs/copy-model --workloads speculative --hf none

The task is the one of ``serve_workloads.COPY_PROMPT``: "rewrite this function with `a` renamed to `b`; change
nothing else", then the function, then the rewritten function. The examples are cut from the Python standard
library's own functions (the embedded corpus ``tinygpt train`` uses, so nothing is downloaded): each function with
one or two of its parameters renamed. The benchmark's own function (``top_p_filter``) is not among them, so the
model copies code it never saw. The model is trained by ``tinygpt.training.train`` with a byte-level BPE trained
on the same text; with no trained GPT-2 reachable offline, this is the trained copier the benchmark can have.
"""

from __future__ import annotations

import argparse
import ast
import random
import re
import sys
import textwrap
from pathlib import Path
from typing import Iterator, Sequence

from .common import pin_threads

# Names a rename may give; a name already in the function is never chosen.
NEW_NAMES = ("scores", "values", "items", "data", "count", "text", "result", "key", "node", "size", "limit",
             "source", "target", "options", "entry", "record", "buffer", "parts", "index", "total", "top_p", "name")


def _functions(source: str) -> Iterator[str]:
    """The dedented source of every function and method in a module's text (none if it does not parse)."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return
    lines = source.splitlines(keepends=True)
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not node.decorator_list:
            yield textwrap.dedent("".join(lines[node.lineno - 1:node.end_lineno]))


def rename_example(code: str, rng: random.Random) -> str | None:
    """One training text: the instruction, ``code``, and ``code`` with one or two parameters renamed (whole words,
    everywhere in the function); None when the function has no parameter worth renaming."""
    try:
        args = ast.parse(code).body[0].args
    except (SyntaxError, IndexError, AttributeError):
        return None
    params = [a.arg for a in args.posonlyargs + args.args + args.kwonlyargs if a.arg not in ("self", "cls")]
    if not params:
        return None
    words = set(re.findall(r"\w+", code))
    fresh = [n for n in NEW_NAMES if n not in words]
    chosen = rng.sample(params, min(len(params), rng.choice((1, 2)), len(fresh)))
    if not chosen:
        return None
    renames = dict(zip(chosen, rng.sample(fresh, len(chosen))))
    renamed = re.sub(r"\b(" + "|".join(map(re.escape, renames)) + r")\b", lambda m: renames[m.group(0)], code)
    said = " and ".join(f"`{old}` renamed to `{new}`" for old, new in renames.items())
    return f"# Rewrite this function with {said}; change nothing else.\n\n{code}\n# Rewritten:\n\n{renamed}"


def copy_task_text(examples: int, *, seed: int = 0, min_lines: int = 4, max_chars: int = 900) -> str:
    """``examples`` rename examples from standard-library functions of ``min_lines``..``max_chars``, seeded."""
    from tinygpt.corpus import embedded_corpus_files

    rng = random.Random(seed)
    pool = [code for path in embedded_corpus_files()
            for code in _functions(path.read_text(encoding="utf-8", errors="replace"))
            if code.count("\n") >= min_lines and len(code) <= max_chars]
    rng.shuffle(pool)
    texts = []
    for code in pool:
        text = rename_example(code if code.endswith("\n") else code + "\n", rng)
        if text is not None:
            texts.append(text)
        if len(texts) == examples:
            break
    if len(texts) < examples:
        raise ValueError(f"only {len(texts)} functions fit (asked for {examples})")
    return "\n\n".join(texts) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.copy_model", description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/copy-model", help="the run folder (default runs/copy-model)")
    parser.add_argument("--examples", type=int, default=4000, help="rename examples to train on (default 4000)")
    parser.add_argument("--max-steps", type=int, default=1000, help="optimizer steps (default 1000)")
    parser.add_argument("--force", action="store_true", help="write into an --out folder that holds other files")
    args = parser.parse_args(argv)
    if args.examples < 1 or args.max_steps < 1:
        parser.error("--examples and --max-steps must be >= 1")
    from tinygpt.training import TrainingOptions, train

    pin_threads()
    out = Path(args.out)
    data = out.parent / f"{out.name}-copy-task.txt"  # beside the run: the run folder holds only what training writes
    data.parent.mkdir(parents=True, exist_ok=True)
    data.write_text(copy_task_text(args.examples), encoding="utf-8")
    print(f"{args.examples} examples ({data.stat().st_size:,} bytes) in {data}", file=sys.stderr)
    train(TrainingOptions(out_dir=str(out), force=args.force, data=[str(data)], tokenizer="bpe:4096",
                          context_length=512, emb_dim=256, n_heads=4, n_layers=4, batch_size=8,
                          max_steps=args.max_steps, eval_every=max(1, args.max_steps // 4), eval_iters=5,
                          progress=False))
    print(f"next: python -m benchmarks.serve --model {out} --workloads speculative --hf none", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
