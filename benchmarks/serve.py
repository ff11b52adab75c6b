"""Serving under load, float32, CPU: tinygpt serve (this checkout and, with ``--before``, another) against Hugging
Face ``transformers serve`` (plain, and with ``--continuous-batching``) on the same weights, side by side.

    python -m benchmarks.serve [--quick] [--workloads throughput,long-arrival,shared-prefix,conversation,speculative]
                               [--clients 1,4,16,64] [--before DIR] [--hf plain,cb|none] [--rounds 3]
                               [--new-tokens 64] [--requests N] [--phase-seconds 120] [--max-batch N]
                               [--draft MODEL] [--model DIR|HUBNAME] [--json PATH]

gpt2-small-shaped random weights (biased QKV, tied head) with the GPT-2 tokenizer, saved once as a tinygpt
checkpoint and exported (``interop.hf.export_hf``) as a Hugging Face folder; or, with ``--model``, a trained model
and its own tokenizer (the HF servers are skipped where it has no Hugging Face form). Each server runs in its own
process on 127.0.0.1: ``tinygpt serve`` of this checkout, of ``--before DIR`` (its ``src`` on PYTHONPATH, e.g. a
``git worktree add /tmp/before e9e2fb8``), and ``transformers serve`` as it ships and with its paged-attention
scheduler. One load driver (asyncio + httpx, in this process) plays the clients; every request is greedy and
streaming, every loop bounded (``--phase-seconds``: clients start no request after it). Each workload runs
``--rounds`` times, the servers' order rotated every round (interleaved, so a slow spell hits all alike), with fresh
prompts each round (so a prefix cache gains nothing across rounds); figures are medians over the rounds.

Workloads (``serve_workloads``; the figures each reports):
- throughput: C clients, each sending ``--requests`` requests one after another (``max_tokens`` new tokens after a
  16-64-token prompt, slices of the-verdict.txt): aggregate completion tokens/s, TTFT p50/p95, per-token p50, the
  share of answers identical to HF's and to the before server's; tinygpt's offline ``generate`` is the 1-client
  yardstick.
- long-arrival: 4 streams decoding when a 1,000-token prompt arrives: the longest gap between two texts of any of
  them, against the median step before it.
- shared-prefix: 16 clients at once with one 512-token system prompt: TTFT, with prefix reuse and (a second server
  of this checkout with ``--no-prefix-cache``, where its server has the flag) without.
- conversation: 8 chats of 4 turns at once, each turn's prompt the whole conversation so far: TTFT of turn 4
  against turn 1 (with and without prefix reuse, as above).
- speculative: one stream on a copy-heavy task (rewrite a given function with renamed variables) and on prose:
  tokens/s and acceptance rate with ``--speculative lookup`` against ``--speculative off`` (and ``--draft MODEL``)
  where this checkout's server has the flags, and always the inference engine in this process (one row, as
  ``generate`` runs it), prompt lookup against plain decoding. Random weights copy nothing on purpose: what it measures there is
  the cost of drafting and verifying, and whatever repetition the random model falls into; a trained model
  (``--model``) shows what drafting gains where the model does copy.

A server or a flag a checkout lacks is skipped and the table says why.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from tinygpt import GPTConfig, GPTModel, generate, save_model

from . import serve_structured
from . import serve_workloads as wl
from .common import format_table, pin_threads, run_and_report, shared_data_dir
from .models import gpt2_small
from .serve_driver import LABELS, SRC, Servers, load, median_row, percentile, rotated

_percentile = percentile  # the name the tests and older callers use
HF_MODES = ("plain", "cb")

def quick_serve_config() -> GPTConfig:
    """Tiny layers, but GPT-2's vocabulary (the servers speak text through the GPT-2 tokenizer)."""
    return GPTConfig(vocab_size=50257, context_length=128, emb_dim=64, n_heads=4, n_layers=2, qkv_bias=True,
                     tie_weights=True)


def _gpt2_tokenizer():
    from tinygpt.tokenizer import gpt2_tokenizer

    vocab = shared_data_dir() / "gpt2"
    return gpt2_tokenizer(vocab if (vocab / "encoder.json").is_file() else None)


