"""Hugging Face GPT-2 <-> tinygpt weight names.

HF GPT-2 stores its linears as ``Conv1D`` with weights laid out [in, out]; ``nn.Linear`` (ours) is [out, in], so
the four per-block projections are transposed on the way in and out. Everything else maps one to one:

    transformer.wte / wpe              <-> tok_emb / pos_emb
    transformer.h.{i}.ln_1 / ln_2      <-> trf_blocks.{i}.norm1 / norm2   (weight/bias <-> scale/shift)
    transformer.h.{i}.attn.c_attn      <-> trf_blocks.{i}.att.qkv         (transposed; q, k, v stacked the same way)
    transformer.h.{i}.attn.c_proj      <-> trf_blocks.{i}.att.out_proj    (transposed)
    transformer.h.{i}.mlp.c_fc / c_proj <-> trf_blocks.{i}.ff.layers.0 / 2 (transposed)
    transformer.ln_f                   <-> final_norm
    lm_head                            <-> out_head

GPT-1 (``OpenAIGPTModel``, post-LN) uses the same block names without the ``transformer.`` prefix and with
``tokens_embed`` / ``positions_embed``; ``block_to_tinygpt`` serves both.
"""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from ..config import GPTConfig
from ..fileio import read_json_object
from ..model import GPTModel
from ..tokenizer import HF_GPT2_FILES, HF_TOKENIZER_FILE, HF_TOKENIZER_FILES, Tokenizer, write_hf_tokenizer

_NORMS = {"ln_1": "norm1", "ln_2": "norm2"}
_LINEARS = {"attn.c_attn": "att.qkv", "attn.c_proj": "att.out_proj", "mlp.c_fc": "ff.layers.0", "mlp.c_proj": "ff.layers.2"}


def block_to_tinygpt(hf: dict[str, torch.Tensor], hf_prefix: str, our_prefix: str) -> dict[str, torch.Tensor]:
    """One block's tensors under ``hf_prefix`` (e.g. ``transformer.h.3.``) renamed/transposed to ``our_prefix``."""
    out = {}
    for hf_name, ours in _NORMS.items():
        out[f"{our_prefix}{ours}.scale"] = hf[f"{hf_prefix}{hf_name}.weight"]
        out[f"{our_prefix}{ours}.shift"] = hf[f"{hf_prefix}{hf_name}.bias"]
    for hf_name, ours in _LINEARS.items():
        out[f"{our_prefix}{ours}.weight"] = hf[f"{hf_prefix}{hf_name}.weight"].t()
        out[f"{our_prefix}{ours}.bias"] = hf[f"{hf_prefix}{hf_name}.bias"]
    return out


def block_to_hf(ours: dict[str, torch.Tensor], our_prefix: str, hf_prefix: str) -> dict[str, torch.Tensor]:
    """The inverse of ``block_to_tinygpt``; a missing QKV bias (qkv_bias=False) is written as zeros."""
    out = {}
    for hf_name, name in _NORMS.items():
        out[f"{hf_prefix}{hf_name}.weight"] = ours[f"{our_prefix}{name}.scale"]
        out[f"{hf_prefix}{hf_name}.bias"] = ours[f"{our_prefix}{name}.shift"]
    for hf_name, name in _LINEARS.items():
        weight = ours[f"{our_prefix}{name}.weight"]
        out[f"{hf_prefix}{hf_name}.weight"] = weight.t()
        bias = ours.get(f"{our_prefix}{name}.bias")
        out[f"{hf_prefix}{hf_name}.bias"] = bias if bias is not None else weight.new_zeros(weight.shape[0])
    return out


def gpt2_to_tinygpt(hf: dict[str, torch.Tensor], config: GPTConfig) -> dict[str, torch.Tensor]:
    """A ``GPT2LMHeadModel`` state dict (with the ``transformer.`` prefix) -> a ``GPTModel`` state dict."""
    out = {
        "tok_emb.weight": hf["transformer.wte.weight"],
        "pos_emb.weight": hf["transformer.wpe.weight"],
        "final_norm.scale": hf["transformer.ln_f.weight"],
        "final_norm.shift": hf["transformer.ln_f.bias"],
        "out_head.weight": hf.get("lm_head.weight", hf["transformer.wte.weight"]),
    }
    for i in range(config.n_layers):
        out.update(block_to_tinygpt(hf, f"transformer.h.{i}.", f"trf_blocks.{i}."))
    if not config.qkv_bias:
        for i in range(config.n_layers):
            del out[f"trf_blocks.{i}.att.qkv.bias"]
    return out


