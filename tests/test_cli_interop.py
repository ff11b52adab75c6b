import json
import shutil

import pytest
import torch

from tinygpt import GPTConfig, GPTModel, generate_greedy, load_model, save_model
from tinygpt.cli import main
from tinygpt.tokenizer import CharTokenizer, gpt2_tokenizer

TEXT = "the quick brown fox jumps over the lazy dog"


def _model(vocab_size: int, **kw) -> GPTModel:
    config = GPTConfig(vocab_size=vocab_size, context_length=16, emb_dim=8, n_heads=2, n_layers=1, **kw)
    return GPTModel(config).eval()


def _expected(model, tokenizer, prompt: str, n: int) -> str:
    out = generate_greedy(model, torch.tensor([tokenizer.encode(prompt)]), n)
    return tokenizer.decode(out[0].tolist())


def _one_line_error(capsys, *fragments):
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    for fragment in fragments:
        assert fragment in err, err


def test_generate_with_a_saved_char_tokenizer(tmp_path, capsys):
    tokenizer = CharTokenizer(TEXT)
    model = _model(tokenizer.vocab_size)
    save_model(model, tmp_path, tokenizer=tokenizer)
    assert main(["generate", "--model", str(tmp_path), "--prompt", "the fox", "--max-new-tokens", "12"]) == 0
    out = capsys.readouterr().out
    assert out == _expected(model, tokenizer, "the fox", 12) + "\n"
    assert out.startswith("the fox") and len(out) == len("the fox") + 12 + 1


def test_generate_gpt2_vocab_from_tokenizer_dir_env_and_checkpoint(tmp_path, gpt2_vocab_dir, monkeypatch, capsys):
    monkeypatch.delenv("TINYGPT_GPT2_VOCAB", raising=False)
    tokenizer = gpt2_tokenizer(gpt2_vocab_dir)
    model = _model(50257, qkv_bias=True, tie_weights=True)
    save_model(model, tmp_path / "bare")
    expected = _expected(model, tokenizer, "Hello, I am", 5) + "\n"
    args = ["generate", "--model", str(tmp_path / "bare"), "--prompt", "Hello, I am", "--max-new-tokens", "5"]
    assert main([*args, "--tokenizer-dir", str(gpt2_vocab_dir)]) == 0
    assert capsys.readouterr().out == expected
    monkeypatch.setenv("TINYGPT_GPT2_VOCAB", str(gpt2_vocab_dir))
    assert main(args) == 0
    assert capsys.readouterr().out == expected
    monkeypatch.delenv("TINYGPT_GPT2_VOCAB")
    save_model(model, tmp_path / "with_tok", tokenizer=tokenizer)
    assert main(["generate", "--model", str(tmp_path / "with_tok"), "--prompt", "Hello, I am",
                 "--max-new-tokens", "5"]) == 0
    assert capsys.readouterr().out == expected


def test_generate_from_an_hf_folder_with_its_vocab_files(tmp_path, gpt2_vocab_dir, monkeypatch, capsys):
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    monkeypatch.delenv("TINYGPT_GPT2_VOCAB", raising=False)
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_positions=16, n_embd=8, n_layer=1, n_head=2))
    hf.save_pretrained(tmp_path)
    shutil.copyfile(gpt2_vocab_dir / "encoder.json", tmp_path / "vocab.json")
    shutil.copyfile(gpt2_vocab_dir / "vocab.bpe", tmp_path / "merges.txt")
    assert main(["generate", "--model", str(tmp_path), "--prompt", "Hello, I am", "--max-new-tokens", "4"]) == 0
    tokenizer = gpt2_tokenizer(gpt2_vocab_dir)
    with torch.no_grad():
        ids = torch.tensor([tokenizer.encode("Hello, I am")])
        for _ in range(4):
            ids = torch.cat((ids, hf.eval()(ids).logits[:, -1].argmax(-1, keepdim=True)), dim=1)
    assert capsys.readouterr().out == tokenizer.decode(ids[0].tolist()) + "\n"


def test_generate_user_errors_are_one_line(tmp_path, capsys, monkeypatch):
    from huggingface_hub import constants

    model = _model(40)
    save_model(model, tmp_path / "no_tok")
    assert main(["generate", "--model", str(tmp_path / "no_tok"), "--prompt", "x"]) == 2
    _one_line_error(capsys, "has no tokenizer", "--tokenizer-dir")
    tokenizer = CharTokenizer(TEXT)
    save_model(_model(tokenizer.vocab_size), tmp_path / "char", tokenizer=tokenizer)
    assert main(["generate", "--model", str(tmp_path / "char"), "--prompt", "QX"]) == 2
    _one_line_error(capsys, "character 'Q'")
    assert main(["generate", "--model", str(tmp_path / "char"), "--prompt", ""]) == 2
    _one_line_error(capsys, "prompt is empty")
    assert main(["generate", "--model", str(tmp_path / "char"), "--prompt", "a", "--max-new-tokens", "-1"]) == 2
    _one_line_error(capsys, "--max-new-tokens")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    assert main(["generate", "--model", "gpt2", "--prompt", "Hello"]) == 2
    _one_line_error(capsys, "cannot fetch 'gpt2'")