def make_prompts(tokenizer: Any, count: int, lo: int, hi: int, *, offset: int = 0) -> list[str]:
    """``count`` texts of lo..hi GPT-2 tokens (spread evenly), cut from the-verdict.txt (or a fixed sentence);
    another ``offset`` gives other texts."""
    path = shared_data_dir() / "the-verdict.txt"
    text = path.read_text(encoding="utf-8") if path.is_file() else "Every effort moves you forward. " * 400
    ids = tokenizer.encode(text)
    out = []
    for i in range(offset, offset + count):
        length = lo + (i * 37) % (hi - lo + 1)
        start = (i * 97) % max(1, len(ids) - length)
        out.append(tokenizer.decode(ids[start:start + length]))
    return out


def prepare(directory: Path, config: GPTConfig, source: str | Path | None = None
            ) -> tuple[GPTModel, Any, Path, Path | str]:
    """The model, its tokenizer, and the same weights as a tinygpt checkpoint and an HF folder.

    ``source`` None: random weights of ``config`` (seed 0) with the GPT-2 tokenizer. Else a trained model (what
    ``tinygpt serve --model`` takes) with its own tokenizer; where it has no Hugging Face form (a char tokenizer, a
    variant GPT-2's classes do not hold), the fourth item is the reason instead of a folder."""
    from tinygpt.interop.hf import export_hf
    from tinygpt.interop.pretrained import load_pretrained

    if source is None:
        torch.manual_seed(0)
        model, tokenizer = GPTModel(config).eval(), _gpt2_tokenizer()
    else:
        model, tokenizer = load_pretrained(source)
        model.eval()
        if tokenizer is None:
            raise ValueError(f"--model {source}: the servers speak text, and it has no tokenizer")
    ours, theirs = directory / "tinygpt", directory / "hf"
    save_model(model, ours, tokenizer=tokenizer)
    try:
        export_hf(model, theirs, tokenizer=tokenizer)
    except ValueError as error:
        return model, tokenizer, ours, f"the model has no Hugging Face form: {error}"
    return model, tokenizer, ours, theirs




def phase_row(impl: str, clients: int, wall: float, records: list[dict[str, Any]]) -> dict[str, Any]:
    tokens = sum(r["tokens"] for r in records)
    per_token = [r["decode_s"] / (r["tokens"] - 1) for r in records if r["tokens"] > 1]
    ttft = [r["ttft_s"] for r in records]
    return {"impl": impl, "clients": clients, "requests": len(records), "tokens": tokens, "wall_s": wall,
            "tokens_per_s": tokens / wall, "ttft_p50_ms": 1e3 * percentile(ttft, 0.5),
            "ttft_p95_ms": 1e3 * percentile(ttft, 0.95),
            "per_token_p50_ms": 1e3 * statistics.median(per_token) if per_token else None}


def offline_row(model: GPTModel, tokenizer: Any, prompts: list[str], new_tokens: int) -> dict[str, Any]:
    """tinygpt ``generate`` on each prompt alone, one after another (after a few warm-up calls)."""
    ids = [tokenizer.encode(p) for p in prompts]
    for row in ids[:4]:  # warm-up, as the servers had
        generate(model, [row], max_new_tokens=new_tokens)
    start = time.perf_counter()
    tokens = sum(generate(model, [row], max_new_tokens=new_tokens).lengths[0] for row in ids)
    wall = time.perf_counter() - start
    return {"impl": "tinygpt offline generate", "clients": 1, "requests": len(ids), "tokens": tokens,
            "wall_s": wall, "tokens_per_s": tokens / wall}


def _hf_modes(hf: bool | Sequence[str], continuous_batching: bool) -> tuple[str, ...]:
    if hf is True:  # the older interface: one HF server, plain unless continuous batching was asked for
        return ("cb",) if continuous_batching else ("plain",)
    if hf is False:
        return ()
    modes = tuple(hf)
    for mode in modes:
        if mode not in HF_MODES:
            raise ValueError(f"hf mode {mode!r} is not one of {', '.join(HF_MODES)}")
    return modes


def _texts(tokenizer: Any, count: int, tokens: int, offset: int) -> list[str]:
    return make_prompts(tokenizer, count, tokens, tokens, offset=offset)


