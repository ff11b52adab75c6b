"""The server's edge as a real process: a second SIGTERM exits at once; with the file-descriptor limit at 1024,
1,100 half-open connections leave ``/health`` answering, and running out of descriptors is logged once."""

from __future__ import annotations

import json
import os
import resource
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

TESTS = Path(__file__).resolve().parent
SRC = TESTS.parent / "src"

# A tiny model (each forward slowed by SLOW seconds) served by run_server with the ServeOptions given as JSON.
SCRIPT = """
import json, sys, time
from serving_support import tiny_model, tokenizer
from tinygpt.serving.app import create_app
from tinygpt.serving.options import ServeOptions
from tinygpt.serving.server import run_server

slow, options = float(sys.argv[1]), ServeOptions(**json.loads(sys.argv[2]))
model = tiny_model(context_length=256)
if slow:
    model.register_forward_pre_hook(lambda module, args: time.sleep(slow))
run_server(create_app(model, tokenizer(), options), announce=lambda url: print(url, flush=True))
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(slow: float = 0.0, fd_limit: int | None = None, **options) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(SRC), str(TESTS), os.environ.get("PYTHONPATH", "")]))

    def limit() -> None:
        if fd_limit is not None:
            resource.setrlimit(resource.RLIMIT_NOFILE, (fd_limit, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))

    options = {"port": port, "model_name": "m", "log_level": "warning", **options}
    process = subprocess.Popen([sys.executable, "-c", SCRIPT, str(slow), json.dumps(options)], env=env,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=limit)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        assert process.poll() is None, process.communicate()
        try:
            if httpx.get(url + "/health", timeout=2).json()["status"] == "ok":
                return process, url
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "the server did not come up"
        time.sleep(0.2)


def _stop(process: subprocess.Popen) -> tuple[str, str]:
    if process.poll() is None:
        process.kill()
    return process.communicate(timeout=30)


def _enough_descriptors(count: int) -> None:
    """This process holds ``count`` client sockets: raise the soft limit to the hard one if needed."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < count + 256:
        if hard != resource.RLIM_INFINITY and hard < count + 256:
            pytest.skip(f"needs {count + 256} file descriptors; the hard limit is {hard}")
        resource.setrlimit(resource.RLIMIT_NOFILE, (count + 256, hard))


def _half_open(url: str, count: int) -> list[socket.socket]:
    host, port = url.rsplit("/", 1)[1].split(":")
    socks = []
    for _ in range(count):
        s = socket.create_connection((host, int(port)), timeout=10)
        s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # the head never ends
        socks.append(s)
    return socks


@pytest.mark.slow
def test_a_second_sigterm_exits_at_once():
    process, url = _start(slow=0.05, shutdown_timeout=60)
    try:
        body = {"model": "m", "prompt": "The quick", "max_tokens": 200, "temperature": 0, "stream": True}
        with httpx.Client(timeout=60) as client, client.stream("POST", url + "/v1/completions", json=body) as r:
            lines = (line for line in r.iter_lines() if line.startswith("data: "))
            next(lines)
            process.send_signal(signal.SIGTERM)  # drains: the stream would go on for 10 s
            next(lines)
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pytest.fail("a second SIGTERM did not end the process")
        assert process.returncode == 128 + signal.SIGTERM
    finally:
        out, err = _stop(process)
    assert "second SIGTERM: exiting at once" in err


@pytest.mark.slow
def test_a_thousand_half_open_connections_leave_health_answering():
    _enough_descriptors(1100)
    process, url = _start(fd_limit=1024, header_timeout=60)
    socks = []
    try:
        socks = _half_open(url, 1100)  # more than the server's descriptors: before, it stopped accepting
        response = httpx.get(url + "/health", timeout=1)
        assert response.json()["status"] == "ok"
    finally:
        for s in socks:
            s.close()
        out, err = _stop(process)
    assert "Traceback" not in err


@pytest.mark.slow
def test_running_out_of_file_descriptors_is_logged_once():
    _enough_descriptors(1100)
    process, url = _start(fd_limit=256, max_connections=4000, header_timeout=60)  # the limit beyond the descriptors
    socks = []
    try:
        socks = _half_open(url, 300)  # beyond the 256 descriptors, within what the listen backlog holds
        time.sleep(3)  # asyncio retries accept() every second
        for s in socks:
            s.close()
        socks = []
        deadline = time.monotonic() + 30
        while True:  # the server recovers once the connections close
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the server did not recover"
            time.sleep(0.2)
    finally:
        for s in socks:
            s.close()
        out, err = _stop(process)
    assert err.count("cannot accept connections") == 1, err[-3000:]
    assert "Traceback" not in err
