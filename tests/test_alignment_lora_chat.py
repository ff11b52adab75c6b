"""A LoRA fine-tune chats: the run folder (an adapter) carries the chat template it trained in, so `tinygpt chat`,
`merge`, `serve --model ADAPTER` and `serve --adapter NAME=DIR` (and the page's Chat tab) answer in it."""

from __future__ import annotations

import io
import json

import pytest

from test_alignment_chat import TAUGHT
from tinygpt.alignment.data import ALPACA_CHAT_TEMPLATE
from tinygpt.cli import main
from tinygpt.interop.pretrained import load_pretrained

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def lora_run(tmp_path, alignment_model_dir, capsys):
    """A LoRA SFT run of the CLI on the three TAUGHT answers (the base is a random tiny GPT: only the adapters
    learn them)."""
    data = tmp_path / "taught.json"
    data.write_text(json.dumps([{"instruction": q, "input": "", "output": a} for q, a in TAUGHT.items()]))
    code = main(["sft", "--model", str(alignment_model_dir), "--data", str(data), "--out", str(tmp_path / "run"),
                 "--lora-r", "16", "--lora-targets", "qkv", "out_proj", "ffn_in", "ffn_out", "--lr", "3e-2",
                 "--max-steps", "80", "--eval-every", "80", "--batch-size", "3", "--val-fraction", "0",
                 "--no-progress"])
    assert code == 0, capsys.readouterr().err
    capsys.readouterr()
    return tmp_path / "run"


def _chat(monkeypatch, capsys, *flags: str) -> list[str]:
    monkeypatch.setattr("sys.stdin", io.StringIO("".join(f"{q}\n" for q in TAUGHT)))
    code = main(["chat", *flags, "--max-new-tokens", "40"])
    done = capsys.readouterr()
    assert code == 0, done.err
    return done.out.splitlines()


def test_a_lora_run_chats_from_its_folder_merged_and_served(lora_run, tmp_path, alignment_model_dir, capsys,
                                                            monkeypatch):
    assert json.loads((lora_run / "tokenizer_config.json").read_text())["chat_template"] == ALPACA_CHAT_TEMPLATE
    assert not (alignment_model_dir / "tokenizer_config.json").exists()  # the base has no template of its own
    assert _chat(monkeypatch, capsys, "--model", str(lora_run)) == list(TAUGHT.values())

    # merged: a plain checkpoint with the adapter's tokenizer and template
    assert main(["merge", "--adapter", str(lora_run), "--out", str(tmp_path / "merged")]) == 0
    capsys.readouterr()
    assert _chat(monkeypatch, capsys, "--model", str(tmp_path / "merged")) == list(TAUGHT.values())

    # served: the adapter folder as the model, and the adapter beside its base (the request's model field picks
    # it; its own folder's template renders the chat, the base's card has none)
    import httpx

    from tinygpt.serving.app import create_app
    from tinygpt.serving.server import BackgroundServer

    for model_dir, adapters, name in ((lora_run, [], "run"), (alignment_model_dir, [f"sft={lora_run}"], "sft")):
        model, tokenizer = load_pretrained(model_dir)
        with BackgroundServer(create_app(model, tokenizer, model_name="run", adapter=adapters)) as server, \
                httpx.Client(base_url=server.url, timeout=60) as http:
            cards = {m["id"]: m["has_chat_template"] for m in http.get("/v1/models").json()["data"]}
            assert cards == ({"run": True} if not adapters else {"run": False, "sft": True})
            for question, answer in TAUGHT.items():
                out = http.post("/v1/chat/completions", json={"model": name, "max_tokens": 40, "temperature": 0,
                                                              "messages": [{"role": "user", "content": question}]})
                assert out.status_code == 200, out.text
                assert out.json()["choices"][0]["message"]["content"] == answer
