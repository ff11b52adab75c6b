"""Real signals to real training processes: SIGINT/SIGTERM checkpoint the current step, print one line with the
command that resumes, exit 130/143; the resumed run is the run that was never interrupted. A second signal stops
at once and leaves every checkpoint loadable. Also the shared refusals (fresh start over checkpoints, nothing left)."""

import json
import os
import shlex
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tinygpt.training import list_checkpoints
from tinygpt.training.checkpointing import refuse_finished, refuse_fresh_start

CONFIG = {"vocab_size": 24, "context_length": 16, "emb_dim": 16, "n_heads": 2, "n_layers": 1}
# Deprecation warnings are errors here: none may come from tinygpt's own calls.
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "error::DeprecationWarning,error::FutureWarning"}


def _train_args(data: Path, config: Path, out: Path, max_steps: int) -> list[str]:
    return ["train", "--data", str(data), "--config", str(config), "--out", str(out), "--max-steps", str(max_steps),
            "--eval-every", "1000", "--eval-iters", "1", "--batch-size", "2", "--sample-tokens", "4", "--warmup-steps",
            "2", "--device", "cpu", "--no-progress"]


def _start(args: list[str], cwd: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "tinygpt", *args], cwd=cwd, env=ENV, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _wait_for_steps(metrics: Path, proc: subprocess.Popen, steps: int = 3, timeout: float = 120) -> None:
    """Until ``metrics`` records ``steps`` optimizer steps (the process is inside its loop)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"the run ended early (code {proc.returncode}): {proc.stderr.read()[-2000:]}")
        if metrics.exists() and len(metrics.read_text().splitlines()) >= steps:
            return
        time.sleep(0.05)
    proc.kill()
    pytest.fail("the run did not reach its loop in time")


def _in_process(capsys, monkeypatch, cwd: Path, args: list[str]) -> tuple[int, str]:
    """``tinygpt *args`` run by the command's own ``main`` in this process (what ``python -m tinygpt`` calls), from
    ``cwd``, on one thread as the subprocesses (OMP_NUM_THREADS=1), with deprecation warnings as errors as ENV makes
    them there: (exit code, stderr). The signalled run stays a real process; its continuation need not pay for a
    second interpreter and torch import."""
    from tinygpt.cli import main

    monkeypatch.chdir(cwd)
    capsys.readouterr()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", DeprecationWarning)
            warnings.simplefilter("error", FutureWarning)
            code = main(args)
    finally:
        torch.set_num_threads(threads)
    return code, capsys.readouterr().err


def _finish(proc: subprocess.Popen) -> tuple[int, str, str]:
    try:
        out, err = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"the process did not stop: {err[-2000:]}")
    return proc.returncode, out, err


@pytest.fixture
def config_file(tmp_path) -> Path:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(CONFIG))
    return path


@pytest.mark.slow
@pytest.mark.parametrize("signum,code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_a_signal_checkpoints_says_how_to_resume_and_the_resume_is_exact(tmp_path, training_text_file, config_file,
                                                                         signum, code, capsys, monkeypatch):
    run = tmp_path / "run"
    proc = _start(_train_args(training_text_file, config_file, run, 100_000), tmp_path)
    _wait_for_steps(run / "metrics.jsonl", proc)
    proc.send_signal(signum)
    returncode, _, err = _finish(proc)
    assert returncode == code, err
    last = err.strip().splitlines()[-1]
    steps = [s for s, _ in list_checkpoints(run)]
    assert len(steps) == 1 and steps[0] >= 3  # the current step, not an older one
    step = steps[0]
    name = signal.Signals(signum).name
    assert last.startswith(f"tinygpt train: interrupted by {name} at step {step} of 100000; saved {run}/step-{step}; "
                           f"resume with: tinygpt train ")
    assert sum("interrupted" in line for line in err.splitlines()) == 1  # one line
    assert not any(p.name.startswith(".") for p in run.iterdir())  # no temporaries left

    # The printed command resumes; run it 3 steps further (--stop-after keeps the schedule of --max-steps), and a
    # straight run to the same step: identical weights.
    resume = shlex.split(last.split("resume with: ", 1)[1])
    assert resume[:2] == ["tinygpt", "train"] and resume[-2:] == ["--resume", "auto"]
    end = ["--stop-after", str(step + 3)]
    resumed, err = _in_process(capsys, monkeypatch, tmp_path, [*resume[1:], *end])
    assert resumed == 0, err[-2000:]
    assert f"resumed from {run}/step-{step} at step {step}" in err
    straight, err = _in_process(capsys, monkeypatch, tmp_path,
                                [*_train_args(training_text_file, config_file, tmp_path / "straight", 100_000), *end])
    assert straight == 0, err[-2000:]
    a = load_file(run / f"step-{step + 3}" / "model.safetensors")
    b = load_file(tmp_path / "straight" / f"step-{step + 3}" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_a_second_ctrl_c_stops_at_once_even_inside_a_checkpoint_write(tmp_path, training_text_file, config_file,
                                                                       capsys, monkeypatch):
    from tinygpt.training.checkpointing import FAULT_ENV

    run = tmp_path / "run"
    args = _train_args(training_text_file, config_file, run, 100_000) + ["--checkpoint-every", "5"]
    proc = subprocess.Popen([sys.executable, "-m", "tinygpt", *args], cwd=tmp_path, env={**ENV, FAULT_ENV: "10"},
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        for line in proc.stderr:  # wait until the process is inside the write of step-10 (it pauses there)
            if FAULT_ENV in line:
                break
        else:
            pytest.fail(f"the run ended (code {proc.wait()}) without reaching the step-10 checkpoint")
        proc.send_signal(signal.SIGINT)  # a request: the write would finish first...
        time.sleep(1.0)
        assert proc.poll() is None
        proc.send_signal(signal.SIGINT)  # ...but the second one does not wait
        err = proc.stderr.read()
        assert proc.wait(timeout=60) == 130
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.stderr.close()
    assert "Traceback" not in err and "stopped at once" in err.strip().splitlines()[-1], err
    assert [s for s, _ in list_checkpoints(run)] == [5]  # the complete one stays; the half-written one is gone
    assert not any(p.name.startswith(".") for p in run.iterdir())
    resumed, err = _in_process(capsys, monkeypatch, tmp_path, [*args, "--stop-after", "6", "--resume", "auto"])
    assert resumed == 0 and f"resumed from {run}/step-5 at step 5" in err, err


@pytest.mark.slow
def test_sigterm_during_sft_checkpoints_and_resumes(tmp_path, alignment_model_dir, capsys, monkeypatch):
    from conftest import INSTRUCTION_DATA

    run = tmp_path / "sft"
    args = ["sft", "--model", str(alignment_model_dir), "--data", str(INSTRUCTION_DATA), "--limit", "16", "--out",
            str(run), "--max-steps", "100000", "--eval-every", "100000", "--batch-size", "2", "--device", "cpu",
            "--no-progress"]
    proc = _start(args, tmp_path)
    _wait_for_steps(run / "metrics.jsonl", proc, steps=2)
    proc.send_signal(signal.SIGTERM)
    returncode, _, err = _finish(proc)
    assert returncode == 143, err
    step = list_checkpoints(run)[-1][0]
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"tinygpt sft: interrupted by SIGTERM at step {step} of 100000; saved {run}/step-{step}")
    resume = shlex.split(last.split("resume with: ", 1)[1])[1:]
    resume[resume.index("--max-steps") + 1] = str(step + 1)
    resumed, err = _in_process(capsys, monkeypatch, tmp_path, resume)
    assert resumed == 0 and f"resumed from {run}/step-{step} at step {step}" in err, err


def test_the_shared_refusals(tmp_path):
    refuse_fresh_start(tmp_path)  # an empty folder: a fresh start is fine
    (tmp_path / "step-3").mkdir()
    for name in ("config.json", "model.safetensors", "training_state.pt"):
        (tmp_path / "step-3" / name).write_text("x")
    with pytest.raises(ValueError, match="already holds checkpoints: pass --resume auto"):
        refuse_fresh_start(tmp_path)
    refuse_finished(3, 4)
    with pytest.raises(ValueError, match="at step 4, already >= max_steps=4: raise --max-steps"):
        refuse_finished(4, 4)