def run(quick: bool = False, *, clients: Sequence[int] = (1, 4, 16), new_tokens: int | None = None,
        requests: int | None = None, max_batch: int | None = None, hf: bool | Sequence[str] = True,
        hf_continuous_batching: bool = False, workloads: Sequence[str] = ("throughput",),
        before: str | Path | None = None, rounds: int | None = None, phase_seconds: float = 120.0,
        draft: str | None = None, device: str = "cpu", model: str | Path | None = None,
        log: Callable[[str], None] = lambda line: None) -> dict[str, Any]:
    """Start the servers, run ``workloads`` (see the module docstring) and return every row, table and ratio.
    ``hf``: True (one HF server: plain, or continuous batching with ``hf_continuous_batching``), False, or modes
    from ``HF_MODES``. ``model``: a trained model to serve instead of the random weights (``prepare``)."""
    for name in workloads:
        if name not in wl.WORKLOADS:
            raise ValueError(f"workload {name!r} is not one of {', '.join(wl.WORKLOADS)}")
    before_src = None
    if before is not None:
        before_src = Path(before).resolve() / "src"
        if not (before_src / "tinygpt" / "__init__.py").is_file():
            raise ValueError(f"--before {before}: no src/tinygpt in it (give a tinygpt checkout)")
    hf_modes = _hf_modes(hf, hf_continuous_batching)
    config = quick_serve_config() if quick else gpt2_small()
    sizes = wl.QUICK_SIZES if quick else wl.Sizes()
    new_tokens = new_tokens or (8 if quick else 64)
    requests = requests or (1 if quick else 3)
    rounds = rounds or (1 if quick else 3)
    max_batch = max_batch or max(max(clients), sizes.prefix_clients, sizes.chats)
    lo, hi = (8, 24) if quick else (16, 64)
    result: dict[str, Any] = {"quick": quick, "new_tokens": new_tokens,
                              "requests_per_client": requests, "max_batch": max_batch, "clients": list(clients),
                              "device": device, "rounds": rounds, "workloads": list(workloads), "sizes": vars(sizes),
                              "threads": torch.get_num_threads(), "rows": [], "tables": {},
                              "before": None if before_src is None else str(before_src),
                              "model": "random weights" if model is None else str(model)}
    with tempfile.TemporaryDirectory(prefix="tinygpt-bench-serve-") as tmp:
        tmp_dir = Path(tmp)
        log(f"building and saving the model ({model or ('quick' if quick else 'gpt2-small') + ' shape'}) ...")
        model, tokenizer, ours, theirs = prepare(tmp_dir, config, model)  # from here on, the model itself
        result["config"] = model.config.to_dict()  # the served model's, random or trained
        servers = Servers(tmp_dir, ours, theirs, max_batch, log, device)
        model = model.to(device)  # the offline rows run where the servers do
        base = ["tinygpt"] + (["before"] if before_src else []) + [("hf" if m == "plain" else "hf-cb")
                                                                  for m in hf_modes]
        try:
            servers.add_tinygpt("tinygpt", SRC)
            if before_src:
                servers.add_tinygpt("before", before_src)
            for mode in hf_modes:
                servers.add_hf("hf" if mode == "plain" else "hf-cb", mode == "cb")
            if {"shared-prefix", "conversation"} & set(workloads):
                servers.add_tinygpt("no-prefix", SRC, ["--no-prefix-cache"])
            if "speculative" in workloads:
                servers.add_tinygpt("spec-off", SRC, ["--speculative", "off"])
                servers.add_tinygpt("spec-lookup", SRC, ["--speculative", "lookup"])
                if draft:
                    servers.add_tinygpt("spec-draft", SRC, ["--draft", draft])
            servers.wait()
            warm_prompts = make_prompts(tokenizer, 4, lo, hi, offset=10_000)
            for key in servers.running:  # warm-up: the first calls of a process build kernels per shape
                warm = [servers.body(key)(p, new_tokens) for p in warm_prompts]
                asyncio.run(load(servers.running[key].url, [warm]))
                asyncio.run(load(servers.running[key].url, [warm[:1]] * 4))
            run_workloads = dict(throughput=_throughput, **{"long-arrival": _long_arrival,
                                 "shared-prefix": _shared_prefix, "conversation": _conversation,
                                 "speculative": _speculative, "structured": serve_structured.measure})
            context = _Run(result, servers, base, tokenizer, model, sizes, rounds, clients, requests, new_tokens,
                           (lo, hi), phase_seconds, log)
            for name in workloads:
                log(f"workload {name} ...")
                run_workloads[name](context)
        finally:
            servers.stop()
        result["not_available"] = servers.not_available
    _ratios(result)
    return result


