"""The training loop: ``train(TrainingOptions(...))`` -- data, model, AdamW, schedule, eval, checkpoints, resume.

One optimizer step = ``grad_accum`` micro-batches of ``batch_size`` windows per rank; the global batch is
``batch_size * grad_accum * world_size`` windows of ``context_length`` tokens. Everything that decides the numbers
(weights, AdamW moments, RNG states, the sampler position) is in each checkpoint, so a resumed run continues the
exact computation: on CPU with the same thread count, N steps straight and N/2 + resume + N/2 are bit-identical.
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

from ..checkpoint import load_config, load_model
from ..config import GPTConfig, get_config
from ..devices import autocast
from ..fileio import RUN, atomic_write_text, check_save_target
from ..generation import generate
from ..model import GPTModel
from ..tokenizer import Tokenizer, load_tokenizer
from . import distributed as dist_utils
from .batches import WindowSampler
from .checkpointing import (capture_rng_state, export_model_files, load_training_state,
                            prune_checkpoints, remove_partial_checkpoints, resolve_resume, restore_rng_state,
                            save_checkpoint)
from .data import PreparedCorpus, prepare_or_reuse
from .metrics import PLOT_INTERVAL_SECONDS, MetricsLog, flops_per_token, peak_flops, plot_losses, unigram_entropy
from .limits import check_memory, check_windows
from .lifecycle import (Diverged, Interrupted, StopRequests, last_good_checkpoint, refuse_finished,
                        refuse_fresh_start)
from .optim import Schedule, build_optimizer, optimizer_step
from .options import DEFAULT_MODEL, TrainingOptions

# The loss or the gradient norm became NaN/inf; the run stopped and the last good checkpoint is kept.
TrainingDiverged = Diverged


@dataclass(frozen=True)
class TrainingResult:
    run_dir: Path
    step: int
    train_loss: float | None
    val_loss: float | None
    best_step: int | None
    best_val_loss: float | None
    unigram_entropy: float
    tokens_per_second: float | None
    samples: list[str]
    model: GPTModel  # this rank's trained model (unwrapped; under FSDP2 its parameters are still sharded)


def resolve_config(spec: str | GPTConfig | None, tokenizer_vocab: int,
                   overrides: dict[str, int | None] | None = None) -> GPTConfig:
    """None -> ``DEFAULT_MODEL`` with the tokenizer's vocabulary; a preset name; a ``.json`` file (without a
    ``vocab_size`` key: the tokenizer's, as for the default); a GPTConfig. ``overrides`` (None values skipped)
    replace fields of the result. A vocabulary larger than the model's ``vocab_size`` is a ``ValueError``."""
    if spec is None:
        config = GPTConfig(vocab_size=tokenizer_vocab, **DEFAULT_MODEL)
    elif isinstance(spec, GPTConfig):
        config = spec
    elif str(spec).endswith(".json"):
        config = GPTConfig.from_file(spec)
        try:
            keys = json.loads(Path(spec).read_text(encoding="utf-8"))
        except (OSError, ValueError):  # from_file has read and parsed it just now
            keys = {}
        if isinstance(keys, dict) and "vocab_size" not in keys:
            config = config.replace(vocab_size=tokenizer_vocab)
    else:
        config = get_config(str(spec))
    given = {k: v for k, v in (overrides or {}).items() if v is not None}
    if given:
        config = config.replace(**given)
    if tokenizer_vocab > config.vocab_size:
        raise ValueError(
            f"the tokenizer has {tokenizer_vocab} tokens but the model's vocab_size is {config.vocab_size}: "
            f"choose a config with vocab_size >= {tokenizer_vocab} (or a smaller tokenizer)"
        )
    return config


def _tokenizer_fingerprint(tokenizer: Tokenizer) -> list[str]:
    return [tokenizer.kind, str(tokenizer.vocab_size), *(tokenizer.decode([i]) for i in range(tokenizer.vocab_size))]


def _seed_everything(seed: int) -> None:
    torch.manual_seed(seed)
    np.random.seed(seed % 2**32)
    random.seed(seed)


