"""Greedy decoding speed, float32, CPU: tinygpt with its KV cache vs without, Hugging Face, llms_from_scratch.

    python -m benchmarks.generation [--quick] [--json PATH] [--repeats N] [--threads N]

gpt2-small-shaped random weights (biased QKV, tied head), a 16-token prompt, 200 new tokens, greedy, batch 1 and
batch 8. The same weights everywhere: tinygpt ``generate`` (cache, the default path), tinygpt ``generate_greedy``
(the seeds' uncached loop), ``GPT2LMHeadModel.generate(use_cache=True)`` and the cached GPT-2 of
``llms_from_scratch.kv_cache``; every implementation's tokens are compared with tinygpt's. Rounds are interleaved
(A B C D, A B C D, ...) after a short warm-up; figures are medians with the min-max spread.

Decoding one token reads every weight once (the head's V x D included), so it is memory-bound: the run also
measures the machine's copy bandwidth (a large tensor copy) and reports the weight traffic the cached decode
achieves against it, and profiles a cached decode to show where the rest of the time goes.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import types
from typing import Any, Callable, Sequence

import torch
from torch import nn

from tinygpt import GPTConfig, GPTModel, generate, generate_greedy

from .common import format_table, pin_threads, self_cpu_shares, write_json_atomic
from .models import available, build_hf, build_tinygpt, build_upstream, gpt2_small, quick_config

Decoder = Callable[[torch.Tensor, int], list[list[int]]]  # (prompt [B, T], new tokens) -> new ids per row


def tinygpt_cached(model: GPTModel) -> Decoder:
    return lambda idx, n: generate(model, idx, max_new_tokens=n).tokens.tolist()


def tinygpt_uncached(model: GPTModel) -> Decoder:
    return lambda idx, n: generate_greedy(model, idx, n)[:, idx.shape[1]:].tolist()


def hf_cached(model: nn.Module) -> Decoder:
    def decode(idx: torch.Tensor, n: int) -> list[list[int]]:
        with torch.inference_mode():
            out = model.generate(idx, attention_mask=torch.ones_like(idx), max_new_tokens=n, min_new_tokens=n,
                                 do_sample=False, use_cache=True, pad_token_id=0)
        return out[:, idx.shape[1]:].tolist()

    return decode


def build_upstream_cached(config: GPTConfig, weights_from: GPTModel) -> nn.Module:
    """``llms_from_scratch.kv_cache.gpt2.GPTModel`` with the same weights (its names are ch04's, minus the mask)."""
    from llms_from_scratch.kv_cache.gpt2 import GPTModel as UpstreamCachedGPT

    cfg = dict(vocab_size=config.vocab_size, context_length=config.context_length, emb_dim=config.emb_dim,
               n_heads=config.n_heads, n_layers=config.n_layers, drop_rate=0.0, qkv_bias=config.qkv_bias)
    model = UpstreamCachedGPT(cfg).eval()
    weights = {k: v for k, v in build_upstream(config, weights_from).state_dict().items() if not k.endswith("mask")}
    model.load_state_dict(weights, strict=True)
    for block in model.trf_blocks:
        block.att.forward = types.MethodType(_upstream_attention_mask_fixed, block.att)
    return model


def _upstream_attention_mask_fixed(self, x, use_cache=False, start_pos=0, cache=None):
    """llms_from_scratch 1.0.19's kv_cache GPT-2 attention, same computation, with its causal mask sliced by rows.

    The package slices the [S, S] mask as ``[:, -T:]`` (columns), so every single-token decode step raises a shape
    error; the query rows of this call are the last T rows, ``[-T:, :]``. Nothing else differs: it concatenates the
    new keys/values to the cache, masks, softmaxes the scaled scores and projects, exactly as the package does.
    """
    b, t, _ = x.shape

    def heads(y: torch.Tensor) -> torch.Tensor:
        return y.view(b, t, self.num_heads, self.head_dim).transpose(1, 2)  # [B, H, T, hd]

    queries, keys, values = heads(self.W_query(x)), heads(self.W_key(x)), heads(self.W_value(x))
    next_cache = None
    if use_cache:
        if cache is not None:
            keys, values = torch.cat([cache[0], keys], dim=2), torch.cat([cache[1], values], dim=2)
        next_cache = (keys, values)
    s = keys.shape[2]
    mask = torch.triu(torch.ones(s, s, dtype=torch.bool, device=x.device), diagonal=1)[-t:, :]  # [T, S]
    scores = (queries @ keys.transpose(2, 3)).masked_fill_(mask, -torch.inf)  # [B, H, T, S]
    weights = torch.softmax(scores / keys.shape[-1] ** 0.5, dim=-1)
    context = (weights @ values).transpose(1, 2).contiguous().view(b, t, self.d_out)
    return self.out_proj(context), next_cache


def upstream_cached(model: nn.Module) -> Decoder:
    """The package's own cached loop (``kv_cache.generate.generate_text_simple``) calls ``model.reset_kv_cache()``,
    which its GPT-2 model does not have, and never passes ``use_cache=True`` (so it would not cache); this drives
    the model the way its forward expects: prefill with ``use_cache=True``, then one token at a time."""
    from llms_from_scratch.kv_cache.utils import KVCache as UpstreamKVCache

    def decode(idx: torch.Tensor, n: int) -> list[list[int]]:
        new = []
        with torch.inference_mode():
            model.current_pos = 0
            cache = UpstreamKVCache(n_layers=len(model.trf_blocks))
            logits = model(idx, use_cache=True, cache=cache)
            for _ in range(n):
                next_idx = logits[:, -1].argmax(dim=-1, keepdim=True)  # [B, 1]
                new.append(next_idx)
                logits = model(next_idx, use_cache=True, cache=cache)
        return torch.cat(new, dim=1).tolist()

    return decode


def copy_bandwidth(megabytes: int, repeats: int = 5) -> dict[str, float]:
    """GB/s of ``dst.copy_(src)`` on a large float32 tensor, counting the bytes read plus the bytes written."""
    n = megabytes * 2**20 // 4
    src, dst = torch.ones(n), torch.empty(n)
    dst.copy_(src)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - start)
    moved = 2 * n * 4
    return {"megabytes": megabytes, "gbps_median": moved / statistics.median(times) / 1e9,
            "gbps_best": moved / min(times) / 1e9}


