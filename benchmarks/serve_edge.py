"""The second hostile-client probe of ``tinygpt serve`` (issue 43), scaled to a small machine: the requests that
showed faults E1, E2, E5, E6, E7, E8, E9 and E14, each measured against a live server (or the GGUF reader) with
the default settings. Run it on a checkout before the fixes and on one after, on the same machine, and compare:

    PYTHONPATH=<checkout>/src python -m benchmarks.serve_edge [--json F]

Everything uses what both versions have (``create_app``'s defaults, ``BackgroundServer``), so the same command
measures both. Each probe is bounded (a client timeout, a child process killed after its limit), so a fault that
used to hang shows as "no answer within N s". The model is a small random GPT (emb 256, 4 blocks, context 512)
with a BPE tokenizer trained here: the figures are this model's, not gpt2-small's; the probe itself used larger
requests.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable

import httpx
import psutil
import torch

TEXT = ("The quick brown fox jumps over the lazy dog. Every effort moves you forward. Below is an instruction that "
        "describes a task. Write a response that appropriately completes the request.\n\n### Instruction:\nName a "
        "colour.\n\n### Response:\nBlue.\n") * 4
LOOPING = ("{% for i in range(99999) %}{% for j in range(99999) %}{% if messages[0]['content'] == 'x' %}"
           "{% endif %}{% endfor %}{% endfor %}{{ messages[0]['content'] }}")


def _model_and_tokenizer() -> tuple[Any, Any]:
    from tinygpt import GPTConfig, GPTModel
    from tinygpt.alignment import data
    from tinygpt.tokenizer import BPETokenizer

    template = getattr(data, "ALPACA_CHAT_TEMPLATE_V1", data.ALPACA_CHAT_TEMPLATE)  # the one checkpoints carry
    tokenizer = BPETokenizer.train([TEXT], 300).with_chat_template(template)
    torch.manual_seed(0)
    model = GPTModel(GPTConfig(vocab_size=tokenizer.vocab_size, context_length=512, emb_dim=256, n_heads=4,
                               n_layers=4)).eval()
    return model, tokenizer


class _Server:
    """A live server in this process, with its RSS sampled every 10 ms while it runs."""

    def __init__(self, model: Any, tokenizer: Any) -> None:
        from tinygpt.serving.app import create_app
        from tinygpt.serving.server import BackgroundServer

        self.background = BackgroundServer(create_app(model, tokenizer, model_name="m"))
        self.peak, self.stop = 0, threading.Event()

    def __enter__(self) -> "_Server":
        self.background.__enter__()
        self.url = self.background.url
        self.rss_start = psutil.Process().memory_info().rss
        threading.Thread(target=self._sample, daemon=True).start()
        return self

    def _sample(self) -> None:
        while not self.stop.is_set():
            self.peak = max(self.peak, psutil.Process().memory_info().rss)
            time.sleep(0.01)

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.background.__exit__(*exc)

    def growth_mb(self) -> float:
        return round((self.peak - self.rss_start) / 2 ** 20, 1)


def _timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    start = time.monotonic()
    try:
        result = fn()
    except httpx.TimeoutException:
        result = "no answer"
    return result, round(time.monotonic() - start, 2)


def _health_watch(url: str, stop: threading.Event, worst: list[float]) -> None:
    """The slowest /health answer while ``stop`` is not set."""
    while not stop.is_set():
        _, seconds = _timed(lambda: httpx.get(url + "/health", timeout=60))
        worst[0] = max(worst[0], seconds)
        time.sleep(0.05)


def probe_e1(model: Any, tokenizer: Any) -> dict[str, Any]:
    """A chat of a 10,000-character system text and 40 turns under the template checkpoints carry."""
    messages = [{"role": "system", "content": "s" * 10000}]
    messages += [{"role": r, "content": "x"} for _ in range(40) for r in ("user", "assistant")]
    messages.append({"role": "user", "content": "x"})
    with _Server(model, tokenizer) as server:
        stop, worst = threading.Event(), [0.0]
        watcher = threading.Thread(target=_health_watch, args=(server.url, stop, worst))
        watcher.start()
        r, seconds = _timed(lambda: httpx.post(server.url + "/v1/chat/completions", json={"messages": messages},
                                               timeout=120))
        stop.set()
        watcher.join()
        return {"body_kb": round(len(json.dumps({"messages": messages})) / 1024, 1),
                "status": getattr(r, "status_code", r), "seconds": seconds, "rss_growth_mb": server.growth_mb(),
                "slowest_health_s": worst[0]}


def _stream_gaps(url: str, body: dict[str, Any], gaps: list[float]) -> None:
    last = None
    with httpx.Client(timeout=300) as client, client.stream("POST", url + "/v1/completions", json=body) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                now = time.monotonic()
                if last is not None:
                    gaps.append(now - last)
                last = now


def probe_e2(model: Any, tokenizer: Any) -> dict[str, Any]:
    """A stream's longest gap while one request scores 4 prompts of ~500 tokens with n 16 (echo + logprobs)."""
    prompts = [tokenizer.decode(tokenizer.encode(TEXT * 3)[i:i + 500]) for i in range(4)]
    with _Server(model, tokenizer) as server:
        gaps: list[float] = []
        stream = threading.Thread(target=_stream_gaps, args=(server.url, {
            "prompt": "Every effort", "max_tokens": 300, "temperature": 0, "stream": True}, gaps))
        stream.start()
        while len(gaps) < 5:
            time.sleep(0.01)
        r, seconds = _timed(lambda: httpx.post(server.url + "/v1/completions", json={
            "prompt": prompts, "echo": True, "logprobs": 1, "n": 16, "max_tokens": 1}, timeout=300))
        stream.join()
        return {"status": getattr(r, "status_code", r), "seconds": seconds,
                "stream_longest_gap_s": round(max(gaps), 2), "stream_median_gap_s": round(sorted(gaps)[len(gaps) // 2], 3)}


def probe_e6(model: Any, tokenizer: Any) -> dict[str, Any]:
    """A chat template that loops on a trigger word: the chat request, then a plain completion."""
    with _Server(model, tokenizer.with_chat_template(LOOPING)) as server:
        r, seconds = _timed(lambda: httpx.post(server.url + "/v1/chat/completions", json={
            "messages": [{"role": "user", "content": "x"}], "max_tokens": 2}, timeout=15))
        after, after_s = _timed(lambda: httpx.post(server.url + "/v1/completions", json={
            "prompt": "x", "max_tokens": 2}, timeout=15))
        return {"status": getattr(r, "status_code", r), "seconds": seconds,
                "completion_after": getattr(after, "status_code", after), "completion_after_s": after_s}


def probe_e9(model: Any, tokenizer: Any) -> dict[str, Any]:
    """A 2-token completion's latency, idle and during 24 concurrent /tokenize calls of 256 KB each."""
    text = ("Every effort moves you forward. " * 9000)[:256 * 1024]
    with _Server(model, tokenizer) as server, concurrent.futures.ThreadPoolExecutor(24) as pool:
        small = {"prompt": "Every", "max_tokens": 2}
        _, idle = _timed(lambda: httpx.post(server.url + "/v1/completions", json=small, timeout=300))
        flood = [pool.submit(httpx.post, server.url + "/tokenize", json={"prompt": text}, timeout=300)
                 for _ in range(24)]
        time.sleep(0.5)
        _, busy = _timed(lambda: httpx.post(server.url + "/v1/completions", json=small, timeout=300))
        for f in flood:
            f.result()
        return {"idle_s": idle, "during_tokenize_flood_s": busy}


def probe_e14(model: Any, tokenizer: Any, seconds: float = 10.0) -> dict[str, Any]:
    """Greedy requests completed by 4 looping clients in ``seconds``, alone and with 3 looping /inspect clients."""
    def run(inspectors: int) -> int:
        with _Server(model, tokenizer) as server:
            stop, done = threading.Event(), [0]

            def client() -> None:
                while not stop.is_set():
                    httpx.post(server.url + "/v1/completions", json={"prompt": "Every effort", "max_tokens": 16,
                                                                       "temperature": 0}, timeout=300)
                    done[0] += 1

            def inspector() -> None:
                while not stop.is_set():
                    httpx.post(server.url + "/inspect", json={"text": TEXT[:400], "logit_lens": True}, timeout=300)

            threads = [threading.Thread(target=client) for _ in range(4)]
            threads += [threading.Thread(target=inspector) for _ in range(inspectors)]
            for t in threads:
                t.start()
            time.sleep(seconds)
            count = done[0]
            stop.set()
            for t in threads:
                t.join()
            return count

    alone, flooded = run(0), run(3)
    return {"completed_alone": alone, "completed_with_inspect_flood": flooded,
            "ratio": round(flooded / max(alone, 1), 3)}


def _child(code: str, limit: float) -> dict[str, Any]:
    """Run ``code`` in a child python; its wall time, peak RSS and last line, or "killed after N s"."""
    start = time.monotonic()
    process = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, env=os.environ.copy())
    peak = 0
    while process.poll() is None and time.monotonic() - start < limit:
        try:
            peak = max(peak, psutil.Process(process.pid).memory_info().rss)
        except psutil.Error:
            pass
        time.sleep(0.05)
    if process.poll() is None:
        process.kill()
        process.wait()
        return {"outcome": f"killed after {limit:g} s", "peak_mb": round(peak / 2 ** 20)}
    lines = process.stdout.read().strip().splitlines()
    return {"outcome": (lines or [""])[-1][:160], "seconds": round(time.monotonic() - start, 2),
            "peak_mb": round(peak / 2 ** 20)}


def probe_files(folder: Path) -> dict[str, Any]:
    """E5 (an array claiming 2^62 items), E7 (a config claiming 20,000 blocks), E8 (tensors all at offset 0)."""
    import struct

    import gguf

    from tinygpt import GPTConfig, GPTModel
    from tinygpt.interop.gguf import gguf_tensors

    def string(text: str) -> bytes:
        return struct.pack("<Q", len(text)) + text.encode()

    head = string("general.architecture") + struct.pack("<I", 8) + string("gpt2")
    array = string("x") + struct.pack("<IIQ", 9, 0, 2 ** 62)
    (folder / "e5.gguf").write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 2) + head + array)
    infos = b"".join(string(f"blk.{i}.attn_norm.weight") + struct.pack("<IQIQ", 1, 8, 0, 0) for i in range(1925))
    data = b"GGUF" + struct.pack("<IQQ", 3, 1925, 1) + head + infos
    (folder / "e8.gguf").write_bytes(data + b"\0" * (-len(data) % 32) + b"\0" * 32)
    model = GPTModel(GPTConfig(vocab_size=64, context_length=16, emb_dim=8, n_heads=2, n_layers=2))
    config = json.loads(model.config.to_json()) | {"n_layers": 20000}
    writer = gguf.GGUFWriter(folder / "e7.gguf", "gpt2")
    writer.add_string("tinygpt.config", json.dumps(config))
    for name, tensor in gguf_tensors(model.state_dict(), model.config).items():
        writer.add_tensor(name, tensor.numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    run = ("from tinygpt.interop.gguf import load_gguf, read_gguf\n"
           "try:\n    r = {fn}({path!r})\n    print('loaded', len(getattr(r, 'shapes', {{}}) or r[0].state_dict()))\n"
           "except Exception as e:\n    print('refused:', type(e).__name__, str(e)[:120])\n")
    return {"e5": _child(run.format(fn="read_gguf", path=str(folder / "e5.gguf")), 20),
            "e7": _child(run.format(fn="load_gguf", path=str(folder / "e7.gguf")), 120),
            "e8": _child(run.format(fn="read_gguf", path=str(folder / "e8.gguf")), 60)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--only", help="comma-separated probes (e1,e2,e6,e9,e14,files)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    model, tokenizer = _model_and_tokenizer()
    probes: dict[str, Callable[[], dict[str, Any]]] = {
        "e1": lambda: probe_e1(model, tokenizer), "e2": lambda: probe_e2(model, tokenizer),
        "e6": lambda: probe_e6(model, tokenizer), "e9": lambda: probe_e9(model, tokenizer),
        "e14": lambda: probe_e14(model, tokenizer)}
    wanted = args.only.split(",") if args.only else ["e1", "e2", "e9", "e14", "files", "e6"]  # e6 last: it hangs
    result: dict[str, Any] = {"load_average": os.getloadavg(), "tinygpt": str(Path(__import__("tinygpt").__file__))}
    for name in wanted:
        if name == "files":
            with tempfile.TemporaryDirectory() as folder:
                result.update(probe_files(Path(folder)))
        else:
            result[name] = probes[name]()
        print(name, json.dumps(result.get(name, {k: result[k] for k in ("e5", "e7", "e8") if k in result})),
              flush=True)
    result["load_average_after"] = os.getloadavg()
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)  # before the fixes a looping template leaves a thread that never ends: do not wait for it
