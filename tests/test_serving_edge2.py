"""The server's edge, round two: each fault the second probe of ``tinygpt serve`` found (issue 43's numbering, E1 to
E15), with the request that showed it. Each test failed on the code before its fix."""

from __future__ import annotations

import contextlib
import socket
import threading
import time

import httpx
import pytest

from serving_support import engine_of, live_server, tiny_model, tokenizer, wait_until

from tinygpt.alignment.data import ALPACA_CHAT_TEMPLATE_V1

PROMPT = "Every effort moves"


@pytest.fixture(scope="module")
def model():
    return tiny_model(context_length=128)


@contextlib.contextmanager
def templated_server(model, template: str, **options):
    """A live server whose model's chat template is ``template``."""
    from tinygpt.serving.app import create_app
    from tinygpt.serving.server import BackgroundServer

    app = create_app(model, tokenizer().with_chat_template(template), model_name="tiny", **options)
    with BackgroundServer(app) as server:
        server.app = app
        yield server


def _error(response: httpx.Response, status: int) -> str:
    assert response.status_code == status, response.text
    return response.json()["error"]["message"]


# --------------------------------------------------------------------- E1: a chat that renders millions of tokens
def test_a_chat_whose_rendering_outgrows_the_context_is_refused_before_tokenizing(model):
    """E1: 127 KB of chat (a long system text, many turns) under the template checkpoints carry rendered the system
    text before every turn; the rendered prompt was tokenized whole (4 GB, 48 s frozen). Now the rendering stops at
    ``max_prompt_chars`` and the tokenizer never sees it."""
    messages = [{"role": "system", "content": "s" * 4000}]
    for i in range(60):
        messages += [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    messages.append({"role": "user", "content": "q"})
    with templated_server(model, ALPACA_CHAT_TEMPLATE_V1) as server:
        state = server.app.state.tinygpt
        seen: list[int] = []
        encode = state.tokenizer.encode
        state.tokenizer.encode = lambda text, **kw: (seen.append(len(text)), encode(text, **kw))[1]
        try:
            with httpx.Client(base_url=server.url, timeout=60) as http:
                message = _error(http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 2}),
                                 400)
                assert "the chat template was stopped: it wrote more than" in message
                assert f"the context's {model.config.context_length} tokens" in message
                assert max(seen, default=0) <= state.max_prompt_chars
                ok = http.post("/v1/chat/completions", json={"messages": messages[-1:], "max_tokens": 2})
                assert ok.status_code == 200, ok.text
        finally:
            state.tokenizer.encode = encode


# --------------------------------------------------------------------- E6: a template that never ends
LOOPING = ("{% for i in range(99999) %}{% for j in range(99999) %}{% if messages[0]['content'] == 'x' %}"
           "{% endif %}{% endfor %}{% endfor %}{{ messages[0]['content'] }}")


def test_a_looping_template_is_a_400_naming_it_and_the_server_goes_on(model):
    """E6: a template that loops on a trigger word hung every worker thread for good; now it is stopped at
    ``--template-timeout`` (a 400 naming the template) and the server keeps serving."""
    with templated_server(model, LOOPING, template_timeout=0.3) as server, \
            httpx.Client(base_url=server.url, timeout=60) as http:
        start = time.monotonic()
        answers = []
        threads = [threading.Thread(target=lambda: answers.append(http.post(
            "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 2})))
            for _ in range(8)]  # more than the worker threads
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert len(answers) == 8
        for response in answers:
            assert "the chat template was stopped: it ran longer than its time limit" in _error(response, 400)
        assert time.monotonic() - start < 30
        assert http.get("/health").json()["status"] == "ok"
        assert http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2}).status_code == 200


def test_a_template_that_fails_otherwise_is_a_400_not_a_500(model):
    with templated_server(model, "{{ 1 // 0 }}") as server, httpx.Client(base_url=server.url, timeout=60) as http:
        message = _error(http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}]}),
                         400)
        assert "the chat template failed: ZeroDivisionError" in message


