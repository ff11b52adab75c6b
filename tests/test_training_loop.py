import json
import math

import pytest
import torch

from tinygpt import GPTConfig
from tinygpt.checkpoint import load_checkpoint_tokenizer, load_model
from tinygpt.cli import main
from tinygpt.training import (Diverged, TrainingOptions, flops_per_token, list_checkpoints, load_training_state,
                              train)
from tinygpt.training.data import prepare_corpus

CONFIG = GPTConfig(vocab_size=24, context_length=16, emb_dim=16, n_heads=2, n_layers=1, drop_rate=0.1)


@pytest.fixture(autouse=True)
def one_thread():
    # Tiny matmuls: one thread is fastest and immune to a busy machine's oversubscription.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def prepared(tmp_path, training_text_file):
    prepare_corpus([training_text_file], "char", tmp_path / "prep", progress=False)
    return tmp_path / "prep"


def options(run_dir, prepared, **overrides) -> TrainingOptions:
    settings = dict(prepared=str(prepared) if prepared else None, config=CONFIG, out_dir=str(run_dir), max_steps=8,
                    batch_size=4, warmup_steps=2, eval_every=4, eval_iters=2, sample_tokens=8, progress=False,
                    device="cpu", seed=0, lr=3e-3)
    settings.update(overrides)
    return TrainingOptions(**settings)


def parameters(directory):
    return dict(load_model(directory).named_parameters())


def test_resume_is_bit_identical(tmp_path, prepared):
    # dropout 0.1 draws from torch's RNG every step: the RNG state must come back exactly, too.
    train(options(tmp_path / "straight", prepared))
    first = train(options(tmp_path / "resumed", prepared, stop_after=4))
    assert first.step == 4 and [s for s, _ in list_checkpoints(tmp_path / "resumed")] == [4]
    second = train(options(tmp_path / "resumed", prepared, resume="auto"))
    assert second.step == 8
    a, b = parameters(tmp_path / "straight"), parameters(tmp_path / "resumed")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    state_a = load_training_state(tmp_path / "straight" / "step-8")
    state_b = load_training_state(tmp_path / "resumed" / "step-8")
    moments_a, moments_b = state_a["optimizer"]["state"], state_b["optimizer"]["state"]
    assert all(torch.equal(moments_a[k]["exp_avg_sq"], moments_b[k]["exp_avg_sq"]) for k in moments_a)
    assert torch.equal(state_a["stage_state"]["sampler"]["generator"], state_b["stage_state"]["sampler"]["generator"])
    steps = [json.loads(line)["step"] for line in (tmp_path / "resumed" / "metrics.jsonl").read_text().splitlines()]
    assert steps == list(range(1, 9))  # one consistent history across the resume


def test_a_run_leaves_a_loadable_model_metrics_and_plot(tmp_path, prepared):
    run = tmp_path / "run"
    result = train(options(run, prepared, max_steps=40, eval_every=10, keep_last=1, lr=1e-2, peak_tflops=0.5))
    vocab = load_checkpoint_tokenizer(run).vocab_size
    assert result.val_loss < math.log(vocab)  # learned something: better than a uniform guess
    model = load_model(run)  # RUN_DIR itself holds the final model
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), result.model.parameters()))
    kept = {s for s, _ in list_checkpoints(run)}
    assert kept == {40, result.best_step}  # the last one and the best by val loss
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 41))
    assert [r["step"] for r in records if "val_loss" in r] == [10, 20, 30, 40]
    per_token = flops_per_token(CONFIG)
    assert all(math.isclose(r["mfu"], r["tokens_per_second"] * per_token / 0.5e12) for r in records)
    assert (run / "loss.png").read_bytes()[:4] == b"\x89PNG"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["best_checkpoint"] == f"step-{result.best_step}" and summary["val_loss"] == result.val_loss


def test_nan_loss_stops_and_keeps_the_last_good_checkpoint(tmp_path, prepared, monkeypatch):
    from tinygpt.training.pretrain import PretrainStage

    real_batches, real_loss = PretrainStage.batches, PretrainStage.loss

    def counting(self, step):
        self.step = step
        return real_batches(self, step)

    def poisoned(self, batch):
        value, metrics = real_loss(self, batch)
        return (value * float("nan") if self.step >= 5 else value), metrics

    monkeypatch.setattr(PretrainStage, "batches", counting)
    monkeypatch.setattr(PretrainStage, "loss", poisoned)
    with pytest.raises(Diverged, match=r"step 6: the loss is nan .*step-4"):
        train(options(tmp_path / "run", prepared))
    assert [s for s, _ in list_checkpoints(tmp_path / "run")] == [4]
    assert load_training_state(tmp_path / "run" / "step-4")["step"] == 4


