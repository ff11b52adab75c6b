"""Before vs after a refactor: the same workloads timed against two checkouts of tinygpt, in child processes.

    python -m benchmarks.ab refactor --before /work/before [--after .] [--rounds 5] [--repeats 5] [--quick]

Each child imports tinygpt from one checkout's ``src/`` (and nothing else of it), builds gpt2-small from seed 0 and
times: the forward with full logits at each ``--shapes`` (float32, inference mode), a cached greedy decode (16-token
prompt, 64 new tokens) and a training step (``benchmarks.train_step``'s 4-layer model, 8 x 256 tokens, AdamW). The
children alternate before / after for ``--rounds`` rounds (the order flipped every round), so that a slow spell of the
machine hits both alike; each reports ``--repeats`` timed calls per case after one warm-up. The ratio is before's
median time / after's: above 1 the refactor is faster. Logits (a SHA-256 of their bytes), tokens and losses must be
identical in every child, or the row says so and the exit status is 1.

The child script uses only the public API both checkouts share (``GPTModel``, ``get_config``, ``GPTConfig``,
``generate``), so the same script measures both.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from .common import format_table, machine_cores

CHILD = r"""
import hashlib, json, sys, time
src, spec = sys.argv[1], json.loads(sys.argv[2])
sys.path.insert(0, src)
import torch
torch.set_num_threads(spec["threads"])
import tinygpt
from tinygpt import GPTConfig, GPTModel, generate, get_config

def digest(t):
    return hashlib.sha256(t.detach().contiguous().numpy().tobytes()).hexdigest()[:16]

def timed(fn, repeats):
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - start)
    return times, out

def model_of(config):
    torch.manual_seed(0)
    return GPTModel(config).eval()

results = {"tinygpt": tinygpt.__file__, "cases": {}}
forward_config = get_config(spec["preset"], **spec["overrides"])
model = model_of(forward_config)
for b, t in spec["shapes"]:
    idx = torch.randint(0, forward_config.vocab_size, (b, t), generator=torch.Generator().manual_seed(5))
    with torch.inference_mode():
        times, logits = timed(lambda: model(idx), spec["repeats"])
    results["cases"][f"forward {b}x{t}"] = {"times": times, "check": digest(logits)}
prompt = torch.randint(0, forward_config.vocab_size, (1, 16), generator=torch.Generator().manual_seed(5))
new = spec["decode_tokens"]
times, tokens = timed(lambda: generate(model, prompt, max_new_tokens=new).tokens, spec["repeats"])
results["cases"][f"cached decode 1x16+{new}"] = {"times": times, "check": tokens.tolist()}
del model
train_config = GPTConfig(**spec["train_config"])
model = model_of(train_config).train()
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)
data = torch.randint(0, train_config.vocab_size, (spec["train_batch"], train_config.context_length + 1),
                     generator=torch.Generator().manual_seed(2))
idx, targets = data[:, :-1].contiguous(), data[:, 1:].contiguous()
losses = []
def step():
    optimizer.zero_grad(set_to_none=True)
    loss = model(idx, targets=targets)
    loss.backward()
    optimizer.step()
    losses.append(loss.item())
times, _ = timed(step, spec["repeats"])
results["cases"][f"train step {spec['train_batch']}x{train_config.context_length}"] = {
    "times": times, "check": [float.hex(x) for x in losses]}
print(json.dumps(results))
"""


def workload(shapes: list[tuple[int, int]], repeats: int, quick: bool, threads: int) -> dict[str, Any]:
    """What every child runs: gpt2-small (quick: a tiny GPT-2) and the training benchmark's model."""
    if quick:
        forward = {"preset": "gpt2-small", "overrides": dict(vocab_size=320, context_length=64, emb_dim=64,
                                                             n_heads=4, n_layers=2, qkv_bias=True, tie_weights=True)}
        train = dict(vocab_size=320, context_length=32, emb_dim=64, n_heads=4, n_layers=2, qkv_bias=True,
                     tie_weights=True)
        return {**forward, "shapes": shapes, "repeats": repeats, "threads": threads, "decode_tokens": 8,
                "train_config": train, "train_batch": 2}
    train = dict(vocab_size=50257, context_length=256, emb_dim=256, n_heads=4, n_layers=4, qkv_bias=True,
                 tie_weights=True)  # benchmarks.train_step.train_config(quick=False)
    return {"preset": "gpt2-small", "overrides": dict(qkv_bias=True, tie_weights=True), "shapes": shapes,
            "repeats": repeats, "threads": threads, "decode_tokens": 64, "train_config": train, "train_batch": 8}


