"""One entry point for "a model to run": a tinygpt checkpoint, a Hugging Face GPT-2 folder, a hub name, a GGUF file.

Used by ``tinygpt generate`` and ``tinygpt convert`` (to and from GGUF too, ``interop.gguf``). The tokenizer comes,
in this order, from an explicit directory, the checkpoint's own saved tokenizer (a GGUF file's own), the Hugging Face
folder's tokenizer (vocab.json + merges.txt, or the tokenizer.json current transformers saves alone), and finally
(for a 50,257-token model) ``gpt2_tokenizer()`` (``$TINYGPT_GPT2_VOCAB`` or tiktoken's cache). A conversion that
cannot carry a tokenizer says so through ``warn``.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Callable

import torch

from ..checkpoint import CONFIG_FILE, WEIGHTS_FILE, load_checkpoint_tokenizer, load_model, save_model
from ..fileio import CHECKPOINT, HF_MODEL, check_save_target, json_object_or_none, read_json_object
from ..model import GPTModel
from ..tokenizer import (HF_TOKENIZER_FILES, TOKENIZER_FILES, Tokenizer, gpt2_tokenizer, has_tokenizer_files,
                         tokenizer_from_dir)
from .hf import GENERATION_CONFIG_FILE, HF_WEIGHT_FILES, export_hf, import_hf, looks_local, resolve_hf_source

GPT2_VOCAB_SIZE = 50257


def is_tinygpt_checkpoint(directory: str | Path) -> bool:
    """True when ``directory/config.json`` is a tinygpt config (it has ``emb_dim``; GPT-2's has ``n_embd``)."""
    return "emb_dim" in (json_object_or_none(Path(directory) / CONFIG_FILE) or {})


def load_pretrained(
    source: str | Path,
    *,
    tokenizer_dir: str | Path | None = None,
    device: str | torch.device = "cpu",
    dtype: torch.dtype | None = None,
    quantize: str | None = None,
    base: str | Path | None = None,
    weights: str = "float32",
) -> tuple[GPTModel, Tokenizer | None]:
    """(model, tokenizer or None) from a tinygpt checkpoint directory, an HF GPT-2 folder, a hub name, a ``.gguf``
    file, or a LoRA adapter folder (its base -- ``base``, else the one it names -- with the adapter merged in:
    ``load_adapted`` keeps them apart; ``base`` given for anything else is a ``ValueError``).

    ``quantize`` (``"nf4"``, ``"nf4-dq"``; QLoRA's frozen base): the block linears in NF4. A checkpoint or a Hugging
    Face folder is quantised tensor by tensor as it is read, so the float base is never whole in memory; a GGUF
    file or an adapter folder is built in float first, then quantised.

    ``weights`` (``fast.weights.WEIGHT_TYPES``): the block linears and the head in bfloat16 or int8 for inference. A
    GGUF file (``interop.gguf_weights``) and a tinygpt checkpoint (``checkpoint.model_from_tensors``) are read
    straight into them, never as a whole float32 model; anything else is loaded, then converted
    (``convert_weights``). On a CPU the weights end in huge pages (``fast.pages.huge_pages``)."""
    from .peft import is_adapter

    from ..fast.pages import huge_pages
    from ..fast.weights import check_weight_type, convert_weights

    check_weight_type(weights)
    if weights != "float32" and (quantize is not None or dtype is not None):
        raise ValueError(f"weights={weights!r} takes neither quantize nor dtype: the weight type is the linears' dtype")
    tokenizer: Tokenizer | None = None
    if quantize is not None:
        from ..quantize import check_quantize

        check_quantize(quantize)
    if Path(source).is_dir() and is_adapter(source):
        from ..lora import merged_model

        model, tokenizer = load_adapted(source, base=base, tokenizer_dir=tokenizer_dir, device=device, dtype=dtype)
        model = _quantized(merged_model(model), quantize)
        convert_weights(model, weights)
        if torch.device(device).type == "cpu":
            huge_pages(model)
        return model, tokenizer
    if base is not None:
        raise ValueError(f"--base {base} applies to a LoRA adapter folder only, and {source} is not one "
                         f"(no adapter_config.json)")
    if Path(source).is_file() and Path(source).suffix.lower() == ".gguf":
        from .gguf import load_gguf

        # read straight into the small type on a CPU (oneDNN's packed bf16 stays there); elsewhere converted below
        direct = weights if torch.device(device).type == "cpu" else "float32"
        model, tokenizer, _ = load_gguf(source, dtype=dtype, weights=direct)
        model = _quantized(model.to(device), quantize)
    elif Path(source).is_dir() and is_tinygpt_checkpoint(source):
        # read straight into the small type on a CPU, as a GGUF file is; elsewhere converted below
        model = load_model(source, device=device, dtype=dtype, quantize=quantize,
                           weights=weights if torch.device(device).type == "cpu" else "float32")
        if tokenizer_dir is None:
            tokenizer = load_checkpoint_tokenizer(source)
    else:
        directory = resolve_hf_source(source)
        model = import_hf(directory, device=device, dtype=dtype, quantize=quantize)
        if tokenizer_dir is None and has_tokenizer_files(directory):
            tokenizer = tokenizer_from_dir(directory)
    if getattr(model, "weight_type", "float32") != weights:
        convert_weights(model, weights)
    if torch.device(device).type == "cpu":
        huge_pages(model)  # a decode step reads every weight: without a page-table walk each 4 KiB (fast.pages)
    if tokenizer_dir is not None:
        tokenizer = tokenizer_from_dir(tokenizer_dir)
    if tokenizer is None and model.config.vocab_size == GPT2_VOCAB_SIZE:
        tokenizer = gpt2_tokenizer()
    if tokenizer is not None and tokenizer.vocab_size > model.config.vocab_size:
        raise ValueError(
            f"the tokenizer has {tokenizer.vocab_size} tokens but the model's vocab_size is {model.config.vocab_size}"
        )
    return model, tokenizer


# Text whose ids two tokenizers must agree on for one model to draft for another (letters, digits, punctuation,
# spaces, a newline, accents and an emoji: each kind of piece a byte-level BPE splits differently)
_TOKENIZER_PROBE = "Hello, World! 42 tokens:\n  def f(x): return x * 3.14  # café naïve 😀"


def _same_ids(a: Tokenizer, b: Tokenizer, text: str) -> bool | None:
    """Whether ``b`` gives ``text`` the ids ``a`` gives it (None: ``a`` cannot encode it, no verdict; False when
    only ``b`` cannot)."""
    try:
        ids = list(a.encode(text))
    except ValueError:
        return None
    try:
        return list(b.encode(text)) == ids
    except ValueError:
        return False


def load_draft(source: str | Path, model: torch.nn.Module, tokenizer: Tokenizer | None, *,
               device: str | torch.device = "cpu") -> GPTModel:
    """A small model to draft for ``model`` (speculative decoding, ``--draft``), loaded as ``load_pretrained``
    loads any model. It must share the tokenizer: the same vocabulary size, and where both have a tokenizer, the
    same ids for a probe text and for the text of the model's first tokens; otherwise a ``ValueError`` says which
    differs."""
    from ..inference.drafting import check_draft_model

    draft, own = load_pretrained(source, device=device)
    try:
        check_draft_model(model, draft)
    except ValueError as err:
        raise ValueError(f"the draft model {source}: {err}") from None
    if own is not None and tokenizer is not None:
        texts = [_TOKENIZER_PROBE]
        try:
            texts.append(tokenizer.decode(list(range(min(model.config.vocab_size, 256)))))
        except (ValueError, KeyError, IndexError):
            pass
        if any(_same_ids(tokenizer, own, text) is False for text in texts):
            raise ValueError(f"the draft model {source} has a tokenizer that splits text differently from the "
                             f"model's: they must share the tokenizer")
    return draft


def _quantized(model: GPTModel, quantize: str | None) -> GPTModel:
    if quantize is not None:
        from ..quantize import is_double_quant, quantize_linears

        quantize_linears(model, double_quant=is_double_quant(quantize))
    return model


def load_adapted(adapter: str | Path, *, base: str | Path | None = None, tokenizer_dir: str | Path | None = None,
                 device: str | torch.device = "cpu", dtype: torch.dtype | None = None, quantize: str | None = None
                 ) -> tuple[GPTModel, Tokenizer | None]:
    """(base model wrapped with the adapter in ``adapter``, its tokenizer). ``base`` (a folder or hub name)
    defaults to the one the adapter names (``base_model_name_or_path``); ``quantize`` (``"nf4"``, ``"nf4-dq"``)
    holds the base in NF4 whatever the adapter was trained with, None keeps the adapter's own choice (an NF4 base is
    quantised as it is read: ``load_pretrained``). The tokenizer is ``tokenizer_dir``'s, else the one saved in the
    adapter folder (a fine-tuning run saves it there, with the chat template it trained), else the base's -- with
    the adapter folder's chat template when it has one (a peft/trl adapter may carry only tokenizer_config.json)."""
    from ..chat_template import read_chat_template as read_template
    from .peft import is_adapter, load_adapter, read_adapter

    found = read_adapter(adapter)
    reference = base if base is not None else found.base
    quantize = quantize if quantize is not None else found.config.quantize
    if reference is None:
        raise ValueError(f"the adapter {adapter} names no base model: give the base (--base DIR|HUBNAME)")
    if Path(reference).is_dir() and is_adapter(reference):
        raise ValueError(f"the base {reference} is itself an adapter: give the model it was trained on")
    if base is None and not Path(reference).exists() and (Path(reference).is_absolute() or looks_local(reference)):
        raise ValueError(f"the adapter {adapter} names its base {reference}, which is not there (moved or deleted?): "
                         f"give the base with --base DIR|HUBNAME")
    own = tokenizer_dir is None and has_tokenizer_files(adapter)
    model, tokenizer = load_pretrained(reference, tokenizer_dir=adapter if own else tokenizer_dir, device=device,
                                       dtype=dtype, quantize=quantize)
    if tokenizer is not None and tokenizer_dir is None and not own:
        template = read_template(adapter)
        if template is not None:
            tokenizer = tokenizer.with_chat_template(template)
    return load_adapter(model, adapter, quantize=quantize), tokenizer


def merge_adapter(adapter: str | Path, out: str | Path, *, base: str | Path | None = None,
                  overwrite: bool = False) -> list[str]:
    """``tinygpt merge``: the base with the adapter folded into its weights, written as a plain tinygpt checkpoint
    (with the adapter's tokenizer and chat template, else the base's: ``load_adapted``) in ``out``; an NF4 (QLoRA)
    adapter is merged into the float base it was trained from. Returns the names of the files written."""
    from ..lora import merged_model

    check_save_target(out, CHECKPOINT, overwrite=overwrite, inputs=[p for p in (adapter, base) if p is not None
                                                                     and Path(p).is_dir()], what="--out")
    model, tokenizer = load_adapted(adapter, base=base)
    save_model(merged_model(model), out, tokenizer=tokenizer, overwrite=overwrite)
    return _written(out, (CONFIG_FILE, WEIGHTS_FILE, *TOKENIZER_FILES))


def _warn(message: str) -> None:
    warnings.warn(message, stacklevel=3)


def _written(out: str | Path, names: tuple[str, ...]) -> list[str]:
    """The files of a conversion in ``out`` (not the other files a folder written with ``overwrite`` keeps)."""
    return sorted(p.name for p in Path(out).iterdir() if p.name in names)


def _weights_size(directory: Path, names: tuple[str, ...]) -> int:
    """Bytes of the first weights file present (the output needs about as much)."""
    return next(((directory / n).stat().st_size for n in names if (directory / n).is_file()), 0)


def convert_from_hf(source: str | Path, out: str | Path, *, overwrite: bool = False,
                    warn: Callable[[str], None] = _warn) -> list[str]:
    """A Hugging Face GPT-2 folder or hub name -> a tinygpt checkpoint in ``out``, with the folder's tokenizer
    (vocab.json + merges.txt, or a lone tokenizer.json). Returns the names of the files written. A folder without a
    usable tokenizer is converted without one, and ``warn`` says what ``generate`` will need.

    ``out`` is checked before the model is read (``fileio.check_save_target``): not a file, writable, room on its
    disk, not the source, and not a folder of another kind unless ``overwrite``."""
    local = Path(source).is_dir()
    check_save_target(out, CHECKPOINT, overwrite=overwrite, inputs=[source] if local else [],
                      needed_bytes=_weights_size(Path(source), HF_WEIGHT_FILES) if local else 0, what="--out")
    directory = resolve_hf_source(source)
    model = import_hf(directory)
    tokenizer = None
    if has_tokenizer_files(directory):
        try:
            tokenizer = tokenizer_from_dir(directory)
        except ValueError as err:
            warn(f"the tokenizer of {source} is not carried over ({err}); `tinygpt generate --model {out}` will need "
                 f"--tokenizer-dir DIR")
    else:
        fallback = ("GPT-2's (from $TINYGPT_GPT2_VOCAB or tiktoken's cache)" if model.config.vocab_size == GPT2_VOCAB_SIZE
                    else "--tokenizer-dir DIR")
        warn(f"{source} holds no tokenizer (neither tokenizer.json nor vocab.json + merges.txt): {out} has none; "
             f"`tinygpt generate --model {out}` will use {fallback}")
    save_model(model, out, tokenizer=tokenizer, overwrite=overwrite)
    return _written(out, (CONFIG_FILE, WEIGHTS_FILE, *TOKENIZER_FILES))


def convert_to_hf(checkpoint: str | Path, out: str | Path, *, overwrite: bool = False,
                  warn: Callable[[str], None] = _warn) -> list[str]:
    """A tinygpt checkpoint -> a folder ``transformers.GPT2LMHeadModel.from_pretrained`` loads, with the
    checkpoint's GPT-2 or BPE tokenizer in Hugging Face's form (so ``transformers.pipeline`` runs on it as is). A
    char tokenizer has no such form: the model is exported without it and ``warn`` says so. Returns the names of the
    files written. ``out`` is checked first, as for ``convert_from_hf``."""
    if not is_tinygpt_checkpoint(checkpoint):
        raise ValueError(f"{checkpoint} is not a tinygpt checkpoint (no config.json with tinygpt's fields)")
    check_save_target(out, HF_MODEL, overwrite=overwrite, inputs=[checkpoint],
                      needed_bytes=_weights_size(Path(checkpoint), (WEIGHTS_FILE,)), what="--out")
    model = load_model(checkpoint)
    tokenizer = load_checkpoint_tokenizer(checkpoint)
    if tokenizer is None:
        warn(f"{checkpoint} has no tokenizer: {out} has none either (transformers will need one from elsewhere)")
    elif tokenizer.kind == "char":
        warn(f"{checkpoint}'s char tokenizer has no Hugging Face form: {out} holds the model without a tokenizer")
        tokenizer = None
    export_hf(model, out, tokenizer=tokenizer, overwrite=overwrite, inputs=(checkpoint,))
    return _written(out, (CONFIG_FILE, *HF_WEIGHT_FILES, GENERATION_CONFIG_FILE, *HF_TOKENIZER_FILES))


# ------------------------------------------------------------------------------------------------ GGUF
def read_chat_template(directory: str | Path) -> str | None:
    """The ``chat_template`` of ``directory/tokenizer_config.json`` (a checkpoint's or a Hugging Face folder's)."""
    path = Path(directory) / "tokenizer_config.json"
    if not path.is_file():
        return None
    template = read_json_object(path).get("chat_template")
    if template is not None and not isinstance(template, str):
        raise ValueError(f"{path}: chat_template must be one template string (named templates are not exported)")
    return template


def convert_to_gguf(source: str | Path, out: str | Path, *, type: str = "f32", overwrite: bool = False,
                    warn: Callable[[str], None] = _warn) -> None:
    """A tinygpt checkpoint or Hugging Face GPT-2 folder -> one GGUF file ``out``, with its tokenizer and chat
    template. An existing ``out`` is replaced only with ``overwrite``; nothing is written when anything fails."""
    from ..fileio import OutputError, check_output_dir
    from .gguf import GGUF_TYPES, gguf_architecture, require_gguf, write_gguf

    require_gguf()
    if type not in GGUF_TYPES:
        raise ValueError(f"--type {type} is not a GGUF type tinygpt writes; allowed: {', '.join(GGUF_TYPES)}")
    out = Path(out)
    if out.is_dir():
        raise OutputError(f"--to-gguf {out} is a folder; give the path of the .gguf file to write")
    if out.exists() and not overwrite:
        raise OutputError(f"--to-gguf {out} exists; pass --force to replace it")
    check_output_dir(out.parent if str(out.parent) else ".", what="--to-gguf")
    model, tokenizer = load_pretrained(source)
    gguf_architecture(model.config)  # refuse before anything else
    if tokenizer is None:
        warn(f"{source} has no tokenizer: {out} has none, and llama.cpp cannot run it without one")
    template = read_chat_template(source) if Path(source).is_dir() else None
    write_gguf(model, out, tokenizer, type=type, chat_template=template, name=Path(str(source)).name or "tinygpt")


def convert_from_gguf(source: str | Path, out: str | Path, *, overwrite: bool = False,
                      warn: Callable[[str], None] = _warn) -> list[str]:
    """A GGUF file (gpt2 or llama) -> a tinygpt checkpoint in ``out`` (dequantised to float32), with its tokenizer
    and its chat template in ``tokenizer_config.json``. Returns the names of the files written."""
    from ..fileio import atomic_write_text
    from .gguf import load_gguf

    check_save_target(out, CHECKPOINT, overwrite=overwrite, inputs=[source], what="--out")
    model, tokenizer, template = load_gguf(source, warn=warn)
    save_model(model, out, tokenizer=tokenizer, overwrite=overwrite)
    names: tuple[str, ...] = (CONFIG_FILE, WEIGHTS_FILE, *TOKENIZER_FILES)
    if template is not None:
        atomic_write_text(Path(out) / "tokenizer_config.json", json.dumps({"chat_template": template}, indent=2)
                          + "\n")
        names += ("tokenizer_config.json",)
    return _written(out, names)
