"""Serving for applications, through a live server and the official ``openai`` client: ``response_format`` /
``grammar`` / ``regex`` (served greedy rows equal offline constrained ``generate``), tools and tool messages,
``/metrics`` (vLLM's names; the gauges equal the scheduler's state), ``/v1/embeddings`` (equal to Hugging Face's
``GPT2Model`` on the ``--to-hf`` export) and ``usage.prompt_tokens_details.cached_tokens``."""

from __future__ import annotations

import base64
import json
import re
import threading

import httpx
import jsonschema
import openai
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from pydantic import BaseModel

from serving_support import live_server, offline, tiny_model, tokenizer, wait_until
from tinygpt import generate
from tinygpt.inference.grammar import compile_grammar
from tinygpt.serving.embeddings import embed
from tinygpt.serving.structured import parse_tools
from tinygpt.serving.tool_calls import ToolCallReader, tool_calls

SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8},
                                           "days": {"type": "integer", "minimum": 1, "maximum": 14}},
          "required": ["city", "days"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                            "parameters": SCHEMA}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"],
    "additionalProperties": False}}}


@pytest.fixture(scope="module")
def server():
    with live_server(tiny_model(context_length=256), max_batch=4) as s:
        yield s


def _http(server) -> httpx.Client:
    return httpx.Client(base_url=server.url, timeout=60)


def _client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def _offline(model, prompt: str, kind: str, source, max_tokens: int) -> str:
    grammar = compile_grammar(kind, source, tokenizer(), model.config.vocab_size)
    row = generate(model, [tokenizer().encode(prompt)], max_new_tokens=max_tokens, eos_id=tokenizer().eot_id,
                   constraints=[grammar.constraint()]).rows()[0]
    return tokenizer().decode([t for t in row if t != tokenizer().eot_id]), len(row)


@pytest.mark.parametrize("field, kind, source, check", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "trip", "schema": SCHEMA}}},
     "json_schema", SCHEMA, lambda t: jsonschema.validate(json.loads(t), SCHEMA)),
    ({"regex": r"[a-c]{2,4}-[0-9]{2}"}, "regex", r"[a-c]{2,4}-[0-9]{2}",
     lambda t: re.fullmatch(r"[a-c]{2,4}-[0-9]{2}", t) or pytest.fail(t)),
    ({"grammar": 'root ::= ("cat" | "dog") " " ("runs" | "sleeps")'}, "grammar",
     'root ::= ("cat" | "dog") " " ("runs" | "sleeps")', lambda t: re.fullmatch("(cat|dog) (runs|sleeps)", t)
     or pytest.fail(t)),
    # vLLM's names for the same constraints
    ({"guided_json": SCHEMA}, "json_schema", SCHEMA, lambda t: jsonschema.validate(json.loads(t), SCHEMA)),
    ({"structured_outputs": {"json": json.dumps(SCHEMA)}}, "json_schema", SCHEMA,
     lambda t: jsonschema.validate(json.loads(t), SCHEMA)),
    ({"guided_choice": ["red wine", "blue", "green tea"]}, "choice", ["red wine", "blue", "green tea"],
     lambda t: t in ("red wine", "blue", "green tea") or pytest.fail(t)),
    ({"structured_outputs": {"regex": r"[0-9]{3}x"}}, "regex", r"[0-9]{3}x",
     lambda t: re.fullmatch(r"[0-9]{3}x", t) or pytest.fail(t)),
    ({"guided_grammar": 'start: "ab" | "cd"'}, "grammar", 'start: "ab" | "cd"',
     lambda t: t in ("ab", "cd") or pytest.fail(t)),
])
def test_a_served_constrained_greedy_row_equals_offline_constrained_generate(server, field, kind, source, check):
    model = server.app.state.tinygpt.model
    body = {"prompt": "Plan a trip:", "max_tokens": 60, "temperature": 0, **field}
    answer = _http(server).post("/v1/completions", json=body).json()
    text, count = _offline(model, "Plan a trip:", kind, source, 60)
    assert answer["choices"][0]["text"] == text and answer["usage"]["completion_tokens"] == count
    assert answer["choices"][0]["finish_reason"] == "stop"
    check(text)
    streamed = _http(server).post("/v1/completions", json={**body, "stream": True}).text
    pieces = [json.loads(line[6:]) for line in streamed.splitlines() if line.startswith("data: {")]
    assert "".join(p["choices"][0]["text"] for p in pieces) == text