# --------------------------------------------------------------------- E2: prompt log-probabilities at admission
def test_prompt_logprobs_go_through_the_token_budget_between_decode_steps(model):
    """E2: echo + logprobs rows ran a whole-prompt forward each at admission, before the next decode step (4 x
    1,025-token prompts x n 16 froze a stream for 212 s). Now a prompt is scored in forwards of at most the token
    budget, with the running rows' decode steps between them (the redesign's scoring rows, issue 35)."""
    import torch

    from tinygpt.generation import GenerationConfig
    from tinygpt.serving.engine import EngineRequest, EngineThread, PromptLogprobs

    from serving_support import Collector

    budget = 16
    engine = EngineThread(model, tokenizer(), max_batch=8, max_queue=64, token_budget=budget)
    forwards: list[int] = []  # tokens of each forward
    hook = model.register_forward_pre_hook(lambda module, args: forwards.append(args[0].shape[1]))
    stream = Collector()
    progress: list[int] = []  # the stream's events when each prompt's log-probabilities arrived

    class Scored(Collector):
        def __call__(self, event):
            if isinstance(event, PromptLogprobs):
                progress.append(len(stream.events))
            super().__call__(event)

    try:
        engine.submit([EngineRequest(tokenizer().encode("The"), GenerationConfig(max_new_tokens=100), stream)])
        wait_until(lambda: len(stream.events) >= 2)
        prompt = tokenizer().encode(PROMPT * 20)[:100]
        sinks = [Scored() for _ in range(4)]
        submitted = len(stream.events)
        engine.submit([EngineRequest(prompt, GenerationConfig(max_new_tokens=2), sink, logprobs=0,
                                     prompt_logprobs=True) for sink in sinks])
        for sink in sinks:
            sink.wait()
            assert isinstance(sink.events[0], PromptLogprobs) and len(sink.events[0].tokens) == len(prompt)
        stream.wait()
    finally:
        hook.remove()
        engine.shutdown()
    assert max(forwards) <= budget
    assert min(progress) > submitted + 1  # the stream went on decoding while the prompts were scored
    with torch.no_grad():
        ref = model(torch.tensor([prompt]))[0].log_softmax(-1)
    got = sinks[0].events[0].tokens
    for t in range(1, len(prompt)):
        assert got[t].logprob == pytest.approx(ref[t - 1, prompt[t]].item(), abs=1e-4)