def tinygpt_to_gpt2(ours: dict[str, torch.Tensor], config: GPTConfig) -> dict[str, torch.Tensor]:
    """A ``GPTModel`` state dict -> a ``GPT2LMHeadModel`` state dict (``lm_head.weight`` included)."""
    out = {
        "transformer.wte.weight": ours["tok_emb.weight"],
        "transformer.wpe.weight": ours["pos_emb.weight"],
        "transformer.ln_f.weight": ours["final_norm.scale"],
        "transformer.ln_f.bias": ours["final_norm.shift"],
        "lm_head.weight": ours["out_head.weight"],
    }
    for i in range(config.n_layers):
        out.update(block_to_hf(ours, f"trf_blocks.{i}.", f"transformer.h.{i}."))
    return out


# ------------------------------------------------------------------------------------------------ folders
# Hugging Face GPT-2 folders (``GPT2LMHeadModel.save_pretrained`` or a hub snapshot) <-> GPTModel.

HF_WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
_IGNORED_BUFFERS = ("attn.bias", "attn.masked_bias")  # causal-mask buffers that old transformers versions saved
_BLOCK_TENSOR = re.compile(r"h\.(\d+)\.(.+)")
_HUB_NAME = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")
# HF config fields that change what the model computes, with the only values tinygpt computes the same way.
_REQUIRED_HF_VALUES: dict[str, tuple[Any, ...]] = {
    "activation_function": ("gelu_new", "gelu_pytorch_tanh"),  # both are the tanh GELU of layers.GELU
    "scale_attn_weights": (True,),  # scores / sqrt(head_dim)
    "scale_attn_by_inverse_layer_idx": (False,),  # an extra 1 / (layer + 1) on the scores
    "add_cross_attention": (False,),  # encoder-decoder blocks
    "model_type": ("gpt2",),
}
# reorder_and_upcast_attn only changes the precision of the same product (fp16 training); ignored.


