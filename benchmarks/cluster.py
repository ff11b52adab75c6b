"""Replicas on Ray Serve, CPU: aggregate throughput of 1 replica against 2 (one torch thread each), TTFT, the time a
killed replica takes to serve again, and Ray's proxy against ``tinygpt serve`` alone.

    python -m benchmarks.cluster [--quick] [--clients 32] [--requests 2] [--new-tokens 32] [--rounds 2]
                                 [--json PATH]

Random weights of a small GPT-2-vocabulary model (``--quick``: tinier) with the GPT-2 tokenizer, saved once. One
local Ray cluster (started here, its start timed) serves the deployment (``serving.replicas``) with 1 replica, then
2, then 1, ... (``--rounds`` of each, alternated: a slow spell of this shared machine hits both alike); each replica
runs one torch thread, ``--max-batch`` = the client count. ``tinygpt serve`` itself (one process, one thread) runs
beside it for the proxy's overhead at 1 client. Every request is greedy and streaming (``serve_driver``); every
loop is bounded.

The kill: with 2 replicas and 4 clients streaming, one replica's process is SIGKILLed; measured are what each
in-flight request got, the seconds until Ray has a replacement process, and until that process answers a request.
The autoscaling: ``--autoscale 1:2`` with a target of 4 requests in flight per replica, 16 clients; the seconds
until a second replica's process exists and until it answers.

Figures: tokens/s (median over rounds) at ``--clients`` for 1 and 2 replicas and their ratio (the target on 2
cores is >= 1.6x), TTFT p50/p95, per-token p50; at 1 client, tokens/s and TTFT through the proxy against the plain
server. The load average before and after is recorded beside them: on a machine shared with other work, the
figures are as noisy as that load.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Sequence

import torch

from tinygpt import GPTConfig, GPTModel, save_model

from .common import format_table, run_and_report
from .serve import _gpt2_tokenizer, make_prompts, phase_row, quick_serve_config
from .serve_driver import ServerProcess, free_port, load, median_row, stream_bodies

WAIT_S = 300.0


def default_config() -> GPTConfig:
    """Big enough that the forward, not Ray's proxy, decides the throughput: ~30M parameters with the head."""
    return GPTConfig(vocab_size=50257, context_length=256, emb_dim=384, n_heads=6, n_layers=6, qkv_bias=True,
                     tie_weights=True)


def _phase(impl: str, url: str | list[str], bodies: list[list[dict[str, Any]]],
           plain_pids: frozenset[int] | set[int] = frozenset()) -> dict[str, Any]:
    """One load phase; with several ``url`` the clients are split between them evenly (the ceiling without Ray).
    The row carries the cores each group of processes kept busy meanwhile (``cores``)."""
    urls = [url] if isinstance(url, str) else url

    async def all_servers() -> tuple[float, list[dict[str, Any]]]:
        start = time.perf_counter()
        parts = await asyncio.gather(*(load(u, bodies[i::len(urls)], seconds=WAIT_S) for i, u in enumerate(urls)))
        return time.perf_counter() - start, [r for _, records, _ in parts for r in records]

    before = _cpu_seconds(plain_pids)
    wall, records = asyncio.run(all_servers())
    row = phase_row(impl, len(bodies), wall, records)
    row["cores"] = _cpu_share(before, _cpu_seconds(plain_pids), wall)
    return row


def _is_replica(proc: Any) -> bool:
    """Whether a ``psutil.Process`` is a Ray Serve replica of tinygpt (by the name Ray gives its process)."""
    return "ServeReplica:tinygpt" in " ".join(proc.cmdline())


def _replica_pids() -> set[int]:
    import psutil

    found = set()
    for proc in psutil.Process().children(recursive=True):
        try:
            if _is_replica(proc) and proc.status() != psutil.STATUS_ZOMBIE:
                found.add(proc.pid)
        except psutil.Error:
            continue
    return found


def _cpu_seconds(plain_pids: frozenset[int] | set[int]) -> dict[int, tuple[str, float]]:
    """User + system CPU seconds so far of this process and every process under it, by pid, each with its group:
    ``replicas`` (Ray Serve replicas of tinygpt), ``plain servers`` (``tinygpt serve`` without Ray), ``ray`` (every
    other process Ray started: GCS, raylet, controller, proxy, dashboard, workers) and ``clients`` (this process:
    the 32 streaming clients and the Ray driver)."""
    import psutil

    me = psutil.Process()
    out: dict[int, tuple[str, float]] = {}
    for proc in [me, *me.children(recursive=True)]:
        try:
            times = proc.cpu_times()
            if proc.pid == me.pid:
                group = "clients"
            elif proc.pid in plain_pids:
                group = "plain servers"
            elif _is_replica(proc):
                group = "replicas"
            else:
                group = "ray"
            out[proc.pid] = (group, times.user + times.system)
        except psutil.Error:
            continue
    return out


