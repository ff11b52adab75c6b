"""`tinygpt chat`: the template, streaming, /exit and EOF; an SFT-trained model answers what it was taught."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from tinygpt import GPTModel, generate_text
from tinygpt.alignment.chat import chat
from tinygpt.alignment.data import ALPACA_CHAT_TEMPLATE, InstructionExample, format_prompt
from tinygpt.alignment import FinetuneOptions
from tinygpt.training import run_stage
from tinygpt.alignment.sft import SFTStage

pytestmark = pytest.mark.usefixtures("one_thread")

TAUGHT = {
    "What is the capital of Indonesia?": "The capital of Indonesia is Jakarta.",
    "What is the atomic number of oxygen?": "The atomic number of oxygen is 8.",
    "Convert 45 kilometers to meters.": "45 kilometers is 45000 meters.",
}


@pytest.fixture
def chat_tokenizer(alignment_tokenizer):
    return alignment_tokenizer.with_chat_template(ALPACA_CHAT_TEMPLATE)


@pytest.fixture
def chat_model_dir(tmp_path, chat_tokenizer, alignment_config):
    """A seeded tiny GPT saved with the alignment tokenizer and the Alpaca chat template (as SFT saves one)."""
    from tinygpt import save_model

    torch.manual_seed(0)
    save_model(GPTModel(alignment_config), tmp_path / "chat", chat_tokenizer)
    return tmp_path / "chat"


class Recorder:
    def __init__(self) -> None:
        self.pieces: list[str] = []

    def __call__(self, text: str) -> None:
        self.pieces.append(text)

    @property
    def text(self) -> str:
        return "".join(self.pieces)


def test_chat_streams_template_answers_and_stops_at_exit(chat_tokenizer, alignment_config):
    model = GPTModel(alignment_config).eval()
    out = Recorder()
    answered = chat(model, chat_tokenizer, ["Say hi.\n", "  \n", "/exit\n", "Never read.\n"], out,
                    max_new_tokens=6, prompt_marker="> ")
    expected = generate_text(model, chat_tokenizer, format_prompt("Say hi."), max_new_tokens=6,
                             stop_texts=["\n### Instruction:", "\n### Input:", "\n### Response:"])
    assert answered == 1
    assert out.text == "> " + expected + "\n> > "  # one answer, a marker per line read, nothing after /exit
    assert len(out.pieces) > 3  # streamed piece by piece, not written once
    assert chat(model, chat_tokenizer, iter(()), Recorder(), max_new_tokens=2) == 0  # EOF at once


def test_chat_reports_a_line_the_tokenizer_cannot_encode_and_goes_on(chat_tokenizer, alignment_config):
    errors: list[str] = []
    out = Recorder()
    answered = chat(GPTModel(alignment_config), chat_tokenizer, ["say <|endoftext|>\n", "ok\n"], out,
                    max_new_tokens=2, report_error=errors.append)
    assert answered == 1 and len(errors) == 1 and "<|endoftext|>" in errors[0]


def test_a_fine_tuned_model_answers_what_it_was_taught(tmp_path, alignment_tokenizer, alignment_config, capsys,
                                                       monkeypatch):
    torch.manual_seed(0)
    examples = [InstructionExample(q, "", a) for q, a in TAUGHT.items()]
    stage = SFTStage(GPTModel(alignment_config), alignment_tokenizer, examples, batch_size=3, val_fraction=0.0)
    run_stage(stage, FinetuneOptions(out_dir=str(tmp_path / "sft"), max_steps=60, lr=1e-2, min_lr=1e-3,
                                     eval_every=60, progress=False))
    out = Recorder()
    assert stage.tokenizer.chat_template.source == ALPACA_CHAT_TEMPLATE  # SFT gives its model the Alpaca template
    chat(stage.policy, stage.tokenizer, [f"{q}\n" for q in TAUGHT], out, max_new_tokens=40)
    assert out.text.splitlines() == list(TAUGHT.values())  # each answer ended at the learned end-of-text

    # The same through the command line (its own main, from the saved checkpoint), the questions on stdin; a real
    # process reading a real pipe is test_a_closed_pipe_ends_chat_quietly's.
    import io

    from tinygpt.cli import main

    capsys.readouterr()
    monkeypatch.setattr("sys.stdin", io.StringIO("".join(f"{q}\n" for q in TAUGHT)))
    code = main(["chat", "--model", str(tmp_path / "sft")])
    done = capsys.readouterr()
    assert code == 0, done.err
    assert done.out.splitlines() == list(TAUGHT.values())

    # And served: the checkpoint's own template (tokenizer_config.json, written by SFT) renders the chat.
    import httpx

    from tinygpt.interop.pretrained import load_pretrained
    from tinygpt.serving.app import create_app
    from tinygpt.serving.server import BackgroundServer

    model, tokenizer = load_pretrained(tmp_path / "sft")
    assert tokenizer.chat_template.source == ALPACA_CHAT_TEMPLATE
    with BackgroundServer(create_app(model, tokenizer, model_name="sft")) as server, \
            httpx.Client(base_url=server.url, timeout=60) as http:
        for question, answer in TAUGHT.items():
            out = http.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": question}],
                                                          "max_tokens": 40, "temperature": 0})
            assert out.json()["choices"][0]["message"]["content"] == answer


def test_a_closed_pipe_ends_chat_quietly(chat_model_dir):
    lines = "".join(f"Say {i}.\n" for i in range(200))
    proc = subprocess.Popen([sys.executable, "-m", "tinygpt", "chat", "--model", str(chat_model_dir),
                             "--max-new-tokens", "30", "--temperature", "1"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdin.write(lines.encode())
    proc.stdin.close()
    proc.stdout.read(2)
    proc.stdout.close()  # `| head -c 2`
    err = proc.stderr.read()
    proc.stderr.close()
    assert proc.wait(timeout=120) == 141 and err == b"", err.decode()


def test_chat_takes_generate_s_stop_flags(tmp_path, chat_model_dir, capsys, monkeypatch):
    import io

    from tinygpt.cli import main

    def answer(*extra):
        monkeypatch.setattr("sys.stdin", io.StringIO("Name a color.\n"))
        assert main(["chat", "--model", str(chat_model_dir), "--max-new-tokens", "12", *extra]) == 0
        return capsys.readouterr().out

    full = answer()[:-1]
    stop = full[4:6]
    assert answer("--stop", stop) == full[: full.find(stop)] + "\n"


def test_a_model_without_a_chat_template_is_refused_in_one_line(alignment_model_dir, capsys, monkeypatch):
    import io

    from tinygpt.cli import main

    monkeypatch.setattr("sys.stdin", io.StringIO("Name a color.\n"))
    assert main(["chat", "--model", str(alignment_model_dir)]) == 2  # a pretrained model, never fine-tuned
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("tinygpt chat: error: ") and captured.err.count("\n") == 1
    assert "no chat template" in captured.err and "tinygpt sft" in captured.err