@pytest.mark.parametrize("stream", [False, True])
def test_forced_tokens_report_the_logprob_of_the_forward_that_fed_them(server, stream):
    model = server.app.state.tinygpt.model
    prompt = tokenizer().encode("Plan a trip:")
    body = {"prompt": "Plan a trip:", "max_tokens": 60, "temperature": 0, "logprobs": 2, "guided_json": SCHEMA}
    grammar = compile_grammar("json_schema", SCHEMA, tokenizer(), model.config.vocab_size)
    result = generate(model, [prompt], max_new_tokens=60, eos_id=tokenizer().eot_id,
                      constraints=[grammar.constraint()])
    answer, forced = result.rows()[0], result.forced[0]
    if stream:
        lines = _http(server).post("/v1/completions", json={**body, "stream": True}).text.splitlines()
        pieces = [json.loads(x[6:])["choices"][0]["logprobs"] for x in lines if x.startswith("data: {")]
        got = [lp for p in pieces if p for lp in p["token_logprobs"]]
    else:
        got = _http(server).post("/v1/completions", json=body).json()["choices"][0]["logprobs"]["token_logprobs"]
    assert len(got) == len(answer) and sum(forced) >= 3
    with torch.no_grad():
        logp = model(torch.tensor([prompt + answer]))[0].log_softmax(-1)  # [T, V]
    ending = len(answer) - max(i for i, f in enumerate(forced) if not f) - 1  # forced after the last draw
    assert any(forced[:len(answer) - ending])  # forced tokens between draws: scored by the next forward
    for t, (token, lp) in enumerate(zip(answer, got)):
        if t >= len(answer) - ending:  # never fed: the row ended with them
            assert lp is None
        else:
            assert lp == pytest.approx(float(logp[len(prompt) + t - 1, token]), abs=1e-4), (t, forced[t])


class Trip(BaseModel):
    city: str
    days: int


def test_openai_parse_with_a_pydantic_model_and_json_object(server):
    client = _client(server)
    done = client.chat.completions.parse(model="tiny", messages=[{"role": "user", "content": "A trip?"}],
                                         response_format=Trip, max_tokens=120, seed=3, temperature=0.9)
    assert isinstance(done.choices[0].message.parsed, Trip)
    stream = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "JSON?"}],
                                            response_format={"type": "json_object"}, max_tokens=150, stream=True,
                                            temperature=0)
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert isinstance(json.loads(text), dict)