def _cpu_share(before: dict[int, tuple[str, float]], after: dict[int, tuple[str, float]], wall: float
               ) -> dict[str, float]:
    """Cores each group kept busy between two ``_cpu_seconds`` samples (CPU seconds / wall seconds); a process
    that started in between counts from zero, one that ended is lost (none end inside a measured phase)."""
    share: dict[str, float] = {}
    for pid, (group, seconds) in after.items():
        share[group] = share.get(group, 0.0) + (seconds - before.get(pid, (group, 0.0))[1]) / wall
    return {group: round(value, 3) for group, value in sorted(share.items())}


def _load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def _kill_replica(url: str, new_tokens: int, prompts: list[str]) -> dict[str, Any]:
    """SIGKILL one of 2 replicas while 4 streams run; what they got, and how long until a replacement serves."""
    import httpx

    before = _replica_pids()
    outcomes: list[str] = []

    def stream(prompt: str) -> None:
        lines: list[str] = []
        try:
            with httpx.stream("POST", url + "/v1/completions", timeout=WAIT_S, json={
                    "model": "bench", "prompt": prompt, "max_tokens": new_tokens * 4, "temperature": 0,
                    "stream": True}) as response:
                lines = [line for line in response.iter_lines() if line]
            error = any('"error"' in line for line in lines)
            outcomes.append("error event + [DONE]" if error and lines[-1] == "data: [DONE]" else
                            "complete" if lines[-1:] == ["data: [DONE]"] else "cut")
        except httpx.HTTPError as err:
            outcomes.append(f"transport error ({type(err).__name__})")

    threads = [threading.Thread(target=stream, args=(p,)) for p in prompts[:4]]
    for t in threads:
        t.start()
    time.sleep(0.5)
    victim = min(before)
    killed = time.monotonic()
    os.kill(victim, signal.SIGKILL)
    for t in threads:
        t.join(WAIT_S)
    replaced = served = None
    while time.monotonic() - killed < WAIT_S:
        now = _replica_pids()
        if replaced is None and len(now) == 2 and victim not in now:
            replaced = time.monotonic() - killed
        if replaced is not None:
            new = (now - before).pop()
            response = httpx.post(url + "/v1/completions", timeout=WAIT_S, json={
                "model": "bench", "prompt": prompts[0], "max_tokens": 4, "temperature": 0})
            if response.status_code == 200 and response.headers.get("x-tinygpt-replica", "").startswith(f"{new}@"):
                served = time.monotonic() - killed
                break
        time.sleep(0.1)
    return {"in_flight": sorted(outcomes), "replacement_process_s": replaced, "replacement_serves_s": served}


def _autoscale(url: str, folder: Path, prompts: list[str], new_tokens: int, clients: int = 16,
               seconds: float = 90.0) -> dict[str, Any]:
    """``--autoscale 1:2`` with ``--max-batch 4`` (the target: 4 requests in flight per replica) under ``clients``
    clients: the seconds from the load's start until Ray has started the second replica's process, and until that
    replica has answered a request."""
    import httpx
    from ray import serve

    from tinygpt.serving.options import ServeOptions
    from tinygpt.serving.replica_options import ReplicaOptions
    from tinygpt.serving.replicas import APP_NAME, replica_deployment

    serve.run(replica_deployment(str(folder), ServeOptions(model_name="bench", max_batch=4),
                                 ReplicaOptions(autoscale="1:2")), name=APP_NAME, route_prefix="/")
    before = _replica_pids()
    started = time.monotonic()
    stop = started + seconds
    first: dict[str, float] = {}

    def client(i: int) -> None:
        while time.monotonic() < stop and "serves" not in first:
            response = httpx.post(url + "/v1/completions", timeout=WAIT_S, json={
                "model": "bench", "prompt": prompts[i % len(prompts)], "max_tokens": new_tokens, "temperature": 0})
            pid = response.headers.get("x-tinygpt-replica", "").split("@")[0]
            if pid and int(pid) not in before:
                first.setdefault("serves", time.monotonic() - started)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    while time.monotonic() < stop and "serves" not in first:
        if "process" not in first and len(_replica_pids() - before) > 0:
            first["process"] = time.monotonic() - started
        time.sleep(0.25)
    for t in threads:
        t.join(WAIT_S)
    return {"clients": clients, "second_replica_process_s": first.get("process"),
            "second_replica_serves_s": first.get("serves")}