def _throughput(run: _Run) -> None:
    result, servers, tokenizer, clients, requests, new_tokens = (run.result, run.servers, run.tokenizer, run.clients,
                                                                 run.requests, run.new_tokens)
    keys = servers.keys(run.base)
    per_round: dict[tuple[str, int], list[dict[str, Any]]] = {}
    texts: dict[int, dict[str, list[str]]] = {}  # clients -> server -> the first round's answers, in order
    prompts = make_prompts(tokenizer, max(clients) * requests * run.rounds, *run.lengths)
    result["prompt_tokens"] = [len(tokenizer.encode(p)) for p in prompts]
    for r in range(run.rounds):
        for c in clients:
            own = prompts[r * max(clients) * requests:]
            for key in rotated(keys, r):
                body = servers.body(key)
                bodies = [[body(own[k * requests + j], new_tokens) for j in range(requests)] for k in range(c)]
                wall, records, cut = asyncio.run(load(servers.running[key].url, bodies, run.phase_seconds))
                row = {**phase_row(LABELS[key], c, wall, records), "cut_short": cut}
                per_round.setdefault((key, c), []).append(row)
                if r == 0:
                    texts.setdefault(c, {})[key] = [rec["text"] for rec in records]
                run.log(f"{row['impl']:<44} {c:>3} clients: {row['tokens_per_s']:.1f} tok/s")
    result["rows"] += [median_row(rows) for rows in per_round.values()]
    result["rows"].append(offline_row(run.model, tokenizer, prompts[:requests], new_tokens))

    # Same weights, greedy: the servers should write the same text (float rounding may rarely flip a token).
    # Compared without U+FFFD: where the last tokens end inside a UTF-8 character, tinygpt shows the replacement
    # character (as ``stream_text`` does) and transformers serve drops the incomplete bytes.
    def same(a: list[str], b: list[str]) -> float:
        n = min(len(a), len(b))
        return sum(x.replace("\ufffd", "") == y.replace("\ufffd", "") for x, y in zip(a, b)) / n if n else 0.0

    result["answers"] = texts
    hf_key = next((k for k in ("hf", "hf-cb") if k in keys), None)
    result["same_text"] = {c: same(t["tinygpt"], t[hf_key]) for c, t in texts.items() if hf_key and "tinygpt" in t}
    result["same_text_before"] = {c: same(t["tinygpt"], t["before"]) for c, t in texts.items() if "before" in t}


@dataclass
class _Run:
    """What every workload runner reads: the servers, the model and its tokenizer, the sizes and settings."""

    result: dict[str, Any]
    servers: Servers
    base: list[str]
    tokenizer: Any
    model: GPTModel
    sizes: wl.Sizes
    rounds: int
    clients: Sequence[int]
    requests: int
    new_tokens: int
    lengths: tuple[int, int]
    phase_seconds: float
    log: Callable[[str], None]

    def interleaved(self, keys: list[str], measure: Callable[[str, int], dict[str, Any]], say: Callable[[dict], str],
                    **labels: Any) -> list[dict[str, Any]]:
        """``measure(server key, round)`` on every server, ``rounds`` times, the order rotated every round; one
        median row per server (``labels`` added to each)."""
        measured: dict[str, list[dict[str, Any]]] = {}
        for r in range(self.rounds):
            for key in rotated(keys, r):
                m = measure(key, r)
                measured.setdefault(key, []).append({**labels, "impl": LABELS[key], **m})
                self.log(f"{LABELS[key]:<44} {say(m)}")
        return [median_row(rows) for rows in measured.values()]

    def with_no_prefix(self) -> list[str]:
        return self.servers.keys(self.base[:1] + ["no-prefix"] + self.base[1:])


def _long_arrival(run: _Run) -> None:
    sizes, tok = run.sizes, run.tokenizer

    def measure(key: str, r: int) -> dict[str, Any]:
        streams = _texts(tok, sizes.long_streams, 24, 1000 + 10 * r)
        long_prompt = _texts(tok, 1, sizes.long_prompt, 2000 + r)[0]
        server = run.servers.running[key]
        return asyncio.run(wl.long_arrival(server.url, run.servers.body(key), streams, long_prompt, sizes))

    run.result["tables"]["long-arrival"] = run.interleaved(
        run.servers.keys(run.base), measure,
        lambda m: f"longest gap {m['longest_gap_ms'] or 0:.0f} ms, step {m['step_ms'] or 0:.0f} ms")