def _no_step_taken(run_dir):
    metrics = run_dir / "metrics.jsonl"
    return not list_checkpoints(run_dir) and (not metrics.exists() or metrics.read_text() == "")


@pytest.mark.parametrize("overrides, message", [
    (dict(config=GPTConfig(vocab_size=8, context_length=16, emb_dim=16, n_heads=2, n_layers=1)),
     "tokenizer has 18 tokens but the model's vocab_size is 8"),
    (dict(config=CONFIG.replace(context_length=4096)), "val split has .* fewer than one window"),
    (dict(max_steps=0), "max_steps=0"),
    (dict(prepared=None, data=["/no/such/corpus.txt"]), "does not exist"),
])
def test_bad_input_fails_before_any_step(tmp_path, prepared, overrides, message):
    with pytest.raises((ValueError, FileNotFoundError), match=message):
        train(options(tmp_path / "run", overrides.pop("prepared", prepared), **overrides))
    assert _no_step_taken(tmp_path / "run")


def test_resume_checks_config_and_run_folder(tmp_path, prepared):
    run = tmp_path / "run"
    train(options(run, prepared, stop_after=4))
    with pytest.raises(ValueError, match="already holds checkpoints"):
        train(options(run, prepared))
    with pytest.raises(ValueError, match=r"does not match the checkpoint .*emb_dim=32 vs checkpoint 16"):
        train(options(run, prepared, resume="auto", config=CONFIG.replace(emb_dim=32)))
    with pytest.raises(ValueError, match="already >= max_steps"):
        train(options(run, prepared, resume=str(run / "step-4"), max_steps=4))
    with pytest.raises(ValueError, match="no such folder"):
        train(options(run, prepared, resume=str(tmp_path / "elsewhere")))
    assert [s for s, _ in list_checkpoints(run)] == [4]


