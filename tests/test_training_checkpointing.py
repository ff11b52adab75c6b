"""A run killed at any instant of its writes leaves, once resumed, no temporary and no folder renamed aside.

The kill is simulated exactly: ``rename_snapshots`` copies the run folder just before every ``os.replace`` -- the
tree on disk had the process been SIGKILLed then (the SIGKILL itself is tests/test_training_faults.py)."""

import pytest
import torch

from tinygpt import GPTConfig
from tinygpt.checkpoint import load_model
from tinygpt.fileio import is_temporary
from tinygpt.tokenizer import CharTokenizer
from tinygpt.training import TrainingOptions, list_checkpoints, train
from tinygpt.training.checkpointing import (export_model_files, remove_partial_checkpoints, save_checkpoint,
                                            step_dir)
from tinygpt.training.data import prepare_corpus

CONFIG = GPTConfig(vocab_size=24, context_length=16, emb_dim=16, n_heads=2, n_layers=1)


def _temporaries(root):
    return [p for p in root.rglob("*") if is_temporary(p.name)]


def test_every_moment_of_checkpoint_writes_is_cleaned_by_one_rule(tmp_path, rename_snapshots):
    from tinygpt import GPTModel

    run = tmp_path / "run"
    model, tokenizer = GPTModel(CONFIG), CharTokenizer("abcdefghijklmnopqrstuvwx")
    save_checkpoint(run, 2, model, tokenizer, {"step": 2})
    shots = rename_snapshots(run)
    save_checkpoint(run, 4, model, tokenizer, {"step": 4})
    save_checkpoint(run, 4, model, tokenizer, {"step": 4})  # again: the old step-4/ is renamed aside first
    export_model_files(model, tokenizer, run)
    assert len(shots) >= 10 and not _temporaries(run)
    for shot in shots:
        assert _temporaries(shot)  # a kill here leaves something behind ...
        remove_partial_checkpoints(shot)
        assert not _temporaries(shot)  # ... and the cleanup takes all of it
        assert {p.name for p in shot.iterdir()} <= {p.name for p in run.iterdir()}
        steps = [s for s, _ in list_checkpoints(shot)]
        assert steps in ([2], [2, 4])
        for _, path in list_checkpoints(shot):
            load_model(path)  # every step-N/ left is complete


@pytest.mark.slow
def test_resume_after_a_kill_inside_a_checkpoint_write_leaves_nothing_behind(tmp_path, training_text_file,
                                                                             rename_snapshots, monkeypatch):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        prepare_corpus([training_text_file], "char", tmp_path / "prep", progress=False)
        settings = dict(prepared=str(tmp_path / "prep"), config=CONFIG.replace(vocab_size=24), max_steps=4,
                        batch_size=2, warmup_steps=1, eval_every=2, eval_iters=1, sample_tokens=4, progress=False,
                        device="cpu", seed=0)
        run = tmp_path / "run"
        shots = rename_snapshots(run)
        train(TrainingOptions(out_dir=str(run), **settings))
        monkeypatch.undo()
        # The kills to resume from: inside the step-4 write (its staged folder not yet renamed in) and inside the
        # final export into the run folder.
        inside_step4 = next(s for s in shots if any(p.name.startswith(".tinygpt-tmp-step-4") for p in s.iterdir()))
        inside_export = next(s for s in reversed(shots) if any(p.name.startswith(".tinygpt-tmp-save")
                                                               for p in s.iterdir()))
        assert _temporaries(inside_step4) and _temporaries(inside_export)
        result = train(TrainingOptions(out_dir=str(inside_step4), resume="auto", **settings))
        assert result.step == 4
        assert _temporaries(inside_step4) == []
        assert sorted(p.name for p in inside_step4.iterdir() if p.name.startswith("step-")) == ["step-2", "step-4"]
        assert load_model(step_dir(inside_step4, 4)).config == load_model(inside_step4).config
        # Killed during the final export, step-4/ is complete: the resume has nothing left to train, but the
        # cleanup has run before it says so.
        with pytest.raises(ValueError, match="already >= max_steps"):
            train(TrainingOptions(out_dir=str(inside_export), resume="auto", **settings))
        assert _temporaries(inside_export) == []
    finally:
        torch.set_num_threads(threads)


def test_step_folders_get_the_umask_mode(tmp_path):
    import os

    from tinygpt import GPTModel

    mask = os.umask(0o027)
    try:
        path = save_checkpoint(tmp_path / "run", 2, GPTModel(CONFIG), CharTokenizer("abc"), {"step": 2})
    finally:
        os.umask(mask)
    modes = {p.name: p.stat().st_mode & 0o777 for p in [path, *path.iterdir()]}
    assert modes == {"step-2": 0o750, "config.json": 0o640, "model.safetensors": 0o640,
                     "tinygpt_tokenizer.json": 0o640, "training_state.pt": 0o640}
