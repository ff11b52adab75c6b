"""One entry point for "a model to run": a tinygpt checkpoint, a Hugging Face GPT-2 folder, or a hub name.

Used by ``tinygpt generate`` and ``tinygpt convert``. The tokenizer comes, in this order, from an explicit
directory, the checkpoint's own saved tokenizer, the Hugging Face folder's vocab.json + merges.txt, and finally
(for a 50,257-token model) ``gpt2_tokenizer()`` (``$TINYGPT_GPT2_VOCAB`` or tiktoken's cache).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..checkpoint import CONFIG_FILE, load_checkpoint_tokenizer, load_model, save_model
from ..model import GPTModel
from ..tokenizer import HF_GPT2_FILES, GPT2Tokenizer, Tokenizer, gpt2_tokenizer, tokenizer_from_dir
from .hf import export_hf, import_hf, resolve_hf_source

GPT2_VOCAB_SIZE = 50257


def is_tinygpt_checkpoint(directory: str | Path) -> bool:
    """True when ``directory/config.json`` is a tinygpt config (it has ``emb_dim``; GPT-2's has ``n_embd``)."""
    path = Path(directory) / CONFIG_FILE
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return False
    return isinstance(data, dict) and "emb_dim" in data


def load_pretrained(
    source: str | Path,
    *,
    tokenizer_dir: str | Path | None = None,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
) -> tuple[GPTModel, Tokenizer | None]:
    """(model, tokenizer or None) from a tinygpt checkpoint directory, an HF GPT-2 folder or a hub name."""
    tokenizer: Tokenizer | None = None
    if Path(source).is_dir() and is_tinygpt_checkpoint(source):
        model = load_model(source, device=device, dtype=dtype)
        if tokenizer_dir is None:
            tokenizer = load_checkpoint_tokenizer(source)
    else:
        directory = resolve_hf_source(source)
        model = import_hf(directory, device=device, dtype=dtype)
        if tokenizer_dir is None and all((directory / name).is_file() for name in HF_GPT2_FILES):
            tokenizer = tokenizer_from_dir(directory)
    if tokenizer_dir is not None:
        tokenizer = tokenizer_from_dir(tokenizer_dir)
    if tokenizer is None and model.config.vocab_size == GPT2_VOCAB_SIZE:
        tokenizer = gpt2_tokenizer()
    if tokenizer is not None and tokenizer.vocab_size > model.config.vocab_size:
        raise ValueError(
            f"the tokenizer has {tokenizer.vocab_size} tokens but the model's vocab_size is {model.config.vocab_size}"
        )
    return model, tokenizer


def convert_from_hf(source: str | Path, out: str | Path) -> list[str]:
    """A Hugging Face GPT-2 folder or hub name -> a tinygpt checkpoint in ``out`` (with its GPT-2 tokenizer files
    when the folder has vocab.json + merges.txt). Returns the names of the files written."""
    directory = resolve_hf_source(source)
    model = import_hf(directory)
    tokenizer = None
    if all((directory / name).is_file() for name in HF_GPT2_FILES):
        tokenizer = tokenizer_from_dir(directory)
    save_model(model, out, tokenizer=tokenizer)
    return sorted(p.name for p in Path(out).iterdir())


def convert_to_hf(checkpoint: str | Path, out: str | Path) -> list[str]:
    """A tinygpt checkpoint -> a folder ``transformers.GPT2LMHeadModel.from_pretrained`` loads (plus vocab.json +
    merges.txt when the checkpoint carries the GPT-2 tokenizer; a char or BPE tokenizer has no GPT-2 form and is
    not written). Returns the names of the files written."""
    if not is_tinygpt_checkpoint(checkpoint):
        raise ValueError(f"{checkpoint} is not a tinygpt checkpoint (no config.json with tinygpt's fields)")
    model = load_model(checkpoint)
    tokenizer = load_checkpoint_tokenizer(checkpoint)
    export_hf(model, out, tokenizer=tokenizer if isinstance(tokenizer, GPT2Tokenizer) else None)
    return sorted(p.name for p in Path(out).iterdir())