# --------------------------------------------------------------------- E4: bodies dripped a byte at a time
def _dripping(server, count: int, length: int = 10000) -> list[socket.socket]:
    socks = []
    for _ in range(count):
        s = socket.create_connection((server.host, server.port), timeout=10)
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n{" % length)
        socks.append(s)
    return socks


def _status(sock: socket.socket) -> bytes:
    data = b""
    with contextlib.suppress(OSError):
        while b"\r\n" not in data:
            chunk = sock.recv(4096)
            if not chunk:
                break
            data += chunk
    return data.split(b"\r\n", 1)[0]


def test_slow_body_senders_cannot_take_every_connection(model):
    """E4: --max-connections connections that sent their head and dripped the body made every new connection,
    /health included, a 503 for the whole body timeout. Now they hold at most --max-body-connections slots (the
    rest are 503 at once) and must keep --min-body-rate (408)."""
    with live_server(model, max_connections=8, body_timeout=30) as server:
        socks = _dripping(server, 8)
        drip = threading.Event()

        def dripper() -> None:  # one byte every 0.2 s from each: 5 bytes/s, under the minimum rate
            while not drip.wait(0.2):
                for s in socks:
                    with contextlib.suppress(OSError):
                        s.send(b" ")

        threading.Thread(target=dripper, daemon=True).start()
        try:
            wait_until(lambda: server.app.state.tinygpt is not None and True, 5)
            time.sleep(0.3)
            assert httpx.get(server.url + "/health", timeout=5).json()["status"] == "ok"
            statuses = [_status(s) for s in socks]
        finally:
            drip.set()
            for s in socks:
                s.close()
    assert statuses.count(b"HTTP/1.1 503 Service Unavailable") == 4  # past the 4 body slots
    assert statuses.count(b"HTTP/1.1 408 Request Timeout") == 4  # under the minimum rate, after the grace


def test_a_body_sent_at_the_minimum_rate_is_read(model):
    with live_server(model, min_body_rate=200) as server:
        s = socket.create_connection((server.host, server.port), timeout=10)
        body = b'{"prompt": "Every effort moves", "max_tokens": 2}' + b" " * 250
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n" % len(body))
        for i in range(0, len(body), 100):  # 100 bytes every 0.25 s: 400 bytes/s
            s.sendall(body[i:i + 100])
            time.sleep(0.25)
        assert _status(s) == b"HTTP/1.1 200 OK"
        s.close()


# --------------------------------------------------------------------- E3: answers nobody reads
def test_an_answer_left_unread_is_dropped_after_the_write_timeout(model):
    """E3: a client that does not read its answer pinned it in memory with no write timeout (150 non-reading
    /inspect clients: RSS 0.34 -> 1.62 GB). Now its connection is aborted --write-timeout seconds after its send
    buffer filled."""
    with live_server(model, write_timeout=0.5) as server:
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.connect((server.host, server.port))
        connections = server.server.server_state.connections
        wait_until(lambda: connections, 5)
        for protocol in connections:  # a small kernel buffer, as over a real network (loopback's hold megabytes)
            protocol.transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        body = b'{"text": "%s", "logit_lens": true}' % (b"Every effort moves you " * 7)
        s.sendall(b"POST /inspect HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        wait_until(lambda: not connections, 20, "the unread connection closed")
        data = b""
        with contextlib.suppress(OSError):
            while chunk := s.recv(1 << 16):
                data += chunk
        s.close()
    head, _, rest = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 OK")
    length = int([line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")][0])
    assert len(rest) < length  # cut: the server dropped what the client did not read


# --------------------------------------------------------------------- E14: inspections starving the streams
def test_inspections_get_at_most_the_time_the_rows_get(model):
    """E14: one /inspect ran between every two decode steps (and all waiting ones at once), so six looping
    /inspect clients cut 32 streams' completed requests from 1,633 to 190 in 120 s. Now a job runs only once the
    rows have had as much time as the last job took."""
    from tinygpt.generation import GenerationConfig
    from tinygpt.serving.engine import EngineRequest, EngineThread

    from serving_support import Collector

    engine = EngineThread(model, tokenizer(), max_batch=4)
    order: list[str] = []
    hook = model.register_forward_pre_hook(
        lambda module, args, kwargs: order.append("step") if kwargs.get("cache") is not None else None,
        with_kwargs=True)
    try:
        stream = Collector()
        engine.submit([EngineRequest(tokenizer().encode("The"), GenerationConfig(max_new_tokens=60), stream)])
        wait_until(lambda: len(stream.events) >= 2)
        finished = threading.Semaphore(0)
        for _ in range(10):
            engine.call(lambda: (order.append("job"), time.sleep(0.02)), lambda result, error: finished.release())
        for _ in range(10):
            assert finished.acquire(timeout=60)
        stream.wait()
    finally:
        hook.remove()
        engine.shutdown()
    jobs = [i for i, kind in enumerate(order) if kind == "job"]
    assert len(jobs) == 10
    assert all(b - a > 1 for a, b in zip(jobs, jobs[1:]) if b < len(order) - 1 and "step" in order[b:])


# --------------------------------------------------------------------- E13: the shared prefix cache
def test_a_cache_salt_keeps_a_prefix_to_the_clients_that_share_the_salt(model):
    """E13: the prefix cache was shared and observable across clients (a fast first token said another client
    had sent the same prefix). ``cache_salt`` (vLLM's) keeps cached prefixes among requests with the same salt;
    greedy answers are the same either way."""
    prompt = tokenizer().decode(tokenizer().encode(PROMPT * 10)[:64])
    with live_server(model) as server, httpx.Client(base_url=server.url, timeout=60) as http:
        blocks = engine_of(server).core.blocks

        def send(**fields):
            before = blocks.hits
            answer = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 4, "temperature": 0,
                                                        **fields})
            assert answer.status_code == 200, answer.text
            return blocks.hits - before, answer.json()["choices"][0]["text"]

        first = send(cache_salt="tenant-a")
        assert first[0] == 0
        assert send(cache_salt="tenant-b")[0] == 0  # another tenant: nothing of a's is reused
        assert send()[0] == 0  # nor by a request without a salt
        again = send(cache_salt="tenant-a")
        assert again[0] > 0 and again[1] == first[1]  # the same tenant reuses its own prefix
        assert send()[0] > 0  # unsalted requests share among themselves, as before
        bad = http.post("/v1/completions", json={"prompt": prompt, "cache_salt": ""})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "cache_salt"
