"""Chat messages -> the prompt: the Alpaca template SFT writes, a Hugging Face folder's own template, and the 400
for a model with none."""

from __future__ import annotations

import json

import httpx
import pytest
import torch

from serving_support import TEXT, tiny_model, tokenizer
from tinygpt import GPTConfig, GPTModel, generate_text
from tinygpt.alignment.data import format_prompt
from tinygpt.serving.chat_format import render_chat


def test_one_user_message_is_exactly_the_sft_prompt():
    assert render_chat([("user", "Name a colour.")]) == format_prompt("Name a colour.")


def test_earlier_turns_are_complete_examples_and_a_system_message_replaces_the_preamble():
    text = render_chat([("system", "Be brief."), ("user", "A?"), ("assistant", "B."), ("user", "C?")])
    first = format_prompt("A?").replace(format_prompt("A?").split("\n\n")[0], "Be brief.") + "B."
    last = format_prompt("C?").replace(format_prompt("C?").split("\n\n")[0] + "\n\n", "")
    assert text == first + "\n\n" + last


@pytest.mark.parametrize("messages, match", [
    ([("assistant", "x")], "end with a user message"),
    ([("user", "a"), ("assistant", "b")], "end with a user message"),
    ([("user", "a"), ("user", "b")], "two user messages in a row"),
    ([("system", "s")], "end with a user message"),
])
def test_bad_conversations(messages, match):
    with pytest.raises(ValueError, match=match):
        render_chat(messages)


# ------------------------------------------------------------------------------ the template from the checkpoint
CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def _chatml_folder(path):
    """A tiny Hugging Face GPT-2 folder whose tokenizer has ChatML's two special tokens and whose
    tokenizer_config.json has a ChatML template (and <|im_end|> as its eos), as a chat model on the Hub does."""
    from tinygpt.interop.hf import export_hf
    from tinygpt.tokenizer import BPETokenizer

    inner = BPETokenizer.train([TEXT], 300).tokenizer
    inner.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    bpe = BPETokenizer(inner)
    torch.manual_seed(0)
    model = GPTModel(GPTConfig(vocab_size=bpe.vocab_size, context_length=128, emb_dim=32, n_heads=2, n_layers=2))
    export_hf(model.eval(), path, bpe)
    config = json.loads((path / "tokenizer_config.json").read_text(encoding="utf-8"))
    config.update(chat_template=CHATML, eos_token="<|im_end|>")
    (path / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return path


def test_a_hugging_face_folder_is_served_with_its_own_template(tmp_path):
    from tinygpt.interop.pretrained import load_pretrained
    from tinygpt.serving.app import create_app
    from tinygpt.serving.server import BackgroundServer

    from tinygpt.checkpoint import load_checkpoint_tokenizer
    from tinygpt.interop.pretrained import convert_from_hf

    model, tok = load_pretrained(_chatml_folder(tmp_path / "hf"))
    assert tok.chat_template.source == CHATML and tok.chat_template.special_tokens["eos_token"] == "<|im_end|>"
    convert_from_hf(tmp_path / "hf", tmp_path / "converted")  # the template comes along into a tinygpt checkpoint
    assert load_checkpoint_tokenizer(tmp_path / "converted").chat_template == tok.chat_template
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    prompt = tok.chat_template.render(messages)
    assert prompt.endswith("<|im_start|>assistant\n")
    ids = tok.encode(prompt)
    assert ids.count(tok.tokenizer.token_to_id("<|im_start|>")) == 3  # the markers are single special tokens
    expected = generate_text(model, tok, prompt, max_new_tokens=12, stop_texts=["<|im_end|>"])
    with BackgroundServer(create_app(model, tok, model_name="hf")) as server, \
            httpx.Client(base_url=server.url, timeout=60) as http:
        card = http.get("/v1/models/hf").json()
        assert card["has_chat_template"] is True
        out = http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 12, "temperature": 0})
        assert out.status_code == 200, out.text
        body = out.json()
        assert body["usage"]["prompt_tokens"] == len(ids)
        assert body["choices"][0]["message"]["content"] == expected


def test_a_model_without_a_template_gets_a_400_naming_why(tmp_path):
    bare = tokenizer().with_chat_template(None)
    from tinygpt.serving.app import create_app
    from tinygpt.serving.server import BackgroundServer

    with BackgroundServer(create_app(tiny_model(), bare, model_name="base")) as server, \
            httpx.Client(base_url=server.url, timeout=60) as http:
        assert http.get("/v1/models/base").json()["has_chat_template"] is False
        out = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
        assert out.status_code == 400
        error = out.json()["error"]
        assert error["param"] == "messages"
        assert "no chat template" in error["message"] and "/v1/completions" in error["message"]
        done = http.post("/v1/completions", json={"prompt": "Name a colour.", "max_tokens": 2})
        assert done.status_code == 200  # completion still works on the same model
