"""Serving under load, float32, CPU: ``tinygpt serve`` vs Hugging Face ``transformers serve`` on the same weights.

    python -m benchmarks.serve [--quick] [--clients 1,4,16] [--new-tokens 64] [--requests N] [--json PATH]
                               [--max-batch N] [--no-hf]

gpt2-small-shaped random weights (biased QKV, tied head) with the GPT-2 tokenizer, saved once as a tinygpt
checkpoint and exported (``interop.hf.export_hf``) as a Hugging Face folder. Each server runs in its own process
on 127.0.0.1; one load driver (asyncio + httpx, in this process) plays C concurrent clients, each sending
``--requests`` streaming ``/v1/completions`` requests one after another: greedy, ``max_tokens`` new tokens after a
16-64-token prompt (slices of the-verdict.txt), after the same warm-up requests for every server. Per phase: aggregate completion tokens/s (the servers' own usage
counts over the phase's wall time), time to first token (p50/p95), the per-token latency (a request's time
from its first to its last token / (tokens - 1), p50), and the share of requests whose text is identical to HF's. tinygpt's own offline ``generate`` on the same prompts, one
at a time, is the 1-client yardstick. Phases are run server by server at each client count, back to back.

``transformers serve`` is started as it ships (no continuous batching; ``--hf-continuous-batching`` turns its
paged-attention scheduler on); if it cannot start here, its rows say why.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from tinygpt import GPTConfig, GPTModel, generate

from .common import format_table, pin_threads, run_and_report, shared_data_dir
from .models import gpt2_small

SRC = Path(__file__).resolve().parents[1] / "src"


def quick_serve_config() -> GPTConfig:
    """Tiny layers, but GPT-2's vocabulary (the servers speak text through the GPT-2 tokenizer)."""
    return GPTConfig(vocab_size=50257, context_length=128, emb_dim=64, n_heads=4, n_layers=2, qkv_bias=True,
                     tie_weights=True)


def _gpt2_tokenizer():
    from tinygpt.tokenizer import gpt2_tokenizer

    vocab = shared_data_dir() / "gpt2"
    return gpt2_tokenizer(vocab if (vocab / "encoder.json").is_file() else None)


def make_prompts(tokenizer: Any, count: int, lo: int, hi: int) -> list[str]:
    """``count`` texts of lo..hi GPT-2 tokens (spread evenly), cut from the-verdict.txt (or a fixed sentence)."""
    path = shared_data_dir() / "the-verdict.txt"
    text = path.read_text(encoding="utf-8") if path.is_file() else "Every effort moves you forward. " * 200
    ids = tokenizer.encode(text)
    out = []
    for i in range(count):
        length = lo + (i * 37) % (hi - lo + 1)
        start = (i * 97) % max(1, len(ids) - length)
        out.append(tokenizer.decode(ids[start:start + length]))
    return out


def prepare(directory: Path, config: GPTConfig) -> tuple[GPTModel, Any, Path, Path]:
    """The random model (seed 0), its tokenizer, and the same weights as a tinygpt checkpoint and an HF folder."""
    from tinygpt.interop.hf import export_hf

    torch.manual_seed(0)
    model = GPTModel(config).eval()
    tokenizer = _gpt2_tokenizer()
    ours, theirs = directory / "tinygpt", directory / "hf"
    model.save_pretrained(ours, tokenizer=tokenizer)
    export_hf(model, theirs, tokenizer=tokenizer)
    return model, tokenizer, ours, theirs


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """A server command in its own process, its log in a file; ``url`` once ``/health`` answers."""

    def __init__(self, name: str, command: list[str], port: int, log_dir: Path) -> None:
        self.name, self.url = name, f"http://127.0.0.1:{port}"
        env = dict(os.environ, PYTHONPATH=str(SRC) + os.pathsep + os.environ.get("PYTHONPATH", ""),
                   HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
        self.log = open(log_dir / f"{name}.log", "w")
        self.process = subprocess.Popen(command, env=env, stdout=self.log, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout: float) -> None:
        import httpx

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.name} exited with code {self.process.returncode} (log: {self.log.name})")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        raise RuntimeError(f"{self.name} did not answer /health within {timeout:.0f} s (log: {self.log.name})")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.log.close()