def test_cli_prepare_and_train(tmp_path, training_text_file, capsys):
    config = tmp_path / "c.json"
    config.write_text(CONFIG.to_json())
    assert main(["prepare", "--data", str(training_text_file), "--out", str(tmp_path / "p"), "--no-progress"]) == 0
    assert "train /" in capsys.readouterr().out
    args = ["train", "--prepared", str(tmp_path / "p"), "--config", str(config), "--out", str(tmp_path / "run"),
            "--max-steps", "4", "--eval-every", "2", "--eval-iters", "1", "--batch-size", "2", "--no-progress",
            "--device", "cpu"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "done: step 4" in out and "unigram baseline" in out
    assert load_model(tmp_path / "run").config == CONFIG
    assert main(args) == 2  # same folder, no --resume: refused in one line
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--resume auto" in err


def test_grad_accumulation_equals_the_larger_batch(tmp_path, prepared):
    config = CONFIG.replace(drop_rate=0.0)
    big = train(options(tmp_path / "big", prepared, config=config, batch_size=4)).model
    accumulated = train(options(tmp_path / "acc", prepared, config=config, batch_size=2, grad_accum=2)).model
    diffs = [(p - q).abs().max().item() for p, q in zip(big.parameters(), accumulated.parameters())]
    assert max(diffs) <= 1e-6  # the same windows; the mean of two half-batch means is the full-batch mean


def test_bf16_autocast_on_cpu(tmp_path, prepared):
    result = train(options(tmp_path / "run", prepared, max_steps=2, eval_every=2, dtype="bfloat16"))
    assert math.isfinite(result.val_loss)
    assert all(p.dtype == torch.float32 for p in result.model.parameters())  # autocast: weights stay float32


def test_force_trains_into_a_folder_with_other_files_and_keeps_them(tmp_path, training_text_file, capsys):
    """--force lets a run use a folder that holds a user's files; they are still there afterwards, untouched."""
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    config = tmp_path / "c.json"
    config.write_text(CONFIG.replace(vocab_size=18).to_json())
    args = ["train", "--data", str(training_text_file), "--config", str(config), "--out", str(mine), "--max-steps",
            "2", "--eval-every", "2", "--eval-iters", "1", "--batch-size", "2", "--no-progress", "--device", "cpu"]
    assert main(args) == 2 and "pass --force" in capsys.readouterr().err
    assert main([*args, "--force"]) == 0
    assert (mine / "notes.txt").read_text() == "mine" and load_model(mine).config.vocab_size == 18
    assert main([*args, "--resume", "auto"]) == 2  # a run folder now: --force is not needed to resume it
    assert "already" in capsys.readouterr().err


def test_every_command_checks_its_out_before_the_work(tmp_path, training_text_file, capsys, monkeypatch):
    """train, sft, reward, dpo, ppo and experiment: an --out that is a file, a folder of unrelated files or a
    folder of another kind is one line, before any data is read or model loaded (the model paths here do not even
    exist, so any work would fail differently)."""
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("mine")
    (tmp_path / "file").write_text("x")
    missing = str(tmp_path / "no-such-model")
    commands = [
        ["train", "--data", str(training_text_file), "--no-progress"],
        ["sft", "--model", missing, "--data", missing, "--no-progress"],
        ["reward", "--model", missing, "--data", missing, "--no-progress"],
        ["dpo", "--model", missing, "--data", missing, "--no-progress"],
        ["ppo", "--policy", missing, "--reward", missing, "--data", missing, "--no-progress"],
    ]
    for command in commands:
        for out, message in ((mine, "already holds unrelated files, not a tinygpt run folder"),
                             (tmp_path / "file", "is an existing file")):
            assert main([*command, "--out", str(out)]) == 2, command
            err = capsys.readouterr().err
            assert err.count("\n") == 1 and message in err and err.startswith(f"tinygpt {command[0]}: "), err
    for command in commands[1:]:  # --force passes the fine-tuning stages' folder check: what fails next is the model
        assert main([*command, "--out", str(mine), "--force"]) == 2
        assert "unrelated files" not in capsys.readouterr().err
    assert main(["experiment", "activations", "--out", str(tmp_path / "file")]) == 2
    assert "is an existing file" in capsys.readouterr().err
    assert sorted(p.name for p in mine.iterdir()) == ["notes.txt"] and (tmp_path / "file").read_text() == "x"


def test_loss_plot_is_drawn_at_the_end_and_at_most_once_per_interval(tmp_path, prepared, monkeypatch):
    from tinygpt.training import loop, pretrain

    drawn = []
    real_plot = pretrain.plot_losses
    monkeypatch.setattr(pretrain, "plot_losses", lambda records, path, **kw: (drawn.append(records[-1]["step"]),
                                                                           real_plot(records, path, **kw)))
    train(options(tmp_path / "quick", prepared))  # evals at 4 and 8, well inside one interval
    assert drawn == [8] and (tmp_path / "quick" / "loss.png").is_file()
    drawn.clear()
    monkeypatch.setattr(loop, "PLOT_INTERVAL_SECONDS", 0.0)
    train(options(tmp_path / "every", prepared))
    assert drawn == [4, 8]  # every eval once the interval has passed


def test_the_eval_sample_is_the_cached_generation_of_the_model(tmp_path, prepared):
    from tinygpt import generate

    # 40 new tokens > context_length 16: the window overflows, the cache is re-prefilled ("shift"). The model's
    # vocabulary is the tokenizer's 18 characters, so every sampled id decodes.
    result = train(options(tmp_path / "run", prepared, config=CONFIG.replace(vocab_size=18), sample_tokens=40,
                           sample_prompt="the"))
    tokenizer = load_checkpoint_tokenizer(tmp_path / "run")
    ids = tokenizer.encode("the")
    again = generate(result.model, [ids], max_new_tokens=40, temperature=0.8, overflow="shift",
                     generator=torch.Generator().manual_seed(0))
    assert result.samples[-1] == tokenizer.decode(ids + again.tokens[0, : again.lengths[0]].tolist())
    assert len(result.samples) == 2  # one per eval


def test_the_loop_is_the_textbook_computation(tmp_path, prepared):
    """Pretraining through the one loop, step for step and bit for bit, against a loop written out here as nanoGPT
    writes its own: seed, init, AdamW, warmup + cosine, accumulated micro-batches, clipping (dropout on: the RNG
    stream must be consumed in the same order, too)."""
    import random

    import numpy as np

    from tinygpt import GPTModel
    from tinygpt.training import PreparedCorpus, WindowSampler, build_optimizer, lr_at

    settings = options(tmp_path / "run", prepared, max_steps=6, grad_accum=2, eval_every=100)
    result = train(settings)
    logged = [json.loads(line)["loss"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]

    torch.manual_seed(0)
    np.random.seed(0)
    random.seed(0)
    model = GPTModel(CONFIG).train()
    optimizer = build_optimizer(model, lr=settings.lr, weight_decay=0.1, betas=(0.9, 0.95))
    sampler = WindowSampler(PreparedCorpus.open(prepared).train, CONFIG.context_length, 0)
    expected = []
    for step in range(6):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, lr=settings.lr, min_lr=settings.lr / 10, warmup_steps=2, max_steps=6)
        total = torch.zeros(())
        for _ in range(2):
            x, y = sampler.sample(settings.batch_size)
            loss = model(x, targets=y)
            (loss / 2).backward()
            total += loss.detach()
        # the norm summed in the optimizer's order of the parameters, as optim.optimizer_step does
        torch.nn.utils.clip_grad_norm_([p for g in optimizer.param_groups for p in g["params"]], 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        expected.append(float(total / 2))
    assert logged == expected
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), result.model.parameters()))