def weight_bytes_per_step(model: GPTModel) -> int:
    """Bytes of weights one decode step reads: every parameter except the two embedding tables (one row each is
    read), plus the head's V x D matrix (the same memory as the token embedding when tied)."""
    head = model.out_head.weight
    tables = {id(model.tok_emb.weight), id(model.pos_emb.weight)}
    rest = sum(p.numel() * p.element_size() for p in model.parameters() if id(p) not in tables)
    tied = id(head) in tables
    return rest + (head.numel() * head.element_size() if tied else 0)


def profile_decode(model: GPTModel, idx: torch.Tensor, n: int, top: int = 12) -> dict[str, Any]:
    """Self CPU time of a cached greedy decode by operator, grouped into matmuls, attention and the rest."""
    from torch.profiler import ProfilerActivity, profile

    generate(model, idx, max_new_tokens=2)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        generate(model, idx, max_new_tokens=n)
    return {"tokens": n, **self_cpu_shares(prof, top)}


def _interleaved(
    decoders: dict[str, Decoder], idx: torch.Tensor, n: int, repeats: dict[str, int], log: Callable[[str], None]
) -> dict:
    """Warm each decoder up on a few tokens, then time rounds A B C ..., each decoder for its own repeat count."""
    for decode in decoders.values():
        decode(idx, 4)
    times: dict[str, list[float]] = {name: [] for name in decoders}
    tokens: dict[str, list[list[int]]] = {}
    for round_ in range(max(repeats.values())):
        for name, decode in decoders.items():
            if round_ >= repeats[name]:
                continue
            start = time.perf_counter()
            tokens[name] = decode(idx, n)
            times[name].append(time.perf_counter() - start)
            log(f"  {tuple(idx.shape)} {name}: {times[name][-1]:.2f} s")
    return {"times": times, "tokens": tokens}


def _first_difference(a: list[list[int]], b: list[list[int]]) -> int | None:
    for row_a, row_b in zip(a, b):
        for i, (x, y) in enumerate(zip(row_a, row_b)):
            if x != y:
                return i
    return None