async def _one(client: Any, url: str, body: dict[str, Any]) -> dict[str, float]:
    """One streaming request: time to first text, first-to-last token time, tokens (the usage count)."""
    start = time.perf_counter()
    first = last = None
    chunks, tokens, text = 0, None, []
    async with client.stream("POST", url + "/v1/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"{url}: HTTP {response.status_code}: {(await response.aread())[:300]!r}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if event.get("usage"):
                tokens = event["usage"]["completion_tokens"]
            text += [c.get("text") or "" for c in event.get("choices", [])]
            if any(c.get("text") for c in event.get("choices", [])):
                now = time.perf_counter()
                first = first if first is not None else now
                last = now
                chunks += 1
    if first is None:
        raise RuntimeError(f"{url}: a request streamed no text")
    return {"ttft_s": first - start, "decode_s": last - first, "tokens": tokens if tokens is not None else chunks,
            "text": "".join(text)}


async def _load(url: str, bodies: list[list[dict[str, Any]]]) -> tuple[float, list[dict[str, float]]]:
    """Each client sends its bodies in turn, all clients at once; returns (wall seconds, every request's record)."""
    import httpx

    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=httpx.Limits(max_connections=64)) as client:
        async def client_loop(own: list[dict[str, Any]]) -> list[dict[str, float]]:
            return [await _one(client, url, body) for body in own]

        start = time.perf_counter()
        results = await asyncio.gather(*(client_loop(own) for own in bodies))
        wall = time.perf_counter() - start
    return wall, [r for own in results for r in own]


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    k = (len(ordered) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def phase_row(impl: str, clients: int, wall: float, records: list[dict[str, float]]) -> dict[str, Any]:
    tokens = sum(r["tokens"] for r in records)
    per_token = [r["decode_s"] / (r["tokens"] - 1) for r in records if r["tokens"] > 1]
    ttft = [r["ttft_s"] for r in records]
    return {"impl": impl, "clients": clients, "requests": len(records), "tokens": tokens, "wall_s": wall,
            "tokens_per_s": tokens / wall, "ttft_p50_ms": 1e3 * _percentile(ttft, 0.5),
            "ttft_p95_ms": 1e3 * _percentile(ttft, 0.95),
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


def run(quick: bool = False, *, clients: Sequence[int] = (1, 4, 16), new_tokens: int | None = None,
        requests: int | None = None, max_batch: int | None = None, hf: bool = True,
        hf_continuous_batching: bool = False, log: Callable[[str], None] = lambda line: None) -> dict[str, Any]:
    config = quick_serve_config() if quick else gpt2_small()
    new_tokens = new_tokens or (8 if quick else 64)
    requests = requests or (1 if quick else 3)
    max_batch = max_batch or max(clients)
    lo, hi = (8, 24) if quick else (16, 64)
    result: dict[str, Any] = {"quick": quick, "config": config.to_dict(), "new_tokens": new_tokens,
                              "requests_per_client": requests, "max_batch": max_batch, "clients": list(clients),
                              "threads": torch.get_num_threads(), "rows": [], "not_available": {}}
    with tempfile.TemporaryDirectory(prefix="tinygpt-bench-serve-") as tmp:
        tmp_dir = Path(tmp)
        log(f"building and saving the model ({'quick' if quick else 'gpt2-small'} shape) ...")
        model, tokenizer, ours, theirs = prepare(tmp_dir, config)
        prompts = make_prompts(tokenizer, max(clients) * requests, lo, hi)
        result["prompt_tokens"] = [len(tokenizer.encode(p)) for p in prompts]
        servers: dict[str, ServerProcess] = {}
        texts: dict[int, dict[str, list[str]]] = {}  # clients -> server -> the answers, in request order
        try:
            port = _free_port()
            servers["tinygpt"] = ServerProcess(
                "tinygpt", [sys.executable, "-m", "tinygpt", "serve", "--model", str(ours), "--port", str(port),
                            "--model-name", "bench", "--max-batch", str(max_batch), "--max-queue", "256",
                            "--log-level", "warning"], port, tmp_dir)
            if hf:
                port = _free_port()
                command = [sys.executable, "-c", "import sys; from transformers.cli.transformers import main; "
                           "sys.argv[0] = 'transformers'; sys.exit(main())", "serve", str(theirs), "--host",
                           "127.0.0.1", "--port", str(port), "--device", "cpu", "--dtype", "float32",
                           "--log-level", "warning"]
                if hf_continuous_batching:
                    command.append("--continuous-batching")
                servers["hf"] = ServerProcess("hf", command, port, tmp_dir)
            for name in list(servers):
                try:
                    servers[name].wait_ready(600)
                except RuntimeError as err:
                    log(f"{name}: not available: {err}")
                    result["not_available"][name] = str(err)
                    servers.pop(name).stop()
            names = {"tinygpt": "bench", "hf": str(theirs)}
            for name, server in servers.items():  # warm-up: the first calls of a process build kernels per shape
                warm = [{"model": names[name], "prompt": p, "max_tokens": new_tokens, "temperature": 0,
                         "stream": True} for p in prompts[-4:]]
                asyncio.run(_load(server.url, [warm]))
                asyncio.run(_load(server.url, [warm[:1]] * min(4, max(clients))))
            for c in clients:
                for name, server in servers.items():
                    # the same requests for both; tinygpt reports usage in the stream only when asked
                    extra = {"stream_options": {"include_usage": True}} if name == "tinygpt" else {}
                    bodies = [[{"model": names[name], "prompt": prompts[k * requests + r], "max_tokens": new_tokens,
                                "temperature": 0, "stream": True, **extra} for r in range(requests)]
                              for k in range(c)]
                    wall, records = asyncio.run(_load(server.url, bodies))
                    row = phase_row("tinygpt serve" if name == "tinygpt" else "HF transformers serve", c, wall,
                                    records)
                    texts.setdefault(c, {})[name] = [r["text"] for r in records]
                    log(f"{row['impl']:<22} {c:>3} clients: {row['tokens_per_s']:.1f} tok/s")
                    result["rows"].append(row)
        finally:
            for server in servers.values():
                server.stop()
        result["rows"].append(offline_row(model, tokenizer, prompts[:requests], new_tokens))
    # Same weights, greedy: the two servers should write the same text (float rounding may rarely flip a token).
    # Compared without U+FFFD: where the last tokens end inside a UTF-8 character, tinygpt shows the replacement
    # character (as ``stream_text`` does) and transformers serve drops the incomplete bytes.
    result["answers"] = texts
    result["same_text"] = {c: sum(a.replace("\ufffd", "") == b.replace("\ufffd", "")
                                  for a, b in zip(t["tinygpt"], t["hf"])) / len(t["tinygpt"])
                           for c, t in texts.items() if len(t) == 2}
    _ratios(result)
    return result


def _ratios(result: dict[str, Any]) -> None:
    """tinygpt / HF aggregate tokens/s at each client count, and tinygpt serve at 1 client / offline generate."""
    by = {(r["impl"], r["clients"]): r["tokens_per_s"] for r in result["rows"]}
    ratios = {}
    for c in result["clients"]:
        if ("HF transformers serve", c) in by and ("tinygpt serve", c) in by:
            ratios[f"tinygpt/hf at {c} clients"] = by[("tinygpt serve", c)] / by[("HF transformers serve", c)]
    if ("tinygpt serve", 1) in by:
        ratios["tinygpt serve/offline generate at 1 client"] = (
            by[("tinygpt serve", 1)] / by[("tinygpt offline generate", 1)])
    result["ratios"] = ratios


def table(result: dict[str, Any]) -> str:
    columns = [("impl", "implementation"), ("clients", "clients"), ("requests", "requests"),
               ("tokens_per_s", "tokens/s"), ("ttft_p50_ms", "TTFT p50 ms"), ("ttft_p95_ms", "TTFT p95 ms"),
               ("per_token_p50_ms", "per-token p50 ms")]
    lines = [format_table(result["rows"], columns), ""]
    lines += [f"{name}: {value:.2f}x" for name, value in result["ratios"].items()]
    lines += [f"identical text to HF at {c} clients: {share:.0%} of requests" for c, share in
              result.get("same_text", {}).items()]
    lines += [f"{name}: not available ({why})" for name, why in result["not_available"].items()]
    return "\n".join(lines)


def _clients(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"--clients must look like 1,4,16 (integers >= 1), got {text!r}")
    return values


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.serve", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny layers, 1,2 clients, 8 tokens: checks it runs")
    parser.add_argument("--clients", type=_clients, default=None, help="concurrent clients (default 1,4,16)")
    parser.add_argument("--new-tokens", type=int, default=None, help="max_tokens per request (default 64)")
    parser.add_argument("--requests", type=int, default=None, help="requests per client (default 3; quick 1)")
    parser.add_argument("--max-batch", type=int, default=None, help="tinygpt's --max-batch (default: max clients)")
    parser.add_argument("--no-hf", dest="hf", action="store_false", help="skip transformers serve")
    parser.add_argument("--hf-continuous-batching", action="store_true",
                        help="start transformers serve with --continuous-batching")
    parser.add_argument("--json", metavar="PATH", help="also write the results here as JSON")
    args = parser.parse_args(argv)
    for name in ("new_tokens", "requests", "max_batch"):
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')}={value} must be >= 1")
    clients = args.clients or ([1, 2] if args.quick else [1, 4, 16])
    pin_threads()

    def compute() -> dict[str, Any]:
        return run(args.quick, clients=clients, new_tokens=args.new_tokens, requests=args.requests,
                   max_batch=args.max_batch, hf=args.hf, hf_continuous_batching=args.hf_continuous_batching,
                   log=lambda line: print(line, file=sys.stderr, flush=True))

    def report(result: dict[str, Any]) -> str:
        return (f"torch {torch.__version__}, {result['threads']} threads, {result['new_tokens']} new tokens, "
                f"{result['requests_per_client']} requests per client"
                f"{' (quick mode: tiny sizes, figures mean nothing)' if args.quick else ''}\n" + table(result))

    return run_and_report(parser, compute, report, args.json)


if __name__ == "__main__":
    sys.exit(main())
