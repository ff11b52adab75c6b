"""The server's edge: each fault a probe of ``tinygpt serve`` found, with the request that showed it (issue 23's
numbering). Every request here is refused with a clear error, or bounded, before it can hurt other clients."""

from __future__ import annotations

import concurrent.futures
import json
import socket
import threading
import time

import httpx
import pytest

from serving_support import engine_of, live_server, tiny_model, tokenizer, wait_until

PROMPT = "Every effort moves"


@pytest.fixture(scope="module")
def model():
    return tiny_model(context_length=256)


@pytest.fixture(scope="module")
def server(model):
    with live_server(model, max_batch=4, max_queue=8) as server:
        yield server


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as client:
        yield client


def slowed(model, seconds: float):
    """``model`` with every forward taking at least ``seconds`` longer (so that a row lasts while a test acts)."""
    return model.register_forward_pre_hook(lambda module, args: time.sleep(seconds))


def _error(response: httpx.Response, status: int) -> str:
    assert response.status_code == status, response.text
    return response.json()["error"]["message"]


# --------------------------------------------------------------------- 1: values that broke the engine
@pytest.mark.parametrize("fields, param", [
    ({"temperature": 1e-300}, "temperature"),
    ({"temperature": 1e-39}, "temperature"),
    ({"temperature": 1.0, "top_p": 1e-46}, "top_p"),
    ({"temperature": 1.0, "repetition_penalty": 1e-300}, "repetition_penalty"),
    ({"seed": 2 ** 64}, "seed"),
    ({"seed": -2 ** 63 - 1}, "seed"),
    ({"seed": 2 ** 63 - 1, "n": 2}, "seed"),  # choice 1 would sample with seed + 1
])
def test_sampling_values_the_engine_cannot_serve_are_400_naming_the_field(http, fields, param):
    response = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 4, **fields})
    assert _error(response, 400).startswith(param) and response.json()["error"]["param"] == param
    ok = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 4, "temperature": 1e-5, "seed": 2 ** 63 - 1,
                                            "top_p": 1e-8, "repetition_penalty": 1e6})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 4  # the range's ends still work