def _shared_prefix(run: _Run) -> None:
    sizes, tok, keys = run.sizes, run.tokenizer, run.with_no_prefix()

    def measure(key: str, r: int) -> dict[str, Any]:
        # a fresh system prompt per server and round: nothing cached from an earlier measurement helps
        offset = 3000 + 100 * r + 10 * keys.index(key)
        system = _texts(tok, 1, sizes.prefix_tokens, offset)[0] + "\n"
        users = _texts(tok, sizes.prefix_clients + 1, sizes.prefix_user_tokens, offset + 5000)
        return asyncio.run(wl.shared_prefix(run.servers.running[key].url, run.servers.body(key), system, users,
                                            sizes))

    run.result["tables"]["shared-prefix"] = run.interleaved(
        keys, measure, lambda m: f"shared-prefix TTFT p50 {m['ttft_p50_ms']:.0f} ms")


def _conversation(run: _Run) -> None:
    sizes, tok, keys = run.sizes, run.tokenizer, run.with_no_prefix()

    def measure(key: str, r: int) -> dict[str, Any]:
        offset = 20_000 + 100 * r + 10 * keys.index(key)
        messages = _texts(tok, sizes.chats * sizes.turns, sizes.turn_user_tokens, offset)
        chats = [messages[i * sizes.turns:(i + 1) * sizes.turns] for i in range(sizes.chats)]
        return asyncio.run(wl.conversation(run.servers.running[key].url, run.servers.body(key), chats, sizes))

    run.result["tables"]["conversation"] = run.interleaved(
        keys, measure, lambda m: f"turn {sizes.turns}/turn 1 TTFT {m['last_over_first']:.2f}x")


def _speculative(run: _Run) -> None:
    sizes, tok = run.sizes, run.tokenizer
    tasks = {"copy": wl.COPY_PROMPT, "prose": _texts(tok, 1, 200, 40_000)[0]}
    keys = run.servers.keys(["spec-off", "spec-lookup", "spec-draft"])
    rows = []
    for task, prompt in tasks.items():
        ids = tok.encode(prompt)[-(run.model.config.context_length - sizes.speculative_new_tokens):]  # quick: fits
        prompt = tok.decode(ids)

        def measure(key: str, r: int) -> dict[str, Any]:
            m = asyncio.run(wl.one_stream(run.servers.running[key].url, run.servers.body(key), prompt, sizes))
            m.pop("text")
            return m

        rows += run.interleaved(keys, measure, lambda m: f"{task}: {m['tokens_per_s']:.1f} tok/s", task=task)
        for mode, m in wl.offline_speculative(run.model, ids, sizes.speculative_new_tokens, run.rounds).items():
            rows.append({"task": task, "impl": f"offline engine {mode}", **m,
                         "rounds": max(run.rounds, 3)})
        run.log(f"speculative {task}: done")
    run.result["tables"]["speculative"] = rows


def _ratios(result: dict[str, Any]) -> None:
    """The headline ratios (issue 22's targets), each from this one run."""
    by = {(r["impl"], r["clients"]): r["tokens_per_s"] for r in result["rows"]}
    ratios = {}
    ours = LABELS["tinygpt"]
    for c in result["clients"]:
        for key, name in (("hf", "hf"), ("hf-cb", "hf continuous batching"), ("before", "before")):
            if (LABELS[key], c) in by and (ours, c) in by:
                ratios[f"tinygpt/{name} at {c} clients"] = by[(ours, c)] / by[(LABELS[key], c)]
    if (ours, 1) in by and ("tinygpt offline generate", 1) in by:
        ratios["tinygpt serve/offline generate at 1 client"] = by[(ours, 1)] / by[("tinygpt offline generate", 1)]
    tables = result["tables"]
    for row in tables.get("long-arrival", []):
        if row.get("gap_over_step"):
            ratios[f"longest gap/median step, {row['impl']}"] = row["gap_over_step"]
    prefix = {row["impl"]: row["ttft_p50_ms"] for row in tables.get("shared-prefix", [])}
    if ours in prefix and LABELS["no-prefix"] in prefix:
        ratios["shared-prefix TTFT p50 without/with prefix reuse"] = prefix[LABELS["no-prefix"]] / prefix[ours]
    for row in tables.get("conversation", []):
        ratios[f"last turn/first turn TTFT, {row['impl']}"] = row["last_over_first"]
    spec = {(row["task"], row["impl"]): row["tokens_per_s"] for row in tables.get("speculative", [])}
    for task in ("copy", "prose"):
        for on, off in ((LABELS["spec-lookup"], LABELS["spec-off"]),
                        ("offline engine lookup", "offline engine off")):
            if (task, on) in spec and (task, off) in spec:
                ratios[f"{task}: {on}/off tokens/s"] = spec[(task, on)] / spec[(task, off)]
    for c, ratio in result.get("structured", {}).get("ratio_json_over_free", {}).items():
        ratios[f"json_schema/unconstrained tokens/s at {c} clients"] = ratio
    result["ratios"] = ratios


