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
