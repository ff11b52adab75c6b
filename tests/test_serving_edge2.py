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
    1,025-token prompts x n 16 froze a stream for 212 s). Now a prompt is scored once for its n rows, in chunks of
    at most the token budget, with the running rows' decode steps between the chunks."""
    from tinygpt.serving.engine import BatchEngine, EngineRequest, PromptLogprobs
    from tinygpt.generation import GenerationConfig

    from serving_support import Collector

    budget = 16
    engine = BatchEngine(model, tokenizer(), max_batch=8, max_queue=64, token_budget=budget)
    forwards: list[tuple[str, int]] = []  # ("score" | "core", tokens) of each forward, in order
    hook = model.register_forward_pre_hook(
        lambda module, args, kwargs: forwards.append(("core" if kwargs.get("batch") is not None else "score",
                                                      args[0].shape[1])), with_kwargs=True)
    try:
        stream = Collector()
        engine.submit([EngineRequest(tokenizer().encode("The"), GenerationConfig(max_new_tokens=100), stream)])
        wait_until(lambda: len(stream.events) >= 2)
        prompt = tokenizer().encode(PROMPT * 20)[:100]
        sinks = [Collector() for _ in range(4)]
        engine.submit([EngineRequest(prompt, GenerationConfig(max_new_tokens=2), sink, logprobs=0,
                                     prompt_logprobs=True) for sink in sinks])
        for sink in sinks:
            sink.wait()
            assert isinstance(sink.events[0], PromptLogprobs) and len(sink.events[0].tokens) == len(prompt)
        stream.wait()
    finally:
        hook.remove()
        engine.shutdown()
    assert max(tokens for _, tokens in forwards) <= budget
    scoring = [i for i, (kind, _) in enumerate(forwards) if kind == "score"]
    assert len(scoring) == -(-len(prompt) // budget)  # once for the four rows
    assert all(b - a > 1 for a, b in zip(scoring, scoring[1:]))  # a decode step between every two chunks
    # the chunked scores equal one whole-prompt forward's
    import torch

    with torch.no_grad():
        ref = model(torch.tensor([prompt]))[0].log_softmax(-1)
    got = sinks[0].events[0].tokens
    for t in range(1, len(prompt)):
        assert got[t].logprob == pytest.approx(ref[t - 1, prompt[t]].item(), abs=1e-4)
