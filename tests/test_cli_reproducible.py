"""The same --seed gives the same weights for every command that trains, whatever the process's global RNG has
been through before (each run starts from a differently seeded global generator)."""

import pytest
import torch
from safetensors.torch import load_file

from conftest import INSTRUCTION_DATA, PREFERENCE_DATA
from tinygpt.cli import main

pytestmark = pytest.mark.usefixtures("one_thread")


def _weights(directory):
    files = sorted(directory.glob("*.safetensors"))
    assert files, f"nothing saved in {directory}"
    return {(f.name, k): v for f in files for k, v in load_file(f).items()}


def _twice(tmp_path, capsys, argv):
    results = []
    for run in range(2):
        torch.manual_seed(1000 + run)  # a different global state before each run: the command must not read it
        torch.rand(7)
        out = tmp_path / f"run{run}"
        assert main([*argv, "--out", str(out), "--seed", "5", "--no-progress"]) == 0, capsys.readouterr().err
        results.append(_weights(out))
    capsys.readouterr()
    first, second = results
    assert first.keys() == second.keys()
    different = [k for k in first if not torch.equal(first[k], second[k])]
    assert not different, different
    return first


def test_train_twice(tmp_path, capsys, training_text_file):
    _twice(tmp_path, capsys, ["train", "--data", str(training_text_file), "--n-layers", "1", "--n-heads", "2",
                              "--emb-dim", "16", "--context-length", "16", "--max-steps", "3", "--eval-every", "3",
                              "--eval-iters", "1", "--batch-size", "2", "--sample-tokens", "2", "--device", "cpu"])


STAGE = ["--limit", "8", "--max-steps", "2", "--batch-size", "4", "--device", "cpu"]


def test_sft_twice(tmp_path, capsys, alignment_model_dir):
    _twice(tmp_path, capsys, ["sft", "--model", str(alignment_model_dir), "--data", str(INSTRUCTION_DATA), *STAGE])


def test_reward_twice(tmp_path, capsys, alignment_model_dir):
    weights = _twice(tmp_path, capsys, ["reward", "--model", str(alignment_model_dir), "--data",
                                        str(PREFERENCE_DATA), *STAGE])
    assert any(name == "reward_head.safetensors" for name, _ in weights)  # the head itself is compared


def test_dpo_twice(tmp_path, capsys, alignment_model_dir):
    _twice(tmp_path, capsys, ["dpo", "--model", str(alignment_model_dir), "--data", str(PREFERENCE_DATA), *STAGE])


def test_ppo_twice(tmp_path, capsys, alignment_model_dir):
    reward = tmp_path / "rm"
    assert main(["reward", "--model", str(alignment_model_dir), "--data", str(PREFERENCE_DATA), "--out", str(reward),
                 *STAGE[:-4], "--max-steps", "1", "--no-progress"]) == 0
    _twice(tmp_path, capsys, ["ppo", "--policy", str(alignment_model_dir), "--reward", str(reward), "--data",
                              str(INSTRUCTION_DATA), "--max-new-tokens", "4", "--ppo-epochs", "2", *STAGE])
