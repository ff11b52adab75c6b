"""The one training loop: ``run_stage(stage, options)`` for pretraining, SFT, the reward model, PPO and DPO alike.

A stage (``training.stage``) says how it makes its batches, its loss and its metrics; this loop owns the rest:
distributed setup, seeding, the optimizer and its warmup + cosine schedule, gradient accumulation and clipping,
evaluation and samples, ``metrics.jsonl`` / ``loss.png`` / TensorBoard, checkpoints, the stop on a signal, and resume.

One resume path: ``--resume`` names a checkpoint (``checkpointing.resolve_resume``; after a torchrun restart,
``--max-restarts``, no ``--resume`` means ``auto``: the newest complete one); its training state is read and
checked (``checkpointing.load_training_state``: the stage's name, the step); the stage sets up and builds its model;
the checkpoint's weights are loaded into it (``checkpointing.load_weights``: its config and tokenizer must match);
then the optimizer state, the stage's own state, the RNG states and the step. Everything that decides the numbers is
in each checkpoint, so on CPU with the same thread count N steps straight and N/2 + resume + N/2 are bit-identical.
"""

from __future__ import annotations

import json
import random
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from ..config import DEFAULT_SEED  # noqa: F401  (also imported from here)
from ..devices import autocast
from ..fileio import RUN, atomic_write_text, check_save_target
from ..lora import is_adapted
from ..model import GPTModel
from . import distributed as dist_utils
from .checkpointing import (capture_rng_state, last_good_checkpoint, load_training_state, load_weights,
                            prune_checkpoints, refuse_finished, refuse_fresh_start, refuse_other_global_batch,
                            remove_partial_checkpoints, resolve_resume, restore_rng_state, save_checkpoint)
from .lifecycle import Diverged, Interrupted, StopRequests
from .memory import checkpoint_blocks
from .metrics import PLOT_INTERVAL_SECONDS, MetricsLog
from .optim import Schedule, build_for, optimizer_step
from .options import LoopOptions, parse_duration
from .stage import Stage



@dataclass(frozen=True)
class TrainingResult:
    """What a run of any stage returns. ``records``: its ``metrics.jsonl`` records (rank 0; [] elsewhere)."""

    run_dir: Path
    step: int
    records: list[dict[str, Any]]
    last_eval: dict[str, float]
    best_step: int | None
    best_val_loss: float | None
    samples: list[str]
    summary: dict[str, Any]  # what summary.json holds (written when the run reached max_steps)
    model: GPTModel  # the stage's policy, trained (unwrapped; under FSDP2 its parameters are still sharded)

    @property
    def train_loss(self) -> float | None:
        return self.last_eval.get("train_loss")

    @property
    def val_loss(self) -> float | None:
        return self.last_eval.get("val_loss")

    @property
    def unigram_entropy(self) -> float | None:
        return self.summary.get("unigram_entropy")

    @property
    def tokens_per_second(self) -> float | None:
        return self.summary.get("tokens_per_second")


def seed_everything(seed: int) -> None:
    """torch (CPU and CUDA), numpy and Python's ``random`` from one seed."""
    torch.manual_seed(seed)
    np.random.seed(seed % 2**32)
    random.seed(seed)


def run_seed(stage: Stage, options: LoopOptions) -> int:
    """The options' seed, else the stage's own (a stage built with one), else ``DEFAULT_SEED``."""
    for value in (options.seed, getattr(stage, "seed", None)):
        if value is not None:
            return value
    return DEFAULT_SEED


def run_stage(stage: Stage, options: LoopOptions) -> TrainingResult:
    """Train (or resume) ``stage`` as ``options`` say, writing ``step-N/`` checkpoints, ``metrics.jsonl`` and the
    plot into ``options.out_dir``; at ``max_steps`` (or the end of ``time_budget``) the finished model is exported
    there and summarised in
    ``summary.json``. Under torchrun a data-parallel stage runs on every rank (only rank 0 writes files)."""
    options.check()
    if options.tensorboard:
        from .tensorboard import require_tensorboard

        require_tensorboard()  # before any work: a missing extra is one line, not a traceback at the first step
    ctx = dist_utils.init_distributed(options.device)
    try:
        return _Loop(stage, options, ctx).run()
    finally:
        dist_utils.close_distributed(ctx)