def source_dir(checkout: str | Path) -> Path:
    """``checkout/src``, refusing a folder that does not hold tinygpt's sources."""
    src = Path(checkout).resolve() / "src"
    if not (src / "tinygpt" / "__init__.py").is_file():
        raise ValueError(f"{checkout} is not a tinygpt checkout: {src / 'tinygpt' / '__init__.py'} does not exist")
    return src


def run_child(src: Path, spec: dict[str, Any]) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # the child sees only the src it is given
    done = subprocess.run([sys.executable, "-c", CHILD, str(src), json.dumps(spec)], capture_output=True,
                          text=True, env=env, cwd=src)
    if done.returncode != 0:
        raise RuntimeError(f"the child for {src} failed:\n{done.stderr[-3000:]}")
    result = json.loads(done.stdout.strip().splitlines()[-1])
    if not Path(result["tinygpt"]).resolve().is_relative_to(src):
        raise RuntimeError(f"the child for {src} imported tinygpt from {result['tinygpt']}")
    return result


def run(before: str | Path, after: str | Path, shapes: list[tuple[int, int]], *, rounds: int, repeats: int,
        quick: bool) -> dict[str, Any]:
    if rounds < 1 or repeats < 1:
        raise ValueError(f"rounds={rounds} and repeats={repeats} must be >= 1")
    context = 64 if quick else 1024
    too_long = [f"{b}x{t}" for b, t in shapes if t > context]
    if too_long:
        raise ValueError(f"shapes {','.join(too_long)} exceed the model's context of {context} tokens"
                         + (" (--quick: e.g. --shapes 1x16,2x8)" if quick else ""))
    sources = {"before": source_dir(before), "after": source_dir(after)}
    spec = workload(shapes, repeats, quick, machine_cores())
    times: dict[str, dict[str, list[float]]] = {}
    checks: dict[str, dict[str, set[str]]] = {}
    for r in range(rounds):
        for variant in (("before", "after") if r % 2 == 0 else ("after", "before")):
            child = run_child(sources[variant], spec)
            for case, got in child["cases"].items():
                times.setdefault(case, {"before": [], "after": []})[variant] += got["times"]
                checks.setdefault(case, {"before": set(), "after": set()})[variant].add(json.dumps(got["check"]))
    rows = []
    for case, by_variant in times.items():
        before_s, after_s = (statistics.median(by_variant[v]) for v in ("before", "after"))
        seen = checks[case]["before"] | checks[case]["after"]
        rows.append({"case": case, "before_ms": before_s * 1e3, "after_ms": after_s * 1e3,
                     **{f"{v}_min_max": f"{min(by_variant[v]) * 1e3:.1f}-{max(by_variant[v]) * 1e3:.1f}"
                        for v in ("before", "after")},
                     "ratio": before_s / after_s, "identical": len(seen) == 1})
    return {"experiment": "refactor", "before": str(sources["before"]), "after": str(sources["after"]),
            "rounds": rounds, "repeats": repeats, "quick": quick, "threads": spec["threads"], "rows": rows}


def table(result: dict[str, Any]) -> str:
    rows = [{**row, "identical": "identical" if row["identical"] else "DIFFER"} for row in result["rows"]]
    head = (f"before: {result['before']}\nafter:  {result['after']}\n{result['rounds']} rounds x "
            f"{result['repeats']} repeats, {result['threads']} threads; ratio = before median / after median\n")
    return head + format_table(rows, [("case", "case"), ("before_ms", "before ms"), ("before_min_max", "min-max"),
                                      ("after_ms", "after ms"), ("after_min_max", "min-max"),
                                      ("ratio", "speed after/before"),
                                      ("identical", "logits/tokens/losses")])
