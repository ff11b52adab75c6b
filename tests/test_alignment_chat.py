"""`tinygpt chat`: the template, streaming, /exit and EOF; an SFT-trained model answers what it was taught."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from tinygpt import GPTModel, generate_text
from tinygpt.alignment.chat import chat
from tinygpt.alignment.data import InstructionExample, format_prompt
from tinygpt.alignment import FinetuneOptions
from tinygpt.training import run_stage
from tinygpt.alignment.sft import SFTStage

pytestmark = pytest.mark.usefixtures("one_thread")

TAUGHT = {
    "What is the capital of Indonesia?": "The capital of Indonesia is Jakarta.",
    "What is the atomic number of oxygen?": "The atomic number of oxygen is 8.",
    "Convert 45 kilometers to meters.": "45 kilometers is 45000 meters.",
}


class Recorder:
    def __init__(self) -> None:
        self.pieces: list[str] = []

    def __call__(self, text: str) -> None:
        self.pieces.append(text)

    @property
    def text(self) -> str:
        return "".join(self.pieces)


def test_chat_streams_template_answers_and_stops_at_exit(alignment_tokenizer, alignment_config):
    model = GPTModel(alignment_config).eval()
    out = Recorder()
    answered = chat(model, alignment_tokenizer, ["Say hi.\n", "  \n", "/exit\n", "Never read.\n"], out,
                    max_new_tokens=6, prompt_marker="> ")
    expected = generate_text(model, alignment_tokenizer, format_prompt("Say hi."), max_new_tokens=6,
                             stop_texts=["\n### Instruction:", "\n### Input:", "\n### Response:"])
    assert answered == 1
    assert out.text == "> " + expected + "\n> > "  # one answer, a marker per line read, nothing after /exit
    assert len(out.pieces) > 3  # streamed piece by piece, not written once
    assert chat(model, alignment_tokenizer, iter(()), Recorder(), max_new_tokens=2) == 0  # EOF at once


def test_chat_reports_a_line_the_tokenizer_cannot_encode_and_goes_on(alignment_tokenizer, alignment_config):
    errors: list[str] = []
    out = Recorder()
    answered = chat(GPTModel(alignment_config), alignment_tokenizer, ["say <|endoftext|>\n", "ok\n"], out,
                    max_new_tokens=2, report_error=errors.append)
    assert answered == 1 and len(errors) == 1 and "<|endoftext|>" in errors[0]


def test_a_fine_tuned_model_answers_what_it_was_taught(tmp_path, alignment_tokenizer, alignment_config):
    torch.manual_seed(0)
    examples = [InstructionExample(q, "", a) for q, a in TAUGHT.items()]
    stage = SFTStage(GPTModel(alignment_config), alignment_tokenizer, examples, batch_size=3, val_fraction=0.0)
    run_stage(stage, FinetuneOptions(out_dir=str(tmp_path / "sft"), max_steps=60, lr=1e-2, min_lr=1e-3,
                                     eval_every=60, progress=False))
    out = Recorder()
    chat(stage.policy, alignment_tokenizer, [f"{q}\n" for q in TAUGHT], out, max_new_tokens=40)
    assert out.text.splitlines() == list(TAUGHT.values())  # each answer ended at the learned end-of-text

    # The same through the command line, with the questions piped into stdin.
    questions = "".join(f"{q}\n" for q in TAUGHT)
    done = subprocess.run([sys.executable, "-m", "tinygpt", "chat", "--model", str(tmp_path / "sft")],
                          input=questions, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == list(TAUGHT.values())


def test_a_closed_pipe_ends_chat_quietly(alignment_model_dir):
    lines = "".join(f"Say {i}.\n" for i in range(200))
    proc = subprocess.Popen([sys.executable, "-m", "tinygpt", "chat", "--model", str(alignment_model_dir),
                             "--max-new-tokens", "30", "--temperature", "1"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdin.write(lines.encode())
    proc.stdin.close()
    proc.stdout.read(2)
    proc.stdout.close()  # `| head -c 2`
    err = proc.stderr.read()
    proc.stderr.close()
    assert proc.wait(timeout=120) == 141 and err == b"", err.decode()


def test_chat_takes_generate_s_stop_flags(tmp_path, alignment_model_dir, capsys, monkeypatch):
    import io

    from tinygpt.cli import main

    def answer(*extra):
        monkeypatch.setattr("sys.stdin", io.StringIO("Name a color.\n"))
        assert main(["chat", "--model", str(alignment_model_dir), "--max-new-tokens", "12", *extra]) == 0
        return capsys.readouterr().out

    full = answer()[:-1]
    stop = full[4:6]
    assert answer("--stop", stop) == full[: full.find(stop)] + "\n"
