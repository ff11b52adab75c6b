"""Fine-tuning stages (``alignment.finetune``) in the one training loop (``training.loop``; there is no alignment
loop of its own any more): one source of truth for batch_size / val_fraction / seed, the divergence refusal it
shares with pretraining (and its one-line CLI report)."""

import pytest
import torch

from conftest import INSTRUCTION_DATA
from tinygpt import GPTModel
from tinygpt.alignment import FinetuneOptions, SFTStage, run_stage
from tinygpt.alignment.data import load_instruction_data
from tinygpt.training import Diverged, list_checkpoints

pytestmark = pytest.mark.usefixtures("one_thread")


def _stage(tokenizer, config, **settings):
    torch.manual_seed(0)
    examples = load_instruction_data(INSTRUCTION_DATA, limit=16)
    return SFTStage(GPTModel(config), tokenizer, examples, **settings)


@pytest.mark.parametrize("name,stage_value,option_value", [
    ("batch_size", 4, 8), ("val_fraction", 0.25, 0.1), ("seed", 1, 2),
])
def test_options_that_contradict_the_stage_are_refused(tmp_path, alignment_tokenizer, alignment_config, name,
                                                       stage_value, option_value):
    stage = _stage(alignment_tokenizer, alignment_config, **{name: stage_value})
    with pytest.raises(ValueError, match=f"built with {name}={stage_value!r} but the options say "
                                         f"{name}={option_value!r}"):
        run_stage(stage, FinetuneOptions(out_dir=str(tmp_path), max_steps=1, progress=False, **{name: option_value}))
    assert not list(tmp_path.iterdir())  # refused before anything was written


def test_unset_options_take_the_stage_s_and_agreeing_ones_pass(tmp_path, alignment_tokenizer, alignment_config):
    stage = _stage(alignment_tokenizer, alignment_config, batch_size=4, val_fraction=0.25, seed=3)
    result = run_stage(stage, FinetuneOptions(out_dir=str(tmp_path / "a"), max_steps=1, progress=False))
    assert result.step == 1
    stage = _stage(alignment_tokenizer, alignment_config, batch_size=4, val_fraction=0.25, seed=3)
    run_stage(stage, FinetuneOptions(out_dir=str(tmp_path / "b"), max_steps=1, progress=False, batch_size=4,
                                     val_fraction=0.25, seed=3))


def test_the_api_functions_build_their_stage_from_the_options(tmp_path, alignment_model_dir, monkeypatch):
    from tinygpt.alignment import sft
    from tinygpt.training import loop

    seen = {}
    real = loop.run_stage

    def spy(stage, options):
        seen.update(batch_size=stage.batch_size, val_fraction=stage.val_fraction, seed=stage.seed)
        return real(stage, options)

    monkeypatch.setattr(sft, "run_stage", spy)
    options = FinetuneOptions(out_dir=str(tmp_path / "run"), max_steps=1, batch_size=3, val_fraction=0.2, seed=9,
                              progress=False, device="cpu")
    sft.sft(alignment_model_dir, INSTRUCTION_DATA, options, limit=10)
    assert seen == {"batch_size": 3, "val_fraction": 0.2, "seed": 9}


def test_divergence_is_the_pretraining_error_and_names_the_kept_checkpoint(tmp_path, alignment_tokenizer,
                                                                          alignment_config, monkeypatch):
    stage = _stage(alignment_tokenizer, alignment_config, batch_size=4)
    real_loss = SFTStage.loss

    def poisoned(self, items):
        loss, metrics = real_loss(self, items)
        return (loss * float("nan"), metrics) if poisoned.calls >= 3 else (loss, metrics)

    poisoned.calls = 0
    real_batches = SFTStage.batches

    def counting(self, step):
        poisoned.calls = step
        return real_batches(self, step)

    monkeypatch.setattr(SFTStage, "loss", poisoned)
    monkeypatch.setattr(SFTStage, "batches", counting)
    with pytest.raises(Diverged, match=r"step 4: the loss is nan .* -- the last good checkpoint is .*step-2"):
        run_stage(stage, FinetuneOptions(out_dir=str(tmp_path), max_steps=6, eval_every=2, progress=False))
    assert [s for s, _ in list_checkpoints(tmp_path)] == [2]


