"""The serving benchmarks' machinery: server processes, streaming requests with per-text-event times, bounded loads.

Every request loop here is bounded: a load's clients stop starting requests at its deadline, and each request has
an HTTP timeout.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

SRC = Path(__file__).resolve().parents[1] / "src"
REQUEST_TIMEOUT_S = 600.0
LABELS = {"tinygpt": "tinygpt serve", "before": "tinygpt serve (before)", "hf": "HF transformers serve",
          "hf-cb": "HF transformers serve --continuous-batching", "no-prefix": "tinygpt serve --no-prefix-cache",
          "spec-off": "tinygpt serve --speculative off", "spec-lookup": "tinygpt serve --speculative lookup",
          "spec-draft": "tinygpt serve --draft"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_help(src: Path) -> str:
    """``tinygpt serve --help`` of the checkout whose ``src`` is given (to see which flags its server takes)."""
    env = dict(os.environ, PYTHONPATH=str(src))
    done = subprocess.run([sys.executable, "-m", "tinygpt", "serve", "--help"], env=env, capture_output=True,
                          text=True, timeout=120)
    return done.stdout


class ServerProcess:
    """A server command in its own process, its log in a file; ``url`` once ``/health`` answers. ``src``: the
    checkout whose tinygpt it imports (this one by default)."""

    def __init__(self, name: str, command: list[str], port: int, log_dir: Path, src: Path = SRC) -> None:
        self.name, self.url = name, f"http://127.0.0.1:{port}"
        env = dict(os.environ, PYTHONPATH=str(src) + os.pathsep + os.environ.get("PYTHONPATH", ""),
                   HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
        self.log = open(log_dir / f"{name.replace(' ', '_')}.log", "w")
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


async def stream_request(client: Any, url: str, body: dict[str, Any], record: dict[str, Any] | None = None
                         ) -> dict[str, Any]:
    """One streaming ``/v1/completions`` request; fills ``record`` (a new dict if None) as it goes and returns it:
    ``started`` (perf_counter), ``times`` (each text event's time from the start, appended live), then ``ttft_s``,
    ``decode_s`` (first to last text), ``tokens`` (the usage count, else the text events), ``text``, ``usage``.
    An empty answer counts its end as its first text. A body asking for ``logprobs`` gets an event per token, whose
    text may be empty (the server holds back a split UTF-8 character or a possible stop text): those count too, so
    ``times`` then holds one time per token rather than per piece of text."""
    record = {} if record is None else record
    record.update(started=time.perf_counter(), times=[], usage={})
    times, text = record["times"], []
    async with client.stream("POST", url + "/v1/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"{url}: HTTP {response.status_code}: {(await response.aread())[:300]!r}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            record["usage"] = event.get("usage") or record["usage"]
            choices = event.get("choices", [])
            pieces = [c.get("text") or "" for c in choices]
            text += pieces
            if any(pieces) or any((c.get("logprobs") or {}).get("tokens") for c in choices):
                times.append(time.perf_counter() - record["started"])
    if not times:  # the answer was empty (an end-of-text first): its end is the first (and last) output
        times.append(time.perf_counter() - record["started"])
    record.update(ttft_s=times[0], decode_s=times[-1] - times[0], text="".join(text),
                  tokens=record["usage"].get("completion_tokens", len(times)))
    return record


def stream_bodies(prompts: list[str], clients: int, requests: int, new_tokens: int, offset: int = 0
                  ) -> list[list[dict[str, Any]]]:
    """``clients`` lists of ``requests`` greedy streaming ``/v1/completions`` bodies each (usage in the stream), the
    prompts taken in turn from ``offset`` on (wrapping)."""
    return [[{"model": "bench", "prompt": prompts[(offset + c * requests + r) % len(prompts)], "max_tokens": new_tokens,
              "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
             for r in range(requests)] for c in range(clients)]


def client(max_connections: int = 64, keepalive: bool = True) -> Any:
    import httpx

    return httpx.AsyncClient(timeout=httpx.Timeout(REQUEST_TIMEOUT_S),
                             limits=httpx.Limits(max_connections=max_connections,
                                                 **({} if keepalive else {"max_keepalive_connections": 0})))


async def load(url: str, bodies: list[list[dict[str, Any]]], seconds: float | None = None, *,
               keepalive: bool = True) -> tuple[float, list[dict[str, Any]], bool]:
    """Each client sends its bodies in turn, all clients at once; a client starts no request after ``seconds``.
    Returns (wall seconds, every finished request's record in client order, whether the deadline cut it short).
    ``keepalive=False``: a new connection per request (for a server that closes kept-alive connections on its own
    schedule, as llama-server's HTTP library does, which a reused connection would meet as a disconnect)."""
    deadline = None if seconds is None else time.perf_counter() + seconds
    cut = False

    async with client(keepalive=keepalive) as http:
        async def client_loop(own: list[dict[str, Any]]) -> list[dict[str, Any]]:
            nonlocal cut
            out = []
            for body in own:
                if deadline is not None and time.perf_counter() > deadline:
                    cut = True
                    break
                out.append(await stream_request(http, url, body))
            return out

        start = time.perf_counter()
        results = await asyncio.gather(*(client_loop(own) for own in bodies))
        wall = time.perf_counter() - start
    return wall, [r for own in results for r in own], cut


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    k = (len(ordered) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def median_or_none(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def median_row(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """One row from the same measurement's rounds: the median of every number (keys of the first row), the
    tokens/s spread, and ``rounds``; other values from the first round."""
    out: dict[str, Any] = {}
    for key, value in rows[0].items():
        values = [r.get(key) for r in rows]
        if isinstance(value, (int, float)) and not isinstance(value, bool) and all(
                isinstance(v, (int, float)) for v in values):
            out[key] = statistics.median(values)
        else:
            out[key] = value
    if "tokens_per_s" in out:
        out["tokens_per_s_min"] = min(r["tokens_per_s"] for r in rows)
        out["tokens_per_s_max"] = max(r["tokens_per_s"] for r in rows)
    out["rounds"] = len(rows)
    return out


class Servers:
    """The server processes of one run, started together, each with the body its requests need."""

    def __init__(self, tmp_dir: Path, ours: Path, theirs: Path | str, max_batch: int, log: Callable[[str], None],
                 device: str = "cpu"):
        """``theirs``: the model as a Hugging Face folder, or why there is none (no HF server can start then)."""
        self.tmp_dir, self.ours, self.theirs, self.max_batch, self.log = tmp_dir, ours, theirs, max_batch, log
        self.device = device
        self.running: dict[str, ServerProcess] = {}
        self.not_available: dict[str, str] = {}
        self._help: dict[Path, str] = {}

    def flags_of(self, src: Path) -> str:
        if src not in self._help:
            self._help[src] = serve_help(src)
        return self._help[src]

    def add_tinygpt(self, key: str, src: Path, extra: Sequence[str] = ()) -> None:
        help_text = self.flags_of(src)
        missing = [f for f in extra if f.startswith("--") and f not in help_text]
        if missing:
            self.not_available[LABELS[key]] = f"this server has no {' '.join(missing)} flag"
            return
        port = free_port()
        model = self.ours if src == SRC else self.model_for(src)
        if model is None:
            return
        command = [sys.executable, "-m", "tinygpt", "serve", "--model", str(model), "--port", str(port),
                   "--model-name", "bench", "--log-level", "warning"]
        for flag, value in (("--max-batch", self.max_batch), ("--max-queue", 256), ("--device", self.device)):
            if flag in help_text:  # a later engine may size its batch otherwise
                command += [flag, str(value)]
        self.running[key] = ServerProcess(LABELS[key], command + list(extra), port, self.tmp_dir, src)

    def model_for(self, src: Path) -> Path | None:
        """The model folder as an older checkout can read it: a copy whose config.json leaves out the keys that
        checkout's ``GPTConfig`` does not know, when each such key holds its default here (the model then uses no
        feature the older code lacks); None (said in ``not_available``) when one does not."""
        import dataclasses
        import shutil

        code = "import dataclasses, json; from tinygpt.config import GPTConfig; " \
               "print(json.dumps([f.name for f in dataclasses.fields(GPTConfig)]))"
        known = set(json.loads(subprocess.run([sys.executable, "-c", code], env=dict(
            os.environ, PYTHONPATH=str(src)), capture_output=True, text=True, check=True).stdout))
        from tinygpt.config import GPTConfig

        config = json.loads((self.ours / "config.json").read_text())
        defaults = {f.name: f.default for f in dataclasses.fields(GPTConfig)}
        newer = [k for k in config if k not in known]
        if any(config[k] != defaults.get(k) for k in newer):
            self.not_available[LABELS["before"]] = f"the model uses {', '.join(newer)}, which {src} lacks"
            return None
        folder = self.tmp_dir / f"model-for-{abs(hash(str(src)))}"
        if not folder.exists():
            shutil.copytree(self.ours, folder)
            (folder / "config.json").write_text(json.dumps({k: v for k, v in config.items() if k in known},
                                                           indent=2))
        return folder

    def add_hf(self, key: str, continuous_batching: bool) -> None:
        from transformers.utils.import_utils import is_serve_available

        if isinstance(self.theirs, str):
            self.not_available[LABELS[key]] = self.theirs
            return
        if not is_serve_available():  # it would exit at start-up with an ImportError in its log
            self.not_available[LABELS[key]] = ("transformers serve needs its serving extras (fastapi, pydantic, "
                                               "uvicorn, openai): pip install 'transformers[serving]'")
            return
        port = free_port()
        command = [sys.executable, "-c", "import sys; from transformers.cli.transformers import main; "
                   "sys.argv[0] = 'transformers'; sys.exit(main())", "serve", str(self.theirs), "--host",
                   "127.0.0.1", "--port", str(port), "--device", self.device, "--dtype", "float32", "--log-level",
                   "warning"] + (["--continuous-batching"] if continuous_batching else [])
        self.running[key] = ServerProcess(LABELS[key], command, port, self.tmp_dir)

    def wait(self) -> None:
        for key in list(self.running):
            try:
                self.running[key].wait_ready(600)
            except RuntimeError as err:
                self.log(f"{LABELS[key]}: not available: {err}")
                self.not_available[LABELS[key]] = str(err)
                self.running.pop(key).stop()

    def body(self, key: str) -> Callable[[str, int], dict[str, Any]]:
        model = "bench" if not key.startswith("hf") else str(self.theirs)
        # tinygpt reports usage in the stream only when asked; transformers serve always does
        extra = {} if key.startswith("hf") else {"stream_options": {"include_usage": True}}
        return lambda prompt, max_tokens: {"model": model, "prompt": prompt, "max_tokens": max_tokens,
                                           "temperature": 0, "stream": True, **extra}

    def keys(self, wanted: Sequence[str]) -> list[str]:
        return [k for k in wanted if k in self.running]

    def stop(self) -> None:
        for server in self.running.values():  # signal every server first: they shut down side by side
            if server.process.poll() is None:
                server.process.terminate()
        for server in self.running.values():
            server.stop()


def rotated(keys: list[str], r: int) -> list[str]:
    return keys[r % len(keys):] + keys[:r % len(keys)] if keys else keys
