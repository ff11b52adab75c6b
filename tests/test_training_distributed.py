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
from tinygpt.training import TrainingOptions, list_checkpoints, train
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


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _two_nodes(tmp_path, train_args: list[str], per_node: tuple[list[str], list[str]] = ([], []),
               timeout: float = 240) -> list[subprocess.CompletedProcess]:
    """``torchrun --nnodes 2`` on this host: two launchers, one process each, meeting at a rendezvous on
    127.0.0.1:<free port> (static, --node-rank 0/1), gloo over the loopback interface; ``per_node``: each node's
    own extra arguments."""
    port = _free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "GLOO_SOCKET_IFNAME": "lo"}
    launchers = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "1", "--node_rank",
         str(rank), "--master_addr", "127.0.0.1", "--master_port", str(port), "-m", "tinygpt", "train", *train_args,
         *per_node[rank]],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=tmp_path) for rank in (0, 1)]
    done = []
    try:
        for proc in launchers:
            out, err = proc.communicate(timeout=timeout)
            done.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    finally:
        for proc in launchers:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return done


@pytest.mark.slow
def test_two_nodes_train_as_one_process_and_resume_at_another_world_size(tmp_path, training_text_file):
    """2 nodes x 1 process x batch 2 = the global batch of 1 process x batch 4: the same windows, the same losses.
    Only rank 0 writes (one metrics line per step, one summary). The 2-node checkpoint resumes in one process: with
    the same global batch it continues the same computation."""
    import json

    prepared = tmp_path / "prep"
    prepare_corpus([training_text_file], "char", prepared, progress=False)
    config = tmp_path / "config.json"
    config.write_text(CONFIG.to_json())
    common = ["--prepared", str(prepared), "--config", str(config), "--max-steps", "4", "--warmup-steps", "1",
              "--eval-every", "2", "--eval-iters", "1", "--sample-tokens", "4", "--device", "cpu", "--seed", "0",
              "--lr", "1e-2", "--no-progress"]
    nodes = _two_nodes(tmp_path, [*common, "--out", str(tmp_path / "nodes"), "--batch-size", "2"])
    for node in nodes:
        assert node.returncode == 0, node.stdout[-2000:] + node.stderr[-6000:]
    assert "done: step 4" in nodes[0].stdout and "done: step 4" not in nodes[1].stdout  # rank 0 reports

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        single = train(TrainingOptions(prepared=str(prepared), out_dir=str(tmp_path / "single"), batch_size=4,
                                       **SETTINGS))
        # The 2-node run's step-2 checkpoint, resumed by one process with the same global batch.
        import shutil

        shutil.copytree(tmp_path / "nodes" / "step-2", tmp_path / "from-nodes" / "step-2")
        resumed = train(TrainingOptions(prepared=str(prepared), out_dir=str(tmp_path / "from-nodes"),
                                        batch_size=4, resume="auto", **SETTINGS))
    finally:
        torch.set_num_threads(threads)

    def losses(run):
        return [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]

    two = losses(tmp_path / "nodes")
    assert [json.loads(line)["step"] for line in (tmp_path / "nodes" / "metrics.jsonl").read_text().splitlines()] \
        == [1, 2, 3, 4]  # written once: by rank 0 alone
    assert two == pytest.approx(losses(tmp_path / "single"), rel=1e-5)  # float tolerance: the all-reduce's sums
    expected = dict(single.model.named_parameters())
    nodes_model = dict(load_model(tmp_path / "nodes").named_parameters())
    assert max((nodes_model[k] - expected[k]).abs().max().item() for k in expected) <= 1e-6
    after = dict(resumed.model.named_parameters())
    assert resumed.step == 4 and max((after[k] - expected[k]).abs().max().item() for k in expected) <= 1e-6


@pytest.mark.slow
def test_nodes_that_see_different_checkpoints_are_refused(tmp_path, training_text_file):
    """Each node with its own --out (no shared file system): rank 0 finds a checkpoint, rank 1 none -- refused on
    both, in one line, instead of training on from two different states."""
    prepared = tmp_path / "prep"
    prepare_corpus([training_text_file], "char", prepared, progress=False)
    config = tmp_path / "config.json"
    config.write_text(CONFIG.to_json())
    common = ["--prepared", str(prepared), "--config", str(config), "--max-steps", "4", "--eval-every", "2",
              "--eval-iters", "1", "--sample-tokens", "0", "--device", "cpu", "--no-progress", "--batch-size", "2",
              "--resume", "auto"]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        train(TrainingOptions(prepared=str(prepared), out_dir=str(tmp_path / "run"), batch_size=4, config=CONFIG,
                              max_steps=4, stop_after=2, eval_every=2, eval_iters=1, sample_tokens=0, progress=False,
                              device="cpu"))
    finally:
        torch.set_num_threads(threads)
    nodes = _two_nodes(tmp_path, common, (["--out", str(tmp_path / "run")], ["--out", str(tmp_path / "other")]))
    for node in nodes:  # torchrun itself exits 1 when its worker fails; the worker's own code was 2
        assert node.returncode == 1 and "exitcode  : 2" in node.stderr, node.stderr[-4000:]
        assert "tinygpt train: error: the ranks resume from different steps ([2, -1]" in node.stderr, node.stderr
    assert [s for s, _ in list_checkpoints(tmp_path / "run")] == [2]  # untouched