class _Run:
    """One invocation of ``train``: the state shared by its steps (kept out of ``train`` to keep that readable)."""

    def __init__(self, options: TrainingOptions) -> None:
        options.check()
        self.o = options
        self.ctx = dist_utils.init_distributed(options.device)
        self.run_dir = Path(options.out_dir)
        self.main = self.ctx.is_main
        if self.main:  # before any work: the run folder is writable, has room, and is not something else's folder
            check_save_target(self.run_dir, RUN, overwrite=options.force,
                              inputs=[*(options.data or []), *filter(None, [options.prepared])])
        self.overrides = {k: getattr(options, k) for k in ("n_layers", "n_heads", "emb_dim", "context_length")}
        self.schedule = Schedule(options.lr, options.min_lr, options.warmup_steps, options.max_steps)

    def log(self, message: str) -> None:
        if self.main:
            tqdm.write(message, file=sys.stderr)

    # ------------------------------------------------------------------------------------------ setup
    def open_data(self) -> None:
        o = self.o
        if o.prepared is not None:
            self.corpus = PreparedCorpus.open(o.prepared)
        else:
            if o.data is None:
                from ..corpus import embedded_corpus_files

                paths = [str(p) for p in embedded_corpus_files()]
                self.log(f"no --data: training on the embedded corpus ({len(paths)} standard-library .py files)")
            else:
                paths = list(o.data)
            target = self.run_dir / "data"
            if self.main:
                prepare_or_reuse(paths, o.tokenizer, target, val_fraction=o.val_fraction, progress=o.progress)
            dist_utils.barrier(self.ctx)
            self.corpus = PreparedCorpus.open(target)
        self.tokenizer = self.corpus.load_tokenizer()

    def build(self) -> None:
        """Model, optimizer and samplers, fresh or from the resume checkpoint; every check before any step."""
        o, ctx = self.o, self.ctx
        if self.main:
            remove_partial_checkpoints(self.run_dir)
        self.resume_from = resolve_resume(o.resume, self.run_dir)
        state: dict[str, Any] | None = None
        if self.resume_from is not None:
            state = load_training_state(self.resume_from)
            config = load_config(self.resume_from)
            if o.config is not None or any(v is not None for v in self.overrides.values()):
                wanted = resolve_config(o.config or config, self.tokenizer.vocab_size, self.overrides)
                if wanted != config:
                    diff = {k: (v, getattr(config, k)) for k, v in wanted.to_dict().items()
                            if getattr(config, k) != v}
                    raise ValueError(f"--config does not match the checkpoint {self.resume_from}: "
                                     + ", ".join(f"{k}={a!r} vs checkpoint {b!r}" for k, (a, b) in diff.items()))
            ckpt_tok = load_tokenizer(self.resume_from)
            if _tokenizer_fingerprint(ckpt_tok) != _tokenizer_fingerprint(self.tokenizer):
                raise ValueError(f"the checkpoint {self.resume_from} was trained with a different tokenizer "
                                 f"({ckpt_tok!r}) than this data's ({self.tokenizer!r})")
        else:
            refuse_fresh_start(self.run_dir)
            config = resolve_config(o.config, self.tokenizer.vocab_size, self.overrides)
        if self.tokenizer.vocab_size > config.vocab_size:
            raise ValueError(f"the tokenizer has {self.tokenizer.vocab_size} tokens but the checkpoint's "
                             f"vocab_size is {config.vocab_size}")
        window = config.context_length + 1
        for split, tokens in (("train", self.corpus.train), ("val", self.corpus.val)):
            if len(tokens) < window:
                raise ValueError(
                    f"the {split} split has {len(tokens)} tokens, fewer than one window of context_length + 1 = "
                    f"{window}: use more text or a config with a smaller context_length"
                )
        check_windows(o.batch_size, ctx.world_size, len(self.corpus.train), config.context_length)
        check_memory(config, o.batch_size, ctx.device, shards=ctx.world_size if o.fsdp else 1)
        self.config = config

        _seed_everything(o.seed)  # every rank the same: identical init and identical data streams
        if state is None:
            with torch.device(ctx.device):
                self.model = GPTModel(config)
        else:
            self.model = load_model(self.resume_from, device=ctx.device)
        self.model.train()
        self.wrapped = dist_utils.wrap_model(self.model, ctx, fsdp=o.fsdp)
        self.forward = torch.compile(self.wrapped) if o.compile else self.wrapped
        self.optimizer = build_optimizer(self.wrapped, lr=o.lr, weight_decay=o.weight_decay,
                                         betas=(o.beta1, o.beta2))
        self.sampler = WindowSampler(self.corpus.train, config.context_length, o.seed)
        self.step = 0
        self.best_step: int | None = None
        self.best_val: float | None = None
        if state is not None:
            dist_utils.load_optimizer_state(self.wrapped, self.optimizer, state["optimizer"])
            self.sampler.load_state_dict(state["sampler"])
            restore_rng_state(state["rng"])
            self.step = int(state["step"])
            self.best_step, self.best_val = state.get("best_step"), state.get("best_val_loss")
            self.log(f"resumed from {self.resume_from} at step {self.step}")
        refuse_finished(self.step, o.max_steps)

    # ------------------------------------------------------------------------------------------ steps
    def batch(self, sampler: WindowSampler) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's rows of the next global micro-batch, on the device: 2 x int64 [batch_size, C]."""
        b, rank, world = self.o.batch_size, self.ctx.rank, self.ctx.world_size
        x, y = sampler.sample(b * world, rows=slice(rank * b, (rank + 1) * b))
        return x.to(self.ctx.device, non_blocking=True), y.to(self.ctx.device, non_blocking=True)

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        # The model's own loss: cross-entropy fused with the head, no [B, C, V] logits (``tinygpt.fast.head_loss``).
        with autocast(self.ctx.device, self.o.dtype):
            return self.forward(x, targets=y)

    def train_step(self) -> tuple[float, float, float]:
        """One optimizer step; returns (mean loss over the global batch, gradient norm, lr)."""
        o = self.o
        lr = self.schedule.apply(self.optimizer, self.step)
        total = torch.zeros((), device=self.ctx.device)
        for micro in range(o.grad_accum):
            x, y = self.batch(self.sampler)
            dist_utils.set_gradient_sync(self.wrapped, micro == o.grad_accum - 1)
            loss = self.loss(x, y)
            (loss / o.grad_accum).backward()
            total += loss.detach()
        mean_loss = float(dist_utils.all_reduce_mean(total / o.grad_accum, self.ctx))
        try:
            norm = optimizer_step(self.optimizer, mean_loss, o.grad_clip, self.step)
        except Diverged as err:
            raise err.kept(last_good_checkpoint(self.run_dir)) from None
        self.step += 1
        return mean_loss, norm, lr

    def evaluate(self) -> dict[str, float]:
        """Mean loss over ``eval_iters`` global batches of each split; the same windows at every eval (a fixed
        seed, its own generator: the training streams are not touched). Under ``torch.inference_mode`` (no view or
        version-counter bookkeeping, lighter than ``no_grad``), except with FSDP: the parameters it unshards here
        must stay ordinary tensors for the next training step."""
        self.wrapped.eval()
        result = {}
        with torch.no_grad() if self.o.fsdp else torch.inference_mode():
            for split, tokens in (("train", self.corpus.train), ("val", self.corpus.val)):
                sampler = WindowSampler(tokens, self.config.context_length, self.o.seed + 1)
                total = torch.zeros((), device=self.ctx.device)
                for _ in range(self.o.eval_iters):
                    total += self.loss(*self.batch(sampler))
                result[f"{split}_loss"] = float(dist_utils.all_reduce_mean(total / self.o.eval_iters, self.ctx))
        self.wrapped.train()
        return result

    def sample(self) -> str:
        """A continuation of the prompt (default: the start of the validation text), sampled at
        ``sample_temperature`` from a generator of its own (so the training RNG streams are untouched; 0 =
        greedy). Every rank runs it (an FSDP forward is collective); rank 0 prints it. The KV cache serves every
        token (``overflow="shift"``: once the window is full its last C/2 tokens are re-prefilled), so a sample
        longer than the window costs a one-token forward per token, not a full-window forward per token."""
        prompt = self.o.sample_prompt
        if prompt:
            ids = self.tokenizer.encode(prompt)
        else:
            ids = [int(t) for t in self.corpus.val[: min(16, self.config.context_length)]]
        if not ids or self.o.sample_tokens == 0:
            return ""
        ids = ids[-self.config.context_length:]
        generator = torch.Generator(self.ctx.device).manual_seed(self.o.seed)
        with autocast(self.ctx.device, self.o.dtype):
            result = generate(self.model, [ids], max_new_tokens=self.o.sample_tokens,
                              temperature=self.o.sample_temperature, generator=generator,
                              overflow="shift" if self.config.context_length > 1 else "slide")
        return self._decode_for_display(ids + result.tokens[0, : result.lengths[0]].tolist())

    def _decode_for_display(self, ids: list[int]) -> str:
        """Text of ``ids``; an id the model has but the tokenizer does not (a model ``vocab_size`` rounded up past
        the tokenizer's) shows as U+FFFD instead of failing the run."""
        vocab, parts, run = self.tokenizer.vocab_size, [], []
        for token in ids:
            if token < vocab:
                run.append(token)
                continue
            parts.append(self.tokenizer.decode(run) + "\ufffd")
            run = []
        return "".join(parts) + self.tokenizer.decode(run)

    def checkpoint(self) -> None:
        """Every rank gathers the full state (a collective under FSDP); rank 0 writes it."""
        model_state, optim_state = dist_utils.full_state(self.wrapped, self.optimizer)
        if self.main:
            state = {
                "step": self.step,
                "optimizer": optim_state,
                "sampler": self.sampler.state_dict(),
                "rng": capture_rng_state(),
                "best_step": self.best_step,
                "best_val_loss": self.best_val,
                "options": {k: v for k, v in asdict(self.o).items() if isinstance(v, (int, float, str, bool))},
            }
            plain = self._plain_model(model_state)
            save_checkpoint(self.run_dir, self.step, plain, self.tokenizer, state)
            self.last_saved = plain
            prune_checkpoints(self.run_dir, self.o.keep_last, {self.best_step} if self.best_step else set())
        dist_utils.barrier(self.ctx)

    def _plain_model(self, model_state: dict[str, torch.Tensor]) -> GPTModel:
        """A CPU GPTModel holding ``model_state`` (the unsharded weights), for ``save_model``."""
        if not self.ctx.distributed and self.ctx.device.type == "cpu" and not self.o.fsdp:
            return self.model
        with torch.device("meta"):
            plain = GPTModel(self.config)
        plain.load_state_dict(model_state, strict=True, assign=True)
        if self.config.tie_weights:
            plain.out_head.weight = plain.tok_emb.weight
        return plain