TABLE_COLUMNS = {
    "long-arrival": [("impl", "implementation"), ("step_ms", "median step ms"), ("longest_gap_ms", "longest gap ms"),
                     ("gap_over_step", "gap/step"), ("long_ttft_ms", "long prompt TTFT ms"), ("rounds", "rounds")],
    "shared-prefix": [("impl", "implementation"), ("ttft_p50_ms", "TTFT p50 ms"), ("ttft_p95_ms", "TTFT p95 ms"),
                      ("rounds", "rounds")],
    "speculative": [("task", "task"), ("impl", "implementation"), ("tokens", "tokens"), ("tokens_per_s", "tokens/s"),
                    ("acceptance", "acceptance"), ("rounds", "rounds")],
}


def table(result: dict[str, Any]) -> str:
    columns = [("impl", "implementation"), ("clients", "clients"), ("requests", "requests"),
               ("tokens_per_s", "tokens/s"), ("ttft_p50_ms", "TTFT p50 ms"), ("ttft_p95_ms", "TTFT p95 ms"),
               ("per_token_p50_ms", "per-token p50 ms"), ("rounds", "rounds")]
    lines = []
    if result["rows"]:
        lines += ["throughput", format_table(result["rows"], columns), ""]
    for name, rows in result["tables"].items():
        cols = TABLE_COLUMNS.get(name)
        if cols is None:  # conversation: one column per turn
            cols = [("impl", "implementation")] + [(k, k.replace("_ttft_ms", " TTFT p50 ms").replace("turn", "turn "))
                                                   for k in rows[0] if k.endswith("_ttft_ms")]
            cols += [("last_over_first", "last/first"), ("rounds", "rounds")]
        lines += [name, format_table(rows, cols), ""]
    if "structured" in result:
        lines += ["structured", serve_structured.table(result["structured"], _structured_table), ""]
    lines += [f"{name}: {value:.2f}x" for name, value in result["ratios"].items()]
    lines += [f"identical text to HF at {c} clients: {share:.0%} of requests" for c, share in
              result.get("same_text", {}).items()]
    lines += [f"identical text to the before server at {c} clients: {share:.0%} of requests" for c, share in
              result.get("same_text_before", {}).items()]
    lines += [f"{name}: not available ({why})" for name, why in result["not_available"].items()]
    return "\n".join(lines)


def _structured_table(rows: list[dict[str, Any]], keys: list[str]) -> str:
    names = {"impl": "implementation", "mode": "output", "clients": "clients", "tokens_per_s": "tokens/s",
             "tokens_per_request": "tokens/request", "valid_share": "valid"}
    return format_table(rows, [(k, names[k]) for k in keys])


def _int_list(flag: str) -> Callable[[str], list[int]]:
    def parse(text: str) -> list[int]:
        try:
            values = [int(v) for v in text.split(",")]
        except ValueError:
            values = []
        if not values or min(values) < 1:
            raise argparse.ArgumentTypeError(f"{flag} must look like 1,4,16 (integers >= 1), got {text!r}")
        return values
    return parse


_clients = _int_list("--clients")


