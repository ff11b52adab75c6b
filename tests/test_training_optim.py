import math
import json

import pytest
import torch

from tinygpt import GPTModel, get_config
from tinygpt.training import build_optimizer, lr_at


def test_weight_decay_on_matrices_only():
    model = GPTModel(get_config("tiny", tie_weights=True, qkv_bias=True))
    opt = build_optimizer(model, lr=1e-3, weight_decay=0.1)
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(p.dim() == 2 for p in decay["params"]) and all(p.dim() == 1 for p in no_decay["params"])
    ids = [id(p) for g in opt.param_groups for p in g["params"]]
    assert len(ids) == len(set(ids)) == len(list(model.parameters()))  # the tied weight once
    assert any(p is model.out_head.weight for p in decay["params"])


def test_bad_optimizer_settings():
    model = GPTModel(get_config("tiny"))
    with pytest.raises(ValueError, match="lr"):
        build_optimizer(model, lr=0.0)
    with pytest.raises(ValueError, match="weight_decay"):
        build_optimizer(model, lr=1e-3, weight_decay=-1)


def test_warmup_then_cosine():
    kw = dict(lr=1.0, min_lr=0.1, warmup_steps=10, max_steps=110)
    assert [lr_at(s, **kw) for s in range(3)] == pytest.approx([0.1, 0.2, 0.3], abs=1e-15)
    assert lr_at(9, **kw) == 1.0  # warmup ends at the peak
    assert lr_at(10, **kw) == 1.0  # cosine starts at the peak
    assert math.isclose(lr_at(60, **kw), 0.55)  # halfway down: min + (max - min) / 2
    assert lr_at(110, **kw) == 0.1 and lr_at(500, **kw) == 0.1
    values = [lr_at(s, **kw) for s in range(10, 110)]
    assert all(a >= b for a, b in zip(values, values[1:]))


def test_no_warmup():
    assert lr_at(0, lr=2.0, min_lr=0.0, warmup_steps=0, max_steps=10) == 2.0


# ------------------------------------------------------------------------------------------------ Muon

from tinygpt import GPTConfig  # noqa: E402
from tinygpt.training import TrainingOptions, load_training_state, train  # noqa: E402
from tinygpt.training.data import prepare_corpus  # noqa: E402
from tinygpt.training.optim import build_muon, is_hidden_matrix  # noqa: E402

MUON_CONFIG = GPTConfig(vocab_size=24, context_length=16, emb_dim=16, n_heads=2, n_layers=2, drop_rate=0.1)


@pytest.fixture
def prepared(tmp_path, training_text_file):
    torch.set_num_threads(1)
    prepare_corpus([training_text_file], "char", tmp_path / "prep", progress=False)
    return tmp_path / "prep"


def muon_options(run_dir, prepared, **overrides) -> TrainingOptions:
    settings = dict(prepared=str(prepared), config=MUON_CONFIG, out_dir=str(run_dir), max_steps=6, batch_size=4,
                    warmup_steps=2, eval_every=3, eval_iters=1, sample_tokens=0, progress=False, device="cpu",
                    seed=0, lr=3e-3, optimizer="muon", muon_lr=0.05, muon_weight_decay=0.01)
    settings.update(overrides)
    return TrainingOptions(**settings)


def test_muon_moves_the_blocks_matrices_and_adamw_the_rest():
    model = GPTModel(get_config("tiny", tie_weights=False, qkv_bias=True))
    optimizer = build_muon(model, lr=1e-3, muon_lr=0.02)
    names = {id(p): n for n, p in model.named_parameters()}
    muon = {names[id(p)] for g in optimizer.muon.param_groups for p in g["params"]}
    assert muon == {f"trf_blocks.{i}.{w}.weight" for i in range(2)
                    for w in ("att.qkv", "att.out_proj", "ff.layers.0", "ff.layers.2")}
    adamw = {names[id(p)] for g in optimizer.adamw.param_groups for p in g["params"]}
    assert muon.isdisjoint(adamw) and muon | adamw == set(names.values())
    assert {"tok_emb.weight", "pos_emb.weight", "out_head.weight", "trf_blocks.0.att.qkv.bias"} <= adamw
    assert [g["peak_lr"] for g in optimizer.param_groups] == [0.02, 1e-3, 1e-3]
    assert not is_hidden_matrix("heads.value.weight", torch.zeros(1, 16))  # a stage's head is AdamW's
    with pytest.raises(ValueError, match="muon_lr"):
        build_muon(model, lr=1e-3, muon_lr=0.0)