def test_parse_duration_and_the_schedule_over_a_budget():
    from tinygpt.training.optim import lr_at_fraction
    from tinygpt.training.options import parse_duration

    assert [parse_duration("t", x) for x in ("90", "90s", "5m", "1.5h", " .5m ")] == [90, 90, 300, 5400, 30]
    for bad in ("5x", "", "0", "-3m", "m"):
        with pytest.raises(ValueError, match=r"time_budget=.*positive duration.*5m"):
            parse_duration("time_budget", bad)
    kw = dict(lr=1.0, min_lr=0.1, warmup_steps=10)
    assert lr_at_fraction(4, 0.9, **kw) == 0.5  # warmup by steps, whatever the time
    assert lr_at_fraction(10, 0.0, **kw) == 1.0 and lr_at_fraction(99, 1.0, **kw) == pytest.approx(0.1)
    assert lr_at_fraction(50, 0.5, **kw) == pytest.approx(0.55) and lr_at_fraction(60, 3.0, **kw) == pytest.approx(0.1)


def test_a_time_budget_ends_the_run_schedules_over_it_and_reports_bits_per_byte(tmp_path, prepared):
    import math

    from tinygpt.training.metrics import tokens_per_byte
    from tinygpt.training import PreparedCorpus

    result = train(options(tmp_path / "run", prepared, time_budget="1.5s", budget_clock="cpu", max_steps=5,
                           eval_every=50, warmup_steps=5))
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["time_budget_seconds"] == 1.5 and summary["budget_seconds_spent"] >= 1.5
    assert result.step > 5  # max_steps does not end a budgeted run
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    lrs = [r["lr"] for r in records]
    assert max(lrs) == pytest.approx(3e-3) and lrs[-1] < 3e-3 / 2  # up, then down over the budget
    corpus = PreparedCorpus.open(prepared)
    per_byte = tokens_per_byte(corpus.load_tokenizer(), corpus.val)
    assert per_byte == 1.0  # a character tokenizer on ASCII text
    assert summary["val_bpb"] == pytest.approx(summary["val_loss"] / math.log(2) * per_byte)
    assert load_model(tmp_path / "run") is not None  # the finished model is exported
    with pytest.raises(ValueError, match="spent its --time-budget"):
        train(options(tmp_path / "run", prepared, time_budget="1.5s", budget_clock="cpu", resume="auto"))
    with pytest.raises(ValueError, match="budget_clock"):
        train(options(tmp_path / "other", prepared, time_budget="1s", budget_clock="gpu"))


def test_resume_reads_the_checkpoints_config_once(tmp_path, prepared, monkeypatch):
    """The resume builds its model from step-N/config.json and checks the weights against the same read."""
    run = tmp_path / "run"
    train(options(run, prepared, stop_after=4))
    reads = []
    from_file = GPTConfig.from_file.__func__
    monkeypatch.setattr(GPTConfig, "from_file", classmethod(lambda cls, path: reads.append(str(path)) or
                                                            from_file(cls, path)))
    result = train(options(run, prepared, resume="auto", max_steps=6))
    assert result.step == 6
    assert reads == [str(run / "step-4" / "config.json")]
