"""Activation checkpointing: the same gradients (float32, 1e-6), really recomputed, and put back after the run."""

import json

import pytest
import torch

from tinygpt import GPTConfig, GPTModel
from tinygpt.training import TrainingOptions, train
from tinygpt.training.data import prepare_corpus
from tinygpt.training.memory import checkpoint_blocks

pytestmark = pytest.mark.usefixtures("one_thread")

CONFIG = GPTConfig(vocab_size=32, context_length=16, emb_dim=32, n_heads=4, n_layers=3, drop_rate=0.1)


def _gradients(model, idx, targets, seed):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)  # the dropout masks
    loss = model(idx, targets=targets)
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


def test_checkpointed_blocks_give_the_same_gradients_and_are_recomputed():
    torch.manual_seed(0)
    model = GPTModel(CONFIG).train()
    idx = torch.randint(0, CONFIG.vocab_size, (4, 16))
    targets = torch.randint(0, CONFIG.vocab_size, (4, 16))
    loss, plain = _gradients(model, idx, targets, seed=1)

    calls = []
    hooks = [block.ff.register_forward_hook(lambda *args: calls.append(1)) for block in model.trf_blocks]
    release = checkpoint_blocks(model)
    try:
        loss_ckpt, recomputed = _gradients(model, idx, targets, seed=1)
    finally:
        release()
    assert len(calls) == 2 * CONFIG.n_layers  # each block ran again in the backward pass
    assert torch.equal(loss, loss_ckpt)
    for name, grad in plain.items():  # dropout replayed with the same masks: the same arithmetic
        torch.testing.assert_close(recomputed[name], grad, rtol=0, atol=1e-6, msg=name)

    calls.clear()
    _gradients(model, idx, targets, seed=1)
    assert len(calls) == CONFIG.n_layers  # released: plain blocks again
    assert all("forward" not in block.__dict__ for block in model.trf_blocks)
    with torch.no_grad():  # no gradients recorded: nothing to recompute, the plain forward
        release = checkpoint_blocks(model)
        calls.clear()
        model(idx)
        release()
    assert len(calls) == CONFIG.n_layers
    for hook in hooks:
        hook.remove()


def test_grad_checkpoint_trains_to_the_same_losses(tmp_path, training_text_file):
    prepare_corpus([training_text_file], "char", tmp_path / "prep", progress=False)
    config = CONFIG.replace(vocab_size=18)
    settings = dict(prepared=str(tmp_path / "prep"), config=config, max_steps=6, batch_size=4, warmup_steps=2,
                    eval_every=3, eval_iters=2, sample_tokens=4, progress=False, device="cpu", seed=0, lr=3e-3)

    def losses(name, **extra):
        result = train(TrainingOptions(out_dir=str(tmp_path / name), **settings, **extra))
        records = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        return [r["loss"] for r in records], result.model

    plain, _ = losses("plain")
    checkpointed, model = losses("ckpt", grad_checkpoint=True)
    assert checkpointed == pytest.approx(plain, rel=1e-5)  # float32: gradients equal to ~1e-7, over 6 steps
    assert all("forward" not in block.__dict__ for block in model.trf_blocks)  # the returned model is plain