def test_generate_with_an_unusable_temperature_is_a_one_line_error(tmp_path, capsys):
    from tinygpt import save_model
    from tinygpt.cli import main

    save_model(tiny_model(context_length=64), tmp_path / "m", tokenizer=tokenizer())
    assert main(["generate", "--model", str(tmp_path / "m"), "--prompt", "hi", "--temperature", "1e-300"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("tinygpt generate: error: --temperature 1e-300 must be 0")


# --------------------------------------------------------------------- 2: /inspect through the queue
def test_inspect_is_admitted_through_the_queue_and_answers_429_past_it(model):
    hook = slowed(model, 0.05)
    try:
        with live_server(model, max_batch=1, max_queue=2) as server:
            def ask(i: int) -> httpx.Response:
                return httpx.post(server.url + "/inspect", json={"text": PROMPT, "layer": 0}, timeout=60)

            with concurrent.futures.ThreadPoolExecutor(12) as pool:
                statuses = [r.status_code for r in pool.map(ask, range(12), timeout=120)]
            busy = httpx.post(server.url + "/inspect", json={"text": PROMPT}, timeout=60)
    finally:
        hook.remove()
    assert set(statuses) == {200, 429} and statuses.count(200) >= 2, statuses
    assert busy.status_code == 200


def test_n_times_max_tokens_is_bounded(http, model):
    response = http.post("/v1/completions", json={"prompt": "a", "max_tokens": 200, "n": 10})  # 2000 > 4 x 256
    assert "lower n or max_tokens" in _error(response, 400) and response.json()["error"]["param"] == "n"


# --------------------------------------------------------------------- 3: a non-streaming client that leaves
def test_a_non_streaming_client_that_disconnects_cancels_its_rows(server, model):
    engine = engine_of(server)
    wait_until(lambda: engine.load()["running"] == 0)
    body = json.dumps({"prompt": PROMPT, "max_tokens": 200, "temperature": 0}).encode()
    hook = slowed(model, 0.01)  # 200 steps would take > 2 s
    try:
        steps = engine.steps
        with socket.create_connection((server.host, server.port), timeout=10) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
            wait_until(lambda: engine.load()["running"] == 1, timeout=20, message="the row to run")
        wait_until(lambda: engine.load()["running"] == 0, timeout=20, message="the row to leave")
    finally:
        hook.remove()
    assert engine.steps - steps < 150  # dropped early, not decoded on to max_tokens


# --------------------------------------------------------------------- 4: body size, tokenising off the loop
def test_a_body_over_the_limit_is_413(http):
    response = http.post("/tokenize", json={"prompt": "x" * (2 ** 20 + 1)})
    assert "at most 1048576" in _error(response, 413)
    chunked = http.post("/tokenize", content=(b'{"prompt": "' + b"x" * 2 ** 20 + b'"}' for _ in range(1)),
                        headers={"Content-Type": "application/json"})  # no Content-Length: counted while read
    assert chunked.status_code == 413


class _BlockingTokenizer:
    """The tokenizer, except that encoding a text that starts with "BLOCK" waits for ``release`` (at most 20 s)."""

    def __init__(self) -> None:
        self.inner, self.release, self.entered = tokenizer(), threading.Event(), threading.Event()
        self.eot_id = self.inner.eot_id

    def encode(self, text: str, **kwargs) -> list[int]:
        if text.startswith("BLOCK"):
            self.entered.set()
            self.release.wait(20)
        return self.inner.encode(text)

    def decode(self, ids: list[int]) -> str:
        return self.inner.decode(ids)


def test_tokenizing_runs_off_the_event_loop(model):
    from tinygpt.serving.app import create_app
    from tinygpt.serving.server import BackgroundServer

    blocking = _BlockingTokenizer()
    with BackgroundServer(create_app(model, blocking, model_name="tiny")) as server, \
            concurrent.futures.ThreadPoolExecutor(1) as pool:
        slow = pool.submit(httpx.post, server.url + "/tokenize", json={"prompt": "BLOCK here"}, timeout=60)
        assert blocking.entered.wait(20)
        try:
            assert httpx.get(server.url + "/health", timeout=5).json()["status"] == "ok"  # the loop still serves
        finally:
            blocking.release.set()
        assert slow.result(timeout=60).status_code == 200


# --------------------------------------------------------------------- 5: slow and many clients
def _half_open(server, count: int) -> list[socket.socket]:
    socks = []
    for _ in range(count):
        s = socket.create_connection((server.host, server.port), timeout=10)
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # the head never ends
        socks.append(s)
    return socks


def _answer_of(sock: socket.socket) -> bytes:
    data = b""
    while True:
        try:
            chunk = sock.recv(4096)
        except (ConnectionResetError, socket.timeout):
            return data
        if not chunk:
            return data
        data += chunk


def test_connections_that_never_finish_their_head_or_body_are_timed_out(model):
    with live_server(model, header_timeout=0.5, body_timeout=0.5) as server:
        socks = _half_open(server, 5)
        body = socket.create_connection((server.host, server.port), timeout=10)
        body.sendall(b"POST /tokenize HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\n\r\n{\"prompt\": ")  # the body never ends
        socks.append(body)
        answers = [_answer_of(s) for s in socks]
        for s in socks:
            s.close()
    assert all(a.startswith(b"HTTP/1.1 408 ") for a in answers), answers


def test_past_max_connections_the_longest_waiting_head_makes_room(model):
    with live_server(model, max_connections=8) as server:
        socks = _half_open(server, 8)
        assert httpx.get(server.url + "/health", timeout=5).json()["status"] == "ok"
        assert _answer_of(socks[0]).startswith(b"HTTP/1.1 408 ")  # the oldest was closed for it
        for s in socks:
            s.close()


# --------------------------------------------------------------------- 6: exposure
def test_a_foreign_host_and_a_non_json_body_are_refused(http):
    rebound = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2},
                        headers={"Host": "attacker.example:8000"})
    assert "not a loopback name" in _error(rebound, 403)
    for host in ("localhost:1234", "127.0.0.1", "[::1]:80"):
        assert http.get("/health", headers={"Host": host}).status_code == 200
    plain = http.post("/v1/completions", content=json.dumps({"prompt": PROMPT, "max_tokens": 2}),
                      headers={"Content-Type": "text/plain"})
    assert "application/json" in _error(plain, 415)
    assert "access-control-allow-origin" not in http.options(
        "/v1/completions", headers={"Origin": "http://elsewhere.example", "Access-Control-Request-Method": "POST"}
    ).headers


