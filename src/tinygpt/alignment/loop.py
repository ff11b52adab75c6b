"""The fine-tuning loop shared by SFT, the reward model, DPO and PPO: schedule, progress, metrics, checkpoints, resume.

A *stage* says how to take one step and how to evaluate; this loop does the rest with the pretraining machinery:
``training.optim`` (AdamW with decay on matrices only, warmup + cosine), ``training.checkpointing`` (atomic
``step-N/`` folders, resume discovery, pruning) and ``training.metrics`` (``metrics.jsonl``). A ``step-N/`` folder
is the stage's GPT as a loadable checkpoint plus ``training_state.pt`` holding the optimizer, the RNG states, the
step, and the stage's extra trainable weights (a reward or value head) and generator states -- only tensors and
plain values, so it loads with ``weights_only=True``. Batches follow from the step number (``batches``), so a
resumed run continues the same computation.
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch
from torch import nn
from tqdm.auto import tqdm

from ..checkpoint import load_model
from ..devices import autocast, resolve_device
from ..fileio import atomic_write_text
from ..model import GPTModel
from ..tokenizer import Tokenizer
from .batches import batch_for_step, batches_per_epoch, split_indices
from ..training.checkpointing import (capture_rng_state, load_training_state, prune_checkpoints,
                                      remove_partial_checkpoints, resolve_resume, restore_rng_state, save_checkpoint)
from ..training.metrics import PLOT_INTERVAL_SECONDS, MetricsLog, plot_losses
from ..training.lifecycle import (Diverged, Interrupted, StopRequests, last_good_checkpoint, refuse_finished,
                                   refuse_fresh_start)
from ..training.limits import check_memory
from ..training.optim import Schedule, build_optimizer, optimizer_step
from .options import FinetuneOptions

DEFAULT_SEED = 1337  # a stage without a seed of its own and options without one: the seed of every command


# The loss or gradient norm became NaN/inf; the update was not applied and the last checkpoint is kept.
FinetuneDiverged = Diverged


@dataclass(frozen=True)
class FinetuneResult:
    run_dir: Path
    step: int
    records: list[dict[str, Any]]  # every metrics.jsonl record of the run, oldest first
    last_eval: dict[str, float]


class Stage:
    """One fine-tuning stage. Subclasses set the attributes and implement ``train_step`` and ``evaluate``."""

    name: str = "stage"
    policy: GPTModel  # the GPT that is trained and saved as the model of every step-N/ checkpoint
    heads: nn.ModuleDict  # further trainable modules (reward head, value head), saved in the training state
    tokenizer: Tokenizer | None
    steps_per_epoch: int = 1
    postfix_keys: tuple[str, ...] = ("loss",)  # the metrics shown on the progress bar
    lora_base: str | None = None  # with LoRA (``adapt``): the base's folder or hub name, which each adapter names

    def train_step(self, step: int, optimizer: torch.optim.Optimizer, grad_clip: float) -> dict[str, float]:
        """One optimizer step (or several, for PPO) at 0-based ``step``; returns the metrics to log."""
        raise NotImplementedError

    def evaluate(self) -> dict[str, float]:
        """Held-out metrics (no gradients)."""
        return {}

    def state_dict(self) -> dict[str, Any]:
        """Extra state to resume exactly (tensors and plain values only)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass

    def plot(self, records: list[dict[str, Any]], run_dir: Path) -> None:
        """Draw the run's curves into ``run_dir`` (called after each evaluation)."""

    def export(self, run_dir: Path) -> None:
        """Write the finished model into ``run_dir`` (default: the policy via ``export_model_files``; with LoRA its
        adapter, in PEFT's format, naming the base)."""
        from ..training.checkpointing import export_model_files

        if is_adapted(self.policy):
            from ..interop.peft import save_adapter

            save_adapter(self.policy, run_dir, base=self.lora_base)
            return
        export_model_files(self.policy, self.tokenizer, run_dir)


def is_adapted(model: nn.Module) -> bool:
    """Whether ``model`` trains LoRA adapters (``adapt``) rather than its own weights."""
    return getattr(model, "lora_config", None) is not None