def test_a_tool_call_round_trip_through_the_openai_client(server):
    client = _client(server)
    messages = [{"role": "user", "content": "Weather in Paris?"}]
    first = client.chat.completions.create(model="tiny", messages=messages, tools=[WEATHER, TIME],
                                           tool_choice="required", parallel_tool_calls=False, max_tokens=120,
                                           temperature=0)
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    call = choice.message.tool_calls[0]
    assert call.function.name in ("get_weather", "get_time")
    jsonschema.validate(json.loads(call.function.arguments),
                        (WEATHER if call.function.name == "get_weather" else TIME)["function"]["parameters"])
    messages += [choice.message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"}]
    final = client.chat.completions.create(model="tiny", messages=messages, tools=[WEATHER, TIME],
                                           tool_choice="none", max_tokens=8)
    assert final.choices[0].message.tool_calls is None and final.choices[0].finish_reason in ("stop", "length")
    named = client.chat.completions.create(model="tiny", messages=messages[:1], tools=[WEATHER, TIME], n=2,
                                           tool_choice={"type": "function", "function": {"name": "get_weather"}},
                                           max_tokens=120, stream=True, temperature=0.8, seed=5)
    calls: dict[int, dict[str, str]] = {}
    for chunk in named:
        for c in chunk.choices:
            for delta in c.delta.tool_calls or []:
                calls.setdefault(c.index, {"name": "", "arguments": ""})
                calls[c.index]["name"] += delta.function.name or ""
                calls[c.index]["arguments"] += delta.function.arguments or ""
    assert sorted(calls) == [0, 1]
    for got in calls.values():
        assert got["name"] == "get_weather"
        jsonschema.validate(json.loads(got["arguments"]), SCHEMA)


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_streamed_tool_calls_grow_as_generated_and_add_up_to_the_unstreamed_calls(server, choice):
    client = _client(server)
    ask = dict(model="tiny", messages=[{"role": "user", "content": "Weather in Rome?"}], tools=[WEATHER, TIME],
               tool_choice=choice, max_tokens=120, temperature=0)
    whole = client.chat.completions.create(**ask).choices[0]
    assert whole.finish_reason == "tool_calls"
    calls: dict[int, dict[str, str]] = {}
    fragments, reasons = 0, []
    for chunk in client.chat.completions.create(**ask, stream=True):
        for c in chunk.choices:
            reasons.append(c.finish_reason)
            for delta in c.delta.tool_calls or []:
                if delta.id is not None:  # a call's first delta: its id, type, name and arguments ""
                    assert delta.index not in calls and delta.type == "function" and delta.function.arguments == ""
                    calls[delta.index] = {"name": delta.function.name, "arguments": ""}
                else:
                    assert delta.function.name is None
                    calls[delta.index]["arguments"] += delta.function.arguments
                    fragments += 1
    assert reasons[-1] == "tool_calls"
    assert [calls[i] for i in sorted(calls)] == [{"name": c.function.name, "arguments": c.function.arguments}
                                                for c in whole.message.tool_calls]
    assert fragments > len(calls)  # the arguments came in pieces, not whole
    for call in calls.values():
        json.loads(call["arguments"])


def test_the_tool_call_reader_splits_calls_at_their_arguments_whatever_the_pieces():
    tools = parse_tools({"tools": [WEATHER, TIME], "tool_choice": "required"})
    args = ['{"city": "P}a\\"r[is", "days": [1, {"x": 2}]}', '{"zone": "UTC"}']
    text = f'[{{"name": "get_weather", "arguments": {args[0]}}}, {{"name": "get_time", "arguments": {args[1]}}}]'
    for size in (1, 3, len(text)):
        reader = ToolCallReader(tools)
        deltas = [d for i in range(0, len(text), size) for d in reader.feed(text[i:i + size])]
        heads = [d for d in deltas if "id" in d]
        assert [(d["index"], d["function"]["name"]) for d in heads] == [(0, "get_weather"), (1, "get_time")]
        for k in (0, 1):
            assert "".join(d["function"]["arguments"] for d in deltas if d["index"] == k) == args[k]
        assert [c["function"]["arguments"] for c in reader.result()] == args
    assert ToolCallReader(tools).result() is None and tool_calls(text[:-2], tools) is None


@pytest.mark.parametrize("body, param, fragment", [
    ({"regex": "a("}, "regex", "unclosed group"),
    ({"grammar": 'root ::= "a" | nothing'}, "grammar", "not found"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string",
                                                                                          "format": "nope"}}}},
     "response_format.json_schema.schema", "Unknown format"),
    ({"response_format": {"type": "xml"}}, "response_format.type", "json_schema"),
    ({"regex": "a", "grammar": "start: \"a\""}, "regex", "not several"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_time"}}},
     "tool_choice.function.name", "not among the tools"),
    ({"tools": [WEATHER]}, "tool_choice", '"auto" needs a chat template'),
    ({"tools": [WEATHER], "tool_choice": "required", "regex": "a"}, "regex", "conflicts with tool_choice"),
    ({"messages": [{"role": "user", "content": "a"}, {"role": "tool", "content": "b"}]},
     "messages[1].tool_call_id", "is required"),
    ({"messages": [{"role": "tool", "content": "b", "tool_call_id": "x"}]}, "messages", "must follow an assistant"),
    ({"seed": 10 ** 30}, "seed", "31 digits"),
    ({"guided_regex": "a", "structured_outputs": {"regex": "b"}}, "structured_outputs.regex",
     "conflicts with guided_regex"),
    ({"response_format": {"type": "json_object"}, "guided_json": SCHEMA}, "guided_json",
     "conflicts with response_format"),
    ({"structured_outputs": {"json": "{nope"}}, "structured_outputs.json", "does not parse"),
    ({"structured_outputs": {"jsn": {}}}, "structured_outputs.jsn", "unknown field"),
    ({"guided_choice": []}, "guided_choice", "non-empty list"),
    ({"guided_regex": "a("}, "guided_regex", "unclosed group"),
])
def test_bad_input_is_a_400_naming_the_field(server, body, param, fragment):
    r = _http(server).post("/v1/chat/completions",
                           json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **body})
    error = r.json()["error"]
    assert r.status_code == 400 and error["param"] == param and fragment in error["message"], error
    assert error["message"].startswith(param) and "\n" not in error["message"]