class _Loop:
    """One invocation of ``run_stage``: the state its steps share."""

    def __init__(self, stage: Stage, options: LoopOptions, ctx: dist_utils.DistContext) -> None:
        self.stage, self.o, self.ctx = stage, options, ctx
        self.run_dir = Path(options.out_dir)
        self.main = ctx.is_main
        self.step = 0
        self.best_step: int | None = None
        self.best_val: float | None = None

    def log(self, message: str) -> None:
        if self.main:
            tqdm.write(message, file=sys.stderr)

    # ------------------------------------------------------------------------------------------ start / resume
    def start(self) -> None:
        """Everything before the first step, every check included; a resume restores the exact state."""
        o, stage, ctx = self.o, self.stage, self.ctx
        if ctx.world_size > 1 and not stage.data_parallel:
            raise ValueError(f"the {stage.name} stage runs in one process: launch it without torchrun")
        if self.main:  # before any work: the run folder is writable, has room, and is not something else's folder
            check_save_target(self.run_dir, RUN, overwrite=o.force, inputs=stage.inputs)
            remove_partial_checkpoints(self.run_dir)
        resume = o.resume
        if resume is None and dist_utils.restart_count() > 0:
            resume = "auto"  # torchrun restarted the workers (--max-restarts): go on from the newest checkpoint
        resume_from = resolve_resume(resume, self.run_dir)
        state = None if resume_from is None else load_training_state(resume_from, stage.name)
        if state is not None:
            refuse_other_global_batch(state, getattr(o, "batch_size", None), ctx.world_size)
        dist_utils.check_same_on_every_rank(-1 if state is None else int(state["step"]), ctx, lambda seen: (
            f"the ranks resume from different steps ({seen}; -1 = a fresh start): every node must see the same "
            f"run folder (--out on a shared file system) or the same --resume checkpoint"))
        if state is None:
            refuse_fresh_start(self.run_dir)
        stage.setup(o, ctx, resume_from)
        seed_everything(run_seed(stage, o))  # every rank the same: identical init and identical data streams
        stage.build(ctx)
        if o.optimizer == "muon" and is_adapted(stage.policy):
            raise ValueError("--optimizer muon trains full weights; a LoRA run trains adapters: use --optimizer adamw")
        if resume_from is not None:
            load_weights(stage, resume_from, state)
        # With a time budget the run ends when the budget is spent (its step count unknown until then); the
        # seconds spent so far are in every checkpoint, so a resume continues the budget and its schedule.
        self.budget = None if o.time_budget is None else parse_duration("time_budget", o.time_budget)
        self.spent = 0.0 if state is None else float(state.get("budget_spent", 0.0))
        if self.budget is not None:
            self.max_steps = None
            self.end = o.stop_after if o.stop_after is not None else sys.maxsize
        else:
            self.max_steps = o.max_steps if o.max_steps is not None else o.epochs * stage.steps_per_epoch
            self.end = self.max_steps if o.stop_after is None else min(self.max_steps, o.stop_after)
        self.schedule = Schedule(o.lr, o.min_lr, o.warmup_steps, self.max_steps)

        self.trainable = stage.trainable()
        self.trainable.train()
        self.release_blocks = checkpoint_blocks(stage.policy) if o.grad_checkpoint else None
        self.wrapped = dist_utils.wrap_model(self.trainable, ctx, fsdp=o.fsdp)
        stage.forward = torch.compile(self.wrapped) if o.compile else self.wrapped
        self.optimizer = build_for(self.wrapped, o)
        if state is not None:
            trained_with = state.get("options", {}).get("optimizer", "adamw")
            if trained_with != o.optimizer:
                raise ValueError(f"{resume_from} was trained with --optimizer {trained_with}: resume it with the same "
                                 f"optimizer (its state is that optimizer's), not {o.optimizer}")
            dist_utils.load_optimizer_state(self.wrapped, self.optimizer, state["optimizer"])
            stage.load_state_dict(state["stage_state"])
            restore_rng_state(state["rng"])
            self.step = int(state["step"])
            self.best_step, self.best_val = state.get("best_step"), state.get("best_val_loss")
            restarted = dist_utils.restart_count()
            self.log(f"resumed from {resume_from} at step {self.step}"
                     f"{f' (torchrun restart {restarted})' if restarted and o.resume is None else ''}")
        if self.budget is None:
            refuse_finished(self.step, self.max_steps)
        elif self.spent >= self.budget:
            raise ValueError(f"the checkpoint has spent its --time-budget {o.time_budget} already: give a larger one "
                             f"to train further")
        self.resumed = resume_from is not None

    # ------------------------------------------------------------------------------------------ one step
    def train_step(self) -> dict[str, float]:
        """One optimizer step: every update of the stage's ``batches``, each accumulated over its micro-batches,
        clipped, refused when not finite; returns lr, the mean loss over the updates (and the global batch), the
        mean gradient norm and the stage's metrics."""
        stage, device, dtype = self.stage, self.stage.device, self.o.dtype
        lr = self.schedule.apply(self.optimizer, self.step, self.spent / self.budget if self.budget else 0.0)
        with autocast(device, dtype):
            updates = stage.batches(self.step)
        loss_sum = norm_sum = 0.0
        extras: dict[str, float] = {}
        for update in updates:
            total = torch.zeros((), device=device)
            micro_extras: dict[str, float] = {}
            for micro, batch in enumerate(update):
                dist_utils.set_gradient_sync(self.wrapped, micro == len(update) - 1)
                with autocast(device, dtype):
                    loss, metrics = stage.loss(batch)
                (loss / len(update)).backward()
                total += loss.detach()
                for name, value in metrics.items():
                    micro_extras[name] = micro_extras.get(name, 0.0) + value
            mean_loss = float(dist_utils.all_reduce_mean(total / len(update), self.ctx))
            try:
                norm = optimizer_step(self.optimizer, mean_loss, self.o.grad_clip, self.step)
            except Diverged as err:
                raise err.kept(last_good_checkpoint(self.run_dir)) from None
            loss_sum += mean_loss
            norm_sum += norm
            for name, value in micro_extras.items():
                extras[name] = extras.get(name, 0.0) + value / len(update)
        self.step += 1
        n = len(updates)
        return {"lr": lr, "loss": loss_sum / n, "grad_norm": norm_sum / n,
                **{name: value / n for name, value in extras.items()}, **stage.step_metrics()}

    def evaluate(self) -> dict[str, float]:
        self.wrapped.eval()
        try:
            with autocast(self.stage.device, self.o.dtype):
                return self.stage.evaluate()
        finally:
            self.wrapped.train()

    def sample(self) -> str | None:
        with autocast(self.stage.device, self.o.dtype):
            return self.stage.sample()

    # ------------------------------------------------------------------------------------------ checkpoints
    def checkpoint(self) -> None:
        """Every rank gathers the full state (a collective under FSDP); rank 0 writes it."""
        model_state, optim_state = dist_utils.full_state(self.wrapped, self.optimizer)
        if self.main:
            state = {
                "stage": self.stage.name,
                "step": self.step,
                "world_size": self.ctx.world_size,  # a resume under another one is refused unless the global
                # batch is the same (checkpointing.refuse_other_global_batch)
                "optimizer": optim_state,
                "rng": capture_rng_state(),
                "best_step": self.best_step,
                "best_val_loss": self.best_val,
                "budget_spent": self.spent,
                "heads": self.stage.heads.state_dict(),
                "stage_state": self.stage.state_dict(),
                "options": {k: v for k, v in asdict(self.o).items() if isinstance(v, (int, float, str, bool))},
            }
            plain = self._plain_policy(model_state)
            save_checkpoint(self.run_dir, self.step, plain, self.stage.tokenizer, state)
            self.last_saved = plain
            prune_checkpoints(self.run_dir, self.o.keep_last, {self.best_step} if self.best_step else set())
        dist_utils.barrier(self.ctx)

    def _plain_policy(self, model_state: dict[str, torch.Tensor]) -> GPTModel:
        """The policy as ``save_model`` needs it: itself in one process; under DDP/FSDP a CPU GPTModel holding the
        unsharded weights ``full_state`` gathered."""
        policy = self.stage.policy
        if not self.ctx.distributed and not self.o.fsdp:
            return policy
        prefix = "" if self.trainable is policy else "policy."
        with torch.device("meta"):
            plain = GPTModel(policy.config)
        plain.load_state_dict({k[len(prefix):]: v for k, v in model_state.items() if k.startswith(prefix)},
                              strict=True, assign=True)
        if policy.config.tie_weights:
            plain.out_head.weight = plain.tok_emb.weight
        return plain

    def budget_spent(self) -> bool:
        """Whether the run has a time budget and has spent it."""
        return self.budget is not None and self.spent >= self.budget

    # ------------------------------------------------------------------------------------------ the loop
    def run(self) -> TrainingResult:
        try:
            self.start()
            return self._loop()
        finally:
            if getattr(self, "release_blocks", None) is not None:
                self.release_blocks()

    def _loop(self) -> TrainingResult:
        o, stage, ctx = self.o, self.stage, self.ctx
        checkpoint_every = o.checkpoint_every or o.eval_every
        log = MetricsLog(self.run_dir / "metrics.jsonl", self.step if self.resumed else None) if self.main else None
        board = None
        if o.tensorboard and self.main:
            from .tensorboard import TensorBoardLog

            board = TensorBoardLog(self.run_dir / "tensorboard", self.step if self.resumed else None)
        # total None with a time budget: a step counter without an end
        bar = tqdm(total=self.max_steps, initial=self.step, desc=stage.name, disable=not (self.main and o.progress),
                   dynamic_ncols=True)
        last_eval: dict[str, float] = {}
        samples: list[str] = []
        rate_window: list[tuple[float, int]] = []
        tokens_per_second = None
        t_last = last_plot = time.perf_counter()
        cpu_last = time.process_time()
        stop = StopRequests().start()  # Ctrl-C / SIGTERM: finish the step, checkpoint, raise Interrupted
        try:
            while self.step < self.end and not self.budget_spent():
                metrics = self.train_step()
                now, cpu_now = time.perf_counter(), time.process_time()
                dt, t_last = now - t_last, now
                self.spent += cpu_now - cpu_last if o.budget_clock == "cpu" else dt
                record: dict[str, Any] = {"step": self.step, **metrics, "step_seconds": dt}
                if self.budget is not None:
                    record["budget_seconds"] = self.spent
                if stage.tokens_per_step:
                    rate_window = (rate_window + [(dt, stage.tokens_per_step)])[-20:]
                    tokens_per_second = sum(n for _, n in rate_window) / max(1e-9, sum(t for t, _ in rate_window))
                    record["tokens_per_second"] = tokens_per_second
                    if stage.flops_per_token:
                        record["tflops"] = tokens_per_second * stage.flops_per_token / 1e12
                        if stage.peak_flops is not None:
                            record["mfu"] = tokens_per_second * stage.flops_per_token / stage.peak_flops
                bar.update(1)
                bar.set_postfix({k: f"{record[k]:.4g}" for k in stage.postfix_keys if k in record}, refresh=False)
                is_last = self.step == self.end or self.budget_spent()
                evaluated = self.step % o.eval_every == 0 or is_last
                if evaluated:
                    last_eval = self.evaluate()
                    record.update(last_eval)
                    if "val_loss" in last_eval and (self.best_val is None or last_eval["val_loss"] < self.best_val):
                        self.best_step, self.best_val = self.step, last_eval["val_loss"]
                    text = self.sample()
                    if text is not None:
                        samples.append(text)
                    message = stage.report(record, text)
                    if message:
                        self.log(message)
                if log is not None:
                    log.append(record)
                    if board is not None:
                        board.append(record)
                    # The plot: at an evaluation at most once per PLOT_INTERVAL_SECONDS, and always at the end.
                    if is_last or (evaluated and time.perf_counter() - last_plot >= PLOT_INTERVAL_SECONDS):
                        stage.plot(log.records, self.run_dir)
                        last_plot = time.perf_counter()
                saved = self.step % checkpoint_every == 0 or is_last
                if saved:
                    self.checkpoint()
                if not is_last and dist_utils.any_rank(stop.signum is not None, ctx):
                    if not saved:
                        self.checkpoint()
                    raise Interrupted(stop.signum, self.step, self.max_steps, self.run_dir / f"step-{self.step}")
                t_last, cpu_last = time.perf_counter(), time.process_time()  # eval and checkpoints stay out of
                # tokens/s and of the time budget
        finally:
            stop.close()
            bar.close()
            if board is not None:
                board.close()

        summary = {"stage": stage.name, "step": self.step, **last_eval, "best_step": self.best_step,
                   "best_val_loss": self.best_val,
                   "best_checkpoint": f"step-{self.best_step}" if self.best_step else None,
                   "tokens_per_second": tokens_per_second, **stage.summary()}
        if self.budget is not None:
            summary.update(time_budget_seconds=self.budget, budget_seconds_spent=self.spent, budget_clock=o.budget_clock)
        if (self.step == self.max_steps or self.budget_spent()) and self.main:
            # The finished model also goes into RUN_DIR itself, so `load_model(RUN_DIR)` and
            # `tinygpt generate --model RUN_DIR` read it; summary.json names the best checkpoint.
            stage.export(self.last_saved, self.run_dir)
            atomic_write_text(self.run_dir / "summary.json", json.dumps(summary, indent=2) + "\n")
        dist_utils.barrier(ctx)
        return TrainingResult(self.run_dir, self.step, list(log.records) if log is not None else [], last_eval,
                              self.best_step, self.best_val, samples, summary, stage.policy)