def run(quick: bool = False, *, clients: int = 32, requests: int = 2, new_tokens: int = 32,
        rounds: int = 2) -> dict[str, Any]:
    from ray import serve

    from tinygpt.serving.options import ServeOptions
    from tinygpt.serving.replica_options import ReplicaOptions
    from tinygpt.serving.replicas import APP_NAME, replica_deployment, run_replicas, shutdown

    config = quick_serve_config() if quick else default_config()
    if quick:
        clients, requests, new_tokens, rounds = min(clients, 8), 1, min(new_tokens, 8), 1
    tokenizer = _gpt2_tokenizer()
    prompts = make_prompts(tokenizer, clients * requests * rounds * 2 + 8, 16, 48)
    result: dict[str, Any] = {"config": config.to_dict(), "clients": clients, "requests": requests,
                              "new_tokens": new_tokens, "rounds": rounds, "cores": os.cpu_count(),
                              "load_average_before": _load_average()}
    with tempfile.TemporaryDirectory(prefix="tinygpt-bench-cluster-") as tmp:
        torch.manual_seed(0)
        folder = Path(tmp) / "model"
        save_model(GPTModel(config).eval(), folder, tokenizer=tokenizer)
        options = ServeOptions(port=free_port(), model_name="bench", max_batch=clients, log_level="warning")
        plain_port = free_port()
        os.environ["OMP_NUM_THREADS"] = "1"  # the plain server's single thread (the replicas set their own)
        plain = ServerProcess("tinygpt serve", [sys.executable, "-m", "tinygpt", "serve", "--model", str(folder),
                                                "--port", str(plain_port), "--model-name", "bench", "--max-batch",
                                                str(clients), "--log-level", "warning"], plain_port, Path(tmp))
        second_port = free_port()
        second = ServerProcess("tinygpt serve 2", [sys.executable, "-m", "tinygpt", "serve", "--model", str(folder),
                                                   "--port", str(second_port), "--model-name", "bench",
                                                   "--max-batch", str(clients), "--log-level", "warning"],
                               second_port, Path(tmp))
        plain_pids = {plain.process.pid, second.process.pid}
        try:
            started = time.monotonic()
            url = run_replicas(str(folder), options, ReplicaOptions(replicas=1))
            result["ray_start_s"] = time.monotonic() - started
            plain.wait_ready(WAIT_S)
            second.wait_ready(WAIT_S)
            rows: dict[str, list[dict[str, Any]]] = {"plain": [], "plain2": [], "ray1": [], "ray2": [],
                                                     "plain_1": [], "ray1_1": []}
            offset = 0

            def bodies(count: int) -> list[list[dict[str, Any]]]:
                nonlocal offset
                out = stream_bodies(prompts, count, requests, new_tokens, offset)
                offset = (offset + count * requests) % len(prompts)
                return out

            for r in range(rounds):
                for replicas in ((1, 2) if r % 2 == 0 else (2, 1)):
                    started = time.monotonic()
                    serve.run(replica_deployment(str(folder), options, ReplicaOptions(replicas=replicas)),
                              name=APP_NAME, route_prefix="/")
                    result.setdefault(f"redeploy_to_{replicas}_s", []).append(time.monotonic() - started)
                    _phase("warm-up", url, bodies(2))
                    rows[f"ray{replicas}"].append(_phase(f"Ray Serve, {replicas} replica(s) x 1 thread", url,
                                                         bodies(clients), plain_pids))
                    if replicas == 1:
                        rows["ray1_1"].append(_phase("Ray Serve, 1 replica, 1 client", url, bodies(1), plain_pids))
                rows["plain"].append(_phase("tinygpt serve (no Ray), 1 thread", plain.url, bodies(clients),
                                            plain_pids))
                rows["plain2"].append(_phase("2 x tinygpt serve (no Ray), clients split", [plain.url, second.url],
                                             bodies(clients), plain_pids))
                rows["plain_1"].append(_phase("tinygpt serve (no Ray), 1 client", plain.url, bodies(1), plain_pids))
            result["rows"] = {key: median_row(value) for key, value in rows.items() if value}
            one, two = result["rows"]["ray1"], result["rows"]["ray2"]
            result["speedup_2_over_1"] = two["tokens_per_s"] / one["tokens_per_s"]
            result["per_round_speedup"] = [b["tokens_per_s"] / a["tokens_per_s"]
                                           for a, b in zip(rows["ray1"], rows["ray2"])]
            # the machine's own ceiling: two engines on two cores with the clients beside them, no Ray
            result["plain_2_over_1"] = result["rows"]["plain2"]["tokens_per_s"] / result["rows"]["plain"]["tokens_per_s"]
            result["cores_busy"] = {key: [r["cores"] for r in value] for key, value in rows.items() if value}
            p1, r1 = result["rows"]["plain_1"], result["rows"]["ray1_1"]
            result["proxy_1_client"] = {"tokens_per_s_ratio": r1["tokens_per_s"] / p1["tokens_per_s"],
                                        "ttft_p50_extra_ms": r1["ttft_p50_ms"] - p1["ttft_p50_ms"],
                                        "per_token_p50_extra_ms": (r1["per_token_p50_ms"] or 0)
                                        - (p1["per_token_p50_ms"] or 0)}
            serve.run(replica_deployment(str(folder), options, ReplicaOptions(replicas=2)), name=APP_NAME,
                      route_prefix="/")
            result["kill"] = _kill_replica(url, new_tokens, prompts)
            result["autoscale"] = _autoscale(url, folder, prompts, new_tokens)
        finally:
            plain.stop()
            second.stop()
            shutdown()
    result["load_average_after"] = _load_average()
    return result


