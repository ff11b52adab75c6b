"""tinygpt beside llama.cpp on the same weights: decode at batch 1, prompt processing, greedy agreement, per type.

Opt-in: it needs a llama.cpp build (never committed). The recipe, from the ``llama-cpp-python`` sdist's vendored
source (about 6 minutes on a quiet 2-core machine, 25 or more on a busy one):

    pip download --no-deps --no-binary :all: llama-cpp-python && tar xzf llama_cpp_python-*.tar.gz
    cp -r llama_cpp_python-*/vendor/llama.cpp llama.cpp && rm -f llama.cpp/.git && cd llama.cpp
    cmake -B build -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DBUILD_SHARED_LIBS=OFF -DLLAMA_OPENSSL=OFF \\
        -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_TESTS=OFF
    cmake --build build -j2 --target llama-bench llama-server

    python -m benchmarks.llamacpp --llama-bin llama.cpp/build/bin --threads 1 [--compile]

Each GGUF type is paired with the tinygpt weight type that stores the same bytes per weight or close: f32 with
float32, f16 with bfloat16 (two bytes), q8_0 with int8 (one byte and a scale: per 32 values in q8_0, per output
channel in tinygpt). tinygpt loads the model it exported (float32) and converts its linears (``fast.weights``).
llama.cpp's figures come from ``llama-bench`` (tg = decode, pp = prompt), tinygpt's from the same measurement
in-process (one forward over the prompt; for decode, ``generate`` at batch 1 of ``--decode`` tokens and of one
token, the rate being the other ``decode - 1`` tokens over the difference: as llama-bench's tg times its decode
calls alone, not its context's set-up; the JSON also keeps each ``generate`` call's end-to-end rate, ``*_e2e``);
the two alternate per round.
Greedy agreement: each prompt's greedy tokens from ``llama-server`` (/completion with token ids, temperature 0)
against tinygpt's with the same type, as the share of tokens equal before the first difference. tinygpt decodes
with the engine's lean step; ``--compile`` adds a second tinygpt decode column with the step compiled
(``GenerationConfig(compile=True)``; the compile itself happens in the warm-up, outside the timings).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import json
import socket
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch

from benchmarks.common import comma_list, format_table, run_and_report, shared_data_dir, time_interleaved
from benchmarks.weights import SHAPES, agreement
from tinygpt import GPTModel, generate
from tinygpt.fast.pages import huge_pages
from tinygpt.fast.weights import convert_weights
from tinygpt.checkpoint import load_checkpoint_tokenizer
from tinygpt.interop.gguf import write_gguf
from tinygpt.tokenizer import CharTokenizer, Tokenizer, gpt2_tokenizer

PAIRS = {"f32": "float32", "f16": "bfloat16", "q8_0": "int8"}


def tokenizer_for(model: GPTModel, source: str | None) -> Tokenizer:
    """The tokenizer the GGUF carries (llama.cpp refuses a file without one): the checkpoint's own with --model;
    for random weights, GPT-2's (from the offline copy beside the checkout, else tiktoken's cache) at V = 50,257,
    else a character vocabulary of V printable characters."""
    if source is not None:
        tokenizer = load_checkpoint_tokenizer(source)
        if tokenizer is None:
            raise ValueError(f"--model {source} has no tokenizer: llama.cpp needs one in the GGUF")
        return tokenizer
    v = model.config.vocab_size
    if v == 50257:
        return gpt2_tokenizer(shared_data_dir() / "gpt2" if (shared_data_dir() / "gpt2").is_dir() else None)
    return CharTokenizer(chr(0x21 + i) if 0x21 + i < 0x7F else chr(0xA1 + i) for i in range(v))


def llama_bench(binary: Path, gguf: Path, *, threads: int, prompt: int, decode: int) -> dict[str, float]:
    """llama-bench's tok/s for pp{prompt} and tg{decode} (one run each, its own repetitions)."""
    out = subprocess.run([str(binary / "llama-bench"), "-m", str(gguf), "-t", str(threads), "-p", str(prompt),
                          "-n", str(decode), "-r", "3", "-o", "json"], capture_output=True, text=True, check=True)
    rows = json.loads(out.stdout)
    return {("prompt" if r["n_prompt"] else "decode"): float(r["avg_ts"]) for r in rows}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def llama_server(binary: Path, gguf: Path, *, threads: int, context: int = 1024, parallel: int = 1) -> Iterator[str]:
    """A llama-server on ``gguf`` (127.0.0.1, a free port), its base URL while the block runs; stopped after.
    ``parallel`` slots (continuous batching), ``context`` tokens each."""
    port = _free_port()
    log = open(gguf.with_suffix(".llama-server.log"), "w")  # beside the file: read it when a request fails
    server = subprocess.Popen([str(binary / "llama-server"), "-m", str(gguf), "-t", str(threads), "-tb", str(threads),
                               "--host", "127.0.0.1", "--port", str(port), "-c", str(context * parallel), "-np",
                               str(parallel)],
                              stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                if time.monotonic() > deadline or server.poll() is not None:
                    raise RuntimeError(f"llama-server did not start on {gguf}") from None
                time.sleep(0.5)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.terminate()
        server.wait(timeout=30)
        log.close()


def completion(url: str, body: dict[str, Any]) -> dict[str, Any]:
    """llama-server's /completion answer to ``body``."""
    request = urllib.request.Request(f"{url}/completion", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=300) as r:
        return json.loads(r.read())


def llama_greedy(binary: Path, gguf: Path, prompts: list[list[int]], n: int, *, threads: int) -> list[list[int]]:
    """Greedy continuations of token-id prompts from llama-server (started, asked, stopped)."""
    with llama_server(binary, gguf, threads=threads) as url:
        return [list(completion(url, {"prompt": prompt, "n_predict": n, "temperature": 0, "top_k": 1,
                                      "cache_prompt": False, "ignore_eos": True, "return_tokens": True})["tokens"])
                for prompt in prompts]


def serve_phases(binary: Path, model: GPTModel, tokenizer: Tokenizer, gguf: Path, kind: str, *, threads: int,
                 clients: list[int], decode: int, repeats: int, compile: bool = False) -> list[dict[str, Any]]:
    """``tinygpt serve --weights PAIRS[kind]`` against ``llama-server`` on the ``kind`` file, both with ``threads``
    threads and a slot per client: at each client count, every client streams 2 greedy completions of ``decode``
    tokens (prompts of 16-48 tokens), the two servers alternating per round; tok/s over the phase, TTFT p50.
    With ``compile``, tinygpt's server compiles its decode steps (``serve --compile``)."""
    import asyncio
    import os
    import sys

    from benchmarks.serve import make_prompts, phase_row
    from benchmarks.serve_driver import ServerProcess, free_port, load, median_row, stream_bodies
    from tinygpt.checkpoint import save_model

    most = max(clients)
    folder = gguf.parent / f"tinygpt-{kind}"
    save_model(model, folder, tokenizer=tokenizer)
    texts = make_prompts(tokenizer, 4 * sum(clients) * (repeats + 1) + 8, 16, 48)  # every request its own prompt
    port = free_port()
    os.environ["OMP_NUM_THREADS"] = str(threads)  # the tinygpt server's threads (read at its start)
    ours = ServerProcess("tinygpt serve", [sys.executable, "-m", "tinygpt", "serve", "--model", str(folder),
                                           "--port", str(port), "--model-name", "bench", "--max-batch", str(most),
                                           "--weights", PAIRS[kind], "--log-level", "warning"]
                          + (["--compile"] if compile else []), port, gguf.parent)
    rows: dict[tuple[str, int], list[dict[str, Any]]] = {}
    offset = 0

    def bodies(count: int) -> list[list[dict[str, Any]]]:
        nonlocal offset
        out = stream_bodies(texts, count, 2, decode, offset)
        offset += 2 * count
        return out

    try:
        ours.wait_ready(300)
        context = min(model.config.context_length, max(512, 64 + decode))  # a slot holds a prompt and its answer
        with llama_server(binary, gguf, threads=threads, context=context, parallel=most) as theirs:
            # a new connection per request for both servers: llama-server closes kept-alive connections itself
            for url in (ours.url, theirs):  # warm-up at each client count (a compiled server compiles per layout)
                for count in clients:
                    asyncio.run(load(url, bodies(count), seconds=600, keepalive=False))
            for r in range(repeats):
                for name in (("tinygpt", "llama") if r % 2 == 0 else ("llama", "tinygpt")):
                    for count in clients:
                        url = ours.url if name == "tinygpt" else theirs
                        wall, records, _ = asyncio.run(load(url, bodies(count), seconds=300, keepalive=False))
                        rows.setdefault((name, count), []).append(phase_row(name, count, wall, records))
    finally:
        ours.stop()
    out = []
    for count in clients:
        mine, ref = median_row(rows[("tinygpt", count)]), median_row(rows[("llama", count)])
        out.append({"gguf": kind, "tinygpt": PAIRS[kind], "clients": count,
                    "llama_tok_s": ref["tokens_per_s"], "tinygpt_tok_s": mine["tokens_per_s"],
                    "ratio": mine["tokens_per_s"] / ref["tokens_per_s"],
                    "llama_ttft_p50_ms": ref["ttft_p50_ms"], "tinygpt_ttft_p50_ms": mine["ttft_p50_ms"]})
    return out


def run(binary: Path, model: GPTModel, tokenizer: Tokenizer, *, threads: int, prompt: int, decode: int,
        repeats: int, types: list[str], compile: bool = False, servers: list[int] | None = None) -> dict[str, Any]:
    torch.set_num_threads(threads)
    model.eval()
    v, c = model.config.vocab_size, model.config.context_length
    prompt, decode = min(prompt, c - 1), min(decode, c - 8)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, v, (8,), generator=g).tolist() for _ in range(4)]
    long_prompt = torch.randint(0, v, (1, prompt), generator=g)
    rows: list[dict[str, Any]] = []
    serving: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory() as tmp:
        for kind in types:
            gguf = Path(tmp) / f"model-{kind}.gguf"
            write_gguf(model, gguf, tokenizer, type=kind)
            ours = copy.deepcopy(model)
            convert_weights(ours, PAIRS[kind])
            huge_pages(ours)  # as every inference command's loader does (interop.load_pretrained)
            theirs: list[dict[str, float]] = []
            with torch.inference_mode():
                stats: dict[str, list[float]] = {name: [] for name in ("decode", "decode_e2e", "prompt", "compiled",
                                                                       "compiled_e2e")}
                decoders = {"decode": (ours, False)}
                if compile:  # its own copy: compiling lays bf16 weights out plain (``fast.weights.plain_weights``)
                    compiled = copy.deepcopy(model)
                    convert_weights(compiled, PAIRS[kind])
                    decoders["compiled"] = (compiled, True)
                timed = {"prompt": lambda: ours(long_prompt, last_only=True)}
                for name, (m, c) in decoders.items():  # n tokens, and the start alone: engine, prefill, 1st token
                    timed[name] = lambda m=m, c=c: generate(m, [prompts[0]], max_new_tokens=decode, compile=c)
                    timed[name + " start"] = lambda m=m, c=c: generate(m, [prompts[0]], max_new_tokens=1, compile=c)
                for _ in range(repeats):  # alternate: llama.cpp, then tinygpt, per round
                    theirs.append(llama_bench(binary, gguf, threads=threads, prompt=prompt, decode=decode))
                    t = {name: v["median_s"] for name, v in time_interleaved(timed, warmup=1, repeats=1).items()}
                    stats["prompt"].append(prompt / t["prompt"])
                    for name in decoders:  # as llama-bench's tg times its decode calls alone
                        stats[name].append((decode - 1) / (t[name] - t[name + " start"]))
                        stats[name + "_e2e"].append(decode / t[name])
                mine = generate(ours, prompts, max_new_tokens=32).rows()
            ref = llama_greedy(binary, gguf, prompts, 32, threads=threads)
            if servers:
                serving += serve_phases(binary, model, tokenizer, gguf, kind, threads=threads, clients=servers,
                                        decode=decode, repeats=repeats, compile=compile)
            med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
            l_dec, l_pre = med([r["decode"] for r in theirs]), med([r["prompt"] for r in theirs])
            rows.append({"gguf": kind, "tinygpt": PAIRS[kind], "llama_decode": l_dec, "tinygpt_decode":
                         med(stats["decode"]), "decode_ratio": med(stats["decode"]) / l_dec,
                         "tinygpt_decode_e2e": med(stats["decode_e2e"]), "llama_prompt": l_pre,
                         "tinygpt_prompt": med(stats["prompt"]), "prompt_ratio": med(stats["prompt"]) / l_pre,
                         "greedy_agreement": agreement(ref, mine)})
            if compile:
                rows[-1].update(tinygpt_compiled=med(stats["compiled"]), compiled_ratio=med(stats["compiled"]) / l_dec,
                                tinygpt_compiled_e2e=med(stats["compiled_e2e"]))
    return {"threads": threads, "prompt": prompt, "decode": decode, "config": dataclasses.asdict(model.config),
            "rows": rows, "servers": serving}


