"""--tensorboard: the run's scalars as event files, read back with TensorBoard's own reader; a clear error without
the package."""

import json
import sys

import pytest

from conftest import PREFERENCE_DATA
from tinygpt import GPTModel
from tinygpt.training import TrainingOptions, train
from tinygpt.training.data import prepare_corpus

pytestmark = pytest.mark.usefixtures("one_thread")


def _scalars(run_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"))
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def _records(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _options(tmp_path, training_text_file, **extra):
    from tinygpt import GPTConfig

    prepare_corpus([training_text_file], "char", tmp_path / "prep", progress=False)
    config = GPTConfig(vocab_size=18, context_length=16, emb_dim=16, n_heads=2, n_layers=1)
    return dict(prepared=str(tmp_path / "prep"), config=config, max_steps=6, batch_size=4, warmup_steps=2,
                eval_every=3, eval_iters=1, sample_tokens=4, progress=False, device="cpu", seed=0,
                peak_tflops=1.0, tensorboard=True, **extra)


def test_pretraining_scalars_match_metrics_jsonl_and_a_resume_continues_them(tmp_path, training_text_file):
    settings = _options(tmp_path, training_text_file)
    run = tmp_path / "run"
    train(TrainingOptions(out_dir=str(run), stop_after=4, **settings))
    train(TrainingOptions(out_dir=str(run), resume="auto", **settings))
    scalars, records = _scalars(run), _records(run)
    assert {"loss", "lr", "grad_norm", "tokens_per_second", "tflops", "mfu", "train_loss", "val_loss"} <= set(scalars)
    for tag in ("loss", "lr", "grad_norm", "val_loss"):
        expected = [(r["step"], r[tag]) for r in records if tag in r]
        got = scalars[tag]
        assert [s for s, _ in got] == [s for s, _ in expected], tag  # steps 1..6 once each across the resume
        assert [v for _, v in got] == pytest.approx([v for _, v in expected], rel=1e-6), tag  # stored as float32
    assert (run / "metrics.jsonl").is_file() and (run / "loss.png").is_file()  # both stay


def test_a_fine_tuning_stage_writes_its_own_metrics(tmp_path, alignment_tokenizer, alignment_config):
    import torch

    from tinygpt.alignment import DPOStage, FinetuneOptions, load_preference_data
    from tinygpt.training import run_stage

    torch.manual_seed(0)
    examples = load_preference_data(PREFERENCE_DATA, limit=12)
    stage = DPOStage(GPTModel(alignment_config), alignment_tokenizer, examples, batch_size=4)
    run_stage(stage, FinetuneOptions(out_dir=str(tmp_path / "dpo"), max_steps=2, eval_every=2, progress=False,
                                     tensorboard=True))
    scalars = _scalars(tmp_path / "dpo")
    assert {"loss", "lr", "grad_norm", "margin", "accuracy", "val_loss", "val_margin"} <= set(scalars)
    assert [s for s, _ in scalars["margin"]] == [1, 2]


def test_without_tensorboard_installed_the_flag_is_one_line(tmp_path, training_text_file, monkeypatch, capsys):
    from tinygpt.cli import main

    monkeypatch.setitem(sys.modules, "tensorboard", None)  # `import tensorboard` now raises ImportError
    with pytest.raises(ValueError, match=r"--tensorboard needs the tensorboard package: pip install"):
        train(TrainingOptions(out_dir=str(tmp_path / "run"), **_options(tmp_path, training_text_file)))
    assert not (tmp_path / "run").exists()  # refused before any work
    args = ["train", "--data", str(training_text_file), "--out", str(tmp_path / "cli"), "--tensorboard",
            "--no-progress", "--device", "cpu"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("tinygpt train: error: --tensorboard needs")
