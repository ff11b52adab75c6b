"""The pre-LN / post-LN experiment beyond its smoke test: warmup, the init profile, the verdict and the sweep."""

import json
import math

import pytest
import torch
import torch.nn.functional as F

from tinygpt import GPTConfig
from tinygpt.cli import build_parser, main
from tinygpt.experiments import run_prepost
from tinygpt.experiments.prepost import (init_gradient_profile, lesson_verdict, model_pair, random_windows,
                                         train_losses, warmup_factor)

TINY = GPTConfig(vocab_size=1, context_length=16, emb_dim=16, n_heads=2, n_layers=2)


@pytest.fixture
def text_file(tmp_path):
    path = tmp_path / "text.txt"
    path.write_text("the quick brown fox jumps over the lazy dog. " * 40, encoding="utf-8")
    return path


def test_warmup_is_linear_then_constant():
    assert [warmup_factor(s, 4) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    assert warmup_factor(0, 0) == 1.0


def test_warmup_scales_the_first_update():
    # Adam's first step moves each weight by about lr * sign(grad): a warmup of 10 steps makes it 10x smaller.
    ids = torch.arange(40) % 7
    config = TINY.replace(vocab_size=7)
    moves = []
    for warmup in (0, 10):
        model, _ = model_pair(config, seed=0)
        before = model.tok_emb.weight.detach().clone()
        train_losses(model, ids, steps=1, batch_size=2, seq_len=8, lr=1e-2, seed=0, warmup=warmup)
        moves.append((model.tok_emb.weight.detach() - before).abs().max().item())
    assert moves[0] == pytest.approx(10 * moves[1], rel=1e-3)


def test_init_profile_is_the_w2_gradient_of_the_same_init():
    ids = torch.arange(200) % 11
    config = TINY.replace(vocab_size=11)
    profile = init_gradient_profile(config, ids, (2, 3), batch_size=2, seq_len=8, seed=5)
    assert {d: [len(v) for v in p.values()] for d, p in profile.items()} == {"2": [2, 2], "3": [3, 3]}
    # Recompute the post-LN L=3 profile by hand from the same weights and batch.
    _, post = model_pair(config.replace(n_layers=3), 5)
    x, y = random_windows(ids, 2, 8, torch.Generator().manual_seed(5))
    F.cross_entropy(post.eval()(x).flatten(0, 1), y.flatten()).backward()
    assert profile["3"]["post_ln"] == [b.ff.layers[2].weight.grad.norm().item() for b in post.trf_blocks]
    assert profile["3"]["pre_ln"] != profile["3"]["post_ln"]


def _run(losses, diverged=False):
    return {"loss": losses, "diverged": diverged}


def test_lesson_verdict():
    pre = _run([4.0] * 9 + [2.0])
    shown = lesson_verdict({"pre_ln": pre, "post_ln": _run([4.0] * 9 + [3.0]),
                            "post_ln_warmup": _run([4.0] * 9 + [2.05])})
    assert shown == {"pre_ln_trains": True, "post_ln_fails": True, "warmup_recovers": True, "shown": True}
    diverged = lesson_verdict({"pre_ln": pre, "post_ln": _run([4.0, math.nan], True),
                               "post_ln_warmup": _run([4.0] * 9 + [2.0])})
    assert diverged["shown"]
    alike = lesson_verdict({"pre_ln": pre, "post_ln": _run([4.0] * 9 + [2.05]), "post_ln_warmup": pre})
    assert alike["post_ln_fails"] is False and alike["shown"] is False
    no_recovery = lesson_verdict({"pre_ln": pre, "post_ln": _run([4.0] * 9 + [3.0]),
                                  "post_ln_warmup": _run([4.0] * 9 + [3.0])})
    assert no_recovery["warmup_recovers"] is False and no_recovery["shown"] is False


def test_sweep_runs_every_cell_and_writes_its_figure(tmp_path, text_file):
    report = run_prepost(tmp_path, seed=3, config=TINY, data=text_file, steps=2, batch_size=2, seq_len=8,
                         depths=(1,), stack_shape=(1, 4, 8), stack_heads=2, profile_depths=(1, 2), sweep=True,
                         sweep_depths=(1, 2), sweep_lrs=(1e-3, 1e-2), sweep_steps=3, warmup=2)
    data = json.loads(report.files["json"].read_text(encoding="utf-8"))
    cells = data["sweep"]["cells"]
    assert [(c["depth"], c["lr"]) for c in cells] == [(1, 1e-3), (1, 1e-2), (2, 1e-3), (2, 1e-2)]
    for c in cells:
        assert set(c["final_loss"]) == {"pre_ln", "post_ln", "post_ln_warmup"}
        assert c["shown"] == (c["pre_ln_trains"] and c["post_ln_fails"] and c["warmup_recovers"])
    for stem in ("prepost_sweep", "prepost_profile", "prepost_training", "prepost_gradients"):
        assert report.files[stem].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    runs = data["training"]["runs"]
    assert data["training"]["warmup"] == 2 and len(runs["post_ln_warmup"]["loss"]) == 2
    # Same init, same batches: the first loss of the two post-LN runs is the same number.
    assert runs["post_ln"]["loss"][0] == runs["post_ln_warmup"]["loss"][0] != runs["pre_ln"]["loss"][0]
    assert "sweep (3 steps per run" in report.text and "seed 002's lesson" in report.text


def test_bad_sweep_and_warmup_arguments(tmp_path):
    with pytest.raises(ValueError, match="warmup"):
        run_prepost(tmp_path, warmup=-1)
    with pytest.raises(ValueError, match="sweep lr"):
        run_prepost(tmp_path, sweep=True, sweep_lrs=(0.0,))
    with pytest.raises(ValueError, match="sweep_steps"):
        run_prepost(tmp_path, sweep=True, sweep_steps=0)
    with pytest.raises(ValueError, match=r"sweep_steps=0 .*defaults to steps"):
        run_prepost(tmp_path, steps=0, sweep=True)


def test_cli_sweep_flags(tmp_path, capsys):
    args = build_parser().parse_args(["experiment", "prepost", "--sweep", "--sweep-steps", "2", "--sweep-depths",
                                      "1,3", "--sweep-lrs", "1e-3,0.01", "--profile-depths", "2", "--warmup", "7"])
    assert (args.sweep, args.sweep_steps, args.sweep_depths, args.sweep_lrs, args.profile_depths, args.warmup) == (
        True, 2, (1, 3), (1e-3, 0.01), (2,), 7)
    defaults = build_parser().parse_args(["experiment", "prepost"])
    assert defaults.sweep is False and defaults.sweep_steps is None and defaults.warmup == 100
    assert main(["experiment", "prepost", "--warmup", "-3", "--out", str(tmp_path)]) == 2
    assert "warmup=-3 must be an integer >= 0" in capsys.readouterr().err
    with pytest.raises(SystemExit) as err:
        main(["experiment", "prepost", "--sweep-lrs", "fast"])
    assert err.value.code == 2 and "--sweep-lrs" in capsys.readouterr().err
