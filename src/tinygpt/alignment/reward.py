"""The reward model (stage three): the GPT trunk + a scalar head, trained on preference pairs (Bradley-Terry).

r(x) = w . h_last + b, where h_last [D] is the final-normed hidden state (``GPTModel.hidden_states``) at the last
real token of prompt + response + end-of-text -- the one position that has read the whole answer (causal
attention). The language-model head is not used. Under the Bradley-Terry model P(chosen > rejected) =
sigmoid(r_chosen - r_rejected), so the loss is -log sigmoid(r_chosen - r_rejected) (InstructGPT, eq. 1).

Saved as a directory: the trunk as an ordinary tinygpt checkpoint (``save_model``) plus ``reward_head.safetensors``
(``weight`` [1, D], ``bias`` [1]); ``save_reward_model`` writes it all atomically. ``load_reward_model`` also reads
a ``step-N/`` folder of a reward run, whose head lives in the training state.

With LoRA (``tinygpt reward --lora-r``) only what trained is saved: the adapter in PEFT's format, naming its base
(``interop.peft``), with the head as PEFT saves a sequence-classification head it trains whole (``task_type``
SEQ_CLS, ``modules_to_save: ["score"]``, ``base_model.model.score.weight`` [1, D]) -- Hugging Face's
``GPT2ForSequenceClassification`` reads the same final-normed hidden state at the last token through ``score``.
Its ``score`` has no bias, so the head's bias goes into ``tinygpt_adapter.json`` (``reward_head.bias``); the
Bradley-Terry loss has no use for it (it cancels in r_chosen - r_rejected), so ``RewardStage`` freezes it at its
initial 0 and the scores PEFT computes from a trained head equal tinygpt's.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from ..config import DEFAULT_SEED
from ..checkpoint import load_checkpoint_tokenizer, load_model, write_checkpoint_files
from ..fileio import REWARD_MODEL, atomic_write_with, save_into
from ..model import GPTModel
from ..tokenizer import Tokenizer
from .batches import EncodedExample, collate_sequences, encode_example, end_of_text_id
from .data import PreferenceExample, load_preference_data
from ..training.loop import TrainingResult, run_stage
from ..lora import is_adapted
from .finetune import SupervisedStage, adapt, load_start_model
from .options import FinetuneOptions

HEAD_FILE = "reward_head.safetensors"
SCORE_WEIGHT = "score.weight"  # the head's weight in an adapter folder, as GPT2ForSequenceClassification names it


@dataclass(frozen=True)
class EncodedPair:
    chosen: EncodedExample
    rejected: EncodedExample


def encode_preferences(tokenizer: Tokenizer, examples: Sequence[PreferenceExample], context_length: int,
                       source: str = "data", *, whole: bool = False) -> list[EncodedPair]:
    """Tokenize prompt + chosen / rejected + end-of-text (truncated as ``encode_example`` says); errors name the
    entry and the key."""
    pairs = []
    for i, e in enumerate(examples):
        where = f"{source}: entry {i}"
        pairs.append(EncodedPair(
            encode_example(tokenizer, e.prompt, e.chosen, context_length, where, "chosen", whole=whole),
            encode_example(tokenizer, e.prompt, e.rejected, context_length, where, "rejected", whole=whole)))
    return pairs


def scalar_head(trunk: GPTModel, seed: int) -> nn.Linear:
    """A new linear head D -> 1 on the trunk's device and dtype: weight ~ N(0, 0.02^2) (GPT-2's init, like every
    other linear layer) drawn from its own generator seeded with ``seed`` (on the CPU, so every device gets the same
    numbers), bias 0. The same seed gives the same head whatever the global RNG has been through."""
    param = next(trunk.parameters())
    generator = torch.Generator().manual_seed(seed)
    weight = torch.empty(1, trunk.config.emb_dim).normal_(0.0, 0.02, generator=generator)
    head = nn.Linear(trunk.config.emb_dim, 1, device=param.device, dtype=param.dtype)
    with torch.no_grad():
        head.weight.copy_(weight)
        head.bias.zero_()
    return head


class RewardModel(nn.Module):
    """A GPT trunk and a scalar head: ids [B, T] + real lengths [B] -> rewards [B]."""

    def __init__(self, trunk: GPTModel, head: nn.Linear | None = None, *, seed: int = DEFAULT_SEED) -> None:
        super().__init__()
        self.trunk = trunk
        self.head = scalar_head(trunk, seed) if head is None else head

    def forward(self, idx: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        h = self.trunk.hidden_states(idx)  # [B, T, D]
        last = h[torch.arange(idx.shape[0], device=idx.device), lengths.to(idx.device) - 1]  # [B, D]
        return self.head(last).squeeze(-1)  # [B]

    @torch.no_grad()
    def score(self, sequences: Sequence[Sequence[int]], pad_id: int) -> torch.Tensor:
        """Rewards [B] (float32, CPU) of token sequences of any lengths (each at most C)."""
        ids, lengths = collate_sequences(sequences, pad_id)
        return self(ids.to(next(self.parameters()).device), lengths).float().cpu()


def bradley_terry_loss(r_chosen: torch.Tensor, r_rejected: torch.Tensor) -> torch.Tensor:
    """Mean of -log sigmoid(r_chosen - r_rejected) over the pairs ([B], [B] -> scalar); logsigmoid is stable."""
    return -F.logsigmoid(r_chosen.float() - r_rejected.float()).mean()


def _head_state(head: nn.Linear) -> dict[str, torch.Tensor]:
    return {"weight": head.weight.detach().cpu().contiguous(), "bias": head.bias.detach().cpu().contiguous()}


def _adapter_head(head: nn.Linear) -> dict[str, Any]:
    """The head as ``interop.peft.save_adapter`` stores it: its weight as PEFT's ``modules_to_save`` (``score``),
    its bias (which GPT-2's ``score`` lacks) in tinygpt_adapter.json."""
    return {"modules": {SCORE_WEIGHT: head.weight.detach().float().cpu().contiguous()},
            "extra": {"reward_head": {"bias": float(head.bias.detach().float().cpu()[0])}}}


def save_reward_model(model: RewardModel, directory: str | Path, tokenizer: Tokenizer | None = None, *,
                      overwrite: bool = False) -> None:
    """Trunk (a checkpoint's files) + ``reward_head.safetensors``, saved as ``save_model`` saves (``fileio.save_into``:
    each file atomically, other files kept, a folder of another kind refused unless ``overwrite``). A trunk with
    LoRA adapters is saved as its adapter and the head (PEFT's format, naming its base: the module docstring)."""
    from safetensors.torch import save_file

    from ..tokenizer import TOKENIZER_FILES

    if is_adapted(model.trunk):
        from ..interop.peft import save_adapter

        save_adapter(model.trunk, directory, overwrite=overwrite, tokenizer=tokenizer, **_adapter_head(model.head))
        return

    with save_into(directory, REWARD_MODEL, overwrite=overwrite, replaces=TOKENIZER_FILES,
                   what="output folder") as tmp:
        write_checkpoint_files(model.trunk, tmp, tokenizer)
        save_file(_head_state(model.head), tmp / HEAD_FILE, metadata={"producer": "tinygpt", "kind": "reward-head"})


def _head_from_state(state: dict[str, torch.Tensor], emb_dim: int, source: Path) -> nn.Linear:
    expected = {"weight": (1, emb_dim), "bias": (1,)}
    for name, shape in expected.items():
        if name not in state or tuple(state[name].shape) != shape:
            got = tuple(state[name].shape) if name in state else "missing"
            raise ValueError(f"{source}: reward head tensor {name!r} must have shape {list(shape)}, got {got}")
    head = nn.Linear(emb_dim, 1)
    head.load_state_dict({k: state[k].float() for k in expected})
    return head


def load_reward_model(directory: str | Path, *, device: str | torch.device = "cpu"
                      ) -> tuple[RewardModel, Tokenizer | None]:
    """(reward model in eval mode, its tokenizer) from a reward directory or a reward run's ``step-N/`` folder; a
    LoRA one (an adapter with its head) is its base with the adapter merged in."""
    from safetensors.torch import load_file

    from ..interop.peft import WEIGHTS_FILE, is_adapter, read_adapter
    from ..training.checkpointing import STATE_FILE, load_training_state

    directory = Path(directory)
    if is_adapter(directory):
        from ..interop.pretrained import load_pretrained

        adapter = read_adapter(directory)
        trunk, tokenizer = load_pretrained(directory, device=device)  # the base it names, the adapter merged in
        if SCORE_WEIGHT in adapter.modules:
            bias = float(adapter.extra.get("reward_head", {}).get("bias", 0.0))
            head = _head_from_state({"weight": adapter.modules[SCORE_WEIGHT], "bias": torch.tensor([bias])},
                                    trunk.config.emb_dim, directory / WEIGHTS_FILE)
        elif (directory / STATE_FILE).is_file():  # a LoRA reward run's step-N/: the head is in the training state
            heads = load_training_state(directory).get("heads", {})
            head = _head_from_state({k.removeprefix("reward."): v for k, v in heads.items()}, trunk.config.emb_dim,
                                    directory / STATE_FILE)
        else:
            raise ValueError(f"{directory} is a LoRA adapter without a reward head ({SCORE_WEIGHT} in "
                             f"modules_to_save): train one with tinygpt reward --lora-r")
        head = head.to(device=device, dtype=next(trunk.parameters()).dtype)
        return RewardModel(trunk, head).eval(), tokenizer
    trunk = load_model(directory, device=device)
    if (directory / HEAD_FILE).is_file():
        head = _head_from_state(load_file(str(directory / HEAD_FILE)), trunk.config.emb_dim, directory / HEAD_FILE)
    elif (directory / STATE_FILE).is_file():
        heads = load_training_state(directory).get("heads", {})
        head = _head_from_state({k.removeprefix("reward."): v for k, v in heads.items()}, trunk.config.emb_dim,
                                directory / STATE_FILE)
    else:
        raise ValueError(f"{directory} is not a reward model: {HEAD_FILE} is missing (train one with tinygpt reward)")
    head = head.to(device=device, dtype=next(trunk.parameters()).dtype)
    return RewardModel(trunk, head).eval(), load_checkpoint_tokenizer(directory)


class RewardStage(SupervisedStage):
    """Train a reward model on preference pairs; metrics: loss, accuracy (r_chosen > r_rejected), margin."""

    name = "reward"
    postfix_keys = ("loss", "accuracy")

    def __init__(self, model: RewardModel, tokenizer: Tokenizer, examples: Sequence[PreferenceExample], *,
                 batch_size: int = 8, val_fraction: float = 0.1, seed: int = DEFAULT_SEED, source: str = "data") -> None:
        self.model = model
        self.policy, self.tokenizer = model.trunk, tokenizer
        # The bias cancels in r_chosen - r_rejected: its gradient is zero but for rounding, which Adam would blow up
        # into steps of the learning rate. Frozen, it stays 0, as GPT-2's bias-less score head (PEFT) holds it.
        model.head.bias.requires_grad_(False)
        self.heads = nn.ModuleDict({"reward": model.head})
        self.pad_id = end_of_text_id(tokenizer)
        pairs = encode_preferences(tokenizer, examples, model.trunk.config.context_length, source, whole=True)
        super().__init__(pairs, batch_size=batch_size, val_fraction=val_fraction, seed=seed)

    def loss(self, items: Sequence[EncodedPair]) -> tuple[torch.Tensor, dict[str, float]]:
        device = next(self.policy.parameters()).device
        # Chosen and rejected go through the trunk as one batch of 2B rows.
        ids, lengths = collate_sequences([p.chosen.ids for p in items] + [p.rejected.ids for p in items], self.pad_id)
        rewards = self.model(ids.to(device), lengths)  # [2B]
        r_chosen, r_rejected = rewards[: len(items)], rewards[len(items):]
        loss = bradley_terry_loss(r_chosen, r_rejected)
        margin = (r_chosen - r_rejected).detach().float()
        return loss, {"accuracy": float((margin > 0).float().mean()),
                      "margin": float(margin.mean())}

    def export(self, model: GPTModel, run_dir: Path) -> None:
        """The head first, then the trunk's files (each replaced atomically, config last); with LoRA the adapter
        and the head alone, in PEFT's format (the module docstring), naming the base."""
        from safetensors.torch import save_file

        if is_adapted(model):
            from ..interop.peft import save_adapter

            save_adapter(model, run_dir, tokenizer=self.tokenizer, **_adapter_head(self.model.head))
            return
        atomic_write_with(Path(run_dir) / HEAD_FILE, lambda tmp: save_file(_head_state(self.model.head), str(tmp)))
        super().export(model, run_dir)


def train_reward_model(model: str | Path, data: str | Path, options: FinetuneOptions, *, limit: int | None = None,
                       tokenizer_dir: str | Path | None = None, lora: Any = None) -> TrainingResult:
    """``tinygpt reward``: a reward model from the GPT at ``model`` trained on the preference file ``data``;
    ``lora`` (a ``LoRAConfig``): the trunk trains adapters (the head trains whole); the run saves both alone."""
    options.check()
    examples = load_preference_data(data, limit)
    trunk, tokenizer = load_start_model(model, options.device, tokenizer_dir, lora=lora)
    settings = options.stage_settings()
    reward_model = RewardModel(adapt(trunk, lora, options, model), seed=settings.get("seed", DEFAULT_SEED))  # seeded
    stage = RewardStage(reward_model, tokenizer, examples, source=str(data), **settings)
    return run_stage(stage, options)