def test_cors_origin_lets_that_page_in(model):
    with live_server(model, cors_origin=["http://localhost:3000"]) as server:
        headers = {"Origin": "http://localhost:3000", "Access-Control-Request-Method": "POST",
                   "Access-Control-Request-Headers": "content-type"}
        preflight = httpx.options(server.url + "/v1/completions", headers=headers, timeout=10)
        other = httpx.options(server.url + "/v1/completions", headers={**headers, "Origin": "http://evil.example"},
                              timeout=10)
    assert preflight.status_code == 200
    assert preflight.headers["access-control-allow-origin"] == "http://localhost:3000"
    assert other.headers.get("access-control-allow-origin") is None


# --------------------------------------------------------------------- 8: 500s that were 400s
@pytest.mark.parametrize("raw, words", [
    (b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "nested more than"),
    (b'{"prompt": "a", "seed": ' + b"9" * 4301 + b"}", "digits"),
    (b'{"prompt": "a", "max_tokens": ' + b"9" * 5000 + b"}", "digits"),
    (b'{"prompt": "a \\ud800 b", "max_tokens": 2}', "lone surrogate"),
    (b'{"prompt": "a \\udc00", "max_tokens": 2, "echo": true}', "lone surrogate"),
    (b'{"prompt": "a", "\\ud800": 1}', "lone surrogate"),
])
def test_bodies_that_were_500s_are_400s(http, raw, words):
    response = http.post("/v1/completions", content=raw, headers={"Content-Type": "application/json"})
    assert words in _error(response, 400)


def test_a_lone_surrogate_in_tokenize_and_chat_is_400(http):
    for path, raw in (("/tokenize", b'{"prompt": "\\ud83d"}'),
                      ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "\\ud83d!"}]}')):
        response = http.post(path, content=raw, headers={"Content-Type": "application/json"})
        assert "lone surrogate" in _error(response, 400)


# --------------------------------------------------------------------- 9: the API key
def test_a_non_ascii_api_key_matches_and_a_401_says_bearer(model):
    key = "clé-🔑"
    with live_server(model, api_key=key) as server:
        body = {"prompt": PROMPT, "max_tokens": 2}
        right = httpx.post(server.url + "/v1/completions", json=body, timeout=30,
                           headers={"Authorization": b"Bearer " + key.encode("utf-8")})
        wrong = httpx.post(server.url + "/v1/completions", json=body, timeout=30,
                           headers={"Authorization": "Bearer nope"})
    assert right.status_code == 200, right.text
    assert wrong.status_code == 401 and wrong.headers["www-authenticate"] == "Bearer"


# --------------------------------------------------------------------- 10: stop strings
@pytest.mark.parametrize("stop", [["x" * 1000], ["a" * 129]])
def test_long_stop_strings_are_refused(http, stop):
    response = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, "stop": stop})
    assert "at most 128 characters" in _error(response, 400)


# --------------------------------------------------------------------- 7: shutdown
def test_past_the_shutdown_timeout_every_stream_ends_with_an_error_and_done(model):
    from tinygpt.serving.app import create_app
    from tinygpt.serving.server import BackgroundServer

    hook = slowed(model, 0.02)  # 200 tokens: > 4 s, past the 0.5 s timeout
    events: list[str] = []
    try:
        server = BackgroundServer(create_app(model, tokenizer(), model_name="tiny"), shutdown_timeout=0.5)
        with server:
            body = {"prompt": PROMPT, "max_tokens": 200, "temperature": 0, "stream": True}
            with httpx.Client(timeout=60) as client, \
                    client.stream("POST", server.url + "/v1/completions", json=body) as r:
                assert r.status_code == 200, r.read()
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        events.append(line[6:])
                        if len(events) == 2:
                            server.server.should_exit = True  # what SIGTERM does
    finally:
        hook.remove()
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert "shut down" in error["message"] and error["type"] == "server_error"
    assert all("choices" in json.loads(e) for e in events[:-2])