def test_convert_both_ways_and_params_of_the_result(tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=50, n_positions=16, n_embd=8, n_layer=2,
                                                              n_head=2, bos_token_id=None, eos_token_id=None))
    hf.save_pretrained(tmp_path / "hf")
    assert main(["convert", "--from-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "ours")]) == 0
    assert "config.json, model.safetensors" in capsys.readouterr().out
    ours = load_model(tmp_path / "ours")
    assert main(["params", "--model", str(tmp_path / "ours"), "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["parameters"]["total"] == data["stored_parameters"] == ours.num_parameters()
    assert data["parameters"]["total"] == sum(p.numel() for p in hf.parameters())
    assert main(["params", "--model", str(tmp_path / "ours")]) == 0
    assert f"{ours.num_parameters():,}" in capsys.readouterr().out
    assert main(["convert", "--to-hf", str(tmp_path / "ours"), "--out", str(tmp_path / "back")]) == 0
    capsys.readouterr()
    again = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "back").eval()
    idx = torch.randint(0, 50, (1, 9))
    with torch.no_grad():
        assert torch.equal(again(idx).logits, hf.eval()(idx).logits)


def test_convert_and_params_errors(tmp_path, capsys):
    assert main(["convert", "--to-hf", str(tmp_path / "missing"), "--out", str(tmp_path / "x")]) == 2
    _one_line_error(capsys, "not a tinygpt checkpoint")
    (tmp_path / "empty").mkdir()
    assert main(["convert", "--from-hf", str(tmp_path / "empty"), "--out", str(tmp_path / "x")]) == 2
    _one_line_error(capsys, "config.json is missing")
    save_model(_model(20), tmp_path / "m")
    assert main(["params", "--model", str(tmp_path / "m"), "--qkv-bias"]) == 2
    _one_line_error(capsys, "--qkv-bias")
    with pytest.raises(SystemExit) as exc:
        main(["params", "--model", str(tmp_path / "m"), "--config", "tiny"])
    assert exc.value.code == 2
    _one_line_error(capsys, "not allowed with argument")
    with pytest.raises(SystemExit):
        main(["convert", "--out", str(tmp_path / "x")])
    _one_line_error(capsys, "one of the arguments --from-hf --to-hf --from-gguf --to-gguf is required")


# ------------------------------------------------------------------------------------------------ saving safely
def _tree(directory):
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*")) if p.is_file()}


def test_convert_never_deletes_what_it_did_not_write(tmp_path, capsys, monkeypatch):
    tokenizer = CharTokenizer(TEXT)
    save_model(_model(tokenizer.vocab_size), tmp_path / "ckpt", tokenizer)
    source = _tree(tmp_path / "ckpt")
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "thesis.tex").write_text("years of work")
    assert main(["convert", "--to-hf", str(tmp_path / "ckpt"), "--out", str(mine)]) == 2
    _one_line_error(capsys, "already holds unrelated files", "--force")
    assert _tree(mine) == {"thesis.tex": b"years of work"}
    assert main(["convert", "--to-hf", str(tmp_path / "ckpt"), "--out", str(mine), "--force"]) == 0
    assert capsys.readouterr().out == f"wrote {mine}: config.json, model.safetensors\n"  # its own files only
    assert (mine / "thesis.tex").read_text() == "years of work" and (mine / "model.safetensors").is_file()
    # The source itself, a folder inside it, and a checkpoint of the other kind: refused, untouched.
    for out in (tmp_path / "ckpt", tmp_path / "ckpt" / "hf"):
        assert main(["convert", "--to-hf", str(tmp_path / "ckpt"), "--out", str(out)]) == 2
        _one_line_error(capsys, "the input")
    save_model(_model(20), tmp_path / "other")
    other = _tree(tmp_path / "other")
    assert main(["convert", "--to-hf", str(tmp_path / "ckpt"), "--out", str(tmp_path / "other")]) == 2
    _one_line_error(capsys, "already holds a tinygpt checkpoint, not a Hugging Face model")
    assert main(["convert", "--from-hf", str(mine), "--out", str(mine)]) == 2
    _one_line_error(capsys, "is the input")
    (tmp_path / "file").write_text("x")
    assert main(["convert", "--to-hf", str(tmp_path / "ckpt"), "--out", str(tmp_path / "file")]) == 2
    _one_line_error(capsys, "is an existing file")
    assert _tree(tmp_path / "ckpt") == source and _tree(tmp_path / "other") == other
    # `--out .` in an empty working directory works and leaves no temporary; in a full one it is refused.
    (tmp_path / "here").mkdir()
    monkeypatch.chdir(tmp_path / "here")
    assert main(["convert", "--to-hf", str(tmp_path / "ckpt"), "--out", "."]) == 0
    capsys.readouterr()
    assert sorted(p.name for p in (tmp_path / "here").iterdir()) == ["config.json", "model.safetensors"]
    monkeypatch.chdir(tmp_path)
    assert main(["convert", "--from-hf", str(tmp_path / "here"), "--out", "."]) == 2
    _one_line_error(capsys, "already holds unrelated files")


def test_hf_folder_saved_by_current_transformers_keeps_its_tokenizer(tmp_path, capsys):
    """transformers saves a fast tokenizer as tokenizer.json alone (no vocab.json / merges.txt): generate and
    convert --from-hf read it; convert --to-hf writes it back so that transformers.pipeline runs as is."""
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    from tinygpt.tokenizer import BPETokenizer, load_tokenizer

    bpe = BPETokenizer.train([TEXT * 20], vocab_size=300)
    hf_dir = tmp_path / "hf"
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=bpe.tokenizer, eos_token="<|endoftext|>")
    fast.save_pretrained(hf_dir)
    assert not (hf_dir / "vocab.json").exists() and (hf_dir / "tokenizer.json").is_file()
    torch.manual_seed(0)
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=bpe.vocab_size, n_positions=32, n_embd=16,
                                                              n_layer=1, n_head=2)).eval()
    hf.save_pretrained(hf_dir)
    prompt = "the lazy fox"
    ids = fast(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        greedy = hf.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=bpe.eot_id)
    expected = fast.decode(greedy[0]) + "\n"
    assert main(["generate", "--model", str(hf_dir), "--prompt", prompt, "--max-new-tokens", "6"]) == 0
    assert capsys.readouterr().out == expected
    assert main(["convert", "--from-hf", str(hf_dir), "--out", str(tmp_path / "ckpt")]) == 0
    assert "warning" not in capsys.readouterr().err
    assert isinstance(load_tokenizer(tmp_path / "ckpt"), BPETokenizer)
    assert main(["generate", "--model", str(tmp_path / "ckpt"), "--prompt", prompt, "--max-new-tokens", "6"]) == 0
    assert capsys.readouterr().out == expected
    # Back to Hugging Face: tokenizer, its config, the generation config and the eos id, with no extra step.
    assert main(["convert", "--to-hf", str(tmp_path / "ckpt"), "--out", str(tmp_path / "back")]) == 0
    capsys.readouterr()
    back = tmp_path / "back"
    assert {"tokenizer.json", "tokenizer_config.json", "generation_config.json"} <= {p.name for p in back.iterdir()}
    assert json.loads((back / "config.json").read_text())["eos_token_id"] == bpe.eot_id
    assert json.loads((back / "generation_config.json").read_text())["eos_token_id"] == bpe.eot_id
    pipe = transformers.pipeline("text-generation", model=str(back), device="cpu")
    out = pipe(prompt, max_new_tokens=6, do_sample=False)[0]["generated_text"]
    assert out + "\n" == expected


