"""``tinygpt serve``: its flag errors are one line with exit 2; a real process serves, and on SIGTERM lets the
in-flight request finish and exits 0."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from serving_support import tiny_model, tokenizer
from tinygpt import save_model
from tinygpt.cli import main

SRC = Path(__file__).resolve().parents[1] / "src"


@pytest.fixture
def model_dir(tmp_path):
    save_model(tiny_model(context_length=64), tmp_path / "m", tokenizer=tokenizer())
    return tmp_path / "m"


@pytest.mark.parametrize("flags, message", [
    (["--max-batch", "0"], "--max-batch 0 must be an integer >= 1"),
    (["--max-queue", "-1"], "--max-queue -1 must be an integer >= 0"),
    (["--port", "70000"], "--port 70000 must be an integer in [0, 65535]"),
    (["--api-key", " "], "--api-key must not be empty"),
    (["--speculative", "draft"], "--speculative draft needs --draft MODEL: the model that drafts"),
    (["--speculative", "lookup", "--draft", "x"], "--speculative lookup conflicts with --draft MODEL (drafts come "
                                                  "from the model: --speculative draft)"),
    # issue 43, E10: settings no request could be served with were accepted, then every long request was a 500
    (["--cache-tokens", "32"], "--cache-tokens 32 holds 32 positions, but one row may need 64 (the model's context "
                               "of 64): raise --cache-tokens"),
    (["--speculative", "lookup", "--speculative-tokens", "100000"],
     "the default cache (--max-batch 8 x the context) holds 512 positions, but one row may need 100064 (the model's "
     "context of 64 + --speculative-tokens 100000): raise --cache-tokens or lower --speculative-tokens"),
    (["--weights", "int8", "--adapter", "a=x"], "--weights int8 cannot serve --adapter: LoRA adapters attach to "
                                                "float32 linears (merge the adapter into the model with tinygpt "
                                                "merge, then serve that with --weights)"),
])
def test_bad_flags_are_one_line_errors(model_dir, capsys, flags, message):
    assert main(["serve", "--model", str(model_dir), *flags]) == 2
    err = capsys.readouterr().err
    assert err.strip() == f"tinygpt serve: error: {message}"


def test_a_model_without_a_tokenizer_is_refused(tmp_path, capsys):
    save_model(tiny_model(), tmp_path / "bare")
    assert main(["serve", "--model", str(tmp_path / "bare")]) == 2
    assert "has no tokenizer: pass --tokenizer-dir" in capsys.readouterr().err


def test_an_address_in_use_is_a_one_line_error(model_dir, capsys):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert main(["serve", "--model", str(model_dir), "--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"tinygpt serve: error: cannot listen on 127.0.0.1:{port}:") and err.count("\n") == 1


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_the_server_process_finishes_in_flight_requests_on_sigterm_and_exits_0(model_dir):
    port = _free_port()
    env = dict(os.environ, PYTHONPATH=str(SRC) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    process = subprocess.Popen(
        [sys.executable, "-m", "tinygpt", "serve", "--model", str(model_dir), "--port", str(port),
         "--model-name", "m", "--shutdown-timeout", "20", "--log-level", "warning"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert process.poll() is None, process.communicate()
            try:
                if httpx.get(url + "/health", timeout=2).json()["status"] == "ok":
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the server did not come up"
            time.sleep(0.2)
        body = {"model": "m", "prompt": "The quick", "max_tokens": 50, "temperature": 0, "stream": True}
        events = []
        with httpx.Client(timeout=60) as client, client.stream("POST", url + "/v1/completions", json=body) as r:
            assert r.status_code == 200, r.read()
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    if len(events) == 2:
                        process.send_signal(signal.SIGTERM)  # mid-stream
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2])["choices"][0]["finish_reason"] in ("length", "stop")
        out, err = process.communicate(timeout=60)
        assert process.returncode == 0, err
        assert "Traceback" not in err
        assert f"on http://127.0.0.1:{port}" in out
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()


def test_a_draft_model_with_another_vocabulary_is_refused(model_dir, tmp_path, capsys):
    from tinygpt import GPTModel

    save_model(GPTModel(tiny_model(context_length=64).config.replace(vocab_size=tokenizer().vocab_size + 5)),
               tmp_path / "d")
    assert main(["serve", "--model", str(model_dir), "--draft", str(tmp_path / "d")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"vocab_size={tokenizer().vocab_size + 5} differs from the target's " \
        f"vocab_size={tokenizer().vocab_size}" in err, err


@pytest.mark.slow
def test_a_sigterm_right_after_the_url_is_printed_stops_the_server(model_dir):
    """Issue 43, E11: a SIGTERM in the first ~20 ms after the URL was printed was swallowed (9 of 10 trials): the
    handler that only noted it was in, uvicorn's not yet. Now the signal stops the server from the start."""
    env = dict(os.environ, PYTHONPATH=str(SRC) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    process = subprocess.Popen(
        [sys.executable, "-m", "tinygpt", "serve", "--model", str(model_dir), "--port", "0", "--log-level",
         "warning"], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = process.stdout.readline()
        assert " on http://127.0.0.1:" in line, process.stderr.read()
        process.send_signal(signal.SIGTERM)  # at once
        process.wait(timeout=60)
        assert process.returncode == 0, process.stderr.read()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


@pytest.mark.parametrize("flags, message", [
    (["--replicas", "0"], "--replicas 0 must be"),
    (["--autoscale", "3:1"], "--autoscale 3:1 must be MIN:MAX"),
    (["--autoscale", "two"], "--autoscale two must be MIN:MAX"),
    (["--replicas", "2", "--autoscale", "1:2"], "conflicts with --replicas"),
    (["--replicas", "2", "--max-connections", "10"], "--max-connections is a setting of tinygpt's own HTTP server"),
    (["--replica-threads", "0"], "--replica-threads 0 must be"),
    (["--replicas", "1", "--port", "0"], "--port 0 with --replicas/--autoscale"),
])
def test_bad_replica_flags_are_one_line_errors(model_dir, capsys, flags, message):
    """Checked before Ray is imported or a model loaded."""
    assert main(["serve", "--model", str(model_dir), *flags]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("tinygpt serve: error: ") and message in err, err


def test_replicas_without_ray_say_what_to_install(model_dir, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "ray.serve", None)  # `import ray.serve` raises ImportError
    assert main(["serve", "--model", str(model_dir), "--replicas", "2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "need the cluster extra: pip install -e '.[cluster]'" in err, err


def test_more_local_replicas_than_cores_are_refused_before_ray_starts(model_dir, capsys):
    """Ray would leave the replicas past the machine's CPUs pending, and the command would wait for them forever."""
    pytest.importorskip("ray.serve")
    cores = os.cpu_count() or 1
    assert main(["serve", "--model", str(model_dir), "--replicas", str(cores + 1)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{cores + 1} replica(s) x 1 thread(s) need {cores + 1} CPUs, and this machine " \
        f"has {cores}" in err, err
