"""LoRA adapters in Hugging Face PEFT's format: ``adapter_config.json`` + ``adapter_model.safetensors``.

For a model Hugging Face's ``GPT2LMHeadModel`` can hold (``convert --to-hf``), the tensors are named as PEFT
names them there, so ``PeftModel.from_pretrained(GPT2LMHeadModel..., DIR)`` loads a tinygpt adapter and tinygpt
loads one trained with peft:

    trf_blocks.{i}.att.qkv.lora_A.qkv        <-> base_model.model.transformer.h.{i}.attn.c_attn.lora_A.weight
    trf_blocks.{i}.att.out_proj.lora_B...    <-> base_model.model.transformer.h.{i}.attn.c_proj.lora_B.weight
    trf_blocks.{i}.ff.layers.0 / 2 ...       <-> ...mlp.c_fc / mlp.c_proj...

A and B keep their shapes ([r, in], [out, r]) in both: GPT-2's ``Conv1D`` stores W transposed, which PEFT
handles with ``fan_in_fan_out=True`` (the update is transposed, not the factors). Other variants (SwiGLU's gate
and up halves, RoPE, RMSNorm) have no GPT-2 form; their tensors keep tinygpt's names under the same prefix.

``tinygpt_adapter.json`` beside them holds what PEFT's config has no field for (the target names, QLoRA's NF4,
the base model's config); an adapter without it (one written by peft) is read from PEFT's config and tensor names.
The base is referenced, not copied: ``base_model_name_or_path`` is the folder or hub name it was trained on (a
local folder relative to the adapter's own folder, so the two can move together; ``resolve_base`` reads it back).
A fine-tuning run saves its tokenizer beside the adapter, as trl does: its ``tokenizer_config.json`` carries the
chat template the adapter was trained in, which the base does not have (``interop.pretrained.load_adapted``).
A reward model's scalar head, trained whole beside the adapter, is saved as PEFT saves a sequence-classification
head (``task_type`` SEQ_CLS, ``modules_to_save: ["score"]``, ``base_model.model.score.weight``) and read back into
``Adapter.modules``; any other ``modules_to_save`` is refused.
A wrong or unknown tensor name is a ``ValueError`` here, never an adapter silently left at its initial value (which
is what peft does with a name it does not expect).
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..config import GPTConfig
from ..fileio import ADAPTER, atomic_write_text, read_json_object, save_into
from ..tokenizer import TOKENIZER_FILES, Tokenizer
from ..lora import LoRAConfig, apply_lora, load_lora_state_dict, lora_state_dict
from .hf import tinygpt_config_to_hf

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
TINYGPT_FILE = "tinygpt_adapter.json"
ADAPTER_FILES = (CONFIG_FILE, WEIGHTS_FILE, TINYGPT_FILE)
PREFIX = "base_model.model."
GPT2_MODULES = {"qkv": "attn.c_attn", "out_proj": "attn.c_proj", "ffn_in": "mlp.c_fc", "ffn_out": "mlp.c_proj"}
_MODULE_PATHS = {"qkv": "att.qkv", "out_proj": "att.out_proj", "ffn_in": "ff.layers.0", "ffn_out": "ff.layers.2"}
_OURS = re.compile(r"trf_blocks\.(\d+)\.(.+)\.lora_([AB])\.(\w+)")
SEQ_CLS_MODULES = ("classifier", "score")  # PEFT's modules_to_save for task_type SEQ_CLS; GPT-2's head is score
_GPT2_KEY = re.compile(r"base_model\.model\.transformer\.h\.(\d+)\.(attn\.c_attn|attn\.c_proj|mlp\.c_fc|mlp\.c_proj)"
                       r"\.lora_([AB])\.weight")


@dataclass
class Adapter:
    """An adapter as read from its folder: its ``LoRAConfig``, tensors by tinygpt's names, and the base it names."""

    config: LoRAConfig
    state: dict[str, torch.Tensor]
    base: str | None
    model_config: GPTConfig | None
    modules: dict[str, torch.Tensor] = field(default_factory=dict)  # modules_to_save's tensors: {"score.weight": ..}
    extra: dict[str, Any] = field(default_factory=dict)  # tinygpt_adapter.json's other keys (a reward head's bias)


