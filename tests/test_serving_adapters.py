"""``tinygpt serve --adapter NAME=DIR``: several LoRA adapters on one base, the request's ``model`` field picks
one; rows of different adapters decode in one batch, each greedy row equal to offline generation with its merged
model. A live server on 127.0.0.1 (the official ``openai`` client), the engine directly, and the CLI's refusals."""

from __future__ import annotations

import httpx
import openai
import pytest
import torch

from lora_support import clone, trained_adapter
from serving_support import Collector, engine_of, live_server, offline, tiny_model, tokenizer
from tinygpt import GenerationConfig, generate_text, lora
from tinygpt.cli import main
from tinygpt.checkpoint import save_model
from tinygpt.interop.peft import save_adapter
from tinygpt.serving.chat_format import CHAT_STOP_TEXTS, render_chat
from tinygpt.serving.engine import EngineRequest

PROMPT = "Every effort moves"
CONFIGS = {"a": lora.LoRAConfig(r=4, alpha=8, targets=("qkv", "out_proj", "ffn_in")),
           "b": lora.LoRAConfig(r=2, alpha=4, targets=("qkv", "ffn_out"))}


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    """The base, {name: (adapter folder, merged model)} for adapters a and b (saved in PEFT's format)."""
    base = tiny_model(context_length=128)
    out = {}
    for seed, (name, config) in enumerate(CONFIGS.items(), start=1):
        adapted, _ = trained_adapter(base, config, seed=seed, scale=0.5)
        folder = tmp_path_factory.mktemp(f"adapter-{name}")
        save_adapter(adapted, folder / "out")
        out[name] = (folder / "out", lora.merged_model(adapted).eval())
    return base, out


@pytest.fixture(scope="module")
def server(adapters):
    base, named = adapters
    # the served model gets the adapters attached in place: a copy, so that ``base`` stays the plain base
    with live_server(clone(base), max_batch=4, max_queue=8,
                     adapter=[f"{name}={folder}" for name, (folder, _) in named.items()]) as server:
        yield server


@pytest.fixture
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def _models(adapters) -> dict[str, torch.nn.Module]:
    base, named = adapters
    return {"tiny": base, **{name: merged for name, (_, merged) in named.items()}}


def test_the_model_field_picks_the_adapter_and_the_answer_is_its_merged_models(client, adapters):
    ids = tokenizer().encode(PROMPT)
    models = _models(adapters)
    expected = {name: offline(model, ids, 10) for name, model in models.items()}
    assert len({tuple(e) for e in expected.values()}) == 3  # the adapters change the answer
    for name in models:
        out = client.completions.create(model=name, prompt=PROMPT, max_tokens=10, temperature=0)
        assert out.model == name
        assert out.choices[0].text == tokenizer().decode(expected[name])
        streamed = client.completions.create(model=name, prompt=PROMPT, max_tokens=10, temperature=0, stream=True)
        assert "".join(c.choices[0].text for c in streamed) == out.choices[0].text


def test_chat_routes_the_adapter_with_the_bases_template(client, adapters):
    messages = [{"role": "user", "content": "Name a colour."}]
    prompt = render_chat([(m["role"], m["content"]) for m in messages])
    for name, model in _models(adapters).items():
        expected = generate_text(model, tokenizer(), prompt, max_new_tokens=8, stop_texts=CHAT_STOP_TEXTS)
        out = client.chat.completions.create(model=name, messages=messages, max_tokens=8, temperature=0)
        assert out.model == name and out.choices[0].message.content == expected


def test_prompt_logprobs_are_scored_with_the_adapter(client, adapters):
    ids = tokenizer().encode(PROMPT)
    merged = _models(adapters)["b"]
    out = client.completions.create(model="b", prompt=ids, max_tokens=1, temperature=0, echo=True, logprobs=0)
    with torch.no_grad():
        ref = merged(torch.tensor([ids]))[0].log_softmax(-1)
    got = out.choices[0].logprobs.token_logprobs
    for t in range(1, len(ids)):
        assert got[t] == pytest.approx(ref[t - 1, ids[t]].item(), abs=1e-4)


