"""Pretraining as a stage of the one loop: ``train(TrainingOptions(...))`` -- next-token loss on random windows.

One optimizer step = ``grad_accum`` micro-batches of ``batch_size`` windows per rank; the global batch is
``batch_size * grad_accum * world_size`` windows of ``context_length`` tokens. The windows come from a
``WindowSampler`` whose generator position is in every checkpoint, so a resumed run draws the same windows.
Everything else -- optimizer, schedule, evaluation cadence, checkpoints, resume, signals -- is ``training.loop``'s.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from ..checkpoint import load_config
from ..config import GPTConfig, get_config
from ..fileio import read_json_object
from ..generation import generate
from ..model import GPTModel
from . import distributed as dist_utils
from .batches import WindowSampler
from .checkpointing import config_mismatch
from .data import PreparedCorpus, prepare_or_reuse
from .limits import check_memory, check_windows
from .loop import TrainingResult, run_stage
from .metrics import flops_per_token, peak_flops, plot_losses, tokens_per_byte, unigram_entropy
from .options import DEFAULT_MODEL, TrainingOptions
from .stage import Stage


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
        if "vocab_size" not in read_json_object(spec):  # from_file has just read it: a JSON object
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


class PretrainStage(Stage):
    """Next-token cross-entropy on random windows of a prepared corpus (the run's own ``data/``, or ``--prepared``)."""

    name = "train"
    postfix_keys = ("loss", "lr", "tokens_per_second")
    data_parallel = True

    def __init__(self, options: TrainingOptions) -> None:
        self.o = options
        self.inputs = (*(options.data or []), *filter(None, [options.prepared]))
        self.heads = nn.ModuleDict()

    # ------------------------------------------------------------------------------------------ setup
    def setup(self, options: TrainingOptions, ctx: dist_utils.DistContext, resume_from: Path | None) -> None:
        self.ctx = ctx
        self._open_data()
        self.config = self._config(resume_from)
        window = self.config.context_length + 1
        for split, tokens in (("train", self.corpus.train), ("val", self.corpus.val)):
            if len(tokens) < window:
                raise ValueError(
                    f"the {split} split has {len(tokens)} tokens, fewer than one window of context_length + 1 = "
                    f"{window}: use more text or a config with a smaller context_length"
                )
        o = self.o
        check_windows(o.batch_size, ctx.world_size, len(self.corpus.train), self.config.context_length)
        check_memory(self.config, o.batch_size, ctx.device, shards=ctx.world_size if o.fsdp else 1)
        self.baseline = unigram_entropy(self.corpus.train, self.corpus.vocab_size)
        self.val_tokens_per_byte = tokens_per_byte(self.tokenizer, self.corpus.val)
        self.flops_per_token = flops_per_token(self.config)
        self.peak_flops = peak_flops(ctx.device, o.peak_tflops)
        self.tokens_per_step = o.batch_size * o.grad_accum * ctx.world_size * self.config.context_length

    def _open_data(self) -> None:
        o = self.o
        if o.prepared is not None:
            self.corpus = PreparedCorpus.open(o.prepared)
        else:
            if o.data is None:
                from ..corpus import embedded_corpus_files

                paths = [str(p) for p in embedded_corpus_files()]
                self._log(f"no --data: training on the embedded corpus ({len(paths)} standard-library .py files)")
            else:
                paths = list(o.data)
            target = Path(o.out_dir) / "data"
            if self.ctx.is_main:
                prepare_or_reuse(paths, o.tokenizer, target, val_fraction=o.val_fraction, progress=o.progress)
            dist_utils.barrier(self.ctx)
            self.corpus = PreparedCorpus.open(target)
        self.tokenizer = self.corpus.load_tokenizer()

    def _config(self, resume_from: Path | None) -> GPTConfig:
        """The options' config; on a resume the checkpoint's, which a --config or override must agree with."""
        o, vocab = self.o, self.tokenizer.vocab_size
        overrides = {k: getattr(o, k) for k in ("n_layers", "n_heads", "emb_dim", "context_length")}
        if resume_from is None:
            return resolve_config(o.config, vocab, overrides)
        config = self.resumed_config = load_config(resume_from)  # the one read of the checkpoint's config
        if o.config is not None or any(v is not None for v in overrides.values()):
            problem = config_mismatch(resolve_config(o.config or config, vocab, overrides), config, resume_from,
                                      "--config")
            if problem:
                raise ValueError(problem)
        if vocab > config.vocab_size:
            raise ValueError(f"the tokenizer has {vocab} tokens but the checkpoint's vocab_size is {config.vocab_size}")
        return config

    def build(self, ctx: dist_utils.DistContext) -> None:
        with torch.device(ctx.device):
            self.policy = GPTModel(self.config)
        c = self.config
        self._log(f"model: {self.policy.num_parameters():,} parameters (V={c.vocab_size} C={c.context_length} "
                  f"D={c.emb_dim} H={c.n_heads} L={c.n_layers}); {ctx.world_size} process(es) on {ctx.device}; "
                  f"{self.tokens_per_step:,} tokens per step; unigram baseline {self.baseline:.3f} nats/token")
        self.sampler = WindowSampler(self.corpus.train, c.context_length, self.o.seed)

    def _log(self, message: str) -> None:
        if self.ctx.is_main:
            tqdm.write(message, file=sys.stderr)

    # ------------------------------------------------------------------------------------------ steps
    def _batch(self, sampler: WindowSampler) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's rows of the next global micro-batch, on the device: 2 x int64 [batch_size, C]."""
        b, rank, world = self.o.batch_size, self.ctx.rank, self.ctx.world_size
        x, y = sampler.sample(b * world, rows=slice(rank * b, (rank + 1) * b))
        return x.to(self.ctx.device, non_blocking=True), y.to(self.ctx.device, non_blocking=True)

    def batches(self, step: int) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
        return [[self._batch(self.sampler) for _ in range(self.o.grad_accum)]]

    def loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, dict[str, float]]:
        # The model's own loss: cross-entropy fused with the head, no [B, C, V] logits (``tinygpt.fast.head_loss``).
        x, y = batch
        return self.forward(x, targets=y), {}

    def evaluate(self) -> dict[str, float]:
        """Mean loss over ``eval_iters`` global batches of each split; the same windows at every eval (a fixed
        seed, its own generator: the training streams are not touched). Under ``torch.inference_mode`` (no view or
        version-counter bookkeeping, lighter than ``no_grad``), except with FSDP: the parameters it unshards here
        must stay ordinary tensors for the next training step."""
        result = {}
        with torch.no_grad() if self.o.fsdp else torch.inference_mode():
            for split, tokens in (("train", self.corpus.train), ("val", self.corpus.val)):
                sampler = WindowSampler(tokens, self.config.context_length, self.o.seed + 1)
                total = torch.zeros((), device=self.ctx.device)
                for _ in range(self.o.eval_iters):
                    total += self.loss(self._batch(sampler))[0]
                result[f"{split}_loss"] = float(dist_utils.all_reduce_mean(total / self.o.eval_iters, self.ctx))
        # bits per byte: nats/token -> bits/token (/ ln 2) -> bits/byte (x the val split's tokens per UTF-8 byte),
        # comparable across tokenizers (a character model and a BPE model of the same text)
        result["val_bpb"] = result["val_loss"] / math.log(2) * self.val_tokens_per_byte
        return result

    def sample(self) -> str:
        """A continuation of the prompt (default: the start of the validation text), sampled at
        ``sample_temperature`` from a generator of its own (so the training RNG streams are untouched; 0 =
        greedy). Every rank runs it (an FSDP forward is collective); rank 0 prints it. The KV cache serves every
        token (``overflow="shift"``: once the window is full its last C/2 tokens are re-prefilled), so a sample
        longer than the window costs a one-token forward per token, not a full-window forward per token."""
        o, c = self.o, self.config.context_length
        ids = self.tokenizer.encode(o.sample_prompt) if o.sample_prompt else [int(t) for t in self.corpus.val[:min(16, c)]]
        if not ids or o.sample_tokens == 0:
            return ""
        ids = ids[-c:]
        generator = torch.Generator(self.ctx.device).manual_seed(o.seed)
        result = generate(self.policy, [ids], max_new_tokens=o.sample_tokens, temperature=o.sample_temperature,
                          generator=generator, overflow="shift" if c > 1 else "slide")
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

    def report(self, record: dict[str, Any], sample: str | None) -> str:
        speed = f"{record['tokens_per_second']:,.0f} tok/s, {record['tflops']:.3g} TFLOP/s" + (
            f", MFU {record['mfu']:.1%}" if "mfu" in record else "")
        return (f"step {record['step']}: train {record['train_loss']:.4f}  val {record['val_loss']:.4f} "
                f"({record['val_bpb']:.4f} bits/byte)  "
                f"(unigram {self.baseline:.4f})  {speed}\n--- sample ---\n{sample}\n---")

    # ------------------------------------------------------------------------------------------ state and files
    def state_dict(self) -> dict[str, Any]:
        return {"sampler": self.sampler.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sampler.load_state_dict(state["sampler"])

    def plot(self, records: list[dict[str, Any]], run_dir: Path) -> None:
        plot_losses(records, run_dir / "loss.png", baseline=self.baseline)

    def summary(self) -> dict[str, Any]:
        return {"unigram_entropy": self.baseline, "config": self.config.to_dict(),
                "tokenizer": self.corpus.header["tokenizer"]}


def train(options: TrainingOptions) -> TrainingResult:
    """Run (or resume) pretraining as ``options`` say; see ``TrainingOptions`` and the module docstring."""
    return run_stage(PretrainStage(options), options)