def is_adapter(directory: str | Path) -> bool:
    """True when ``directory`` holds an adapter (``adapter_config.json``)."""
    return (Path(directory) / CONFIG_FILE).is_file()


def has_gpt2_form(config: GPTConfig) -> bool:
    """Whether the model (and so its adapter) has a Hugging Face GPT-2 form."""
    try:
        tinygpt_config_to_hf(config)
    except ValueError:
        return False
    return True


def _to_peft_name(name: str, gpt2: bool) -> str:
    layer, path, ab, part = _OURS.fullmatch(name).groups()
    if gpt2:
        return f"{PREFIX}transformer.h.{layer}.{GPT2_MODULES[part]}.lora_{ab}.weight"
    return f"{PREFIX}{name}.weight"


def _adapter_files(model: nn.Module, base: str | Path | None, modules: dict[str, torch.Tensor] | None = None,
                   extra: dict[str, Any] | None = None
                   ) -> tuple[dict[str, torch.Tensor], dict[str, Any], dict[str, Any]]:
    """(tensors by PEFT's names, adapter_config.json, tinygpt_adapter.json) of ``model``'s adapters; ``modules``:
    the tensors of a sequence-classification head trained whole (``{"score.weight": [1, D]}``), saved as PEFT saves
    ``modules_to_save`` (``base_model.model.score.weight``, ``task_type`` SEQ_CLS); ``extra``: more keys for
    tinygpt_adapter.json."""
    config: LoRAConfig | None = getattr(model, "lora_config", None)
    if config is None:
        raise ValueError("the model has no LoRA adapters (apply_lora first)")
    ours_state = lora_state_dict(model)
    base = base if base is not None else getattr(model, "lora_base", None)
    gpt2 = has_gpt2_form(model.config) and all(t in GPT2_MODULES for t in config.targets)
    state = {_to_peft_name(name, gpt2): t.to("cpu").contiguous() for name, t in ours_state.items()}
    targets = ([GPT2_MODULES[t] for t in config.targets] if gpt2
               else sorted({_OURS.fullmatch(n).group(2) for n in ours_state}))
    peft_config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": None if base is None else str(base),
        "r": config.r, "lora_alpha": config.alpha, "lora_dropout": config.dropout, "target_modules": targets,
        "fan_in_fan_out": gpt2, "bias": "none", "use_rslora": False, "use_dora": False, "modules_to_save": None,
        "init_lora_weights": True, "inference_mode": True, "rank_pattern": {}, "alpha_pattern": {},
        "layers_to_transform": None, "layers_pattern": None, "revision": None,
    }
    if modules:
        names = sorted({key.split(".", 1)[0] for key in modules})
        if not set(names) <= set(SEQ_CLS_MODULES):
            raise ValueError(f"modules_to_save {names} are not supported (only a sequence-classification head: "
                             f"{list(SEQ_CLS_MODULES)})")
        state.update({PREFIX + key: t.detach().to("cpu").contiguous() for key, t in modules.items()})
        peft_config.update(task_type="SEQ_CLS", modules_to_save=names)
    ours = {"lora": config.to_dict(), "model_config": json.loads(model.config.to_json()), **(extra or {})}
    return state, peft_config, ours


def portable_base(base: str | Path | None, directory: str | Path) -> str | None:
    """How an adapter saved in ``directory`` names ``base``: a local folder as a path relative to ``directory``
    (POSIX separators; the adapter and its base can move together, as a run folder beside its base does), a hub
    name as it is. ``resolve_base`` reads it back."""
    if base is None or not Path(base).is_dir():
        return None if base is None else str(base)
    target, home = Path(base).resolve(), Path(directory).resolve()
    try:
        relative = Path(os.path.relpath(target, home)).as_posix()
    except ValueError:  # another drive (Windows): no relative path exists
        return str(target)
    return relative if relative.startswith("..") else f"./{relative}"  # "./x": a folder, never a hub name


def resolve_base(recorded: str | None, directory: str | Path) -> str | None:
    """The base an adapter in ``directory`` names (``base_model_name_or_path``), as a path that opens from here:
    a relative one is taken from the adapter's folder (tinygpt writes it so); an absolute path or a hub name as
    recorded (peft writes those)."""
    if recorded is None:
        return None
    if recorded.startswith(("./", "../")) or recorded in (".", ".."):
        return os.path.normpath(os.path.join(str(directory), recorded))
    return recorded


