"""A real training process, SIGKILLed in the middle of a checkpoint write, resumes from the last complete one."""

import os
import signal
import subprocess
import sys

import pytest
import torch

from tinygpt import GPTConfig
from tinygpt.checkpoint import load_model
from tinygpt.fileio import TEMP_PREFIX
from tinygpt.training import TrainingOptions, list_checkpoints, train
from tinygpt.training.checkpointing import FAULT_ENV

CONFIG = GPTConfig(vocab_size=24, context_length=16, emb_dim=16, n_heads=2, n_layers=1)


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="needs SIGKILL")
def test_sigkill_during_checkpoint_write_resumes_from_last_complete(tmp_path, training_text_file):
    config = tmp_path / "config.json"
    config.write_text(CONFIG.to_json())
    run = tmp_path / "run"
    args = ["--data", str(training_text_file), "--config", str(config), "--out", str(run), "--max-steps", "6",
            "--eval-every", "2", "--eval-iters", "1", "--batch-size", "2", "--sample-tokens", "4", "--device", "cpu",
            "--no-progress"]
    env = {**os.environ, FAULT_ENV: "4", "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "tinygpt", "train", *args], env=env, stderr=subprocess.PIPE,
                            stdout=subprocess.DEVNULL, text=True)
    try:
        for line in proc.stderr:  # wait until the process is inside the write of step-4
            if FAULT_ENV in line:
                break
        else:
            pytest.fail(f"the run ended (code {proc.wait()}) without reaching the step-4 checkpoint")
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(timeout=30) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.stderr.close()

    assert [s for s, _ in list_checkpoints(run)] == [2]  # step-4 was never completed
    assert any(p.name.startswith(f"{TEMP_PREFIX}step-4.") for p in run.iterdir())  # its half-written temporary
    settings = dict(data=[str(training_text_file)], config=str(config), max_steps=6, eval_every=2, eval_iters=1,
                    batch_size=2, sample_tokens=4, device="cpu", progress=False)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the subprocess (OMP_NUM_THREADS=1): the same arithmetic
    try:
        result = train(TrainingOptions(out_dir=str(run), resume="auto", **settings))
        straight = train(TrainingOptions(out_dir=str(tmp_path / "straight"), **settings))
    finally:
        torch.set_num_threads(threads)
    assert result.step == 6
    assert all(torch.equal(a, b) for a, b in zip(result.model.parameters(), straight.model.parameters()))
    assert [s for s, _ in list_checkpoints(run)][-1] == 6
    leftovers = [p for p in run.rglob("*") if p.name.startswith(".")]
    assert leftovers == []  # the crash's temporary (and anything nested in it) is cleaned up
    assert load_model(run).config == CONFIG
