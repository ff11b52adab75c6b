"""Decoding with weights in fewer bytes: float32 against bfloat16 and int8 weights (``tinygpt.fast.weights``).

For each model shape, one copy of the same weights per weight type; interleaved in one process: decode tok/s at
batch 1 through the engine (``generate``, greedy, KV-cached), prompt tok/s (one forward over ``--prompt`` tokens),
the bytes of weights a decode step reads, and the greedy agreement of each type with float32 (the share of new
tokens equal to float32's before the first difference, over several prompts). With ``--model DIR`` the weights are
a trained tinygpt model's (agreement means something there; on random weights the logits are nearly flat).

    python -m benchmarks.weights --threads 1                 # gpt2-small shapes and the default train model's
    python -m benchmarks.weights --model runs/tinygpt        # a trained model
"""

from __future__ import annotations

import argparse
import copy
from typing import Any, Sequence

import torch

from benchmarks.common import format_table, run_and_report, time_interleaved
from tinygpt import GPTConfig, GPTModel, generate
from tinygpt.fast.weights import WEIGHT_TYPES, Bf16Linear, Int8Linear, convert_weights

SHAPES = {
    "gpt2-small": GPTConfig(vocab_size=50257, context_length=1024, emb_dim=768, n_heads=12, n_layers=12,
                            qkv_bias=True),
    "train-default": GPTConfig(vocab_size=222, context_length=128, emb_dim=128, n_heads=4, n_layers=4),
}
QUICK = {"quick": GPTConfig(vocab_size=96, context_length=64, emb_dim=64, n_heads=4, n_layers=2)}


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of the linears' weights (blocks and head) a decode step reads, as stored."""
    total = 0
    for module in model.modules():
        if isinstance(module, torch.nn.Linear):
            total += module.weight.numel() * module.weight.element_size()
        elif isinstance(module, (Bf16Linear, Int8Linear)):
            stored = module.weight if isinstance(module, Bf16Linear) else module.qweight
            total += module.in_features * module.out_features * stored.element_size()
    return total


def agreement(reference: list[list[int]], other: list[list[int]]) -> float:
    """The share of reference tokens matched before each row's first difference."""
    same = 0
    for a, b in zip(reference, other):
        for x, y in zip(a, b):
            if x != y:
                break
            same += 1
    return same / max(1, sum(len(a) for a in reference))


def measure(name: str, model: GPTModel, *, new_tokens: int, prompt_tokens: int, repeats: int) -> list[dict[str, Any]]:
    model.eval()
    v, c = model.config.vocab_size, model.config.context_length
    prompt_tokens = min(prompt_tokens, c)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, v, (8,), generator=g).tolist() for _ in range(4)]
    long_prompt = torch.randint(0, v, (1, prompt_tokens), generator=g)
    new_tokens = min(new_tokens, c - 8)
    models = {"float32": model}
    for kind in WEIGHT_TYPES[1:]:
        models[kind] = copy.deepcopy(model)
        convert_weights(models[kind], kind)
    decode = {k: (lambda m=m: generate(m, [prompts[0]], max_new_tokens=new_tokens)) for k, m in models.items()}
    prompt = {k: (lambda m=m: m(long_prompt, last_only=True)) for k, m in models.items()}
    with torch.inference_mode():
        dec = time_interleaved(decode, warmup=1, repeats=repeats)
        pre = time_interleaved(prompt, warmup=1, repeats=repeats)
        greedy = {k: generate(m, prompts, max_new_tokens=new_tokens).rows() for k, m in models.items()}
    rows = []
    for kind in models:
        rows.append({"model": name, "weights": kind, "weight_mb": weight_bytes(models[kind]) / 1e6,
                     "decode_tok_s": new_tokens / dec[kind]["median_s"],
                     "decode_vs_f32": dec["float32"]["median_s"] / dec[kind]["median_s"],
                     "prompt_tok_s": prompt_tokens / pre[kind]["median_s"],
                     "prompt_vs_f32": pre["float32"]["median_s"] / pre[kind]["median_s"],
                     "greedy_agreement": agreement(greedy["float32"], greedy[kind])})
    return rows


def run(models: dict[str, GPTModel], *, threads: int, new_tokens: int, prompt_tokens: int,
        repeats: int) -> dict[str, Any]:
    torch.set_num_threads(threads)
    rows = []
    for name, model in models.items():
        rows += measure(name, model, new_tokens=new_tokens, prompt_tokens=prompt_tokens, repeats=repeats)
    return {"threads": threads, "new_tokens": new_tokens, "prompt_tokens": prompt_tokens, "rows": rows}


def table(result: dict[str, Any]) -> str:
    head = f"{result['threads']} thread(s), decode {result['new_tokens']} tokens, prompt {result['prompt_tokens']}"
    return head + "\n" + format_table(result["rows"], [
        ("model", "model"), ("weights", "weights"), ("weight_mb", "weights MB"), ("decode_tok_s", "decode tok/s"),
        ("decode_vs_f32", "vs f32"), ("prompt_tok_s", "prompt tok/s"), ("prompt_vs_f32", "vs f32"),
        ("greedy_agreement", "greedy = f32")])


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.weights", description=__doc__.splitlines()[0])
    parser.add_argument("--model", help="a trained tinygpt model folder (default: random weights at fixed shapes)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--new-tokens", type=int, default=64, help="decoded tokens per timed run (default 64)")
    parser.add_argument("--prompt", type=int, default=512, help="prompt tokens (default 512, cut to the context)")
    parser.add_argument("--repeats", type=int, default=5, help="timed rounds (default 5)")
    parser.add_argument("--quick", action="store_true", help="a tiny shape: checks the benchmark runs, in seconds")
    parser.add_argument("--json", metavar="PATH", help="also write the results here as JSON")
    args = parser.parse_args(argv)

    def compute() -> dict[str, Any]:
        if args.model:
            from tinygpt.checkpoint import load_model

            models = {args.model: load_model(args.model)}
        else:
            torch.manual_seed(0)
            models = {n: GPTModel(c) for n, c in (QUICK if args.quick else SHAPES).items()}
        return run(models, threads=args.threads, new_tokens=8 if args.quick else args.new_tokens,
                   prompt_tokens=16 if args.quick else args.prompt, repeats=1 if args.quick else args.repeats)

    return run_and_report(parser, compute, table, args.json)


if __name__ == "__main__":
    raise SystemExit(main())