def _metrics(server) -> dict[str, float]:
    text = _http(server).get("/metrics").text
    return {s.name + json.dumps({k: v for k, v in s.labels.items() if k != "model_name"}, sort_keys=True): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_metrics_parse_and_the_gauges_are_the_schedulers_state_while_four_streams_run(server):
    state = server.app.state.tinygpt
    engine = state.engine
    before = _metrics(server)
    streams = [threading.Thread(target=lambda i=i: _http(server).post("/v1/completions", json={
        "prompt": f"stream {i} " * 20, "max_tokens": 40, "temperature": 0, "stream": True}).text) for i in range(5)]
    for t in streams:
        t.start()
    wait_until(lambda: engine.load()["running"] == 4, message="four rows running")
    gate, held = threading.Event(), threading.Event()
    engine.call(lambda: (held.set(), gate.wait(30)), lambda result, error: None)  # the engine waits between steps
    try:
        assert held.wait(30)
        got = _metrics(server)
        blocks = engine.core.blocks
        # the scheduler's counts at the moment the engine stopped (a stream may have ended since all four ran)
        running, waiting = len(engine.core.scheduler.running), engine.load()["waiting"]
        assert got["vllm:num_requests_running{}"] == running >= 1
        assert got["vllm:num_requests_waiting{}"] == waiting and running + waiting <= 5
        used = (blocks.capacity_blocks - blocks.num_free) / blocks.capacity_blocks
        assert got["vllm:kv_cache_usage_perc{}"] == pytest.approx(used) and used > 0
        assert got["vllm:gpu_cache_usage_perc{}"] == got["vllm:kv_cache_usage_perc{}"]
    finally:
        gate.set()
    for t in streams:
        t.join(60)
    after = _metrics(server)
    assert after["vllm:generation_tokens_total{}"] - before.get("vllm:generation_tokens_total{}", 0) == 5 * 40
    assert after['vllm:request_success_total{"finished_reason": "length"}'] - before.get(
        'vllm:request_success_total{"finished_reason": "length"}', 0) == 5
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "time_per_output_token_seconds"):
        assert after[f"vllm:{name}_count{{}}"] - before.get(f"vllm:{name}_count{{}}", 0) == 5


def test_cached_tokens_count_the_prompt_tokens_the_prefix_cache_gave(server):
    body = {"prompt": "The same long system prompt for every request. " * 4, "max_tokens": 2}
    first = _http(server).post("/v1/completions", json=body).json()["usage"]
    hits = _metrics(server)["vllm:prefix_cache_hits_total{}"]
    second = _http(server).post("/v1/completions", json=body).json()["usage"]
    assert first["prompt_tokens_details"]["cached_tokens"] == 0
    cached = second["prompt_tokens_details"]["cached_tokens"]
    block = server.app.state.tinygpt.engine.core.blocks.block_size
    assert cached == (second["prompt_tokens"] - 1) // block * block > 0  # whole blocks; the last token is fed
    assert _metrics(server)["vllm:prefix_cache_hits_total{}"] - hits == cached