@contextlib.contextmanager
def reference_model(reference: GPTModel | None, policy: GPTModel) -> Iterator[GPTModel]:
    """The frozen reference DPO and PPO compare the policy with: ``reference`` itself, or with ``None`` (a LoRA
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


def adapt(stage_model: GPTModel, lora: Any, options: FinetuneOptions) -> GPTModel:
    """``stage_model`` with LoRA adapters (``lora``: a ``LoRAConfig``, or None for full fine-tuning, which returns
    the model as it is); the adapters' A matrices are drawn from the run's seed."""
    if lora is None:
        return stage_model
    from ..lora import apply_lora

    return apply_lora(stage_model, lora, seed=options.seed if options.seed is not None else DEFAULT_SEED)


def _trainable(stage: Stage) -> nn.ModuleDict:
    return nn.ModuleDict({"policy": stage.policy, "heads": stage.heads})


def _restore(stage: Stage, optimizer: torch.optim.Optimizer, directory: Path) -> int:
    state = load_training_state(directory)
    if state.get("stage") != stage.name:
        raise ValueError(f"{directory} is a checkpoint of the {state.get('stage')!r} stage, not {stage.name!r}")
    if is_adapted(stage.policy):
        _restore_adapter(stage, directory)
    else:
        saved = load_model(directory, device=next(stage.policy.parameters()).device)
        if saved.config != stage.policy.config:
            raise ValueError(f"{directory}: the checkpoint's model config differs from the starting model's")
        stage.policy.load_state_dict(saved.state_dict())
    stage.heads.load_state_dict(state["heads"])
    optimizer.load_state_dict(state["optimizer"])
    stage.load_state_dict(state["stage_state"])
    restore_rng_state(state["rng"])
    return int(state["step"])


def _restore_adapter(stage: Stage, directory: Path) -> None:
    """A LoRA run's ``step-N/`` holds the adapter only: the base is the one the run starts from again."""
    from ..interop.peft import read_adapter
    from ..lora import load_lora_state_dict

    adapter = read_adapter(directory)
    if adapter.model_config is not None and adapter.model_config != stage.policy.config:
        raise ValueError(f"{directory}: the adapter was trained on a base of another config than the starting model")
    if adapter.config != stage.policy.lora_config:
        raise ValueError(f"{directory}: the run trained LoRA {adapter.config.to_dict()}, but the options give "
                         f"{stage.policy.lora_config.to_dict()}: resume with the run's --lora-* flags")
    load_lora_state_dict(stage.policy, adapter.state, source=str(directory))


def _checkpoint(stage: Stage, optimizer: torch.optim.Optimizer, options: FinetuneOptions, run_dir: Path,
                step: int) -> None:
    state = {"stage": stage.name, "step": step, "optimizer": optimizer.state_dict(), "rng": capture_rng_state(),
             "heads": stage.heads.state_dict(), "stage_state": stage.state_dict(),
             "options": {k: v for k, v in asdict(options).items() if isinstance(v, (int, float, str))}}
    write_model = None
    if is_adapted(stage.policy):  # only what trains: the adapter (and the heads, in the state), not the base
        from ..interop.peft import write_adapter_files

        def write_model(folder: Path) -> None:
            write_adapter_files(stage.policy, folder, base=stage.lora_base)
    save_checkpoint(run_dir, step, stage.policy, stage.tokenizer, state, write_model)
    prune_checkpoints(run_dir, options.keep_last)


def _seed(stage: Stage, options: FinetuneOptions) -> int:
    for value in (options.seed, getattr(stage, "seed", None)):
        if value is not None:
            return value
    return DEFAULT_SEED


def check_stage_agrees(stage: Stage, options: FinetuneOptions) -> None:
    """``ValueError`` when the options give a batch size, validation share or seed other than the one the stage
    was built with (the stage splits and batches its data with its own: the options' would be silently ignored)."""
    for name, wanted in options.stage_settings().items():
        mine = getattr(stage, name, None)
        if mine is not None and mine != wanted:
            raise ValueError(f"the {stage.name} stage was built with {name}={mine!r} but the options say "
                             f"{name}={wanted!r}: give the stage's value, or leave it unset in the options")


def run_stage(stage: Stage, options: FinetuneOptions) -> FinetuneResult:
    """Train ``stage`` as ``options`` say, writing checkpoints and ``metrics.jsonl`` into ``options.out_dir``;
    the finished model is exported into that folder (``Stage.export``) and summarized in ``summary.json``."""
    options.check()
    check_stage_agrees(stage, options)
    run_dir = Path(options.out_dir)
    remove_partial_checkpoints(run_dir)
    max_steps = options.max_steps or options.epochs * stage.steps_per_epoch
    end = max_steps if options.stop_after is None else min(max_steps, options.stop_after)
    schedule = Schedule(options.lr, options.min_lr, options.warmup_steps, max_steps)
    device = next(stage.policy.parameters()).device
    check_memory(stage.policy.config, 0, device, what=f"{stage.name} fine-tuning")
    modules = _trainable(stage)
    optimizer = build_optimizer(modules, lr=options.lr, weight_decay=options.weight_decay)

    resume_from = resolve_resume(options.resume, run_dir)
    step = 0
    if resume_from is not None:
        step = _restore(stage, optimizer, resume_from)
        tqdm.write(f"resumed {stage.name} from {resume_from} at step {step}", file=sys.stderr)
    else:
        refuse_fresh_start(run_dir)
    refuse_finished(step, max_steps)
    if resume_from is None:
        torch.manual_seed(_seed(stage, options))  # dropout masks of a fresh run; a resume restored the saved RNG states
    log = MetricsLog(run_dir / "metrics.jsonl", step if resume_from is not None else None)
    checkpoint_every = options.checkpoint_every or options.eval_every
    last_eval: dict[str, float] = {}
    bar = tqdm(total=max_steps, initial=step, desc=stage.name, disable=not options.progress, dynamic_ncols=True)
    stage.policy.train()
    stage.heads.train()
    stop = StopRequests().start()  # Ctrl-C / SIGTERM: finish the step, checkpoint, raise Interrupted
    last_plot = time.perf_counter()
    try:
        while step < end:
            lr = schedule.apply(optimizer, step)
            t0 = time.perf_counter()
            try:
                with autocast(device, options.dtype):
                    metrics = stage.train_step(step, optimizer, options.grad_clip)
            except Diverged as err:
                raise err.kept(last_good_checkpoint(run_dir)) from None
            step += 1
            record: dict[str, Any] = {"step": step, "lr": lr, **metrics, "step_seconds": time.perf_counter() - t0}
            bar.update(1)
            bar.set_postfix({k: f"{v:.3f}" for k, v in metrics.items() if k in stage.postfix_keys},
                            refresh=False)
            evaluated = step % options.eval_every == 0 or step == end
            if evaluated:
                with autocast(device, options.dtype):
                    last_eval = stage.evaluate()
                stage.policy.train()
                stage.heads.train()
                record.update(last_eval)
            log.append(record)
            # The plot as the pretraining loop draws it: at most once per PLOT_INTERVAL_SECONDS, and at the end.
            if step == end or (evaluated and time.perf_counter() - last_plot >= PLOT_INTERVAL_SECONDS):
                stage.plot(log.records, run_dir)
                last_plot = time.perf_counter()
            saved = step % checkpoint_every == 0 or step == end
            if saved:
                _checkpoint(stage, optimizer, options, run_dir, step)
            if stop.signum is not None and step < end:
                if not saved:
                    _checkpoint(stage, optimizer, options, run_dir, step)
                raise Interrupted(stop.signum, step, max_steps, run_dir / f"step-{step}")
    finally:
        stop.close()
        bar.close()
    if step == max_steps:
        stage.export(run_dir)
        summary = {"stage": stage.name, "step": step, **last_eval}
        atomic_write_text(run_dir / "summary.json", json.dumps(summary, indent=2) + "\n")
    return FinetuneResult(run_dir, step, list(log.records), last_eval)


