"""torchrun on CPU (gloo): 2 ranks of DDP, and of FSDP2 (with a resume halfway), end where one process on the same
global batch ends."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from tinygpt import GPTConfig
from tinygpt.checkpoint import load_model
from tinygpt.training import TrainingOptions, train
from tinygpt.training.data import prepare_corpus

CONFIG = GPTConfig(vocab_size=24, context_length=16, emb_dim=16, n_heads=2, n_layers=2)
SETTINGS = dict(config=CONFIG, max_steps=4, warmup_steps=1, eval_every=2, eval_iters=1, sample_tokens=4,
                progress=False, device="cpu", seed=0, lr=1e-2)

WORKER = textwrap.dedent("""
    import json, os, sys
    import torch
    from tinygpt import GPTConfig
    from tinygpt.cli import main
    from tinygpt.training import TrainingOptions, train

    prepared, out, settings = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    settings["config"] = GPTConfig.from_dict(settings["config"])
    rank = int(os.environ["RANK"])
    torch.distributed.init_process_group("gloo")  # ours: train() joins it and leaves it open for the second run
    # DDP through the library: every rank dumps its own parameters.
    result = train(TrainingOptions(prepared=prepared, out_dir=out + "/ddp", batch_size=2, **settings))
    torch.save({k: v.detach() for k, v in result.model.named_parameters()}, f"{out}/ddp-rank{rank}.pt")
    json_config = out + "/config.json"
    if rank == 0:
        open(json_config, "w").write(settings["config"].to_json())
    torch.distributed.barrier()
    # FSDP2 through the command line, interrupted after step 2 and resumed: rank 0 writes the gathered model.
    fsdp = ["train", "--prepared", prepared, "--out", out + "/fsdp", "--fsdp", "--batch-size", "2",
            "--config", json_config, "--max-steps", "4", "--warmup-steps", "1", "--eval-every", "2",
            "--eval-iters", "1", "--sample-tokens", "4", "--device", "cpu", "--seed", "0", "--lr", "1e-2",
            "--no-progress"]
    code = main(fsdp + ["--stop-after", "2"]) or main(fsdp + ["--resume", "auto"])
    torch.distributed.destroy_process_group()
    sys.exit(code)
""")


@pytest.mark.slow
def test_two_ranks_match_one_process(tmp_path, training_text_file):
    prepared = tmp_path / "prep"
    prepare_corpus([training_text_file], "char", prepared, progress=False)
    worker = tmp_path / "worker.py"
    worker.write_text(WORKER)
    settings = {**SETTINGS, "config": CONFIG.to_dict()}
    import json

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(worker),
         str(prepared), str(tmp_path), json.dumps(settings)],
        capture_output=True, text=True, env=env, timeout=180,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-6000:]
    assert proc.stdout.count("done: step 4") == 1, proc.stdout  # only rank 0 prints, the summary line included
    assert proc.stderr.count("model: ") == 3  # rank 0's line for each run: the library's, the CLI's two
    assert "Warning" not in proc.stderr, proc.stderr  # no deprecation warnings from tinygpt's calls into torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        single = train(TrainingOptions(prepared=str(prepared), out_dir=str(tmp_path / "single"), batch_size=4,
                                       **SETTINGS)).model
    finally:
        torch.set_num_threads(threads)
    expected = dict(single.named_parameters())

    ranks = [torch.load(tmp_path / f"ddp-rank{r}.pt", weights_only=True) for r in range(2)]
    assert all(torch.equal(ranks[0][k], ranks[1][k]) for k in expected)  # DDP ranks agree exactly
    assert max((ranks[0][k] - expected[k]).abs().max().item() for k in expected) <= 1e-6
    assert any(not torch.equal(ranks[0][k], load_model(tmp_path / "single" / "step-2").state_dict()[k])
               for k in expected)  # the comparison is of trained weights, not of the init
    fsdp = dict(load_model(tmp_path / "fsdp").named_parameters())
    assert max((fsdp[k] - expected[k]).abs().max().item() for k in expected) <= 1e-6
