"""What the fine-tuning stages (SFT, reward, DPO, PPO) share on top of the one loop (``training.loop.run_stage``).

- ``FinetuneStage``: a stage built around a starting model that its caller loaded (``load_start_model``); it runs in
  one process, and refuses options whose batch size, validation share or seed contradict its own.
- ``SupervisedStage``: a stage trained on a fixed list of examples, one batch per step (``batches``: the batch of any
  step follows from the step number, so a resumed run sees the same data).

A ``step-N/`` folder of a fine-tuning run is the stage's GPT as a loadable checkpoint plus ``training_state.pt``
(the loop's: optimizer, RNG states, step, the stage's heads -- a reward or value head -- and generator states).
With LoRA (``adapt``) it is the adapter instead (PEFT's format, naming the base), and so is the finished run;
``reference_model`` is then the policy's own base, its adapters switched off.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch

from ..devices import resolve_device
from ..lora import is_adapted
from ..model import GPTModel
from ..tokenizer import Tokenizer
from ..training.distributed import DistContext
from ..training.limits import check_memory
from ..training.metrics import plot_losses
from ..training.stage import Stage
from .batches import batch_for_step, batches_per_epoch, split_indices
from .options import FinetuneOptions

SAMPLE_TOKENS = 48  # new tokens at most of the sample answer an evaluation prints


def check_stage_agrees(stage: Stage, options: FinetuneOptions) -> None:
    """``ValueError`` when the options give a batch size, validation share or seed other than the one the stage
    was built with (the stage splits and batches its data with its own: the options' would be silently ignored)."""
    for name, wanted in options.stage_settings().items():
        mine = getattr(stage, name, None)
        if mine is not None and mine != wanted:
            raise ValueError(f"the {stage.name} stage was built with {name}={mine!r} but the options say "
                             f"{name}={wanted!r}: give the stage's value, or leave it unset in the options")


class FinetuneStage(Stage):
    """A fine-tuning stage: ``policy`` (and ``heads``) exist when it is built; the loop only checks and trains.

    After each evaluation it prints one line as ``tinygpt train`` does: the step's own metrics (``postfix_keys``:
    the loss, PPO's reward and KL) and the evaluation's (train/val loss, DPO's margin and rewards, ...), and below
    it the sample, when the stage gives one (SFT and DPO: the answer to a fixed held-out prompt)."""

    def setup(self, options: FinetuneOptions, ctx: DistContext, resume_from: Path | None) -> None:
        if isinstance(options, FinetuneOptions):
            check_stage_agrees(self, options)
        check_memory(self.policy.config, 0, self.device, what=f"{self.name} fine-tuning")

    def report(self, record: dict[str, Any], sample: str | None) -> str:
        shown = [k for k in self.postfix_keys if k in record]
        shown += [k for k in record if k == "train_loss" or k.startswith("val_")]  # train's others: metrics.jsonl
        values = "  ".join(f"{k.replace('_', ' ')} {record[k]:.4f}" for k in shown)
        line = f"step {record['step']}: {values}"
        return line if sample is None else f"{line}\n{sample}"

    def export(self, model: GPTModel, run_dir: Path) -> None:
        """The finished model into ``run_dir``: a checkpoint's files, or with LoRA the adapter (naming its base) and
        the tokenizer with the stage's chat template, so the adapter folder chats as a checkpoint does."""
        if is_adapted(model):
            from ..interop.peft import save_adapter

            save_adapter(model, run_dir, tokenizer=self.tokenizer)
            return
        super().export(model, run_dir)


def adapt(model: GPTModel, lora: Any, options: FinetuneOptions, base: str | Path) -> GPTModel:
    """``model`` with LoRA adapters (``lora``: a ``LoRAConfig``; None = full fine-tuning, the model as it is). The
    A matrices are drawn from the run's seed; ``base`` (the folder or hub name the model came from) is what every
    saved adapter names as its base."""
    if lora is None:
        return model
    from ..lora import apply_lora
    from ..config import DEFAULT_SEED

    seed = options.seed if options.seed is not None else DEFAULT_SEED
    apply_lora(model, lora, seed=seed)
    model.lora_base = str(Path(base).resolve()) if Path(base).is_dir() else str(base)
    return model


@contextlib.contextmanager
def reference_model(reference: GPTModel | None, policy: GPTModel) -> Iterator[GPTModel]:
    """The frozen model DPO and PPO compare the policy with: ``reference`` itself, or with ``None`` (a LoRA
    policy) the policy's own base -- its adapters switched off, in eval mode -- so the base is held once."""
    if reference is not None:
        yield reference
        return
    from ..lora import adapters_disabled

    was_training = policy.training
    policy.eval()
    try:
        with adapters_disabled(policy):
            yield policy
    finally:
        policy.train(was_training)


class SupervisedStage(FinetuneStage):
    """A stage trained on a fixed list of examples: subclasses implement ``loss(items) -> (loss, metrics)``.

    The examples are split once (seeded) into train and val; step s trains on ``batch_for_step(s)``. Evaluation
    averages the loss and the metrics over all val items and over as many train items (the first ones), reported as
    ``val_<name>`` / ``train_<name>`` (so ``train_loss`` / ``val_loss`` for the loss). With ``answers_samples``
    (SFT, DPO: items are ``EncodedExample``s or pairs of them) each evaluation also answers one fixed prompt, the
    first held-out example's (the first training example's without a held-out split), greedily in eval mode: the
    same text for the same weights, and no random number drawn, so a resumed run stays exact.
    """

    answers_samples = False

    def __init__(self, items: Sequence[Any], *, batch_size: int, val_fraction: float, seed: int) -> None:
        train_idx, val_idx = split_indices(len(items), val_fraction, seed)
        self.train_items = [items[i] for i in train_idx]
        self.val_items = [items[i] for i in val_idx]
        self.batch_size, self.val_fraction, self.seed = batch_size, val_fraction, seed
        self.steps_per_epoch = batches_per_epoch(len(self.train_items), batch_size)

    def batches(self, step: int) -> list[list[list[Any]]]:
        chosen = batch_for_step(len(self.train_items), self.batch_size, step, self.seed)
        return [[[self.train_items[i] for i in chosen]]]  # one update of one micro-batch

    @torch.no_grad()
    def _average(self, items: Sequence[Any]) -> dict[str, float]:
        totals: dict[str, float] = {}
        for start in range(0, len(items), self.batch_size):
            part = items[start : start + self.batch_size]
            loss, metrics = self.loss(part)
            for name, value in {"loss": float(loss), **metrics}.items():
                totals[name] = totals.get(name, 0.0) + value * len(part)
        return {name: value / len(items) for name, value in totals.items()}

    def evaluate(self) -> dict[str, float]:
        result = {}
        splits = {"train": self.train_items[: max(len(self.val_items), self.batch_size)], "val": self.val_items}
        for split, items in splits.items():
            if items:
                result.update({f"{split}_{k}": v for k, v in self._average(items).items()})
        return result

    @torch.no_grad()
    def sample(self) -> str | None:
        if not self.answers_samples or not (self.val_items or self.train_items):
            return None
        from ..text_stream import generate_text
        from .chat import STOP_TEXTS

        item = (self.val_items or self.train_items)[0]
        example = getattr(item, "chosen", item)  # a preference pair: its prompt
        prompt = self.tokenizer.decode(list(example.ids[: example.prompt_len]))
        new_tokens = max(1, min(SAMPLE_TOKENS, self.policy.config.context_length - example.prompt_len))
        was_training = self.policy.training
        self.policy.eval()
        try:
            answer = generate_text(self.policy, self.tokenizer, prompt, max_new_tokens=new_tokens,
                                   stop_texts=STOP_TEXTS)
        finally:
            self.policy.train(was_training)
        asked = prompt.split("### Instruction:\n", 1)[-1].split("\n\n### Response:", 1)[0]
        asked = " ".join(asked.replace("### Input:", "/").split())
        return f"--- sample: {asked[:100]}{'...' if len(asked) > 100 else ''} ---\n{answer.strip()}\n---"

    def plot(self, records: list[dict[str, Any]], run_dir: Path) -> None:
        plot_losses(records, run_dir / "loss.png")


def load_start_model(source: str | Path, device: str | torch.device | None = None,
                     tokenizer_dir: str | Path | None = None, lora: Any = None) -> tuple[GPTModel, Tokenizer]:
    """The model a stage starts from (a tinygpt checkpoint, a Hugging Face GPT-2 folder or a hub name) and its
    tokenizer (``tokenizer_dir``, else the model's own), which fine-tuning cannot do without. ``device`` None:
    cuda when available. With QLoRA (``lora``, a ``LoRAConfig`` whose ``quantize`` is set) the block linears are
    quantised as they are read, so the float base is never whole in memory (``adapt`` then wraps them)."""
    from ..interop.pretrained import load_pretrained

    quantize = getattr(lora, "quantize", None)
    model, tokenizer = load_pretrained(source, device=resolve_device(device), tokenizer_dir=tokenizer_dir,
                                       quantize=quantize)
    if tokenizer is None:
        raise ValueError(f"{source} has no tokenizer saved beside it; fine-tuning needs the model's tokenizer: "
                         f"pass --tokenizer-dir DIR")
    return model, tokenizer