def hf_config_to_tinygpt(hf: dict[str, Any], source: str | Path = "config.json") -> GPTConfig:
    """A Hugging Face ``GPT2Config`` dict -> ``GPTConfig`` (qkv_bias=True, tie_weights from the config).

    Fields that change the computation and that tinygpt does not implement are a ``ValueError`` naming them.
    """
    if not isinstance(hf, dict):
        raise ValueError(f"{source}: a config must be a JSON object")
    for name, allowed in _REQUIRED_HF_VALUES.items():
        if name in hf and hf[name] not in allowed:
            raise ValueError(
                f"{source}: {name}={hf[name]!r} is not supported by tinygpt (supported: "
                f"{', '.join(map(repr, allowed))})"
            )
    if hf.get("pruned_heads"):
        raise ValueError(f"{source}: pruned_heads={hf['pruned_heads']!r} is not supported (every head is kept)")
    architectures = hf.get("architectures") or ["GPT2LMHeadModel"]
    unknown = [a for a in architectures if a not in ("GPT2LMHeadModel", "GPT2Model")]
    if unknown:
        raise ValueError(f"{source}: architectures={unknown} is not supported (GPT2LMHeadModel or GPT2Model only)")
    missing = [k for k in ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head") if k not in hf]
    if missing:
        raise ValueError(f"{source}: missing GPT-2 config field(s) {', '.join(missing)}")
    d = hf["n_embd"]
    if hf.get("n_inner") not in (None, 4 * d if isinstance(d, int) else None):
        raise ValueError(f"{source}: n_inner={hf['n_inner']!r} is not supported (tinygpt's feed-forward is 4*n_embd)")
    if hf.get("n_ctx", hf["n_positions"]) != hf["n_positions"]:
        raise ValueError(f"{source}: n_ctx={hf['n_ctx']} differs from n_positions={hf['n_positions']}")
    # GPT2Config's defaults are 0.1; the residual rate is our drop_rate and the others are set only where they differ.
    resid, emb, attn = (hf.get(k, 0.1) for k in ("resid_pdrop", "embd_pdrop", "attn_pdrop"))
    try:
        return GPTConfig(
            vocab_size=hf["vocab_size"], context_length=hf["n_positions"], emb_dim=d, n_heads=hf["n_head"],
            n_layers=hf["n_layer"], drop_rate=resid, drop_rate_emb=None if emb == resid else emb,
            drop_rate_attn=None if attn == resid else attn,
            qkv_bias=True, tie_weights=bool(hf.get("tie_word_embeddings", True)), pre_ln=True,
            norm_eps=hf.get("layer_norm_epsilon", 1e-5),
        )
    except (TypeError, ValueError) as err:
        raise ValueError(f"{source}: {err}") from None


def tinygpt_config_to_hf(config: GPTConfig, eos_token_id: int | None = None) -> dict[str, Any]:
    """``GPTConfig`` -> a ``GPT2Config`` dict. Fields GPT-2 has no equivalent for must hold their defaults.

    ``eos_token_id`` (the tokenizer's end of text; default 50256 for a 50,257-token model) is also GPT-2's bos."""
    if not config.pre_ln:
        raise ValueError("GPT-2 is pre-LN: a post-LN model (pre_ln=False) cannot be exported as GPT2LMHeadModel")
    handled = {"vocab_size", "context_length", "emb_dim", "n_heads", "n_layers", "drop_rate", "drop_rate_emb",
               "drop_rate_attn", "drop_rate_shortcut", "qkv_bias", "tie_weights", "pre_ln", "norm_eps",
               "zero_init_proj"}  # an init: the trained weights export as they are
    for f in dataclasses.fields(GPTConfig):
        if f.name not in handled and getattr(config, f.name) != f.default:
            raise ValueError(
                f"{f.name}={getattr(config, f.name)!r} has no GPT-2 equivalent (GPT-2 needs {f.default!r})"
            )
    eot = eos_token_id if eos_token_id is not None else 50256 if config.vocab_size == 50257 else None
    return {
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
        "vocab_size": config.vocab_size, "n_positions": config.context_length,
        "n_ctx": config.context_length,  # OpenAI's GPT-2 configs carry it; llama.cpp's converter reads it
        "n_embd": config.emb_dim,
        "n_layer": config.n_layers, "n_head": config.n_heads, "n_inner": None,
        "activation_function": "gelu_new", "layer_norm_epsilon": config.norm_eps,
        "resid_pdrop": config.shortcut_dropout, "embd_pdrop": config.emb_dropout, "attn_pdrop": config.attn_dropout,
        "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False,
        "tie_word_embeddings": config.tie_weights, "initializer_range": 0.02,
        "bos_token_id": eot, "eos_token_id": eot, "use_cache": True,
    }


def _hf_name_to_ours(name: str, n_layers: int) -> tuple[str, bool] | None:
    """A GPT-2 tensor name (no ``transformer.`` prefix) -> (our name, transpose?); None for an ignored buffer."""
    top = {"wte.weight": "tok_emb.weight", "wpe.weight": "pos_emb.weight", "ln_f.weight": "final_norm.scale",
           "ln_f.bias": "final_norm.shift", "lm_head.weight": "out_head.weight"}
    if name in top:
        return top[name], False
    match = _BLOCK_TENSOR.fullmatch(name)
    if match and int(match[1]) < n_layers:
        prefix, (module, _, kind) = f"trf_blocks.{int(match[1])}.", match[2].rpartition(".")
        if match[2] in _IGNORED_BUFFERS:
            return None
        if module in _NORMS and kind in ("weight", "bias"):
            return f"{prefix}{_NORMS[module]}.{'scale' if kind == 'weight' else 'shift'}", False
        if module in _LINEARS and kind in ("weight", "bias"):
            return f"{prefix}{_LINEARS[module]}.{kind}", kind == "weight"  # Conv1D [in, out] -> Linear [out, in]
    raise ValueError(f"unexpected tensor {name!r}: not part of a GPT-2 model tinygpt understands")


def _hf_weights_path(directory: Path) -> Path:
    for name in HF_WEIGHT_FILES:
        if (directory / name).is_file():
            return directory / name
    if (directory / "model.safetensors.index.json").is_file():
        raise ValueError(f"{directory}: sharded checkpoints (model.safetensors.index.json) are not supported")
    raise ValueError(f"{directory} holds no GPT-2 weights: expected {' or '.join(HF_WEIGHT_FILES)}")


def _read_hf_tensors(path: Path, transient: Callable[[str], bool]) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs of an HF weights file, one tensor in memory at a time where the format allows.

    safetensors: ``checkpoint.read_safetensors`` (mapped, except the ``transient`` tensors -- the ones about to be
    transposed into new memory -- read into a private buffer that is freed after the transpose).
    """
    if path.suffix == ".safetensors":
        from ..checkpoint import read_safetensors

        yield from read_safetensors(path, transient)
        return
    # weights_only: tensors and plain containers only, never arbitrary objects. mmap avoids a second copy in
    # memory; files from before torch 1.6's zip format cannot be mapped and are read whole.
    try:
        try:
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as err:
            if "mmap" not in str(err):
                raise
            state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # torch raises UnpicklingError / RuntimeError for anything but plain tensors
        raise ValueError(f"{path}: cannot be read as plain tensors (weights_only=True): {err}") from None
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ValueError(f"{path}: expected a dict of tensors")
    while state:
        name = next(iter(state))
        yield name, state.pop(name)


def import_hf(source: str | Path, *, device: str | torch.device = "cpu", dtype: torch.dtype | None = None,
              cache_dir: str | Path | None = None, quantize: str | None = None) -> GPTModel:
    """A Hugging Face GPT-2 folder, or a hub name such as ``gpt2-medium``, as a ``GPTModel`` (eval mode).

    Names with or without the ``transformer.`` prefix are accepted; the four Conv1D weights are transposed; the
    legacy ``attn.bias`` / ``attn.masked_bias`` buffers are skipped; any other unknown tensor, a missing one or a
    wrong shape is a ``ValueError`` naming the file and the key. ``quantize`` (``"nf4"``, ``"nf4-dq"``): the block
    linears become ``NF4Linear``, each quantised as it is read (``checkpoint.model_from_tensors``).
    """
    from ..checkpoint import model_from_state_dict, model_from_tensors

    directory = resolve_hf_source(source, cache_dir=cache_dir)
    config_path = directory / "config.json"
    if not config_path.is_file():
        raise ValueError(f"{directory} is not a Hugging Face GPT-2 folder: config.json is missing")
    hf_config = read_json_object(config_path)
    config = hf_config_to_tinygpt(hf_config, config_path)
    path = _hf_weights_path(directory)
    if quantize is not None:
        from ..quantize import check_quantize

        check_quantize(quantize)
        return model_from_tensors(config, _hf_tensors_as_ours(path, config), source=path, quantize=quantize,
                                  device=device, dtype=dtype)
    return model_from_state_dict(config, dict(_hf_tensors_as_ours(path, config)), source=path, device=device,
                                 dtype=dtype)


def _hf_tensors_as_ours(path: Path, config: GPTConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """(tinygpt name, tensor) for each tensor of an HF GPT-2 weights file, as it is read: Conv1D weights
    transposed, legacy buffers skipped, a stored ``lm_head.weight`` last (dropped when tied, after checking that it
    equals the embedding)."""
    seen: set[str] = set()
    head = embedding = None

    def transposed(name: str) -> bool:
        try:
            mapped = _hf_name_to_ours(name.removeprefix("transformer."), config.n_layers)
        except ValueError:
            return False  # reported by the loop below
        return mapped is not None and mapped[1]

    for name, tensor in _read_hf_tensors(path, transposed):
        short = name.removeprefix("transformer.")
        try:
            mapped = _hf_name_to_ours(short, config.n_layers)
        except ValueError as err:
            raise ValueError(f"{path}: {err}") from None
        if mapped is None:
            continue
        ours, transpose = mapped
        if ours in seen or (ours == "out_head.weight" and head is not None):
            raise ValueError(f"{path}: tensor {name!r} appears twice (with and without the transformer. prefix)")
        if transpose:
            if tensor.dim() != 2:
                raise ValueError(f"{path}: tensor {name!r} has shape {list(tensor.shape)}, a matrix is needed")
            tensor = tensor.t().contiguous()
        if ours == "out_head.weight":
            head = tensor
            continue
        if ours == "tok_emb.weight":
            embedding = tensor
        seen.add(ours)
        yield ours, tensor
        del tensor
    if head is not None:
        if config.tie_weights:
            # HF ties lm_head to wte on load; a stored copy must agree, or the file means two different models.
            if embedding is not None and not torch.equal(head, embedding):
                raise ValueError(f"{path}: 'lm_head.weight' differs from 'wte.weight' but the config ties them")
        else:
            yield "out_head.weight", head


GENERATION_CONFIG_FILE = "generation_config.json"


def export_hf(model: GPTModel, directory: str | Path, tokenizer: Tokenizer | None = None, *,
              overwrite: bool = False, inputs: tuple[str | Path, ...] = ()) -> None:
    """Write ``model`` as a folder that ``transformers.GPT2LMHeadModel.from_pretrained`` loads exactly.

    ``config.json`` + ``model.safetensors`` (``transformer.``-prefixed names, Conv1D layout, ``lm_head.weight`` only
    when untied). A model without QKV bias gets zero biases (the same function). A GPT-2 or BPE ``tokenizer`` adds
    its files in Hugging Face's form (``tokenizer.write_hf_tokenizer``) and its end-of-text id becomes the eos of
    config.json and generation_config.json, so ``transformers.pipeline("text-generation", model=directory)`` runs
    as is; a character tokenizer has no such form: ``ValueError``. Saved by ``fileio.save_into``: a folder holding
    anything but a Hugging Face model is refused unless ``overwrite``; ``inputs`` (the source) may not contain it.
    """
    from safetensors.torch import save_file

    from ..fileio import HF_MODEL, atomic_write_text, save_into

    if not isinstance(model, GPTModel):
        raise TypeError(f"model must be a GPTModel, got {type(model).__name__}")
    if tokenizer is not None and tokenizer.kind == "char":
        raise ValueError("a char tokenizer has no Hugging Face form (only GPT-2's and a trained BPE do)")
    eos = tokenizer.eot_id if tokenizer is not None else None
    hf_config = tinygpt_config_to_hf(model.config, eos_token_id=eos)
    ours = {name: t.detach().to("cpu") for name, t in model.state_dict().items()}
    state = {name: t.contiguous() for name, t in tinygpt_to_gpt2(ours, model.config).items()}
    if model.config.tie_weights:
        del state["lm_head.weight"]  # the same tensor as wte: written once, HF re-ties it on load
    needed = sum(t.numel() * t.element_size() for t in state.values())
    with save_into(directory, HF_MODEL, overwrite=overwrite, inputs=inputs, needed_bytes=needed,
                   replaces=(*HF_TOKENIZER_FILES, GENERATION_CONFIG_FILE), what="output folder") as tmp:
        atomic_write_text(tmp / "config.json", json.dumps(hf_config, indent=2) + "\n")
        save_file(state, tmp / "model.safetensors", metadata={"format": "pt"})
        if tokenizer is not None:
            write_hf_tokenizer(tokenizer, tmp, model_max_length=model.config.context_length)
        if hf_config["eos_token_id"] is not None:
            ids = {k: hf_config["eos_token_id"] for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
            atomic_write_text(tmp / GENERATION_CONFIG_FILE, json.dumps(ids, indent=2) + "\n")


def looks_local(name: str) -> bool:
    """Whether ``name`` is meant as a path rather than a hub name: it starts with ``./``, ``../``, ``/`` or ``~``,
    holds a backslash or a drive, ends with a file suffix tinygpt reads (``.gguf``), or its first component is a
    folder that exists here (``runs/nope`` beside ``runs/``)."""
    if name.startswith(("./", "../", "/", "~", ".\\", "..\\")) or "\\" in name or ":" in name:
        return True
    if name.lower().endswith(".gguf"):
        return True
    first = name.split("/", 1)[0]
    return "/" in name and Path(first).is_dir()


def resolve_hf_source(source: str | Path, *, cache_dir: str | Path | None = None) -> Path:
    """A local folder as is; otherwise a hub repository name, downloaded (or found in the local HF cache). A name
    that ``looks_local`` and is not there is "no such folder" (not a hub lookup that fails over the network)."""
    path = Path(source)
    if path.is_dir():
        return path
    name = str(source)
    if looks_local(name) and not path.exists():
        kind = "file" if name.lower().endswith(".gguf") else "folder"
        where = path.expanduser().absolute()
        raise ValueError(f"{name}: no such {kind}" + (f" (looked for at {where})" if str(where) != name else ""))
    if not _HUB_NAME.match(name) or path.exists():
        raise ValueError(f"{name} is neither a directory nor a Hugging Face hub name such as 'gpt2' or 'gpt2-medium'")
    return _download_from_hub(name, cache_dir)


_HUB_PROBE_SECONDS = 3.0


def _hub_unreachable() -> str | None:
    """Why the hub cannot be reached (offline mode, no route, no DNS), or None when a connection opens at once.

    huggingface_hub retries a dead network five times with backoff (tens of seconds); one short connection attempt
    tells the same thing now."""
    import socket
    from urllib.parse import urlparse

    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE:
        return "HF_HUB_OFFLINE is set"
    url = urlparse(constants.ENDPOINT)
    try:
        socket.create_connection((url.hostname, url.port or (443 if url.scheme == "https" else 80)),
                                 timeout=_HUB_PROBE_SECONDS).close()
    except OSError as err:
        return f"no connection to {url.hostname}: {err.strerror or err}"
    return None


def _download_from_hub(repo_id: str, cache_dir: str | Path | None) -> Path:
    """The folder of ``repo_id``'s files: from the local HF cache when it holds them, else downloaded."""
    import huggingface_hub
    from huggingface_hub.errors import EntryNotFoundError, LocalEntryNotFoundError, RepositoryNotFoundError

    def fetch_all(local_only: bool) -> Path:
        def fetch(filename: str) -> Path:
            return Path(huggingface_hub.hf_hub_download(repo_id, filename, cache_dir=cache_dir,
                                                        local_files_only=local_only))

        directory = fetch("config.json").parent
        for weights in HF_WEIGHT_FILES:
            try:
                fetch(weights)
                break
            except LocalEntryNotFoundError:  # offline and not cached: a subclass of EntryNotFoundError, not "absent"
                raise
            except EntryNotFoundError:  # the repository has no such file: try the next format
                continue
        for optional in (*HF_GPT2_FILES, HF_TOKENIZER_FILE):
            try:
                fetch(optional)
            except EntryNotFoundError:  # absent, or offline and not cached: the tokenizer is optional
                pass
        return directory

    def unavailable(reason: str) -> ValueError:
        offline = reason.startswith("HF_HUB_OFFLINE")
        advice = "" if offline else "set HF_HUB_OFFLINE=1 to use only the local cache (no network wait), or "
        return ValueError(
            f"{repo_id!r} is not a local folder, and tinygpt cannot fetch {repo_id!r} from the Hugging Face hub "
            f"({reason}{', and it is not in the local cache' if offline else ''}); {advice}pass a folder holding "
            f"config.json + model.safetensors + vocab.json + merges.txt")

    try:
        return fetch_all(local_only=True)  # a cached repository needs no network at all
    except Exception:  # not (wholly) cached: huggingface_hub raises several unrelated types
        pass
    reason = _hub_unreachable()
    if reason is not None:
        raise unavailable(reason) from None
    try:
        return fetch_all(local_only=False)
    except RepositoryNotFoundError:
        raise ValueError(f"{repo_id!r} is not a local directory nor a repository on the Hugging Face hub") from None
    except Exception as err:  # a network that failed midway: huggingface_hub raises several unrelated types
        raise unavailable(type(err).__name__) from None


# The Llama converter (RMSNorm, SwiGLU, RoPE, GQA) lives in its own module; these names make it reachable from here.
from .llama import from_llama_state_dict, llama_config_to_tinygpt, load_llama_folder  # noqa: E402,F401
