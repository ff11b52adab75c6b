"""The reward model: Bradley-Terry loss, the last-real-token head, separation of chosen from rejected on its
training pairs, atomic save/load (directory and step-N checkpoint)."""

from __future__ import annotations

import math

import pytest
import torch

from conftest import PREFERENCE_DATA
from tinygpt import GPTModel
from tinygpt.alignment.data import load_preference_data
from tinygpt.alignment import FinetuneOptions
from tinygpt.training import run_stage
from tinygpt.alignment.reward import (HEAD_FILE, RewardModel, RewardStage, bradley_terry_loss, load_reward_model,
                                      save_reward_model)
from tinygpt.cli import main

pytestmark = pytest.mark.usefixtures("one_thread")


def test_bradley_terry_loss_is_minus_log_sigmoid_of_the_difference():
    chosen, rejected = torch.tensor([2.0, -1.0, 30.0]), torch.tensor([1.0, 1.0, -30.0])
    expected = sum(math.log1p(math.exp(-(c - r))) for c, r in zip(chosen.tolist(), rejected.tolist())) / 3
    assert bradley_terry_loss(chosen, rejected).item() == pytest.approx(expected, rel=1e-6)


def test_reward_reads_the_last_real_token_and_ignores_padding(alignment_config):
    model = RewardModel(GPTModel(alignment_config)).eval()
    ids = torch.tensor([[5, 6, 7, 0, 0], [5, 6, 7, 8, 9]])
    lengths = torch.tensor([3, 5])
    with torch.no_grad():
        batch = model(ids, lengths)
        alone = model(ids[:1, :3], torch.tensor([3]))
        h = model.trunk.hidden_states(ids[1:])[0, 4]
    assert torch.allclose(batch[0], alone[0], atol=1e-6)  # right padding never reaches the real tokens
    assert torch.allclose(batch[1], model.head(h)[0], atol=1e-6)


def test_reward_model_separates_chosen_from_rejected_and_round_trips(tmp_path, alignment_tokenizer,
                                                                     alignment_config):
    torch.manual_seed(0)
    examples = load_preference_data(PREFERENCE_DATA, limit=24)
    model = RewardModel(GPTModel(alignment_config))
    stage = RewardStage(model, alignment_tokenizer, examples, batch_size=8, val_fraction=0.0, seed=0)
    before = stage._average(stage.train_items)
    result = run_stage(stage, FinetuneOptions(out_dir=str(tmp_path / "rm"), max_steps=24, lr=3e-3, eval_every=24,
                                              progress=False))
    after = stage._average(stage.train_items)
    assert after["accuracy"] > 0.9 and after["loss"] < before["loss"]
    assert result.last_eval["train_accuracy"] > 0.9

    pairs = stage.train_items[:4]
    pad = alignment_tokenizer.eot_id
    sequences = [p.chosen.ids for p in pairs] + [p.rejected.ids for p in pairs]
    scores = model.eval().score(sequences, pad)
    for directory in (tmp_path / "rm", tmp_path / "rm" / "step-24", tmp_path / "saved"):
        if directory.name == "saved":
            save_reward_model(model, directory, alignment_tokenizer)
        loaded, tokenizer = load_reward_model(directory)
        assert torch.equal(loaded.score(sequences, pad), scores), directory
        assert tokenizer.vocab_size == alignment_tokenizer.vocab_size
    (tmp_path / "saved" / HEAD_FILE).unlink()
    with pytest.raises(ValueError, match="is not a reward model"):
        load_reward_model(tmp_path / "saved")


def test_cli_reward_reports_accuracy_and_names_bad_entries(tmp_path, alignment_model_dir, capsys):
    code = main(["reward", "--model", str(alignment_model_dir), "--data", str(PREFERENCE_DATA), "--limit", "12",
                 "--out", str(tmp_path / "rm"), "--max-steps", "2", "--batch-size", "4", "--val-fraction", "0.25",
                 "--no-progress"])
    done = capsys.readouterr()
    assert code == 0 and "val_accuracy" in done.out
    assert "step 2: loss " in done.err and "  val accuracy " in done.err and "--- sample" not in done.err
    assert (tmp_path / "rm" / HEAD_FILE).is_file()
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"instruction": "a", "chosen": "b", "rejected": "c"}\n{"instruction": "a", "chosen": "b", '
                   '"rejected": ""}\n')
    assert main(["reward", "--model", str(alignment_model_dir), "--data", str(bad)]) == 2
    assert "bad.jsonl: line 2: empty response in key 'rejected'" in capsys.readouterr().err


def test_save_reward_model_keeps_foreign_files_and_refuses_other_kinds(tmp_path, alignment_tokenizer,
                                                                        alignment_config):
    from tinygpt.checkpoint import save_model

    model = RewardModel(GPTModel(alignment_config))
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="already holds unrelated files, not a tinygpt reward model"):
        save_reward_model(model, mine, alignment_tokenizer)
    save_reward_model(model, mine, alignment_tokenizer, overwrite=True)
    assert (mine / "notes.txt").read_text() == "mine" and (mine / HEAD_FILE).is_file()
    save_reward_model(model, mine, alignment_tokenizer)  # over a reward model: no flag needed
    save_model(model.trunk, tmp_path / "plain")
    with pytest.raises(ValueError, match="already holds a tinygpt checkpoint, not a tinygpt reward model"):
        save_reward_model(model, tmp_path / "plain")
    with pytest.raises(ValueError, match="already holds a tinygpt reward model, not a tinygpt checkpoint"):
        save_model(model.trunk, mine)