def test_bf16_autocast_and_the_device_rule(tmp_path, alignment_tokenizer, alignment_config):
    stage = _stage(alignment_tokenizer, alignment_config, batch_size=4)
    result = run_stage(stage, FinetuneOptions(out_dir=str(tmp_path), max_steps=2, eval_every=2, dtype="bfloat16",
                                              progress=False))
    assert result.step == 2 and all(torch.isfinite(torch.tensor(r["loss"])) for r in result.records)
    assert next(stage.policy.parameters()).dtype == torch.float32  # autocast: the weights stay float32
    with pytest.raises(ValueError, match="dtype='fp16' is not allowed; allowed: auto, float32, bfloat16"):
        run_stage(stage, FinetuneOptions(out_dir=str(tmp_path / "x"), dtype="fp16"))


def test_the_loss_plot_is_drawn_at_the_end_and_at_most_once_per_interval(tmp_path, alignment_tokenizer,
                                                                        alignment_config, monkeypatch):
    from tinygpt.training import loop

    drawn = []
    real_plot = SFTStage.plot
    monkeypatch.setattr(SFTStage, "plot", lambda self, records, run_dir: (drawn.append(records[-1]["step"]),
                                                                          real_plot(self, records, run_dir)))
    options = dict(max_steps=6, eval_every=2, progress=False)
    run_stage(_stage(alignment_tokenizer, alignment_config, batch_size=4),
              FinetuneOptions(out_dir=str(tmp_path / "quick"), **options))  # evals at 2, 4, 6 inside one interval
    assert drawn == [6] and (tmp_path / "quick" / "loss.png").is_file()
    drawn.clear()
    monkeypatch.setattr(loop, "PLOT_INTERVAL_SECONDS", 0.0)
    run_stage(_stage(alignment_tokenizer, alignment_config, batch_size=4),
              FinetuneOptions(out_dir=str(tmp_path / "every"), **options))
    assert drawn == [2, 4, 6]  # every evaluation once the interval has passed


def test_sft_through_the_loop_is_the_textbook_computation(tmp_path, alignment_tokenizer, alignment_config):
    """An SFT stage in the one loop, bit for bit, against the loop written out here: the step's batch, the masked
    loss, AdamW with its warmup + cosine, clipping."""
    import copy

    from tinygpt.alignment.batches import batch_for_step, collate_targets, end_of_text_id
    from tinygpt.training import build_optimizer, lr_at

    stage = _stage(alignment_tokenizer, alignment_config, batch_size=4, seed=3)
    model = copy.deepcopy(stage.policy)
    result = run_stage(stage, FinetuneOptions(out_dir=str(tmp_path), max_steps=5, warmup_steps=2, lr=1e-3,
                                              eval_every=100, progress=False))
    optimizer = build_optimizer(model, lr=1e-3, weight_decay=0.1)
    pad = end_of_text_id(alignment_tokenizer)
    expected = []
    for step in range(5):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, lr=1e-3, min_lr=1e-3 / 10, warmup_steps=2, max_steps=5)
        chosen = batch_for_step(len(stage.train_items), 4, step, 3)
        inputs, targets = collate_targets([stage.train_items[i] for i in chosen], pad)
        loss = model(inputs, targets=targets)
        loss.backward()
        # the norm summed in the optimizer's order of the parameters, as optim.optimizer_step does
        torch.nn.utils.clip_grad_norm_([p for g in optimizer.param_groups for p in g["params"]], 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        expected.append(float(loss.detach()))
    assert [r["loss"] for r in result.records] == expected
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), stage.policy.parameters()))
