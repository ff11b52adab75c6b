"""DPO: the loss is eq. 7 of Rafailov et al., the reference stays frozen, and training raises the margin."""

from __future__ import annotations

import json
import math
import re

import pytest
import torch

from conftest import PREFERENCE_DATA
from tinygpt import GPTModel
from tinygpt.alignment.data import load_preference_data
from tinygpt.alignment.dpo import DPOStage, dpo_loss
from tinygpt.alignment import FinetuneOptions
from tinygpt.training import run_stage
from tinygpt.cli import main

pytestmark = pytest.mark.usefixtures("one_thread")


def test_dpo_loss_formula():
    pc, pr, rc, rr = (torch.tensor([v]) for v in (-3.0, -5.0, -4.0, -4.5))
    loss, chosen, rejected = dpo_loss(pc, pr, rc, rr, beta=0.5)
    assert chosen.item() == pytest.approx(0.5) and rejected.item() == pytest.approx(-0.25)
    assert loss.item() == pytest.approx(math.log1p(math.exp(-0.75)), rel=1e-6)


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
def test_response_logprobs_equal_the_sum_over_every_positions_logits(alignment_config, dtype, tol):
    # DPO's log p(response | prompt) with the head on the response's positions only = the same sum over the full
    # [B, T, V] logits, and the same gradient.
    from tinygpt.alignment.logprobs import response_logprobs, sequence_logprobs

    torch.manual_seed(0)
    model = GPTModel(alignment_config).to(dtype)
    inputs = torch.randint(0, alignment_config.vocab_size, (3, 12))
    targets = torch.randint(0, alignment_config.vocab_size, (3, 12))
    targets[:, :5] = -100  # the prompts
    targets[1, 9:] = -100  # a shorter response, padded
    targets[2, :] = -100  # no response at all: log p = 0
    got = response_logprobs(model, inputs, targets)
    (g_got,) = torch.autograd.grad(got.sum(), model.tok_emb.weight)
    want = sequence_logprobs(model(inputs), targets)
    (g_want,) = torch.autograd.grad(want.sum(), model.tok_emb.weight)
    assert got.shape == (3,) and got[2] == 0
    torch.testing.assert_close(got, want.to(got.dtype), rtol=tol, atol=tol)
    torch.testing.assert_close(g_got, g_want.to(g_got.dtype), rtol=tol, atol=tol)


def test_dpo_raises_the_margin_and_keeps_the_reference(tmp_path, alignment_tokenizer, alignment_config):
    torch.manual_seed(0)
    examples = load_preference_data(PREFERENCE_DATA, limit=16)
    stage = DPOStage(GPTModel(alignment_config), alignment_tokenizer, examples, beta=0.5, batch_size=8,
                     val_fraction=0.0, seed=0)
    reference = {k: v.clone() for k, v in stage.reference.state_dict().items()}
    before = stage._average(stage.train_items)
    assert before["margin"] == pytest.approx(0.0, abs=1e-5)  # policy == reference at the start
    result = run_stage(stage, FinetuneOptions(out_dir=str(tmp_path / "dpo"), max_steps=8, lr=3e-3, eval_every=8,
                                              progress=False))
    after = stage._average(stage.train_items)
    assert after["margin"] > 0.5 and after["accuracy"] > 0.9 and after["loss"] < math.log(2)
    assert result.last_eval["train_margin"] == pytest.approx(stage._average(stage.train_items[:8])["margin"],
                                                             rel=1e-5)  # the eval's train subset: one batch
    from tinygpt.alignment.data import ALPACA_CHAT_TEMPLATE
    from tinygpt.checkpoint import load_checkpoint_tokenizer

    # the saved model chats in the Alpaca format it was trained on, as an SFT model does
    assert load_checkpoint_tokenizer(tmp_path / "dpo").chat_template.source == ALPACA_CHAT_TEMPLATE
    assert all(torch.equal(v, stage.reference.state_dict()[k]) for k, v in reference.items())
    assert not any(p.requires_grad for p in stage.reference.parameters())


def test_cli_dpo(tmp_path, alignment_model_dir, capsys):
    code = main(["dpo", "--model", str(alignment_model_dir), "--data", str(PREFERENCE_DATA), "--limit", "8",
                 "--beta", "0.2", "--out", str(tmp_path / "d"), "--max-steps", "2", "--batch-size", "4",
                 "--no-progress"])
    done = capsys.readouterr()
    assert code == 0 and "val_margin" in done.out
    assert re.search(r"^step 2: loss \S+  margin \S+  accuracy \S+  train loss \S+  val loss \S+  val margin \S+  "
                     r"val accuracy \S+  val chosen reward \S+  val rejected reward \S+$", done.err, re.M)
    assert re.search(r"^--- sample: .+ ---$", done.err, re.M)
    assert main(["dpo", "--model", str(alignment_model_dir), "--data", str(PREFERENCE_DATA), "--beta", "0"]) == 2
    assert "tinygpt dpo: error: --beta 0.0 must be a number > 0" in capsys.readouterr().err


def test_a_pair_left_out_is_one_warning_line_not_python_s(tmp_path, alignment_model_dir, capsys):
    pairs = [{"instruction": f"Say {w}.", "input": "", "chosen": w, "rejected": w + "!"} for w in ("a", "b", "c")]
    pairs.append({"instruction": "Same.", "input": "", "chosen": "x", "rejected": "x"})
    (tmp_path / "p.json").write_text(json.dumps(pairs))
    assert main(["dpo", "--model", str(alignment_model_dir), "--data", str(tmp_path / "p.json"), "--out",
                 str(tmp_path / "d"), "--max-steps", "1", "--batch-size", "2", "--no-progress"]) == 0
    err = capsys.readouterr().err
    line = next(line for line in err.splitlines() if "left out" in line)
    assert line.startswith("tinygpt dpo: warning: ") and "entry whose 'chosen' and 'rejected' are identical" in line
    assert "UserWarning" not in err and "warnings.warn" not in err