class SupervisedStage(Stage):
    """A stage trained on a fixed list of examples: subclasses implement ``loss(items) -> (loss, metrics)``.

    The examples are split once (seeded) into train and val; step s trains on ``batch_for_step(s)``. Evaluation
    averages the metrics over all val items and over as many train items (the first ones), reported as
    ``val_<name>`` / ``train_<name>`` (so ``train_loss`` / ``val_loss`` for the loss).
    """

    def __init__(self, items: Sequence[Any], *, batch_size: int, val_fraction: float, seed: int) -> None:
        train_idx, val_idx = split_indices(len(items), val_fraction, seed)
        self.train_items = [items[i] for i in train_idx]
        self.val_items = [items[i] for i in val_idx]
        self.batch_size, self.val_fraction, self.seed = batch_size, val_fraction, seed
        self.steps_per_epoch = batches_per_epoch(len(self.train_items), batch_size)

    def loss(self, items: Sequence[Any]) -> tuple[torch.Tensor, dict[str, float]]:
        raise NotImplementedError

    def train_step(self, step: int, optimizer: torch.optim.Optimizer, grad_clip: float) -> dict[str, float]:
        chosen = batch_for_step(len(self.train_items), self.batch_size, step, self.seed)
        loss, metrics = self.loss([self.train_items[i] for i in chosen])
        loss.backward()
        metrics["grad_norm"] = optimizer_step(optimizer, float(loss.detach()), grad_clip, step)
        return metrics

    @torch.no_grad()
    def _average(self, items: Sequence[Any]) -> dict[str, float]:
        totals: dict[str, float] = {}
        for start in range(0, len(items), self.batch_size):
            part = items[start : start + self.batch_size]
            _, metrics = self.loss(part)
            for name, value in metrics.items():
                totals[name] = totals.get(name, 0.0) + value * len(part)
        return {name: value / len(items) for name, value in totals.items()}

    def evaluate(self) -> dict[str, float]:
        self.policy.eval()
        self.heads.eval()
        result = {}
        splits = {"train": self.train_items[: max(len(self.val_items), self.batch_size)], "val": self.val_items}
        for split, items in splits.items():
            if items:
                result.update({f"{split}_{k}": v for k, v in self._average(items).items()})
        return result

    def plot(self, records: list[dict[str, Any]], run_dir: Path) -> None:
        plot_losses(records, run_dir / "loss.png")


def load_start_model(source: str | Path, device: str | torch.device | None = None,
                     tokenizer_dir: str | Path | None = None) -> tuple[GPTModel, Tokenizer]:
    """The model a stage starts from (a tinygpt checkpoint, a Hugging Face GPT-2 folder or a hub name) and its
    tokenizer (``tokenizer_dir``, else the model's own), which fine-tuning cannot do without. ``device`` None:
    cuda when available."""
    from ..interop.pretrained import load_pretrained

    model, tokenizer = load_pretrained(source, device=resolve_device(device), tokenizer_dir=tokenizer_dir)
    if tokenizer is None:
        raise ValueError(f"{source} has no tokenizer saved beside it; fine-tuning needs the model's tokenizer: "
                         f"pass --tokenizer-dir DIR")
    return model, tokenizer
