"""Training checkpoints: ``step-N/`` folders, written atomically, pruned to the last K and the best, found on resume.

A ``step-N/`` folder is a model checkpoint that ``tinygpt.checkpoint.load_model`` reads as it is (``config.json``,
``model.safetensors``, the tokenizer's files) plus ``training_state.pt``: optimizer state, step, the RNG states of
torch / numpy / Python, the data sampler's position and the run's settings. That file holds only tensors and plain
Python values, so it loads with ``torch.load(weights_only=True)`` -- no pickle of arbitrary objects.

The whole folder is assembled in a temporary sibling and renamed into place (``fileio.atomic_directory``): a crash
at any instant leaves every ``step-N/`` either complete or absent, so resume never sees half a checkpoint. What a
crash leaves instead -- the temporary, or an older folder renamed aside -- carries ``fileio.TEMP_PREFIX`` like every
temporary of ``fileio``, and ``remove_partial_checkpoints`` deletes exactly those.
"""

from __future__ import annotations

import os
import random
import re
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..config import GPTConfig
from ..checkpoint import CONFIG_FILE, WEIGHTS_FILE, save_model, write_checkpoint_files
from ..fileio import atomic_directory, atomic_write_with, remove_temporaries
from ..model import GPTModel
from ..tokenizer import Tokenizer

STATE_FILE = "training_state.pt"
_STEP_DIR = re.compile(r"^step-(\d+)$")
# Test hook: when this names a step, the process pauses (for SLEEP_SECONDS) in the middle of writing that step's
# checkpoint -- model files written, state not yet, folder not yet renamed -- so a test can SIGKILL it exactly there.
FAULT_ENV = "TINYGPT_PAUSE_IN_CHECKPOINT_WRITE"
_FAULT_SLEEP_SECONDS = 300.0