def run(
    quick: bool, *, repeats: int | None = None, threads: int | None = None,
    log: Callable[[str], None] = lambda line: None,
) -> dict[str, Any]:
    """Run the whole comparison; returns JSON-able results (``table`` formats them). ``log`` gets progress lines."""
    if threads is not None:
        torch.set_num_threads(threads)
    config = quick_config() if quick else gpt2_small()
    prompt_len, n_new = (8, 24) if quick else (16, 200)
    repeats = repeats or (2 if quick else 5)
    slow_repeats = 1 if quick else max(1, repeats // 3)  # the uncached loop is ~C x the work per step
    ours = build_tinygpt(config)
    decoders: dict[str, Decoder] = {"tinygpt": tinygpt_cached(ours), "tinygpt-no-cache": tinygpt_uncached(ours)}
    skipped = []
    if available("hf"):
        decoders["hf"] = hf_cached(build_hf(config, ours))
    else:
        skipped.append("hf")
    if available("upstream"):
        decoders["upstream-kv-cache"] = upstream_cached(build_upstream_cached(config, ours))
    else:
        skipped.append("upstream-kv-cache")

    bandwidth = copy_bandwidth(16 if quick else 512)
    weights = weight_bytes_per_step(ours)
    rows = []
    generator = torch.Generator().manual_seed(1)
    for batch in (1, 8):
        idx = torch.randint(0, config.vocab_size, (batch, prompt_len), generator=generator)
        names = [n for n in decoders if batch == 1 or n != "tinygpt-no-cache"]  # uncached: batch 1 only
        counts = {n: slow_repeats if n == "tinygpt-no-cache" else repeats for n in names}
        measured = _interleaved({n: decoders[n] for n in names}, idx, n_new, counts, log)
        ours_median = statistics.median(measured["times"]["tinygpt"])
        for name in names:
            t = measured["times"][name]
            median = statistics.median(t)
            rows.append({
                "shape": f"{batch}x{prompt_len}+{n_new}", "impl": name, "time_ms": median * 1e3,
                "min_ms": min(t) * 1e3, "max_ms": max(t) * 1e3, "samples": len(t),
                "tokens_per_s": batch * n_new / median,
                "tinygpt_speedup": median / ours_median,
                "weight_gbps": weights * n_new / median / 1e9,
                "tokens_match": measured["tokens"][name] == measured["tokens"]["tinygpt"],
                "first_difference": _first_difference(measured["tokens"][name], measured["tokens"]["tinygpt"]),
            })
    idx = torch.randint(0, config.vocab_size, (1, prompt_len), generator=generator)
    return {
        "quick": quick, "config": config.to_dict(), "prompt_tokens": prompt_len, "new_tokens": n_new,
        "threads": torch.get_num_threads(), "weight_bytes_per_step": weights, "copy_bandwidth": bandwidth,
        "rows": rows, "not_available": skipped, "profile": profile_decode(ours, idx, 8 if quick else 50),
    }


def table(result: dict[str, Any]) -> str:
    rows = [{**r, "time": f"{r['time_ms']:.0f} [{r['min_ms']:.0f}-{r['max_ms']:.0f}]",
             "match": "yes" if r["tokens_match"] else f"from step {r['first_difference']}"} for r in result["rows"]]
    columns = [("shape", "B x prompt+new"), ("impl", "impl"), ("time", "ms median [min-max]"), ("samples", "n"),
               ("tokens_per_s", "tokens/s"), ("tinygpt_speedup", "tinygpt speedup"),
               ("weight_gbps", "weight GB/s"), ("match", "tokens = tinygpt's")]
    bw = result["copy_bandwidth"]
    lines = [format_table(rows, columns), "",
             "weight GB/s = weights read per step x new tokens / total time (prompt prefill included: a lower "
             "bound on the decode steps' rate)",
             f"weights read per decode step: {result['weight_bytes_per_step'] / 1e6:.1f} MB; copy bandwidth "
             f"({bw['megabytes']} MB tensor, read + write): {bw['gbps_median']:.1f} GB/s median, "
             f"{bw['gbps_best']:.1f} best"]
    for name in result["not_available"]:
        lines.append(f"{name}: not available (package not installed)")
    prof = result["profile"]
    lines.append(f"\nwhere a cached decode's time goes ({prof['tokens']} tokens, batch 1, self CPU time):")
    lines += [f"  {share:6.1%}  {name}" for name, share in sorted(prof["shares"].items(), key=lambda s: -s[1])]
    lines.append("top operators: " + ", ".join(f"{o['op']} {o['share']:.1%}" for o in prof["top_ops"][:6]))
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.generation", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes: checks the benchmark runs, in seconds")
    parser.add_argument("--json", metavar="PATH", help="also write the results here as JSON")
    parser.add_argument("--repeats", type=int, default=None, help="timed rounds (default 5; quick 2)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: one per core)")
    args = parser.parse_args(argv)
    if args.repeats is not None and args.repeats < 1:
        parser.error(f"--repeats={args.repeats} must be >= 1")
    if args.threads is not None and args.threads < 1:
        parser.error(f"--threads={args.threads} must be >= 1")
    if args.threads is None:
        pin_threads()
    result = run(args.quick, repeats=args.repeats, threads=args.threads,
                 log=lambda line: print(line, file=sys.stderr, flush=True))
    print(f"torch {torch.__version__}, {result['threads']} threads"
          f"{' (quick mode: tiny sizes, figures mean nothing)' if args.quick else ''}")
    print(table(result))
    if args.json:
        write_json_atomic(args.json, result)
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
