"""Sizes that cannot fit are refused before any allocation, with the figure that would be needed; a config file
without vocab_size takes the tokenizer's; --n-layers/--n-heads/--emb-dim/--context-length override the config."""

import json

import pytest
import torch

from tinygpt import GPTConfig, GPTModel
from tinygpt.checkpoint import load_model
from tinygpt.cli import main
from tinygpt.training import limits

TINY = ["--eval-every", "2", "--eval-iters", "1", "--sample-tokens", "2", "--device", "cpu", "--no-progress"]


def _train(capsys, *argv):
    code = main(["train", *argv])
    return code, capsys.readouterr().err


def test_a_batch_larger_than_the_data_is_refused_before_it_is_built(tmp_path, capsys, training_text_file):
    code, err = _train(capsys, "--data", str(training_text_file), "--out", str(tmp_path / "r"), "--n-layers", "1",
                       "--n-heads", "2", "--emb-dim", "16", "--context-length", "16", "--batch-size", "100000000",
                       *TINY)
    assert code == 2 and err.count("\n") == 1, err  # one line, before the model exists
    last = err.splitlines()[-1]
    assert last.startswith("tinygpt train: error: --batch-size 100000000 = 100,000,000 windows per step, but the "
                           "train split (")
    assert "use at most --batch-size" in last
    assert not list((tmp_path / "r").glob("step-*"))


def test_a_model_larger_than_memory_is_refused_with_the_figure(tmp_path, capsys, training_text_file):
    # gpt2-xl's width with 100,000 blocks: about 3e12 parameters, 49 TB for weights + gradients + AdamW.
    code, err = _train(capsys, "--data", str(training_text_file), "--out", str(tmp_path / "r"), "--config",
                       "gpt2-xl", "--context-length", "16", "--n-layers", "100000", "--batch-size", "2", *TINY)
    assert code == 2, err
    last = err.splitlines()[-1]
    assert last.startswith("tinygpt train: error: training needs at least ") and " GiB on cpu (" in last
    assert "parameters x 16 bytes" in last and "is available: use a smaller model" in last


def test_the_memory_bound_counts_weights_optimizer_and_activations(monkeypatch):
    config = GPTConfig(vocab_size=100, context_length=8, emb_dim=16, n_heads=2, n_layers=3)
    params = GPTModel(config).num_parameters()
    assert limits.parameter_count(config) == params
    assert limits.training_bytes(config, 4) == 16 * params + 4 * (4 * 8) * 3 * 15 * 16
    monkeypatch.setattr(limits, "available_memory", lambda device: limits.training_bytes(config, 4) - 1)
    limits.check_memory(config, 3, torch.device("cpu"))  # fits
    with pytest.raises(ValueError, match=r"a smaller --batch-size \(with --grad-accum"):
        limits.check_memory(config, 4, torch.device("cpu"))
    monkeypatch.setattr(limits, "available_memory", lambda device: None)  # unknown: no refusal
    limits.check_memory(config, 10**9, torch.device("cpu"))


def test_a_config_file_without_vocab_size_takes_the_tokenizer_s(tmp_path, capsys, training_text_file):
    config = tmp_path / "c.json"
    config.write_text(json.dumps({"context_length": 16, "emb_dim": 16, "n_heads": 2, "n_layers": 1}))
    code, err = _train(capsys, "--data", str(training_text_file), "--out", str(tmp_path / "r"), "--config",
                       str(config), "--max-steps", "2", "--batch-size", "2", *TINY)
    assert code == 0, err
    chars = len(set(training_text_file.read_text()))
    assert load_model(tmp_path / "r").config.vocab_size == chars  # not 50257

    config.write_text(json.dumps({"vocab_size": 5, "context_length": 16, "emb_dim": 16, "n_heads": 2,
                                  "n_layers": 1}))
    code, err = _train(capsys, "--data", str(training_text_file), "--out", str(tmp_path / "r2"), "--config",
                       str(config), "--max-steps", "2", "--batch-size", "2", *TINY)
    assert code == 2 and f"the tokenizer has {chars} tokens but the model's vocab_size is 5" in err


def test_size_overrides_make_a_tiny_run_without_a_json_file(tmp_path, capsys, training_text_file):
    out = tmp_path / "r"
    sizes = ["--n-layers", "1", "--n-heads", "2", "--emb-dim", "8", "--context-length", "12"]
    code, err = _train(capsys, "--data", str(training_text_file), "--out", str(out), *sizes, "--max-steps", "2",
                       "--batch-size", "2", *TINY)
    assert code == 0, err
    config = load_model(out).config
    assert (config.n_layers, config.n_heads, config.emb_dim, config.context_length) == (1, 2, 8, 12)
    code, err = _train(capsys, "--data", str(training_text_file), "--out", str(out), *sizes[:-1], "16",
                       "--max-steps", "4", "--batch-size", "2", "--resume", "auto", *TINY)
    assert code == 2 and "context_length=16 vs checkpoint 12" in err