def table(result: dict[str, Any]) -> str:
    head = (f"{result['threads']} thread(s); decode {result['decode']} tokens at batch 1, prompt {result['prompt']} "
            f"tokens; ratio = tinygpt / llama.cpp")
    return head + "\n" + format_table(result["rows"], [
        ("gguf", "llama.cpp file"), ("tinygpt", "tinygpt weights"), ("llama_decode", "llama.cpp decode tok/s"),
        ("tinygpt_decode", "tinygpt decode tok/s"), ("decode_ratio", "ratio"),
        *([("tinygpt_compiled", "compiled tok/s"), ("compiled_ratio", "ratio")] if "tinygpt_compiled" in
          (result["rows"] or [{}])[0] else []), ("llama_prompt", "llama.cpp pp tok/s"),
        ("tinygpt_prompt", "tinygpt pp tok/s"), ("prompt_ratio", "ratio"), ("greedy_agreement", "greedy agree")]) + (
        "\n\nservers, streaming greedy completions (2 per client), tok/s over the phase; ratio = tinygpt / llama-server\n"
        + format_table(result["servers"], [
            ("gguf", "llama-server file"), ("tinygpt", "tinygpt serve --weights"), ("clients", "clients"),
            ("llama_tok_s", "llama-server tok/s"), ("tinygpt_tok_s", "tinygpt tok/s"), ("ratio", "ratio"),
            ("llama_ttft_p50_ms", "llama TTFT p50 ms"), ("tinygpt_ttft_p50_ms", "tinygpt TTFT p50 ms")])
        if result.get("servers") else "")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.llamacpp", description=__doc__.splitlines()[0])
    parser.add_argument("--llama-bin", required=True, help="the folder holding llama-bench and llama-server")
    parser.add_argument("--model", help="a tinygpt model folder (default: random weights, --shape's shapes)")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="gpt2-small", help="without --model")
    parser.add_argument("--types", default="f32,f16,q8_0", help="GGUF types, comma-separated (f32,f16,q8_0)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--decode", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--compile", action="store_true",
                        help="also time tinygpt's decode step compiled (and run --servers' tinygpt serve --compile)")
    parser.add_argument("--servers", metavar="CLIENTS", default="",
                        help="also run tinygpt serve against llama-server at these client counts, e.g. 1,16")
    parser.add_argument("--json", metavar="PATH")
    args = parser.parse_args(argv)

    def compute() -> dict[str, Any]:
        binary = Path(args.llama_bin)
        if not (binary / "llama-bench").is_file() or not (binary / "llama-server").is_file():
            raise ValueError(f"--llama-bin {binary} has no llama-bench and llama-server: build them (see the recipe "
                             f"in this module's docstring)")
        types = comma_list(args.types, list(PAIRS), "--types")
        if args.model:
            from tinygpt.checkpoint import load_model

            model = load_model(args.model)
        else:
            torch.manual_seed(0)
            model = GPTModel(SHAPES[args.shape])
        try:
            servers = [int(x) for x in args.servers.split(",") if x]
        except ValueError:
            raise ValueError(f"--servers {args.servers}: client counts, comma-separated, e.g. 1,16") from None
        if any(n < 1 for n in servers):
            raise ValueError(f"--servers {args.servers}: each client count must be >= 1")
        return run(binary, model, tokenizer_for(model, args.model), threads=args.threads, prompt=args.prompt,
                   decode=args.decode, repeats=args.repeats, types=types, compile=args.compile, servers=servers)

    return run_and_report(parser, compute, table, args.json)


if __name__ == "__main__":
    raise SystemExit(main())