def test_a_muon_run_equals_torch_muon_and_adamw_driven_by_hand(tmp_path, prepared):
    """The loop with --optimizer muon, bit for bit, against torch.optim.Muon on the blocks' matrices and
    torch.optim.AdamW on the rest, written out here: the same schedule scaled to each peak rate, clipping over
    both, dropout on."""
    import random

    import numpy as np

    from tinygpt.training import PreparedCorpus, WindowSampler

    settings = muon_options(tmp_path / "run", prepared, eval_every=100)
    result = train(settings)
    logged = [json.loads(line)["loss"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]

    torch.manual_seed(0)
    np.random.seed(0)
    random.seed(0)
    model = GPTModel(MUON_CONFIG).train()
    hidden = [p for b in model.trf_blocks for p in (b.att.qkv.weight, b.att.out_proj.weight, b.ff.layers[0].weight,
                                                    b.ff.layers[2].weight)]
    rest = [p for p in model.parameters() if all(p is not h for h in hidden)]
    muon = torch.optim.Muon(hidden, lr=0.05, momentum=0.95, weight_decay=0.01)
    adamw = torch.optim.AdamW([{"params": [p for p in rest if p.dim() == 2], "weight_decay": 0.1},
                               {"params": [p for p in rest if p.dim() == 1], "weight_decay": 0.0}],
                              lr=settings.lr, betas=(0.9, 0.95))
    sampler = WindowSampler(PreparedCorpus.open(prepared).train, MUON_CONFIG.context_length, 0)
    expected = []
    for step in range(6):
        rate = lr_at(step, lr=settings.lr, min_lr=settings.lr / 10, warmup_steps=2, max_steps=6)
        muon.param_groups[0]["lr"] = rate * 0.05 / settings.lr
        for group in adamw.param_groups:
            group["lr"] = rate
        x, y = sampler.sample(settings.batch_size)
        loss = model(x, targets=y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(hidden + [p for g in adamw.param_groups for p in g["params"]], 1.0)
        muon.step()
        adamw.step()
        muon.zero_grad(set_to_none=True)
        adamw.zero_grad(set_to_none=True)
        expected.append(float(loss.detach()))
    assert logged == expected
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), result.model.parameters()))


def test_resume_with_muon_is_bit_identical(tmp_path, prepared):
    from tinygpt.checkpoint import load_model

    train(muon_options(tmp_path / "straight", prepared))
    train(muon_options(tmp_path / "resumed", prepared, stop_after=3))
    assert train(muon_options(tmp_path / "resumed", prepared, resume="auto")).step == 6
    a, b = (dict(load_model(tmp_path / d).named_parameters()) for d in ("straight", "resumed"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    state_a, state_b = (load_training_state(tmp_path / d / "step-6")["optimizer"] for d in ("straight", "resumed"))
    buffers = [k for k, v in state_a["state"].items() if "momentum_buffer" in v]
    assert len(buffers) == 4 * MUON_CONFIG.n_layers  # Muon's state is in the checkpoint, keyed by name
    assert all(torch.equal(state_a["state"][k]["momentum_buffer"], state_b["state"][k]["momentum_buffer"])
               for k in buffers)
    with pytest.raises(ValueError, match="trained with --optimizer muon"):
        train(muon_options(tmp_path / "resumed", prepared, resume="auto", optimizer="adamw", max_steps=8))


def test_bad_muon_settings_are_refused(tmp_path, prepared):
    for overrides, message in ((dict(optimizer="sgd"), "optimizer"), (dict(muon_lr=0), "muon_lr"),
                               (dict(muon_momentum=1.0), "muon_momentum")):
        with pytest.raises(ValueError, match=message):
            train(muon_options(tmp_path / "bad", prepared, **overrides))


def test_muon_with_lora_is_refused_in_one_line_before_any_step(tmp_path, alignment_model_dir, capsys):
    """Muon orthogonalises whole weight matrices; a LoRA run trains low-rank adapters, so the pair is refused."""
    from conftest import INSTRUCTION_DATA
    from tinygpt.cli import main

    if not INSTRUCTION_DATA.is_file():
        pytest.skip(f"needs the instruction data at {INSTRUCTION_DATA}")
    code = main(["sft", "--model", str(alignment_model_dir), "--data", str(INSTRUCTION_DATA), "--limit", "8",
                 "--out", str(tmp_path / "run"), "--batch-size", "4", "--max-steps", "2", "--no-progress",
                 "--lora-r", "2", "--optimizer", "muon"])
    err = capsys.readouterr().err
    assert code != 0
    assert "--optimizer muon trains full weights" in err and "--optimizer adamw" in err
    assert "Traceback" not in err and not list((tmp_path / "run").glob("step-*"))
