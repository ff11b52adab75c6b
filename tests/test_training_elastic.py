"""Training under torchrun's elastic restarts: a worker killed after a checkpoint makes ``--max-restarts 1`` restart
the group, which resumes from the newest complete checkpoint with no flag and ends bit-identical to a run never
interrupted; a resume under another world size is refused unless the global batch stays the same."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from tinygpt import GPTConfig
from tinygpt.checkpoint import load_model
from tinygpt.cli import main
from tinygpt.training import TrainingOptions, train
from tinygpt.training.checkpointing import STATE_FILE
from tinygpt.training.data import prepare_corpus

CONFIG = GPTConfig(vocab_size=24, context_length=16, emb_dim=16, n_heads=2, n_layers=2)

# ``tinygpt train`` through the CLI; on torchrun's first attempt rank 1 SIGKILLs itself once step 3 is done: the
# step-2 checkpoint is complete by then (every rank leaves a checkpoint through a barrier).
WORKER = textwrap.dedent("""
    import os, signal, sys
    from tinygpt.cli import main
    from tinygpt.training import loop

    if os.environ["RANK"] == "1" and os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
        step = loop._Loop.train_step

        def dying_step(self):
            if self.step == 3:
                print("rank 1: killing itself after step 3", file=sys.stderr, flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            return step(self)

        loop._Loop.train_step = dying_step
    sys.exit(main(["train", *sys.argv[1:]]))
""")


def _torchrun(tmp_path, target: list[str], args: list[str], *extra: str) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                             *extra, *target, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env, cwd=tmp_path)


@pytest.mark.slow
def test_a_killed_worker_restarts_from_the_last_checkpoint_and_ends_bit_identical(tmp_path, training_text_file):
    prepared = tmp_path / "prep"
    prepare_corpus([training_text_file], "char", prepared, progress=False)
    config = tmp_path / "config.json"
    config.write_text(CONFIG.to_json())
    common = ["--prepared", str(prepared), "--config", str(config), "--max-steps", "6", "--warmup-steps", "1",
              "--eval-every", "2", "--eval-iters", "1", "--sample-tokens", "4", "--device", "cpu", "--seed", "0",
              "--lr", "1e-2", "--no-progress", "--batch-size", "2"]
    worker = tmp_path / "worker.py"
    worker.write_text(WORKER)
    # Both launched at once (two --standalone rendezvous on their own ports): the wall time of one.
    runs = {"straight": _torchrun(tmp_path, ["-m", "tinygpt", "train"], [*common, "--out", str(tmp_path / "straight")]),
            "elastic": _torchrun(tmp_path, [str(worker)], [*common, "--out", str(tmp_path / "elastic")],
                                 "--max-restarts", "1")}
    done = {}
    try:
        for name, proc in runs.items():
            out, err = proc.communicate(timeout=300)
            done[name] = (proc.returncode, out, err)
    finally:
        for proc in runs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    for name, (code, out, err) in done.items():
        assert code == 0, f"{name}: {out[-2000:]}{err[-6000:]}"
    err = done["elastic"][2]
    assert "rank 1: killing itself after step 3" in err
    assert "resumed from" in err and "step-2 at step 2 (torchrun restart 1)" in err, err[-4000:]

    straight = load_model(tmp_path / "straight").state_dict()
    elastic = load_model(tmp_path / "elastic").state_dict()
    assert straight.keys() == elastic.keys()
    assert all(torch.equal(straight[k], elastic[k]) for k in straight)  # bit-identical
    assert any(not torch.equal(straight[k], load_model(tmp_path / "elastic" / "step-4").state_dict()[k])
               for k in straight)  # the comparison is of the last step's weights


def test_a_resume_at_another_world_size_keeps_the_global_batch_or_is_refused(tmp_path, training_text_file,
                                                                             capsys):
    """A checkpoint of 2 processes x batch 2 (its state says so) resumes in 1 process with batch 4 -- the same
    windows -- and is refused with batch 2, in one line naming the flag that keeps the global batch."""
    prepared = tmp_path / "prep"
    prepare_corpus([training_text_file], "char", prepared, progress=False)
    settings = dict(prepared=str(prepared), config=CONFIG, max_steps=4, warmup_steps=1, eval_every=2, eval_iters=1,
                    sample_tokens=0, progress=False, device="cpu", seed=0)
    run = tmp_path / "run"
    train(TrainingOptions(out_dir=str(run), batch_size=2, stop_after=2, **settings))
    state_path = run / "step-2" / STATE_FILE
    state = torch.load(state_path, weights_only=False)
    assert state["world_size"] == 1
    state["world_size"] = 2  # as a 2-process run with --batch-size 2 writes it
    torch.save(state, state_path)
    config = tmp_path / "config.json"
    config.write_text(CONFIG.to_json())
    args = ["train", "--prepared", str(prepared), "--config", str(config), "--out", str(run), "--max-steps", "4",
            "--warmup-steps", "1", "--eval-every", "2", "--eval-iters", "1", "--sample-tokens", "0", "--device",
            "cpu", "--no-progress", "--resume", "auto"]
    capsys.readouterr()
    assert main([*args, "--batch-size", "2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "the checkpoint was trained by 2 process(es) x --batch-size 2 (4 windows per " \
        "micro-batch); 1 x 2 would draw other windows: resume with --batch-size 4 to keep them" in err, err
    assert main([*args, "--batch-size", "4"]) == 0