def train(options: TrainingOptions) -> TrainingResult:
    """Run (or resume) training as ``options`` say; see ``TrainingOptions`` and the module docstring."""
    run = _Run(options)
    try:
        return _train(run)
    finally:
        dist_utils.close_distributed(run.ctx)


def _train(run: _Run) -> TrainingResult:
    o, ctx = run.o, run.ctx
    run.open_data()
    run.build()
    baseline = unigram_entropy(run.corpus.train, run.corpus.vocab_size)
    per_token = flops_per_token(run.config)
    peak = peak_flops(ctx.device, o.peak_tflops)
    tokens_per_step = o.batch_size * o.grad_accum * ctx.world_size * run.config.context_length
    checkpoint_every = o.checkpoint_every or o.eval_every
    end = o.max_steps if o.stop_after is None else min(o.max_steps, o.stop_after)
    log = MetricsLog(run.run_dir / "metrics.jsonl", run.step if run.resume_from else None) if run.main else None
    c = run.config
    run.log(f"model: {run.model.num_parameters():,} parameters (V={c.vocab_size} C={c.context_length} D={c.emb_dim} "
            f"H={c.n_heads} L={c.n_layers}); {ctx.world_size} process(es) on "
            f"{ctx.device}; {tokens_per_step:,} tokens per step; unigram baseline {baseline:.3f} nats/token")

    bar = tqdm(total=o.max_steps, initial=run.step, desc="train", disable=not (run.main and o.progress),
               dynamic_ncols=True)
    last_eval: dict[str, float] = {}
    samples: list[str] = []
    rate_window: list[tuple[float, int]] = []
    tokens_per_second = None
    t_last = last_plot = time.perf_counter()
    stop = StopRequests().start()  # Ctrl-C / SIGTERM: finish the step, checkpoint, raise Interrupted
    try:
        while run.step < end:
            loss, norm, lr = run.train_step()
            now = time.perf_counter()
            dt, t_last = now - t_last, now
            rate_window = (rate_window + [(dt, tokens_per_step)])[-20:]
            tokens_per_second = sum(n for _, n in rate_window) / max(1e-9, sum(t for t, _ in rate_window))
            record: dict[str, Any] = {"step": run.step, "loss": loss, "lr": lr, "grad_norm": norm,
                                      "tokens_per_second": tokens_per_second, "step_seconds": dt,
                                      "tflops": tokens_per_second * per_token / 1e12}
            if peak is not None:
                record["mfu"] = tokens_per_second * per_token / peak
            bar.update(1)
            bar.set_postfix(loss=f"{loss:.3f}", lr=f"{lr:.2e}", tok_s=f"{tokens_per_second:,.0f}", refresh=False)
            is_last = run.step == end
            if run.step % o.eval_every == 0 or is_last:
                last_eval = run.evaluate()
                record.update(last_eval)
                if run.best_val is None or last_eval["val_loss"] < run.best_val:
                    run.best_step, run.best_val = run.step, last_eval["val_loss"]
                text = run.sample()
                samples.append(text)
                speed = f"{tokens_per_second:,.0f} tok/s, {record['tflops']:.3g} TFLOP/s" + (
                    f", MFU {record['mfu']:.1%}" if "mfu" in record else "")
                run.log(f"step {run.step}: train {last_eval['train_loss']:.4f}  val {last_eval['val_loss']:.4f}  "
                        f"(unigram {baseline:.4f})  {speed}\n--- sample ---\n{text}\n---")
            if log is not None:
                log.append(record)
                if is_last or ("val_loss" in record and time.perf_counter() - last_plot >= PLOT_INTERVAL_SECONDS):
                    plot_losses(log.records, run.run_dir / "loss.png", baseline=baseline)
                    last_plot = time.perf_counter()
            saved = run.step % checkpoint_every == 0 or is_last
            if saved:
                run.checkpoint()
            if not is_last and dist_utils.any_rank(stop.signum is not None, ctx):
                if not saved:
                    run.checkpoint()
                raise Interrupted(stop.signum, run.step, o.max_steps, run.run_dir / f"step-{run.step}")
            t_last = time.perf_counter()  # eval and checkpoint time stay out of tokens/s
    finally:
        stop.close()
        bar.close()

    if run.step == o.max_steps and run.main:
        # The finished model also goes into RUN_DIR itself, so `load_model(RUN_DIR)` and
        # `tinygpt generate --model RUN_DIR` read it; summary.json names the best checkpoint.
        export_model_files(run.last_saved, run.tokenizer, run.run_dir)
        summary = {
            "step": run.step,
            "train_loss": last_eval.get("train_loss"),
            "val_loss": last_eval.get("val_loss"),
            "unigram_entropy": baseline,
            "best_step": run.best_step,
            "best_val_loss": run.best_val,
            "best_checkpoint": f"step-{run.best_step}" if run.best_step else None,
            "tokens_per_second": tokens_per_second,
            "config": run.config.to_dict(),
            "tokenizer": run.corpus.header["tokenizer"],
        }
        atomic_write_text(run.run_dir / "summary.json", json.dumps(summary, indent=2) + "\n")
    dist_utils.barrier(ctx)
    return TrainingResult(run.run_dir, run.step, last_eval.get("train_loss"), last_eval.get("val_loss"),
                          run.best_step, run.best_val, baseline, tokens_per_second, samples, run.model)
