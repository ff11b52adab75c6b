"""The server through the official ``openai`` client (and raw HTTP where the client hides the wire): a live
uvicorn on 127.0.0.1 at a free port, a tiny random model, answers compared with ``tinygpt.generate``."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest
import torch

from serving_support import engine_of, live_server, offline, tiny_model, tokenizer, wait_until
from tinygpt import generate_text
from tinygpt.serving.chat_format import CHAT_STOP_TEXTS, render_chat

PROMPT = "Every effort moves"


@pytest.fixture(scope="module")
def model():
    return tiny_model(context_length=256)


@pytest.fixture(scope="module")
def server(model):
    with live_server(model, max_batch=4, max_queue=8) as server:
        yield server


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as client:
        yield client


def test_completion_is_the_offline_greedy_answer_with_true_usage_and_finish_reason(client, model):
    ids = tokenizer().encode(PROMPT)
    expected = offline(model, ids, 12)
    out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0)
    choice = out.choices[0]
    assert choice.text == tokenizer().decode(expected)
    assert choice.finish_reason == ("length" if len(expected) == 12 else "stop")
    assert (out.usage.prompt_tokens, out.usage.completion_tokens, out.usage.total_tokens) == (
        len(ids), 12, len(ids) + 12)
    assert out.object == "text_completion" and out.model == "tiny"


def test_streamed_completion_equals_the_whole_one(client):
    whole = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=20, temperature=0).choices[0]
    chunks = list(client.completions.create(model="tiny", prompt=PROMPT, max_tokens=20, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert text == whole.text and reasons == [whole.finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20
    assert len([c for c in chunks if c.choices and c.choices[0].text]) > 1  # it really came in pieces


def test_stop_ends_the_text_before_it_and_says_stop(client):
    text = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=30, temperature=0).choices[0].text
    stop = text[4:7]
    for stream in (False, True):
        out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=30, temperature=0,
                                        stop=[stop, "\u2603"], stream=stream)
        if stream:
            chunks = list(out)
            got = "".join(c.choices[0].text for c in chunks)
            reason = chunks[-1].choices[0].finish_reason
        else:
            got, reason = out.choices[0].text, out.choices[0].finish_reason
        assert (got, reason) == (text[: text.find(stop)], "stop")


def test_prompt_forms_n_and_seed(client, model):
    ids = [tokenizer().encode(p) for p in ("The quick", "Every")]
    out = client.completions.create(model="tiny", prompt=ids, max_tokens=6, temperature=0, n=2)
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    for c in out.choices:
        assert c.text == tokenizer().decode(offline(model, ids[c.index // 2], 6))
    listed = client.completions.create(model="tiny", prompt=["The quick", "Every"], max_tokens=6, temperature=0)
    assert [c.text for c in listed.choices] == [out.choices[0].text, out.choices[2].text]
    one = client.completions.create(model="tiny", prompt=ids[0][:2], max_tokens=6, temperature=0)  # a list of ids
    assert one.choices[0].text == tokenizer().decode(offline(model, ids[0][:2], 6))
    a = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=16, temperature=1.0, seed=5, n=3)
    b = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=16, temperature=1.0, seed=5, n=3)
    assert [c.text for c in a.choices] == [c.text for c in b.choices]
    assert len({c.text for c in a.choices}) > 1  # choice j uses seed + j


def test_logprobs_with_echo_score_the_prompt_as_lm_eval_needs(client, model):
    ids = tokenizer().encode(PROMPT)
    out = client.completions.create(model="tiny", prompt=ids, max_tokens=1, temperature=0, echo=True, logprobs=2)
    lp = out.choices[0].logprobs
    assert out.choices[0].text.startswith(PROMPT)
    assert len(lp.tokens) == len(ids) + 1 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    with torch.no_grad():
        ref = model(torch.tensor([ids]))[0].log_softmax(-1)
    for t in range(1, len(ids)):
        assert lp.token_logprobs[t] == pytest.approx(ref[t - 1, ids[t]].item(), abs=1e-4)
        assert len(lp.top_logprobs[t]) == 2
    assert "".join(lp.tokens[: len(ids)]) == PROMPT and lp.text_offset[1] == len(lp.tokens[0])
    # greedy: the generated token is the argmax, so its logprob is the top alternative's
    assert lp.token_logprobs[-1] == pytest.approx(max(lp.top_logprobs[-1].values()), abs=1e-6)


def test_a_model_with_more_rows_than_its_tokenizer_has_tokens_is_served(model):
    """A vocabulary padded past the tokenizer's (a multiple of 64, as nanoGPT pads GPT-2's): logprobs name the
    padding ids (they crashed the response), a prompt may not hold them, the rest is the offline answer."""
    padded = tiny_model(context_length=32, vocab_size=tokenizer().vocab_size + 20)
    last = padded.config.vocab_size - 1
    ids = tokenizer().encode(PROMPT)
    with torch.no_grad():  # the padding row ties with the prompt's next greedy token: it is in that top 20, and
        first = int(padded(torch.tensor([ids]))[0, -1].argmax())  # argmax takes the first of a tie: the text's
        padded.out_head.weight[last] = padded.out_head.weight[first]
    with live_server(padded, max_batch=2) as server, httpx.Client(base_url=server.url, timeout=60) as http:
        got = http.post("/v1/completions", json={"prompt": ids, "max_tokens": 3, "temperature": 0, "echo": True,
                                                 "logprobs": 20})
        assert got.status_code == 200, got.text
        tops = [t for t in got.json()["choices"][0]["logprobs"]["top_logprobs"] if t]
        assert any(f"<|id {last}|>" in t for t in tops)
        assert got.json()["choices"][0]["text"] == PROMPT + tokenizer().decode(offline(padded, ids, 3))
        bad = http.post("/v1/completions", json={"prompt": ids + [last], "max_tokens": 1})
        assert bad.status_code == 400 and f"0 <= id < {tokenizer().vocab_size} (the tokenizer's" in bad.text


def _offline_chat(model, messages, max_tokens):
    prompt = render_chat([(m["role"], m["content"]) for m in messages])
    return generate_text(model, tokenizer(), prompt, max_new_tokens=max_tokens, stop_texts=CHAT_STOP_TEXTS)


def test_chat_renders_the_sft_template_and_streams_deltas(client, model):
    messages = [{"role": "user", "content": "Name a colour."}]
    expected = _offline_chat(model, messages, 10)
    out = client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0)
    assert out.choices[0].message.role == "assistant" and out.choices[0].message.content == expected
    assert out.object == "chat.completion"
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0,
                                                 stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == out.choices[0].finish_reason
    turns = messages + [{"role": "assistant", "content": "Blue."}, {"role": "user", "content": "Another."}]
    more = client.chat.completions.create(model="tiny", messages=turns, max_completion_tokens=8, temperature=0,
                                          logprobs=True, top_logprobs=2)
    assert more.choices[0].message.content == _offline_chat(model, turns, 8)
    assert all(len(t.top_logprobs) == 2 for t in more.choices[0].logprobs.content)


def test_chat_without_max_tokens_may_fill_the_context_and_says_length(client, model):
    messages = [{"role": "user", "content": "Name a colour."}]
    out = client.chat.completions.create(model="tiny", messages=messages, temperature=0)
    prompt_tokens = out.usage.prompt_tokens
    if out.choices[0].finish_reason == "length":
        assert prompt_tokens + out.usage.completion_tokens - 1 == model.config.context_length
    else:
        assert out.usage.completion_tokens < model.config.context_length - prompt_tokens + 1


@pytest.mark.parametrize("kwargs, param", [
    (dict(max_tokens=1000), "max_tokens"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(temperature=-0.5), "temperature"),
    (dict(top_p=0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(stop=["a", "b", "c", "d", "e"]), "stop"),
    (dict(prompt=[[1, 2], [10 ** 6]]), "prompt"),
    (dict(prompt="x" * 1000), "prompt"),
    (dict(extra_body={"max_tokens": "5"}), "max_tokens"),
    (dict(extra_body={"frequency_penalty": 0.5}), "frequency_penalty"),
    (dict(extra_body={"no_such_field": 1}), "no_such_field"),
])
def test_bad_requests_are_400_naming_the_field(client, kwargs, param):
    args = dict(model="tiny", prompt=PROMPT, max_tokens=4) | kwargs
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(**args)
    assert err.value.status_code == 400 and err.value.body["param"] == param
    assert param in err.value.body["message"]


def test_unknown_model_is_404_and_a_wrong_key_401(client, model):
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="gpt-9", prompt=PROMPT, max_tokens=2)
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-9")
    assert [m.id for m in client.models.list()] == ["tiny"]
    with live_server(model, api_key="sesame") as locked:
        wrong = openai.OpenAI(base_url=locked.url + "/v1", api_key="nope", max_retries=0, timeout=30)
        with pytest.raises(openai.AuthenticationError):
            wrong.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        right = openai.OpenAI(base_url=locked.url + "/v1", api_key="sesame", max_retries=0, timeout=30)
        assert right.completions.create(model="tiny", prompt=PROMPT, max_tokens=2).usage.completion_tokens == 2
        assert httpx.get(locked.url + "/health", timeout=10).status_code == 200  # health needs no key


def test_raw_http_errors_are_openai_json_never_a_traceback(http):
    cases = [
        (http.post("/v1/completions", content=b"{not json", headers={"Content-Type": "application/json"}), 400,
         "not valid JSON"),
        (http.post("/v1/completions", json=[1, 2]), 400, "JSON object"),
        (http.post("/v1/completions", json={"max_tokens": 3}), 400, "prompt: is required"),
        (http.post("/v1/chat/completions", json={"messages": []}), 400, "messages"),
        (http.post("/v1/chat/completions", json={"messages": [{"role": "robot", "content": "x"}]}), 400, "role"),
        (http.post("/v1/chat/completions", json={"messages": [{"role": "assistant", "content": "x"}]}), 400,
         "end with a user message"),
        (http.get("/v1/nothing"), 404, "Not Found"),
        (http.get("/v1/completions"), 405, "Method Not Allowed"),
    ]
    for response, status, text in cases:
        assert response.status_code == status, response.text
        body = response.json()
        assert text in body["error"]["message"] and "Traceback" not in response.text


def test_tokenize_detokenize_and_health(http):
    ids = http.post("/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    assert ids == tokenizer().encode(PROMPT)
    assert http.post("/detokenize", json={"tokens": ids}).json() == {"prompt": PROMPT}
    bad = http.post("/detokenize", json={"tokens": [0, 99999]})
    assert bad.status_code == 400 and "99999" in bad.json()["error"]["message"]
    health = http.get("/health").json()
    assert health["status"] == "ok" and health["max_batch"] == 4


def test_tokenizer_info_and_the_end_of_text_round_trip(http):
    """lm-eval's remote tokenizer: /tokenizer_info names the end-of-text text, /tokenize (with its
    add_special_tokens field) maps it back to the id, so a client needs no tokenizer files of its own."""
    info = http.get("/tokenizer_info").json()
    eot = tokenizer().eot_id
    assert info["eos_token_id"] == eot and info["bos_token"] is None
    ids = http.post("/tokenize", json={"prompt": info["eos_token"], "add_special_tokens": False}).json()["tokens"]
    assert ids == [eot]
    bad = http.post("/tokenize", json={"prompt": "x", "add_special_tokens": "no"})
    assert bad.status_code == 400 and "add_special_tokens" in bad.json()["error"]["message"]


def test_inspect_gives_causal_attention_and_the_next_token_distribution(http, model):
    body = http.post("/inspect", json={"text": PROMPT, "layer": 1, "top": 3, "logit_lens": True}).json()
    ids = tokenizer().encode(PROMPT)
    t = len(ids)
    assert [tok["id"] for tok in body["tokens"]] == ids and body["n_layers"] == 2
    weights = torch.tensor(body["attention"])  # [H, T, T]
    assert weights.shape == (2, t, t)
    lower = torch.ones(t, t, dtype=torch.bool).tril()
    assert torch.all(weights[:, ~lower] == 0) and torch.all(weights[:, lower] > 0)
    assert torch.allclose(weights.sum(-1), torch.ones(2, t), atol=1e-4)
    with torch.no_grad():
        probs = model(torch.tensor([ids]))[0].softmax(-1)
    assert [c["id"] for c in body["next"][-1]] == probs[-1].topk(3).indices.tolist()
    assert len(body["lens"]) == 2 and body["lens"][-1][-1]["id"] == body["next"][-1][0]["id"]
    bad = http.post("/inspect", json={"text": PROMPT, "layer": 2})
    assert bad.status_code == 400 and "layer" in bad.json()["error"]["message"]


def test_the_page_is_served(http):
    page = http.get("/")
    assert page.status_code == 200 and "text/html" in page.headers["content-type"]
    assert "Inspect" in page.text and "/v1/chat/completions" in page.text and "http" not in page.text.split(
        "<script>")[1].replace("http.", "")  # no external script


def test_a_client_that_disconnects_mid_stream_frees_its_row(server, model):
    engine = engine_of(server)
    wait_until(lambda: engine.load()["running"] == 0)
    hook = model.register_forward_pre_hook(lambda module, args: time.sleep(0.01))  # 100 steps outlast the checks
    try:
        with httpx.Client(base_url=server.url, timeout=30) as c:
            with c.stream("POST", "/v1/completions", json={"prompt": PROMPT, "max_tokens": 100, "temperature": 0,
                                                           "stream": True}) as response:
                lines = response.iter_lines()
                first = next(line for line in lines if line.startswith("data: "))
                assert json.loads(first[6:])["choices"][0]["finish_reason"] is None
                assert engine.load()["running"] == 1
                steps = engine.steps
        wait_until(lambda: engine.load()["running"] == 0, timeout=20, message="the row to leave")
    finally:
        hook.remove()
    assert engine.steps - steps < 90  # dropped, not decoded on to max_tokens


def _drafts(usage):
    details = usage.completion_tokens_details
    return None if details is None else (details.accepted_prediction_tokens, details.rejected_prediction_tokens)


def test_usage_reports_the_drafts_accepted_and_rejected_when_the_server_drafts(client):
    """OpenAI's ``usage.completion_tokens_details.accepted/rejected_prediction_tokens`` from the engine's draft
    counts, in completions and chat, whole and in the streamed usage chunk; a server that does not draft (the
    module's) reports no details. Drafts by the target itself are all accepted, another model's are not; the text
    is the offline greedy one either way."""
    model = tiny_model(context_length=128)
    ids = tokenizer().encode(PROMPT)
    expected = tokenizer().decode(offline(model, ids, 16))
    plain = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=16, temperature=0)
    assert plain.usage.completion_tokens_details is None
    messages = [{"role": "user", "content": "Name a colour."}]
    for draft in (model, tiny_model(context_length=128, seed=1)):
        with live_server(model, max_batch=2, draft_model=draft, speculative_tokens=3) as server:
            c = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
            whole = c.completions.create(model="tiny", prompt=PROMPT, max_tokens=16, temperature=0)
            assert whole.choices[0].text == expected
            accepted, rejected = _drafts(whole.usage)
            if draft is model:
                assert accepted > 0 and rejected == 0
            else:
                assert rejected > 0
            chunks = list(c.completions.create(model="tiny", prompt=PROMPT, max_tokens=16, temperature=0,
                                               stream=True, stream_options={"include_usage": True}))
            assert _drafts(chunks[-1].usage) == (accepted, rejected)
            chat = c.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0)
            streamed = list(c.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0,
                                                      stream=True, stream_options={"include_usage": True}))
            assert sum(_drafts(chat.usage)) > 0 and _drafts(streamed[-1].usage) == _drafts(chat.usage)
            engine = server.app.state.tinygpt.engine.core
            assert engine.drafts is not None and len(engine.drafts) == 0  # each finished row gave its cache back


def test_the_page_s_guide_links_open_read_only_and_nothing_outside_docs(http, model):
    import re

    from tinygpt.serving.app import DOCS_ROOT, create_app

    page = http.get("/").text
    links = set(re.findall(r'href="(docs/[^"]+)"', page))
    assert links, "the page links to the guide"
    for link in links:
        out = http.get("/" + link)
        assert out.status_code == 200 and out.text == (DOCS_ROOT.parent / link).read_text(encoding="utf-8")
    for bad in ("/docs/../pyproject.toml", "/docs/%2e%2e/pyproject.toml", "/docs/guide/nope.md", "/docs/../src"):
        out = http.get(bad)
        assert out.status_code == 404 and "[project]" not in out.text  # an error, never the file
    from starlette.testclient import TestClient

    app = create_app(model, tokenizer(), docs_url="https://example.org/tinygpt/docs/")
    out = TestClient(app, base_url="http://127.0.0.1").get("/docs/guide/05-block.md", follow_redirects=False)
    assert out.status_code == 307 and out.headers["location"] == "https://example.org/tinygpt/docs/guide/05-block.md"
    with pytest.raises(ValueError, match="docs_url"):
        create_app(model, tokenizer(), docs_url="example.org")