def test_models_list_the_base_and_each_adapter_and_an_unknown_name_is_404(client, server):
    listed = {m.id: m for m in client.models.list()}
    assert list(listed) == ["tiny", "a", "b"]
    assert listed["a"].model_extra["parent"] == "tiny" and "parent" not in listed["tiny"].model_extra
    assert client.models.retrieve("b").id == "b"
    with pytest.raises(openai.NotFoundError, match="'tiny', 'a', 'b'"):
        client.completions.create(model="c", prompt=PROMPT, max_tokens=2)
    assert httpx.get(server.url + "/health", timeout=10).json()["adapters"] == ["a", "b"]


def test_rows_of_the_base_and_both_adapters_decode_together_each_as_alone(server, adapters):
    engine = engine_of(server)
    models = _models(adapters)
    index = {"tiny": -1, "a": 0, "b": 1}
    prompts = {name: tokenizer().encode(text) for name, text in
               zip(models, ["The quick brown fox", "Every effort moves you", "Name a colour."])}
    sinks = {name: Collector() for name in models}
    steps = engine.steps
    engine.submit([EngineRequest(prompts[name], GenerationConfig(max_new_tokens=12, eos_id=tokenizer().eot_id),
                                 sinks[name], adapter=index[name]) for name in models])
    for name, model in models.items():
        assert sinks[name].wait().tokens == offline(model, prompts[name], 12), name
    # one submit: the three rows joined the batch at one step, so they shared their forwards
    assert engine.max_rows_seen >= 3 and engine.steps - steps <= 13


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, adapters):
    folder = tmp_path_factory.mktemp("serve") / "m"
    save_model(adapters[0], folder, tokenizer=tokenizer())
    return folder


@pytest.mark.parametrize("flags, message", [
    (["--adapter", "a"], "--adapter a must be NAME=DIR"),
    (["--adapter", "=x"], "--adapter =x must be NAME=DIR"),
    (["--adapter", "m=x"], "--adapter m=x names the base model ('m')"),
    (["--model-name", "base", "--adapter", "base=x"], "--adapter base=x names the base model ('base')"),
    (["--adapter", "a=x", "--adapter", "a=y"], "--adapter a=y repeats the NAME 'a'"),
])
def test_bad_adapter_flags_are_one_line_errors(model_dir, capsys, flags, message):
    assert main(["serve", "--model", str(model_dir), *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"tinygpt serve: error: {message}") and err.count("\n") == 1


def test_a_missing_a_foreign_or_an_nf4_adapter_is_refused(model_dir, adapters, tmp_path, capsys):
    base = adapters[0]
    other, _ = trained_adapter(tiny_model(context_length=64), CONFIGS["a"], seed=3)
    save_adapter(other, tmp_path / "other")
    nf4, _ = trained_adapter(base, lora.LoRAConfig(r=2, quantize="nf4"), seed=4)
    save_adapter(nf4, tmp_path / "nf4")
    for value, message in [(f"x={tmp_path / 'none'}", "no such folder"),
                           (f"x={model_dir}", "is not a LoRA adapter"),
                           (f"x={tmp_path / 'other'}", "trained on a model of another config"),
                           (f"x={tmp_path / 'nf4'}", "'x' was trained on an NF4 base: merge it")]:
        assert main(["serve", "--model", str(model_dir), "--adapter", value]) == 2
        err = capsys.readouterr().err
        assert err.startswith("tinygpt serve: error: --adapter") and message in err and err.count("\n") == 1, err


def test_inspect_honours_the_model_field(server, adapters):
    """Issue 43, E12: /inspect ignored ``model`` (an adapter's name inspected the base; an unknown name was a 200)."""
    from tinygpt.serving.inspect import inspect_text

    models = _models(adapters)
    ids = tokenizer().encode(PROMPT)
    with httpx.Client(base_url=server.url, timeout=60) as http:
        for name, model in models.items():
            answer = http.post("/inspect", json={"model": name, "text": PROMPT, "top": 3})
            assert answer.status_code == 200, answer.text
            expected = inspect_text(model, tokenizer(), ids, layer=0, top=3, logit_lens=False)
            got = answer.json()
            assert [[t["id"] for t in row] for row in got["next"]] == [[t["id"] for t in row]
                                                                       for row in expected["next"]], name
            assert got["next"][-1][0]["prob"] == pytest.approx(expected["next"][-1][0]["prob"], abs=1e-4)
        unknown = http.post("/inspect", json={"model": "nope", "text": PROMPT})
        assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"