def write_adapter_files(model: nn.Module, directory: str | Path, *, base: str | Path | None = None,
                        tokenizer: Tokenizer | None = None, home: str | Path | None = None,
                        modules: dict[str, torch.Tensor] | None = None, extra: dict[str, Any] | None = None) -> None:
    """Write the adapter's files (and ``tokenizer``'s, with its chat template) into ``directory``, a folder the
    caller stages (a training run's ``step-N/``); ``home``: the folder the files end up in (default
    ``directory``), from which the base is named (``portable_base``); ``modules``, ``extra``: as ``_adapter_files``
    says (a reward model's head). ``save_adapter`` is the user-facing save."""
    from safetensors.torch import save_file

    base = base if base is not None else getattr(model, "lora_base", None)
    state, peft_config, ours = _adapter_files(model, portable_base(base, home if home is not None else directory),
                                              modules, extra)
    directory = Path(directory)
    if tokenizer is not None:
        tokenizer.save(directory)
    save_file(state, directory / WEIGHTS_FILE, metadata={"format": "pt", "producer": "tinygpt"})
    atomic_write_text(directory / TINYGPT_FILE, json.dumps(ours, indent=2) + "\n")
    atomic_write_text(directory / CONFIG_FILE, json.dumps(peft_config, indent=2) + "\n")


def save_adapter(model: nn.Module, directory: str | Path, *, base: str | Path | None = None,
                 overwrite: bool = False, tokenizer: Tokenizer | None = None,
                 modules: dict[str, torch.Tensor] | None = None, extra: dict[str, Any] | None = None) -> None:
    """Write the adapters of ``model`` (made by ``apply_lora``) into ``directory`` in PEFT's format; ``base``: the
    folder or hub name of the base model (default: the one ``adapt`` recorded), written as
    ``base_model_name_or_path`` (a local folder relative to ``directory``: ``portable_base``); ``tokenizer`` (with
    the chat template the adapter was trained in) is saved beside it; ``modules``, ``extra``: a head trained whole
    (``_adapter_files``). Saved through ``fileio.save_into`` (``adapter_config.json`` last; other files kept)."""
    state, _, _ = _adapter_files(model, base, modules, extra)  # errors before anything is created
    needed = sum(t.numel() * t.element_size() for t in state.values())
    with save_into(directory, ADAPTER, overwrite=overwrite, needed_bytes=needed, what="output folder",
                   replaces=TOKENIZER_FILES if tokenizer is not None else ()) as tmp:
        write_adapter_files(model, tmp, base=base, tokenizer=tokenizer, home=directory, modules=modules, extra=extra)


def _check_peft_config(peft: dict[str, Any], path: Path) -> None:
    """``ValueError`` for the PEFT features tinygpt's LoRA does not have (each would change the function)."""
    if peft.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{path}: peft_type {peft.get('peft_type')!r} is not supported (only LORA)")
    for key in ("use_dora", "use_qalora"):
        if peft.get(key):
            raise ValueError(f"{path}: {key}=true is not supported (plain LoRA only)")
    for key in ("rank_pattern", "alpha_pattern"):
        if peft.get(key):
            raise ValueError(f"{path}: a per-module {key} is not supported (one rank and alpha for all)")
    if peft.get("bias", "none") != "none" or peft.get("lora_bias"):
        raise ValueError(f"{path}: trained biases (bias={peft.get('bias')!r}) are not supported (bias='none')")
    if peft.get("modules_to_save") and (peft.get("task_type") != "SEQ_CLS"
                                        or not set(peft["modules_to_save"]) <= set(SEQ_CLS_MODULES)):
        raise ValueError(f"{path}: modules_to_save={peft['modules_to_save']!r} is not supported (only a "
                         f"sequence-classification head, task_type SEQ_CLS: {list(SEQ_CLS_MODULES)})")