def test_gpt2_tokenizer_model_exports_for_the_pipeline(tmp_path, gpt2_vocab_dir, capsys):
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    tokenizer = gpt2_tokenizer(gpt2_vocab_dir)
    model = _model(50257, qkv_bias=True, tie_weights=True)
    save_model(model, tmp_path / "ckpt", tokenizer)
    assert main(["convert", "--to-hf", str(tmp_path / "ckpt"), "--out", str(tmp_path / "hf")]) == 0
    capsys.readouterr()
    assert json.loads((tmp_path / "hf" / "generation_config.json").read_text())["eos_token_id"] == 50256
    pipe = transformers.pipeline("text-generation", model=str(tmp_path / "hf"), device="cpu")
    out = pipe("Hello, I am", max_new_tokens=4, do_sample=False)[0]["generated_text"]
    assert out == _expected(model, tokenizer, "Hello, I am", 4)


def test_convert_says_when_a_tokenizer_is_not_carried(tmp_path, capsys):
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    tokenizer = CharTokenizer(TEXT)
    save_model(_model(tokenizer.vocab_size), tmp_path / "char", tokenizer)
    assert main(["convert", "--to-hf", str(tmp_path / "char"), "--out", str(tmp_path / "hf")]) == 0
    err = capsys.readouterr().err
    assert err.startswith("tinygpt convert: warning: ") and "char tokenizer has no Hugging Face form" in err
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == ["config.json", "model.safetensors"]
    assert main(["convert", "--from-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "back")]) == 0
    err = capsys.readouterr().err
    assert "holds no tokenizer" in err and "--tokenizer-dir" in err and err.count("\n") == 1
