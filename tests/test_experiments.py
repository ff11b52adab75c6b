"""The experiments at tiny sizes: their figures are real (checked against independent computations) and the
PNG and JSON files are written."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from tinygpt import GPTConfig, GPTModel, count_parameters, get_config
from tinygpt.cli import main
from tinygpt.experiments import (EXPERIMENTS, run_activations, run_anatomy, run_attention, run_layernorm,
                                 run_prepost, run_residual)
from tinygpt.experiments.anatomy import linear_bias_parameters
from tinygpt.experiments.attention import attention_weights, train_char_model
from tinygpt.experiments.prepost import block_stacks
from tinygpt.experiments.residual import ExampleDeepNeuralNetwork, build_pair

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _check_files(report, *pngs: str) -> dict:
    for stem in pngs:
        path = report.files[stem]
        assert path.read_bytes()[:8] == PNG_MAGIC and path.stat().st_size > 5000, stem
    data = json.loads(report.files["json"].read_text(encoding="utf-8"))
    assert data["experiment"] == report.name
    assert data["findings"] == report.findings and report.findings
    return data


# ------------------------------------------------------------------------------------------------ residual
def test_residual_shortcuts_enlarge_first_layer_gradient(tmp_path):
    report = run_residual(tmp_path, seed=123)
    data = _check_files(report, "residual")
    grads = data["mean_abs_weight_grad"]
    assert data["same_init"] and data["repeatable"]
    assert len(grads["with_shortcut"]) == len(grads["without_shortcut"]) == 5
    assert grads["with_shortcut"][0] > 10 * grads["without_shortcut"][0]
    # Recompute layer 0 by hand from the same seed: the report shows the real gradient.
    _, net = build_pair(123)
    loss = torch.nn.functional.mse_loss(net(torch.tensor([[1.0, 0.0, -1.0]])), torch.tensor([[0.0]]))
    loss.backward()
    assert net.layers[0][0].weight.grad.abs().mean().item() == grads["with_shortcut"][0]


def test_residual_is_reproducible_and_seed_dependent(tmp_path):
    a = run_residual(tmp_path / "a", seed=7).data["mean_abs_weight_grad"]
    b = run_residual(tmp_path / "b", seed=7).data["mean_abs_weight_grad"]
    c = run_residual(tmp_path / "c", seed=8).data["mean_abs_weight_grad"]
    assert a == b and a != c


def test_example_network_shortcut_only_where_shapes_match():
    net = ExampleDeepNeuralNetwork(use_shortcut=True)
    x = torch.tensor([[1.0, 0.0, -1.0]])
    h = x
    for layer in net.layers[:-1]:
        h = h + layer(h)
    assert torch.equal(net(x), net.layers[-1](h))  # the 3 -> 1 layer has no shortcut


# ------------------------------------------------------------------------------------------------ prepost
def test_prepost_stacks_share_weights_and_differ(tmp_path):
    pre, post = block_stacks(2, 32, 4, 8, seed=3)
    for (name, a), (_, b) in zip(pre.state_dict().items(), post.state_dict().items()):
        assert torch.equal(a, b), name
    assert [blk.pre_ln for blk in pre] == [True, True] and [blk.pre_ln for blk in post] == [False, False]

    text = tmp_path / "text.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 40, encoding="utf-8")
    config = GPTConfig(vocab_size=1, context_length=16, emb_dim=16, n_heads=2, n_layers=2)
    report = run_prepost(tmp_path / "out", seed=3, config=config, data=text, steps=3, batch_size=2, seq_len=8,
                         depths=(2, 3), stack_shape=(2, 8, 32), stack_heads=4, profile_depths=(2,), init="gpt2",
                         seeds=1, contrast_depths=(), control_init=None)
    data = _check_files(report, "prepost_gradients", "prepost_profile", "prepost_mechanism", "prepost_training")
    for depth in ("2", "3"):
        r = data["stacks"]["results"][depth]
        assert r["outputs_allclose"] is False and r["outputs_max_abs_diff"] > 1e-3
        for variant in ("pre_ln", "post_ln"):
            norms = r["input_grad_norm_per_block"][variant]
            assert len(norms) == int(depth) and all(math.isfinite(g) and g > 0 for g in norms)
    training = data["training"]
    assert training["config"]["vocab_size"] == len(set(text.read_text(encoding="utf-8")))
    runs = training["cells"][0]["runs"]["3"]
    for variant in ("pre_ln", "pre_ln_warmup", "post_ln", "post_ln_warmup"):
        run = runs[variant]
        assert len(run["loss"]) == 3 and run["diverged"] is False
        assert abs(run["loss"][0] - math.log(training["config"]["vocab_size"])) < 0.5  # near-uniform at init
    assert runs["pre_ln"]["loss"] != runs["post_ln"]["loss"]


def test_prepost_rejects_bad_arguments(tmp_path):
    with pytest.raises(ValueError, match="steps"):
        run_prepost(tmp_path, steps=-1)
    with pytest.raises(ValueError, match="lr"):
        run_prepost(tmp_path, lr=0.0, steps=1)


# ------------------------------------------------------------------------------------------------ activations
def test_activations_gap_matches_an_independent_computation(tmp_path):
    data = _check_files(run_activations(tmp_path), "activations")
    c = math.sqrt(2 / math.pi)
    xs = [-4 + i * 0.01 for i in range(801)]
    gap = max(abs(0.5 * x * (1 + math.erf(x / math.sqrt(2))) - 0.5 * x * (1 + math.tanh(c * (x + 0.044715 * x**3))))
              for x in xs)
    assert data["max_abs_gelu_exact_minus_tanh_float64"] == pytest.approx(gap, rel=1e-6)
    assert 0 < data["max_abs_float32_constant_effect_float64"] < 1e-7
    assert data["max_abs_fused_minus_formula_float64"] < 1e-12
    assert data["minima"]["ReLU"]["value"] == 0.0 and data["minima"]["SiLU"]["value"] < 0


# ------------------------------------------------------------------------------------------------ layernorm
def test_layernorm_example_and_statistics(tmp_path):
    data = _check_files(run_layernorm(tmp_path), "layernorm")
    outputs = data["example"]["outputs"]
    assert outputs["biased var (divide by D), eps 0"] == [-1.0, 1.0]
    assert outputs["unbiased var (divide by D-1), eps 0"] == pytest.approx([-1 / math.sqrt(2), 1 / math.sqrt(2)])
    stages = data["statistics"]["stages"]
    assert stages["normalised (before scale/shift)"]["max_abs_mean"] < 1e-5
    assert stages["normalised (before scale/shift)"]["max_abs_var_minus_1"] < 1e-4
    assert stages["after scale/shift (full layer)"]["max_abs_var_minus_1"] > 0.05


# ------------------------------------------------------------------------------------------------ attention
def test_attention_upper_triangle_is_exactly_zero(tmp_path):
    report = run_attention(tmp_path, seed=1, config="tiny", prompt="hello world", layer=1)
    data = _check_files(report, "attention")
    w = torch.tensor(data["weights"])  # [H, T, T]
    assert w.shape == (4, 11, 11)
    assert torch.all(w[:, torch.triu(torch.ones(11, 11, dtype=torch.bool), 1)] == 0)
    assert torch.all(w[:, torch.tril(torch.ones(11, 11, dtype=torch.bool))] > 0)
    assert torch.allclose(w.sum(-1), torch.ones(4, 11), atol=1e-6)
    assert data["upper_triangle_all_zero"] is True
    assert data["token_ids"] == [b % 16 for b in b"hello world"]


def test_attention_weights_are_the_ones_the_model_uses():
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=20, context_length=8, emb_dim=12, n_heads=3, n_layers=2, pre_ln=False)
    model = GPTModel(config)
    idx = torch.randint(0, 20, (1, 6))
    weights, gap = attention_weights(model, idx, layer=1)
    assert weights.shape == (1, 3, 6, 6) and gap < 1e-5
    # Layer 1's attention input in a post-LN model is block 0's output: recompute its weights by hand.
    x = model.trf_blocks[0](model.tok_emb(idx) + model.pos_emb(torch.arange(6)))
    _, expected = model.trf_blocks[1].att(x, return_weights=True)
    assert torch.equal(weights, expected)


def test_attention_from_a_checkpoint(tmp_path):
    from tinygpt.checkpoint import save_model
    from tinygpt.tokenizer import CharTokenizer

    tokenizer = CharTokenizer("abcdefgh ")
    torch.manual_seed(0)
    save_model(GPTModel(GPTConfig(vocab_size=9, context_length=12, emb_dim=8, n_heads=2, n_layers=1)),
               tmp_path / "ckpt", tokenizer)
    data = run_attention(tmp_path / "out", model_dir=tmp_path / "ckpt", prompt="bad cafe").data
    assert data["token_ids"] == tokenizer.encode("bad cafe") and data["tokens"] == list("bad cafe")
    assert data["upper_triangle_all_zero"] is True


def test_attention_rejects_bad_input(tmp_path):
    with pytest.raises(ValueError, match="context_length=16"):
        run_attention(tmp_path, config="tiny", prompt="x" * 17)
    with pytest.raises(ValueError, match="layer"):
        run_attention(tmp_path, config="tiny", prompt="abc", layer=2)
    with pytest.raises(ValueError, match="exactly one"):
        run_attention(tmp_path, prompt="abc")


# ------------------------------------------------------------------------------------------------ anatomy
def test_anatomy_sums_match_count_parameters_and_models(tmp_path):
    data = _check_files(run_anatomy(tmp_path), "anatomy")
    assert set(data["configs"]) >= {"tiny", "gpt2-small", "gpt2-xl"}
    for name, r in data["configs"].items():
        total = count_parameters(get_config(name)).total
        assert sum(r["parameters"].values()) == r["total"] == total, name
        assert r["memory_bytes"]["float32"]["total"] == 16 * total
        assert r["memory_bytes"]["bfloat16"]["total"] == 8 * total
    assert data["configs"]["tiny"]["total"] == GPTModel(get_config("tiny")).num_parameters()
    assert data["exercise_12x768"]["bias_free_saving_no_qkv_bias"] == 12 * 6 * 768
    assert data["exercise_12x768"]["bias_free_saving_with_qkv_bias"] == 12 * 9 * 768


@pytest.mark.parametrize("qkv_bias", [False, True])
def test_bias_free_saving_counts_the_built_models_linear_biases(qkv_bias):
    config = get_config("tiny", qkv_bias=qkv_bias)
    model = GPTModel(config)
    biases = sum(m.bias.numel() for m in model.trf_blocks.modules()
                 if isinstance(m, torch.nn.Linear) and m.bias is not None)
    assert linear_bias_parameters(config) == biases > 0


def test_anatomy_accepts_a_config_file(tmp_path):
    path = tmp_path / "mine.json"
    path.write_text(get_config("tiny", tie_weights=True).to_json(), encoding="utf-8")
    data = run_anatomy(tmp_path / "out", configs=[str(path)]).data
    assert list(data["configs"]) == ["mine"]
    assert data["configs"]["mine"]["parameters"]["head"] == 0


# ------------------------------------------------------------------------------------------------ CLI
def test_cli_runs_an_experiment(tmp_path, capsys):
    assert main(["experiment", "layernorm", "--out", str(tmp_path), "--seed", "5"]) == 0
    out = capsys.readouterr().out
    assert "-0.707107" in out and (tmp_path / "layernorm.png").exists() and (tmp_path / "layernorm.json").exists()
    assert set(EXPERIMENTS) == {"residual", "prepost", "activations", "layernorm", "attention", "anatomy", "ladder"}


def test_cli_attention_with_a_random_preset(tmp_path, capsys):
    assert main(["experiment", "attention", "--config", "tiny", "--prompt", "abc", "--layer", "1",
                 "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "attention.json").read_text(encoding="utf-8"))
    assert data["layer"] == 1 and data["token_ids"] == [97 % 16, 98 % 16, 99 % 16]
    assert "exactly zero: True" in capsys.readouterr().out


def test_cli_user_errors_exit_2(tmp_path, capsys):
    assert main(["experiment", "anatomy", "--config", "nope", "--out", str(tmp_path)]) == 2
    assert "unknown config 'nope'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as err:
        main(["experiment", "nonsense"])
    assert err.value.code == 2


def test_a_report_keeps_the_other_files_of_its_folder_and_checks_it_first(tmp_path):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    report = run_layernorm(out=out)
    assert (out / "notes.txt").read_text() == "mine"
    assert {p.name for p in out.iterdir()} == {"notes.txt", *(Path(p).name for p in report.files.values())}
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="is an existing file, not a folder"):
        run_layernorm(out=tmp_path / "file")


def test_train_char_model_learns_and_is_seeded():
    # The attention page's model, in small: its loss falls below a uniform guess, and a seed gives the same weights.
    text = "the cat sat on the mat. " * 20
    model, tokenizer, losses = train_char_model(text, steps=30, emb_dim=16, n_heads=2, context_length=8, seed=1)
    again, _, losses_again = train_char_model(text, steps=30, emb_dim=16, n_heads=2, context_length=8, seed=1)
    other, _, _ = train_char_model(text, steps=30, emb_dim=16, n_heads=2, context_length=8, seed=2)
    assert tokenizer.vocab_size == len(set(text)) and not model.training
    assert losses[0] == pytest.approx(math.log(tokenizer.vocab_size), abs=0.5) and losses[-1] < losses[0] - 0.5
    assert losses == losses_again and torch.equal(model.tok_emb.weight, again.tok_emb.weight)
    assert not torch.equal(model.tok_emb.weight, other.tok_emb.weight)
    with pytest.raises(ValueError, match="at least context_length"):
        train_char_model("short", context_length=8)