def table(result: dict[str, Any]) -> str:
    rows = list(result["rows"].values())
    text = format_table(rows, [("impl", "server"), ("clients", "clients"), ("tokens_per_s", "tok/s"),
                               ("tokens_per_s_min", "min"), ("tokens_per_s_max", "max"),
                               ("ttft_p50_ms", "TTFT p50 ms"), ("ttft_p95_ms", "TTFT p95 ms"),
                               ("per_token_p50_ms", "per-token p50 ms"), ("rounds", "rounds")])
    proxy, kill = result["proxy_1_client"], result["kill"]
    return "\n".join([
        text,
        f"2 replicas / 1 replica at {result['clients']} clients: {result['speedup_2_over_1']:.2f}x "
        f"(rounds: {', '.join(f'{x:.2f}' for x in result['per_round_speedup'])}; target >= 1.6x)",
        f"without Ray, 2 x tinygpt serve (clients split) / 1 x tinygpt serve: {result['plain_2_over_1']:.2f}x",
        *(f"cores busy, {key} (per round): " + "; ".join(", ".join(f"{g} {v:.2f}" for g, v in r.items())
                                                          for r in rounds)
          for key, rounds in result["cores_busy"].items() if key in ("ray1", "ray2", "plain", "plain2")),
        f"Ray's proxy at 1 client: {proxy['tokens_per_s_ratio']:.2f}x the plain server's tok/s, TTFT p50 "
        f"{proxy['ttft_p50_extra_ms']:+.1f} ms, per-token p50 {proxy['per_token_p50_extra_ms']:+.2f} ms",
        f"killed replica: in-flight requests {kill['in_flight']}; a replacement process after "
        f"{_seconds(kill['replacement_process_s'])}, serving after {_seconds(kill['replacement_serves_s'])}",
        f"--autoscale 1:2 (target 4 in flight per replica) under {result['autoscale']['clients']} clients: a second "
        f"replica's process after {_seconds(result['autoscale']['second_replica_process_s'])}, serving after "
        f"{_seconds(result['autoscale']['second_replica_serves_s'])}",
        f"Ray cluster start (first replica up): {result['ray_start_s']:.1f} s; load average before "
        f"{result['load_average_before']}, after {result['load_average_after']} on {result['cores']} cores",
    ])


def _seconds(value: float | None) -> str:
    return "never (within the bound)" if value is None else f"{value:.1f} s"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.cluster", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a tinier model and load: a smoke run")
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--requests", type=int, default=2, help="requests each client sends, one after another")
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2, help="alternations of 1 and 2 replicas")
    parser.add_argument("--json", help="also write the result here")
    args = parser.parse_args(argv)
    return run_and_report(parser, lambda: run(args.quick, clients=args.clients, requests=args.requests,
                                              new_tokens=args.new_tokens, rounds=args.rounds), table, args.json)


if __name__ == "__main__":
    raise SystemExit(main())
