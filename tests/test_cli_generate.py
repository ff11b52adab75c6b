"""``tinygpt generate``'s sampling, stopping, cache, overflow, streaming and prompt-source options."""

import io
import sys

import pytest
import torch

from tinygpt import GPTConfig, GPTModel, generate_greedy, save_model
from tinygpt.cli import main
from tinygpt.tokenizer import CharTokenizer

TEXT = "the quick brown fox jumps over the lazy dog"


@pytest.fixture
def char_model(tmp_path, one_thread):
    tokenizer = CharTokenizer(TEXT)
    torch.manual_seed(3)
    config = GPTConfig(vocab_size=tokenizer.vocab_size, context_length=16, emb_dim=16, n_heads=2, n_layers=1)
    model = GPTModel(config).eval()
    save_model(model, tmp_path / "m", tokenizer=tokenizer)
    return str(tmp_path / "m"), model, tokenizer


def _run(capsys, *args):
    code = main(["generate", *args])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_stream_no_stream_and_no_cache_print_the_same_greedy_text(char_model, capsys):
    path, model, tokenizer = char_model
    ids = generate_greedy(model, torch.tensor([tokenizer.encode("the fox")]), 20)[0].tolist()
    expected = tokenizer.decode(ids) + "\n"  # 7 + 20 > C = 16: the default overflow slides like the seeds
    for extra in ([], ["--no-stream"], ["--no-cache"], ["--no-cache", "--no-stream"]):
        assert _run(capsys, "--model", path, "--prompt", "the fox", "--max-new-tokens", "20", *extra)[:2] == (
            0, expected)


def test_stop_text_ends_the_output_before_it(char_model, capsys):
    path, model, tokenizer = char_model
    ids = generate_greedy(model, torch.tensor([tokenizer.encode("the fox")]), 12)[0].tolist()
    continuation = tokenizer.decode(ids)[len("the fox"):]
    stop = continuation[3:5]
    code, out, _ = _run(capsys, "--model", path, "--prompt", "the fox", "--max-new-tokens", "12",
                        "--stop", stop, "--stop", "zzz")
    assert code == 0 and out == "the fox" + continuation[: continuation.find(stop)] + "\n"


def test_prompt_from_a_file_and_from_stdin(char_model, capsys, tmp_path, monkeypatch):
    path, _, _ = char_model
    reference = _run(capsys, "--model", path, "--prompt", "a dog", "--max-new-tokens", "6")[1]
    (tmp_path / "p.txt").write_text("a dog", encoding="utf-8")
    assert _run(capsys, "--model", path, "--prompt-file", str(tmp_path / "p.txt"), "--max-new-tokens", "6")[1] == \
        reference
    monkeypatch.setattr(sys, "stdin", io.StringIO("a dog"))
    assert _run(capsys, "--model", path, "--prompt", "-", "--max-new-tokens", "6")[1] == reference


def test_sampling_with_a_seed_repeats(char_model, capsys):
    path, _, _ = char_model
    args = ["--model", path, "--prompt", "the", "--max-new-tokens", "12", "--temperature", "1.5", "--top-k", "5",
            "--top-p", "0.9", "--repetition-penalty", "1.2", "--seed", "11"]
    first, second = _run(capsys, *args), _run(capsys, *args)
    assert first[0] == 0 and first[1] == second[1]
    assert first[1].startswith("the") and len(first[1]) == len("the") + 12 + 1


@pytest.mark.parametrize("args,fragment", [
    (["--temperature", "-1"], "temperature"), (["--top-p", "0"], "top_p"), (["--top-k", "0"], "top_k"),
    (["--stop", ""], "--stop"), (["--prompt-file", "/nonexistent/p.txt"], "--prompt-file"),
    (["--overflow", "error", "--max-new-tokens", "40"], "new tokens fit"),
    (["--overflow", "shift", "--shift-keep", "0"], "shift_keep"),
    (["--shift-keep", "4"], "--overflow shift only"),
    (["--overflow", "shift", "--shift-keep", "16", "--max-new-tokens", "20"], "shift_keep=16"),
])
def test_bad_options_are_one_line_errors(char_model, capsys, args, fragment):
    path, _, _ = char_model
    source = [] if "--prompt-file" in args else ["--prompt", "the fox"]
    code, _, err = _run(capsys, "--model", path, *source, *args)
    assert code == 2 and err.count("\n") == 1 and fragment in err, err


def test_shift_keep_chooses_how_much_the_shift_policy_keeps(char_model, capsys):
    from tinygpt import generate

    path, model, tokenizer = char_model
    prompt = torch.tensor([tokenizer.encode("the fox")])
    outputs = {}
    for keep in (4, 12):
        expected = generate(model, prompt, max_new_tokens=30, overflow="shift", shift_keep=keep).tokens[0].tolist()
        code, out, _ = _run(capsys, "--model", path, "--prompt", "the fox", "--max-new-tokens", "30",
                            "--overflow", "shift", "--shift-keep", str(keep))
        assert code == 0 and out == "the fox" + tokenizer.decode(expected) + "\n"
        outputs[keep] = out
    assert outputs[4] != outputs[12]  # the flag really reaches the policy
