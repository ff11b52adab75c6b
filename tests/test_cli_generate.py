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
    (["--temperature", "-1"], "--temperature -1.0 must be"), (["--temperature", "1", "--top-p", "0"], "--top-p 0.0"),
    (["--temperature", "1", "--top-k", "0"], "--top-k 0 must be an integer >= 1"),
    (["--stop", ""], "--stop"), (["--prompt-file", "/nonexistent/p.txt"], "--prompt-file"),
    (["--overflow", "error", "--max-new-tokens", "40"], "new tokens fit"),
    (["--overflow", "shift", "--shift-keep", "0"], "--shift-keep 0"),
    (["--shift-keep", "4"], "--overflow shift only"),
    (["--overflow", "shift", "--shift-keep", "16", "--max-new-tokens", "20"], "--shift-keep 16"),
])
def test_bad_options_are_one_line_errors(char_model, capsys, args, fragment):
    path, _, _ = char_model
    source = [] if "--prompt-file" in args else ["--prompt", "the fox"]
    code, _, err = _run(capsys, "--model", path, *source, *args)
    assert code == 2 and err.count("\n") == 1 and fragment in err, err


def test_a_draft_model_gives_the_same_greedy_text(char_model, capsys, tmp_path):
    path, model, tokenizer = char_model
    expected = _run(capsys, "--model", path, "--prompt", "the fox", "--max-new-tokens", "8", "--overflow", "error")
    torch.manual_seed(4)
    save_model(GPTModel(model.config).eval(), tmp_path / "draft", tokenizer=tokenizer)  # another random model
    for draft in (path, str(tmp_path / "draft")):
        for k in ([], ["--speculative-tokens", "2"]):
            got = _run(capsys, "--model", path, "--prompt", "the fox", "--max-new-tokens", "8", "--overflow",
                       "error", "--draft", draft, *k)
            assert got == expected and expected[0] == 0


def test_a_draft_model_must_share_the_tokenizer(char_model, capsys, tmp_path):
    path, model, tokenizer = char_model
    other = CharTokenizer(TEXT.replace("z", "Z"))  # as many characters, other ids
    save_model(GPTModel(model.config).eval(), tmp_path / "ids", tokenizer=other)
    code, _, err = _run(capsys, "--model", path, "--prompt", "the fox", "--draft", str(tmp_path / "ids"))
    assert code == 2 and "splits text differently" in err and err.count("\n") == 1, err
    save_model(GPTModel(model.config.replace(vocab_size=40)).eval(), tmp_path / "vocab")
    code, _, err = _run(capsys, "--model", path, "--prompt", "the fox", "--draft", str(tmp_path / "vocab"))
    assert code == 2 and f"vocab_size=40 differs from the target's vocab_size={model.config.vocab_size}" in err
    code, _, err = _run(capsys, "--model", path, "--prompt", "the fox", "--draft", path, "--no-cache")
    assert code == 2 and "--draft needs the cache" in err


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


def test_stop_escapes_are_decoded(char_model, capsys):
    path, model, tokenizer = char_model
    full = _run(capsys, "--model", path, "--prompt", "the fox", "--max-new-tokens", "20")[1]
    continuation = full[len("the fox"):-1]
    stop = continuation[3:5]
    escaped = "".join(f"\\x{ord(c):02x}" for c in stop)  # the stop text written as escapes, as a shell passes it
    code, out, _ = _run(capsys, "--model", path, "--prompt", "the fox", "--max-new-tokens", "20", "--stop", escaped)
    assert code == 0 and out == "the fox" + continuation[: continuation.find(stop)] + "\n"


def test_sampling_flags_under_greedy_warn_once(char_model, capsys):
    path, _, _ = char_model
    greedy = _run(capsys, "--model", path, "--prompt", "the", "--max-new-tokens", "4")
    code, out, err = _run(capsys, "--model", path, "--prompt", "the", "--max-new-tokens", "4", "--top-k", "3",
                          "--top-p", "0.5")
    assert code == 0 and out == greedy[1]  # greedy: the flags change nothing...
    assert err == ("tinygpt generate: warning: --top-k and --top-p have no effect with --temperature 0 (greedy "
                   "decoding); give --temperature > 0 to sample\n")  # ...and say so
    assert _run(capsys, "--model", path, "--prompt", "the", "--max-new-tokens", "4", "--temperature", "1",
                "--top-k", "3")[2] == ""


def test_device_and_dtype(char_model, capsys):
    path, _, _ = char_model
    plain = _run(capsys, "--model", path, "--prompt", "the", "--max-new-tokens", "4", "--device", "cpu")
    bf16 = _run(capsys, "--model", path, "--prompt", "the", "--max-new-tokens", "4", "--dtype", "bfloat16")
    assert plain[0] == 0 and bf16[0] == 0 and bf16[1].startswith("the")
    code, _, err = _run(capsys, "--model", path, "--prompt", "the", "--device", "tpu")
    assert code == 2 and err.startswith("tinygpt generate: error: device='tpu'")


def _read_a_little_then_close(proc, size=4):
    first = proc.stdout.read(size)
    proc.stdout.close()  # the reader goes away, as `head -c 4` does
    err = proc.stderr.read()
    proc.stderr.close()
    return first, proc.wait(timeout=120), err


def test_a_closed_pipe_ends_generate_quietly(char_model):
    import subprocess

    path, _, _ = char_model
    proc = subprocess.Popen([sys.executable, "-m", "tinygpt", "generate", "--model", path, "--prompt", "the",
                             "--max-new-tokens", "5000", "--temperature", "1"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    first, code, err = _read_a_little_then_close(proc)
    assert first.startswith(b"the")
    assert code == 141 and err == b"", err.decode()  # 128 + SIGPIPE, no BrokenPipeError traceback


@pytest.mark.parametrize("weights", ["bfloat16", "int8"])
def test_weights_generate_what_the_converted_model_generates(char_model, capsys, weights):
    from tinygpt.fast.weights import convert_weights

    path, model, tokenizer = char_model
    converted = GPTModel(model.config)
    converted.load_state_dict(model.state_dict())
    convert_weights(converted, weights)
    ids = generate_greedy(converted, torch.tensor([tokenizer.encode("the")]), 8)[0].tolist()
    code, out, _ = _run(capsys, "--model", path, "--prompt", "the", "--max-new-tokens", "8", "--weights", weights)
    assert code == 0 and out == tokenizer.decode(ids) + "\n"
    with pytest.raises(SystemExit) as exit_:
        main(["generate", "--model", path, "--prompt", "the", "--weights", "fp8"])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "--weights" in err and "bfloat16" in err and "int8" in err