def _names(allowed: Sequence[str], none: bool = False) -> Callable[[str], list[str]]:
    def parse(text: str) -> list[str]:
        if none and text == "none":
            return []
        values = text.split(",")
        bad = [v for v in values if v not in allowed]
        if bad or not values:
            raise argparse.ArgumentTypeError(f"{','.join(bad) or repr(text)} is not allowed; allowed: "
                                             f"{', '.join(allowed)}{' or none' if none else ''} (comma-separated)")
        return values
    return parse


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.serve", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny layers, 1,2 clients, few tokens: checks it runs")
    parser.add_argument("--workloads", type=_names(wl.WORKLOADS), default=list(wl.WORKLOADS),
                        help=f"comma-separated, of {', '.join(wl.WORKLOADS)} (default: all)")
    parser.add_argument("--clients", type=_clients, default=None, help="throughput's clients (default 1,4,16,64)")
    parser.add_argument("--before", metavar="DIR", help="also serve the tinygpt checkout DIR (its src/)")
    parser.add_argument("--hf", type=_names(HF_MODES, none=True), default=None,
                        help="transformers serve modes: plain, cb (--continuous-batching) or none (default "
                             "plain,cb)")
    parser.add_argument("--no-hf", dest="hf", action="store_const", const=[], help="the same as --hf none")
    parser.add_argument("--hf-continuous-batching", dest="hf", action="store_const", const=["cb"],
                        help="the same as --hf cb")
    parser.add_argument("--rounds", type=int, default=None, help="interleaved rounds per workload (default 3)")
    parser.add_argument("--phase-seconds", type=float, default=120.0,
                        help="a throughput phase's clients start no request after this (default 120)")
    parser.add_argument("--new-tokens", type=int, default=None, help="max_tokens per request (default 64)")
    parser.add_argument("--requests", type=int, default=None, help="requests per client (default 3; quick 1)")
    parser.add_argument("--max-batch", type=int, default=None, help="tinygpt's --max-batch (default: max clients)")
    parser.add_argument("--draft", metavar="MODEL", help="also serve this checkout with --draft MODEL")
    parser.add_argument("--device", default="cpu", help="where every server and the offline rows run (default cpu)")
    parser.add_argument("--model", metavar="DIR|HUBNAME",
                        help="serve this trained model (a tinygpt checkpoint, a Hugging Face GPT-2 folder or hub "
                             "name; as `tinygpt serve --model`) instead of random gpt2-small-shaped weights")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads of every server and of the offline rows (default: $OMP_NUM_THREADS, "
                             "else one per core)")
    parser.add_argument("--json", metavar="PATH", help="also write the results here as JSON")
    args = parser.parse_args(argv)
    for name in ("new_tokens", "requests", "max_batch", "rounds", "threads"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')}={value} must be >= 1")
    if args.phase_seconds <= 0:
        parser.error(f"--phase-seconds={args.phase_seconds} must be > 0")
    clients = args.clients or ([1, 2] if args.quick else [1, 4, 16, 64])
    hf = list(HF_MODES) if args.hf is None else args.hf
    # The servers (child processes) and the offline rows (this process) run with the same thread count, or the
    # 1-client ratio against offline ``generate`` would compare one thread with two.
    threads = args.threads or _env_threads() or pin_threads()
    torch.set_num_threads(threads)
    os.environ["OMP_NUM_THREADS"] = str(threads)  # inherited by every server process

    def compute() -> dict[str, Any]:
        return run(args.quick, clients=clients, new_tokens=args.new_tokens, requests=args.requests,
                   max_batch=args.max_batch, hf=hf, workloads=args.workloads, before=args.before,
                   rounds=args.rounds, phase_seconds=args.phase_seconds, draft=args.draft, device=args.device,
                   model=args.model, log=lambda line: print(line, file=sys.stderr, flush=True))

    def report(result: dict[str, Any]) -> str:
        return (f"{result['model']}, torch {torch.__version__}, {result['threads']} threads, "
                f"{result['new_tokens']} new tokens, "
                f"{result['requests_per_client']} requests per client, {result['rounds']} rounds"
                f"{' (quick mode: tiny sizes, figures mean nothing)' if args.quick else ''}\n" + table(result))

    return run_and_report(parser, compute, report, args.json)


def _env_threads() -> int | None:
    value = os.environ.get("OMP_NUM_THREADS", "")
    return int(value) if value.isdigit() and int(value) > 0 else None


if __name__ == "__main__":
    sys.exit(main())
