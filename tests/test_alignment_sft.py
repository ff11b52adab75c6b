"""Supervised fine-tuning: response-only loss (masked targets get exactly zero gradient), training lowers the
response loss, exact resume, and the CLI round trip to a model `chat` can load."""

from __future__ import annotations

import io
import json
import re

import pytest
import torch
import torch.nn.functional as F

from conftest import INSTRUCTION_DATA
from tinygpt import GPTModel, load_checkpoint_tokenizer, load_model
from tinygpt.alignment.batches import IGNORE_INDEX, collate_targets
from tinygpt.alignment.data import load_instruction_data
from tinygpt.alignment import FinetuneOptions
from tinygpt.training import run_stage
from tinygpt.alignment.sft import SFTStage, encode_instructions, response_loss
from tinygpt.cli import main

pytestmark = pytest.mark.usefixtures("one_thread")


def test_masked_positions_get_exactly_zero_gradient(alignment_tokenizer, alignment_config):
    examples = load_instruction_data(INSTRUCTION_DATA, limit=4)
    encoded = encode_instructions(alignment_tokenizer, examples, alignment_config.context_length)
    inputs, targets = collate_targets(encoded, alignment_tokenizer.eot_id)
    model = GPTModel(alignment_config)
    logits = model(inputs)  # [B, T, V]
    logits.retain_grad()
    loss = response_loss(logits, targets)
    loss.backward()
    masked = targets == IGNORE_INDEX
    assert masked.any() and (~masked).any()
    assert torch.count_nonzero(logits.grad[masked]) == 0  # prompt and padding: exactly no gradient
    assert (logits.grad[~masked].abs().sum(dim=-1) > 0).all()  # every response target: some gradient
    # The loss is the mean over response targets only.
    per_token = F.cross_entropy(logits.detach().flatten(0, 1), targets.clamp(min=0).flatten(), reduction="none")
    assert torch.allclose(loss, per_token[~masked.flatten()].mean(), rtol=1e-6)


def test_the_stage_loss_is_response_loss_with_its_gradients(alignment_tokenizer, alignment_config):
    # SFTStage takes the head-fused loss (no logits); it must be response_loss over the logits, gradients included.
    stage = _stage(alignment_tokenizer, alignment_config, n=4)
    examples = load_instruction_data(INSTRUCTION_DATA, limit=4)
    items = encode_instructions(alignment_tokenizer, examples, alignment_config.context_length)
    fused, _ = stage.loss(items)
    fused.backward()
    fused_grads = {n: p.grad.clone() for n, p in stage.policy.named_parameters()}
    stage.policy.zero_grad()
    inputs, targets = collate_targets(items, stage.pad_id)
    plain = response_loss(stage.policy(inputs), targets)
    plain.backward()
    torch.testing.assert_close(fused, plain)
    for name, p in stage.policy.named_parameters():
        torch.testing.assert_close(fused_grads[name], p.grad, rtol=1e-5, atol=1e-7, msg=name)


def _stage(tokenizer, config, n=32, seed=1):
    torch.manual_seed(0)
    examples = load_instruction_data(INSTRUCTION_DATA, limit=n)
    return SFTStage(GPTModel(config), tokenizer, examples, batch_size=8, val_fraction=0.125, seed=seed)


def test_sft_lowers_the_response_loss(tmp_path, alignment_tokenizer, alignment_config):
    stage = _stage(alignment_tokenizer, alignment_config)
    before = stage.evaluate()
    result = run_stage(stage, FinetuneOptions(out_dir=str(tmp_path / "run"), max_steps=12, lr=3e-3, eval_every=12,
                                              progress=False))
    after = result.last_eval
    assert after["train_loss"] < before["train_loss"] - 0.5
    assert after["val_loss"] < before["val_loss"]
    assert [r["step"] for r in result.records] == list(range(1, 13))
    assert (tmp_path / "run" / "loss.png").is_file() and (tmp_path / "run" / "step-12").is_dir()
    reloaded = load_model(tmp_path / "run")
    assert torch.equal(reloaded.out_head.weight, stage.policy.out_head.weight)
    assert load_checkpoint_tokenizer(tmp_path / "run").vocab_size == alignment_tokenizer.vocab_size