def read_adapter(directory: str | Path) -> Adapter:
    """Read an adapter folder (tinygpt's or peft's): its config, tensors under tinygpt's names and base reference."""
    from safetensors.torch import load_file

    directory = Path(directory)
    if not is_adapter(directory):
        raise ValueError(f"{directory} is not a LoRA adapter: {CONFIG_FILE} is missing")
    peft = read_json_object(directory / CONFIG_FILE)
    _check_peft_config(peft, directory / CONFIG_FILE)
    weights = directory / WEIGHTS_FILE
    if not weights.is_file():
        raise ValueError(f"{directory}: {WEIGHTS_FILE} is missing (adapter_model.bin is pickle: not read)")
    try:
        raw = load_file(str(weights))
    except Exception as err:  # SafetensorError is not a ValueError
        raise ValueError(f"{weights}: not a valid safetensors file: {err}") from None
    ours = read_json_object(directory / TINYGPT_FILE) if (directory / TINYGPT_FILE).is_file() else None
    state: dict[str, torch.Tensor] = {}
    modules: dict[str, torch.Tensor] = {}
    targets: dict[int, set[str]] = {}
    by_hf = {hf: ours_name for ours_name, hf in GPT2_MODULES.items()}
    saved = tuple(f"{PREFIX}{m}." for m in peft.get("modules_to_save") or ())
    for key, tensor in raw.items():
        match = _GPT2_KEY.fullmatch(key)
        if saved and key.startswith(saved):
            modules[key[len(PREFIX):]] = tensor
            continue
        if match:
            layer, module, ab = match.groups()
            target = by_hf[module]
            name = f"trf_blocks.{layer}.{_MODULE_PATHS[target]}.lora_{ab}.{target}"
        elif key.startswith(PREFIX) and key.endswith(".weight") and _OURS.fullmatch(key[len(PREFIX):-7]):
            name = key[len(PREFIX):-7]
            layer, target = _OURS.fullmatch(name).group(1), _OURS.fullmatch(name).group(4)
        else:
            raise ValueError(f"{weights}: unexpected tensor {key!r}: not a LoRA factor of a GPT-2 block "
                             f"(expected names like {PREFIX}transformer.h.0.attn.c_attn.lora_A.weight)")
        state[name] = tensor
        targets.setdefault(int(layer), set()).add(target)
    if not state:
        raise ValueError(f"{weights}: holds no LoRA tensors")
    if len({frozenset(t) for t in targets.values()}) != 1 or sorted(targets) != list(range(len(targets))):
        raise ValueError(f"{weights}: adapts different modules in different layers (layers_to_transform): "
                         f"tinygpt adapts the same targets in every layer")
    if ours is not None:
        config = LoRAConfig.from_dict(ours.get("lora", {}))
        model_config = GPTConfig.from_dict(ours["model_config"]) if "model_config" in ours else None
    else:
        r, alpha = peft.get("r", 8), peft.get("lora_alpha", 8)
        if peft.get("use_rslora"):
            alpha = alpha * math.sqrt(r)  # rsLoRA scales by alpha / sqrt(r): the same as alpha * sqrt(r) / r
        order = [t for t in GPT2_MODULES if t in targets[0]]
        config = LoRAConfig(r=r, alpha=alpha, dropout=peft.get("lora_dropout", 0.0), targets=tuple(order))
        model_config = None
    extra = {k: v for k, v in (ours or {}).items() if k not in ("lora", "model_config")}
    return Adapter(config, state, resolve_base(peft.get("base_model_name_or_path"), directory), model_config,
                   modules, extra)


def load_adapter(model: nn.Module, directory: str | Path, *, quantize: str | None = None) -> nn.Module:
    """Wrap ``model`` (a plain ``GPTModel``, the adapter's base) with the adapter in ``directory``, in place.

    ``quantize`` (``"nf4"``) holds the base in NF4 (QLoRA) whatever the adapter was trained with; None keeps the
    adapter's own choice. Returns the model, frozen but for the adapters."""
    adapter = read_adapter(directory)
    if adapter.model_config is not None and adapter.model_config != model.config:
        raise ValueError(f"{directory}: the adapter was trained on a model of another config than this base")
    config = adapter.config if quantize is None else LoRAConfig(**{**adapter.config.to_dict(), "quantize": quantize})
    apply_lora(model, config)
    load_lora_state_dict(model, adapter.state, source=str(Path(directory) / WEIGHTS_FILE))
    return model