def test_embeddings_float_and_base64_batched_equal_one_at_a_time(server):
    http = _http(server)
    inputs = ["the quick brown fox", "a", "Every effort moves you forward"]
    many = http.post("/v1/embeddings", json={"input": inputs}).json()
    assert [d["index"] for d in many["data"]] == [0, 1, 2]
    vectors = torch.tensor([d["embedding"] for d in many["data"]])
    for i, text in enumerate(inputs):
        one = http.post("/v1/embeddings", json={"input": text, "encoding_format": "base64"}).json()
        decoded = torch.frombuffer(bytearray(base64.b64decode(one["data"][0]["embedding"])), dtype=torch.float32)
        torch.testing.assert_close(decoded, vectors[i], atol=1e-6, rtol=0)
    assert torch.allclose(vectors.norm(dim=-1), torch.ones(3), atol=1e-5)
    emb = _client(server).embeddings.create(model="tiny", input=[[5, 6, 7], [8]])  # ids; base64 by default
    assert len(emb.data) == 2 and len(emb.data[0].embedding) == server.app.state.tinygpt.model.config.emb_dim
    r = http.post("/v1/embeddings", json={"input": "x", "pooling": "max"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "pooling"


@pytest.mark.parametrize("pooling", ["mean", "last"])
def test_an_embedding_prefilled_in_chunks_equals_it_unchunked_and_the_plain_forward(pooling):
    model = tiny_model(context_length=64)
    inputs = [list(range(3, 53)), [7, 8, 9], list(range(100, 137))]  # 50 and 37 tokens: chunks of 8
    whole = embed(model, inputs, pooling, normalize=False)
    chunked = embed(model, inputs, pooling, normalize=False, max_rows=2, token_budget=8)
    torch.testing.assert_close(chunked, whole, atol=1e-5, rtol=0)
    with torch.no_grad():
        for i, ids in enumerate(inputs):
            states = model.hidden_states(torch.tensor([ids]))[0]  # [T, D]
            want = states.mean(0) if pooling == "mean" else states[-1]
            torch.testing.assert_close(whole[i], want, atol=1e-5, rtol=0)


def test_embeddings_batched_with_streams_leave_their_greedy_tokens_as_offline_generate(server):
    state = server.app.state.tinygpt
    before = _metrics(server)["vllm:prompt_tokens_total{}"]
    prompts = [f"Stream number {i} tells a story about" for i in range(3)]
    inputs = [" ".join(["embedding", "row", str(i)] * 8) for i in range(6)]  # ~110 tokens: chunked beside decodes
    texts: dict[int, str] = {}
    got: dict[str, list] = {}

    def stream(i: int) -> None:
        body = {"prompt": prompts[i], "max_tokens": 40, "temperature": 0, "stream": True}
        lines = _http(server).post("/v1/completions", json=body).text.splitlines()
        texts[i] = "".join(json.loads(x[6:])["choices"][0]["text"] for x in lines if x.startswith("data: {"))

    def embeddings() -> None:
        got["data"] = _http(server).post("/v1/embeddings", json={"input": inputs, "normalize": False}).json()["data"]

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(3)] + [threading.Thread(target=embeddings)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    for i, prompt in enumerate(prompts):
        assert texts[i] == tokenizer().decode(offline(state.model, tokenizer().encode(prompt), 40))
    ids = [tokenizer().encode(text) for text in inputs]
    want = embed(state.model, ids, normalize=False)
    torch.testing.assert_close(torch.tensor([d["embedding"] for d in got["data"]]), want, atol=1e-5, rtol=0)
    counted = _metrics(server)["vllm:prompt_tokens_total{}"] - before
    assert counted == sum(len(one) for one in ids) + sum(len(tokenizer().encode(p)) for p in prompts)


@pytest.mark.parametrize("pooling", ["mean", "last"])
def test_embeddings_equal_hugging_face_gpt2model_on_the_export(eval_model_dirs, pooling):
    from transformers import GPT2Model

    from tinygpt import load_model

    ours_dir, hf_dir = eval_model_dirs
    model = load_model(ours_dir).eval()
    hf = GPT2Model.from_pretrained(hf_dir).eval()
    inputs = [[464, 2068, 7586, 21831], [40, 716], [11, 318, 257, 1332, 13, 383, 286]]
    got = embed(model, inputs, pooling, normalize=False)
    with torch.no_grad():
        for i, ids in enumerate(inputs):
            states = hf(torch.tensor([ids])).last_hidden_state[0]  # [T, D]
            want = states.mean(0) if pooling == "mean" else states[-1]
            torch.testing.assert_close(got[i], want, atol=1e-5, rtol=0)


def test_tools_and_tool_messages_reach_the_chat_template_as_apply_chat_template_passes_them():
    from tinygpt.chat_template import ChatTemplate
    from tinygpt.serving.chat_format import render_chat
    from tinygpt.serving.protocol import parse_chat
    from tinygpt.serving.structured import read_chat

    template = ChatTemplate(  # a template that writes tools and calls (as Hermes-style templates do)
        "{% for t in tools %}[tool {{ t.function.name }}]{% endfor %}"
        "{% for m in messages %}<{{ m.role }}>{{ m.content }}"
        "{% for c in m.tool_calls or [] %}(call {{ c.function.name }} {{ c.function.arguments.city }}){% endfor %}"
        "{% if m.tool_call_id %}(for {{ m.tool_call_id }}){% endif %}{% endfor %}<assistant>")
    body = {"messages": [{"role": "user", "content": "Weather?"},
                         {"role": "assistant", "content": None, "tool_calls": [
                             {"id": "call_1", "type": "function",
                              "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "days": 2}'}}]},
                         {"role": "tool", "tool_call_id": "call_1", "content": "rain"}],
            "tools": [WEATHER], "tool_choice": "none"}
    req = read_chat(parse_chat(body), body)
    text = render_chat(req.messages, template, req.extras, req.tools.tools)
    assert text == ("[tool get_weather]<user>Weather?<assistant>(call get_weather Oslo)<tool>rain(for call_1)"
                    "<assistant>")


HERMES = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
          "{% if tools %}Call a tool as <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call>{% endif %}"
          "<|im_start|>assistant\n")


def test_auto_reads_hermes_style_calls_and_is_refused_where_the_template_defines_none(server):
    from tinygpt.serving.structured import ToolSpec, template_writes_calls
    from tinygpt.serving.tool_calls import auto_calls

    tools = ToolSpec([WEATHER, TIME], "auto", functions={"get_weather": SCHEMA, "get_time": {}})
    content, calls = auto_calls('Let me look. <tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}'
                                '</tool_call>', tools)
    assert content == "Let me look." and calls[0]["function"] == {"name": "get_time", "arguments": '{"zone": "UTC"}'}
    assert auto_calls("no call here", tools) == ("no call here", None)
    assert auto_calls('<tool_call>{"name": "unknown"}</tool_call>', tools)[1] is None
    assert not template_writes_calls(tokenizer().chat_template)
    hermes = tokenizer().with_chat_template(HERMES)
    assert template_writes_calls(hermes.chat_template)
    from tinygpt.serving.app import create_app
    from tinygpt.serving.server import BackgroundServer

    with BackgroundServer(create_app(tiny_model(context_length=256), hermes, model_name="tiny")) as other:
        answer = _client(other).chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                        tools=[WEATHER], max_tokens=6, temperature=0)
        # a random model writes no call: the answer is its text (the template defines calls, so auto is honoured)
        assert answer.choices[0].message.tool_calls is None and answer.choices[0].finish_reason in ("stop", "length")
    r = _http(server).post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                         "tools": [WEATHER], "tool_choice": "auto"})
    assert r.status_code == 400 and "auto" in r.json()["error"]["message"]