def test_resume_continues_the_same_computation(tmp_path, alignment_tokenizer, alignment_config):
    alignment_config = alignment_config.replace(drop_rate=0.1)  # dropout: the saved RNG state must be restored
    options = dict(max_steps=6, lr=3e-3, eval_every=100, progress=False)
    straight = _stage(alignment_tokenizer, alignment_config)
    run_stage(straight, FinetuneOptions(out_dir=str(tmp_path / "a"), **options))
    first = _stage(alignment_tokenizer, alignment_config)
    run_stage(first, FinetuneOptions(out_dir=str(tmp_path / "b"), stop_after=3, **options))
    assert not (tmp_path / "b" / "config.json").exists()  # interrupted: no final export yet
    with pytest.raises(ValueError, match="already holds checkpoints"):
        run_stage(_stage(alignment_tokenizer, alignment_config), FinetuneOptions(out_dir=str(tmp_path / "b"),
                                                                                 **options))
    resumed = _stage(alignment_tokenizer, alignment_config)
    result = run_stage(resumed, FinetuneOptions(out_dir=str(tmp_path / "b"), resume="auto", **options))
    assert result.step == 6 and [r["step"] for r in result.records] == list(range(1, 7))
    for (name, a), b in zip(straight.policy.state_dict().items(), resumed.policy.state_dict().values()):
        assert torch.equal(a, b), name


def test_cli_sft_then_chat_and_bad_data(tmp_path, alignment_model_dir, capsys, monkeypatch):
    out = tmp_path / "sft"
    code = main(["sft", "--model", str(alignment_model_dir), "--data", str(INSTRUCTION_DATA), "--limit", "16",
                 "--out", str(out), "--max-steps", "2", "--batch-size", "4", "--lr", "1e-3", "--no-progress",
                 "--seed", "123"])  # a seed whose tiny answers hold no newline
    assert code == 0
    done = capsys.readouterr()
    assert "sft done" in done.out
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 2
    # the evaluation, as train prints it: losses, then the answer to the first held-out example's instruction
    assert re.search(r"^step 2: loss \d+\.\d{4}  train loss \d+\.\d{4}  val loss \d+\.\d{4}$", done.err, re.M)
    assert re.search(r"^--- sample: .+ ---\n.*\n---$", done.err, re.M)
    assert "examples (14 to train, 2 held out)" in done.err  # too little data: a warning with the numbers

    monkeypatch.setattr("sys.stdin", io.StringIO("Name a color.\n\nSay hi.\n/exit\nnever answered\n"))
    assert main(["chat", "--model", str(out), "--max-new-tokens", "5"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2  # two answers, the blank line skipped, nothing after /exit

    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps([{"instruction": "a", "input": "", "output": "b"}, {"instruction": "c", "input": ""}]))
    code = main(["sft", "--model", str(alignment_model_dir), "--data", str(bad), "--out", str(tmp_path / "x")])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "entry 1: missing key 'output'" in err


def test_a_character_tokenizer_model_is_refused_with_the_command_that_makes_a_fitting_base(tmp_path, capsys):
    from tinygpt import GPTConfig, save_model
    from tinygpt.tokenizer import CharTokenizer

    tokenizer = CharTokenizer(sorted(set("abcdefghijklmnopqrstuvwxyz #:.\n")))
    save_model(GPTModel(GPTConfig(vocab_size=tokenizer.vocab_size, context_length=16, emb_dim=16, n_heads=2,
                                  n_layers=1)), tmp_path / "char", tokenizer)
    assert main(["sft", "--model", str(tmp_path / "char"), "--data", str(INSTRUCTION_DATA), "--limit", "4",
                 "--out", str(tmp_path / "sft")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "char tokenizer has no end-of-text token" in err
    assert err.rstrip().endswith("tinygpt train --tokenizer bpe --out runs/tinygpt-bpe")
    assert not (tmp_path / "sft").exists()


def test_sft_defaults_scale_with_the_model(alignment_config):
    from tinygpt import get_config
    from tinygpt.alignment.sft import sft_defaults

    assert sft_defaults(get_config("gpt2-small")) == (5e-5, 1)  # GPT-2's own fine-tuning rate
    small_lr, small_epochs = sft_defaults(alignment_config)
    assert small_lr > 5e-5 * 10 and small_epochs > 1
    assert sft_defaults(alignment_config, lora=True) == (small_lr * 10, small_epochs)  # only the updates move