def step_dir(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / f"step-{step}"


def capture_rng_state() -> dict[str, Any]:
    """The torch (CPU and every CUDA device), numpy and Python RNG states, as weights_only-loadable values."""
    np_kind, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
    version, internal, gauss = random.getstate()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": {"kind": np_kind, "keys": torch.from_numpy(np_keys.astype(np.int64)), "pos": int(np_pos),
                  "has_gauss": int(np_has_gauss), "gauss": float(np_gauss)},
        "python": {"version": version, "internal": list(internal), "gauss": gauss},
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    np_state = state["numpy"]
    np.random.set_state((np_state["kind"], np_state["keys"].numpy().astype(np.uint32), np_state["pos"],
                         np_state["has_gauss"], np_state["gauss"]))
    py = state["python"]
    random.setstate((py["version"], tuple(py["internal"]), py["gauss"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(run_dir: Path, step: int, model: GPTModel, tokenizer: Tokenizer | None,
                    training_state: dict[str, Any]) -> Path:
    """Write ``run_dir/step-{step}/`` atomically (replacing an older folder of that name) and return its path.

    A model with LoRA adapters (``tinygpt.lora``) is written as its adapter alone (``interop.peft``, naming its
    base) and the tokenizer: only what trains, not the frozen base."""
    from ..lora import is_adapted

    target = step_dir(run_dir, step)
    with atomic_directory(target) as tmp:
        if is_adapted(model):
            from ..interop.peft import write_adapter_files

            write_adapter_files(model, tmp, base=model.lora_base, tokenizer=tokenizer, home=target)
        else:
            write_checkpoint_files(model, tmp, tokenizer)
        if os.environ.get(FAULT_ENV) == str(step):
            print(f"[{FAULT_ENV}] pausing inside the write of {target.name}", file=sys.stderr, flush=True)
            time.sleep(_FAULT_SLEEP_SECONDS)
        atomic_write_with(tmp / STATE_FILE, lambda path: torch.save(training_state, path))
    return target


def is_complete(directory: Path) -> bool:
    """A ``step-N/`` with its training state and a model: a checkpoint's files, or a LoRA adapter's."""
    model_files = ((CONFIG_FILE, WEIGHTS_FILE), ("adapter_config.json", "adapter_model.safetensors"))
    return (directory / STATE_FILE).is_file() and any(all((directory / n).is_file() for n in names)
                                                      for names in model_files)


def list_checkpoints(run_dir: Path) -> list[tuple[int, Path]]:
    """Complete ``step-N/`` folders of ``run_dir`` as (N, path), oldest first."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return []
    found = []
    for child in run_dir.iterdir():
        match = _STEP_DIR.match(child.name)
        if match and child.is_dir() and is_complete(child):
            found.append((int(match.group(1)), child))
    return sorted(found)


def load_training_state(directory: Path, stage: str | None = None) -> dict[str, Any]:
    """The training state of the checkpoint ``directory``; with ``stage``, refused unless a run of that stage wrote
    it (a checkpoint from before stages were named is pretraining's, ``"train"``)."""
    path = Path(directory) / STATE_FILE
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise ValueError(f"{directory} is not a training checkpoint: {STATE_FILE} is missing") from None
    except Exception as err:  # a truncated or foreign file: unpickling errors of several types
        raise ValueError(f"{path}: cannot read the training state ({type(err).__name__}: {err})") from None
    if not isinstance(state, dict) or "step" not in state:
        raise ValueError(f"{path} is not a tinygpt training state")
    written_by = state.get("stage", "train")
    if stage is not None and written_by != stage:
        raise ValueError(f"{directory} is a checkpoint of the {written_by!r} stage, not {stage!r}")
    if "stage_state" not in state and "sampler" in state:  # pretraining's layout before the one loop
        state = {**state, "stage_state": {"sampler": state["sampler"]}, "heads": {}}
    return state


def config_mismatch(wanted: GPTConfig, saved: GPTConfig, directory: Path, what: str) -> str | None:
    """None when the configs agree, else the error: ``{what} does not match the checkpoint DIR: k=a vs checkpoint
    b, ...`` (one wording for every stage)."""
    diff = {k: (v, getattr(saved, k)) for k, v in wanted.to_dict().items() if getattr(saved, k) != v}
    if not diff:
        return None
    return f"{what} does not match the checkpoint {directory}: " + ", ".join(
        f"{k}={a!r} vs checkpoint {b!r}" for k, (a, b) in diff.items())


def tokenizer_fingerprint(tokenizer: Tokenizer) -> list[str]:
    """Kind, size and every token's text: two tokenizers with the same fingerprint give the same ids."""
    return [tokenizer.kind, str(tokenizer.vocab_size), *(tokenizer.decode([i]) for i in range(tokenizer.vocab_size))]


def load_weights(stage: Any, directory: Path, state: dict[str, Any]) -> None:
    """Load a checkpoint's model weights into ``stage.policy`` and its heads' into ``stage.heads`` (in place, before
    the loop wraps them). ``ValueError`` when the checkpoint's config or tokenizer differs from the stage's. The
    checkpoint's config is ``stage.resumed_config`` when the stage has read it already, else read here."""
    from ..checkpoint import load_config, load_weights_into
    from ..lora import is_adapted
    from ..tokenizer import load_tokenizer

    adapter = None
    if is_adapted(stage.policy):  # a LoRA run's step-N/ holds the adapter; the base is the run's starting model
        from ..interop.peft import read_adapter

        adapter = read_adapter(directory)
        if adapter.config != stage.policy.lora_config:
            raise ValueError(f"{directory}: the run trained LoRA {adapter.config.to_dict()}, but the options give "
                             f"{stage.policy.lora_config.to_dict()}: resume with the run's --lora-* flags")
    saved_config = (adapter.model_config if adapter is not None else
                    getattr(stage, "resumed_config", None) or load_config(directory))
    problem = config_mismatch(stage.policy.config, saved_config, directory, f"the {stage.name} model")
    if problem:
        raise ValueError(problem)
    if stage.tokenizer is not None:
        saved_tokenizer = load_tokenizer(directory)
        if tokenizer_fingerprint(saved_tokenizer) != tokenizer_fingerprint(stage.tokenizer):
            raise ValueError(f"the checkpoint {directory} was trained with a different tokenizer "
                             f"({saved_tokenizer!r}) than this run's ({stage.tokenizer!r})")
    if adapter is not None:
        from ..lora import load_lora_state_dict

        load_lora_state_dict(stage.policy, adapter.state, source=str(directory))
    else:
        load_weights_into(stage.policy, directory)
    stage.heads.load_state_dict(state["heads"])


def resolve_resume(resume: str | os.PathLike | None, run_dir: Path) -> Path | None:
    """Which checkpoint to resume from.

    ``None`` -> none. ``"auto"`` -> the newest complete ``step-N/`` in ``run_dir``, or none when there is none yet
    (so the same command starts a run and continues it). A path -> that checkpoint folder, or the newest complete
    checkpoint inside that run folder; a path holding neither is a ``ValueError``.
    """
    if resume is None:
        return None
    if str(resume) == "auto":
        found = list_checkpoints(run_dir)
        return found[-1][1] if found else None
    path = Path(resume)
    if not path.is_dir():
        raise ValueError(f"--resume {path}: no such folder")
    if is_complete(path):
        return path
    found = list_checkpoints(path)
    if not found:
        raise ValueError(f"--resume {path}: neither a complete step-N checkpoint nor a run folder holding one")
    return found[-1][1]


def refuse_other_global_batch(state: dict[str, Any], batch_size: int | None, world_size: int) -> None:
    """``ValueError`` when a checkpoint resumes under another world size with other rows per micro-batch. Each
    micro-batch draws ``batch_size x world_size`` windows from one stream and rank r takes its ``batch_size`` rows
    of them, so the same product resumes the same computation (up to the order of the all-reduce's sums); another
    product would draw other windows and train on another batch size."""
    saved_world, saved_batch = state.get("world_size"), state.get("options", {}).get("batch_size")
    if saved_world is None or saved_batch is None or batch_size is None or saved_world == world_size:
        return
    if saved_batch * saved_world != batch_size * world_size:
        keep = saved_batch * saved_world / world_size
        fix = f"--batch-size {int(keep)}" if keep == int(keep) else f"{saved_world} processes"
        raise ValueError(f"the checkpoint was trained by {saved_world} process(es) x --batch-size {saved_batch} "
                         f"({saved_batch * saved_world} windows per micro-batch); {world_size} x {batch_size} would "
                         f"draw other windows: resume with {fix} to keep them")


def refuse_fresh_start(run_dir: Path) -> None:
    """``ValueError`` when ``run_dir`` already holds ``step-N/`` checkpoints (a fresh run would mix with them)."""
    if list_checkpoints(run_dir):
        raise ValueError(f"{run_dir} already holds checkpoints: pass --resume auto to continue that run, or choose "
                         f"another --out")


def refuse_finished(step: int, max_steps: int) -> None:
    """``ValueError`` when a resumed run has nothing left to do."""
    if step >= max_steps:
        raise ValueError(f"the checkpoint is at step {step}, already >= max_steps={max_steps}: raise --max-steps to "
                         f"train further")


def last_good_checkpoint(run_dir: Path) -> str:
    """What a stopped run keeps, in words (for ``Diverged``)."""
    kept = list_checkpoints(run_dir)
    return f"the last good checkpoint is {kept[-1][1]}" if kept else "no checkpoint had been written yet"


def remove_partial_checkpoints(run_dir: Path) -> list[Path]:
    """Delete what a killed write left anywhere in ``run_dir`` (``fileio.remove_temporaries``: every entry named
    ``fileio.TEMP_PREFIX...``, the one rule all of fileio's writers name their temporaries by); never a complete
    ``step-N/`` nor any other file. Returns what was removed."""
    return remove_temporaries(run_dir)


def prune_checkpoints(run_dir: Path, keep_last: int, keep: set[int] = frozenset()) -> None:
    """Delete complete ``step-N/`` folders except the newest ``keep_last`` and the steps in ``keep`` (the best)."""
    found = list_checkpoints(run_dir)
    newest = {step for step, _ in found[-keep_last:]} if keep_last > 0 else set()
    for step, path in found:
        if step not in newest and step not in keep:
            shutil.rmtree(path, ignore_errors=True)


def export_model_files(model: GPTModel, tokenizer: Tokenizer | None, run_dir: Path) -> None:
    """Put ``model``'s checkpoint files (config, weights, tokenizer) directly into ``run_dir``, which also holds
    the run's other files (``save_model``: each file replaced atomically, the config last; a run's config and
    tokenizer never change -- resume checks them -- so a crash between two replacements still leaves a matching
    set)."""
    save_model(model, run_dir, tokenizer)
