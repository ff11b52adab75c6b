"""tinygpt's checkpoint format: a directory with ``config.json`` + ``model.safetensors`` (+ the tokenizer's files).

- ``config.json`` is exactly ``GPTConfig.to_json()``; ``model.safetensors`` holds the persistent state dict. A tied
  head is the token embedding itself, so ``out_head.weight`` is written once, as ``tok_emb.weight``.
- A save goes through ``fileio.save_into``: the files are staged inside the target folder and each is renamed onto
  its name (``config.json`` last); files the save did not write are kept, and a folder that holds something else (a
  Hugging Face model, a prepared corpus, unrelated files) is refused unless ``overwrite=True``.
- Loading is strict and runs no code: safetensors is a JSON header plus raw bytes (no pickle). Every key, shape and
  dtype is checked against the config before anything is copied; any mismatch is a ``ValueError`` naming the file
  and the key. The model is built on the meta device and the loaded tensors are assigned into it
  (``load_state_dict(assign=True)``), so peak memory is one copy of the weights, not two.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path
from typing import Callable, Iterable, Iterator, Mapping, Sequence

import torch

from .config import GPTConfig
from .fileio import CHECKPOINT, atomic_write_text, save_into
from .model import GPTModel
from .tokenizer import TOKENIZER_FILES, Tokenizer, find_descriptor, load_tokenizer

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
_TIED_KEY = "out_head.weight"


def _expected_shapes(model: GPTModel) -> dict[str, torch.Size]:
    """Persistent tensors the file must hold, with their shapes (the tied head is not stored)."""
    shapes = {name: t.shape for name, t in model.state_dict().items()}
    if model.config.tie_weights:
        del shapes[_TIED_KEY]
    return shapes


def _check_save_arguments(model: GPTModel, tokenizer: Tokenizer | None) -> None:
    if not isinstance(model, GPTModel):
        raise TypeError(f"model must be a GPTModel, got {type(model).__name__}")
    if tokenizer is not None and not isinstance(tokenizer, Tokenizer):
        raise TypeError(f"tokenizer must be a tinygpt Tokenizer, got {type(tokenizer).__name__}")
    if tokenizer is not None and tokenizer.vocab_size > model.config.vocab_size:
        raise ValueError(
            f"the tokenizer has {tokenizer.vocab_size} tokens but the model's vocab_size is {model.config.vocab_size}"
        )
    if model.config.tie_weights and model.out_head.weight.data_ptr() != model.tok_emb.weight.data_ptr():
        raise ValueError("config.tie_weights is true but out_head.weight is no longer tok_emb.weight; "
                         "re-tie them (model.out_head.weight = model.tok_emb.weight) before saving")


def _state_to_save(model: GPTModel, tokenizer: Tokenizer | None) -> dict[str, torch.Tensor]:
    """The tensors ``model.safetensors`` holds (CPU, contiguous, a tied head once), after checking the arguments."""
    _check_save_arguments(model, tokenizer)
    raw = model.state_dict()
    if model.config.tie_weights:
        del raw[_TIED_KEY]  # the same tensor as tok_emb.weight: stored once
    return {name: t.detach().to("cpu").contiguous() for name, t in raw.items()}


def write_checkpoint_files(model: GPTModel, directory: str | Path, tokenizer: Tokenizer | None = None) -> None:
    """Write the checkpoint's files (config, weights, tokenizer) into ``directory``, a folder the caller stages
    (``fileio.save_into`` or ``fileio.atomic_directory``); ``save_model`` is the user-facing save."""
    from safetensors.torch import save_file

    state = _state_to_save(model, tokenizer)
    directory = Path(directory)
    atomic_write_text(directory / CONFIG_FILE, model.config.to_json() + "\n")
    save_file(state, directory / WEIGHTS_FILE, metadata={"format": "pt", "producer": "tinygpt"})
    if tokenizer is not None:
        tokenizer.save(directory)


def save_model(model: GPTModel, directory: str | Path, tokenizer: Tokenizer | None = None, *,
               overwrite: bool = False) -> None:
    """Write ``model`` (and ``tokenizer``) as a checkpoint in ``directory`` (created if missing).

    Each file is replaced atomically, ``config.json`` last; other files in the folder are kept, and the tokenizer
    files of an earlier checkpoint there that this one lacks are removed. A folder holding anything but a tinygpt
    checkpoint or run (a Hugging Face model, a prepared corpus, unrelated files) is an ``OutputError`` unless
    ``overwrite=True``, which writes the checkpoint's files beside what is there.
    """
    _check_save_arguments(model, tokenizer)  # argument errors before anything is created
    needed = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    with save_into(directory, CHECKPOINT, overwrite=overwrite, replaces=TOKENIZER_FILES, needed_bytes=needed,
                   what="output folder") as tmp:
        write_checkpoint_files(model, tmp, tokenizer)


def load_config(directory: str | Path) -> GPTConfig:
    """The validated ``GPTConfig`` of a checkpoint directory."""
    path = Path(directory) / CONFIG_FILE
    if not path.is_file():
        raise ValueError(f"{Path(directory)} is not a tinygpt checkpoint: {CONFIG_FILE} is missing")
    try:
        return GPTConfig.from_file(path)  # its errors already name the file and the key
    except ValueError as err:
        if '"model_type"' in path.read_text(encoding="utf-8", errors="replace"):  # transformers writes this key
            raise ValueError(
                f"{Path(directory)} holds a Hugging Face model, not a tinygpt checkpoint: convert it with "
                f"`tinygpt convert --from-hf {directory} --out DIR` (or load it with tinygpt.interop.hf.import_hf)"
            ) from None
        raise err from None


MIN_BYTES_PER_PARAMETER = 0.5  # the smallest any stored weight takes (4-bit)


def check_config_fits(config: GPTConfig, file_bytes: int, source: str | Path) -> None:
    """Refuse a config whose parameters cannot be in a file of ``file_bytes`` (at least half a byte each), from
    the formula, before any model is built for it (a config claiming 20,000 blocks or ``emb_dim`` 2^40 took
    minutes, or a traceback, to find out)."""
    from .params import count_parameters

    total = count_parameters(config).total
    if total * MIN_BYTES_PER_PARAMETER > file_bytes:
        raise ValueError(f"{source}: the config describes {total:,} parameters, which need at least "
                         f"{int(total * MIN_BYTES_PER_PARAMETER):,} bytes; the file has {file_bytes:,}")


def _whole_header(path: Path) -> bool:
    """A safetensors file at least as long as its header says (8 bytes of length, then the JSON header)."""
    if not path.is_file():
        return False
    with open(path, "rb") as file:
        head = file.read(8)
        return len(head) == 8 and 8 + struct.unpack("<Q", head)[0] <= file.seek(0, 2)


def check_names_and_shapes(source: str | Path, shapes: Mapping[str, Sequence[int]],
                           expected: Mapping[str, Sequence[int]]) -> None:
    """Raise a ``ValueError`` naming ``source`` and the first missing, unexpected or mis-shaped tensor."""
    missing = sorted(set(expected) - set(shapes))
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ValueError(f"{source}: missing tensor {missing[0]!r}{more}")
    unexpected = sorted(set(shapes) - set(expected))
    if unexpected:
        raise ValueError(f"{source}: unexpected tensor {unexpected[0]!r} (not part of a GPTModel with this config)")
    for name, shape in expected.items():
        if tuple(shapes[name]) != tuple(shape):
            raise ValueError(
                f"{source}: tensor {name!r} has shape {list(shapes[name])}, the config needs {list(shape)}"
            )


def _read_weights(path: Path, expected: dict[str, torch.Size], device: str) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    if not path.is_file():
        raise ValueError(f"{path.parent} is not a tinygpt checkpoint: {WEIGHTS_FILE} is missing")
    try:
        handle = safe_open(str(path), framework="pt", device=str(device))
    except Exception as err:  # safetensors raises its own SafetensorError (not a ValueError) on a corrupt header
        raise ValueError(f"{path}: not a valid safetensors file (truncated or corrupt): {err}") from None
    with handle as f:
        # Names and shapes come from the header: check them all before reading a single tensor.
        check_names_and_shapes(path, {name: f.get_slice(name).get_shape() for name in f.keys()}, expected)
        state = {}
        for name in expected:
            try:
                state[name] = f.get_tensor(name)
            except Exception as err:
                raise ValueError(f"{path}: cannot read tensor {name!r}: {err}") from None
    return state


SAFETENSORS_FLOATS = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def read_safetensors(path: Path, private: Callable[[str], bool]) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs of a safetensors file, in the file's order, one tensor read at a time.

    A tensor comes straight from the file's copy-on-write mapping (no copy), except those for which
    ``private(name)`` is true -- the ones about to be turned into new memory (transposed, quantised): they are read
    into a private buffer instead, freed once the caller drops it. Mapped pages, once read, stay resident while the
    mapping lives, so a mapped-then-copied tensor would count twice in the process's memory.
    """
    from safetensors import safe_open

    try:
        handle = safe_open(str(path), framework="pt", device="cpu")  # validates the header and the offsets
    except Exception as err:  # SafetensorError is not a ValueError
        raise ValueError(f"{path}: not a valid safetensors file (truncated or corrupt): {err}") from None
    with handle as f, open(path, "rb") as raw:
        (header_len,) = struct.unpack("<Q", raw.read(8))  # the format: u64 header length, JSON header, data
        header = json.loads(raw.read(header_len))
        for name in f.keys():
            info = header[name]
            dtype = SAFETENSORS_FLOATS.get(info["dtype"])
            start, end = info["data_offsets"]
            if not private(name) or dtype is None or end == start:
                yield name, f.get_tensor(name)
                continue
            buffer = bytearray(end - start)
            raw.seek(8 + header_len + start)
            raw.readinto(buffer)
            yield name, torch.frombuffer(buffer, dtype=dtype).view(info["shape"])
            del buffer  # the caller's reference, if it kept one, is the only one left


def _floating(source: str | Path, name: str, tensor: torch.Tensor) -> torch.Tensor:
    if not tensor.is_floating_point():
        raise ValueError(f"{source}: tensor {name!r} has dtype {tensor.dtype}, a floating dtype is needed")
    return tensor


def _tie_and_check(model: GPTModel, config: GPTConfig, tied_head: bool = True) -> GPTModel:
    if config.tie_weights and tied_head:
        model.out_head.weight = model.tok_emb.weight  # assign made two Parameters: make them one again
    # The model holds no buffers (its causal mask is built per call), so nothing else is left on meta; were one added,
    # this says so instead of running with a meta tensor.
    still_meta = [name for name, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if still_meta:
        raise RuntimeError(f"load_model left tensors on the meta device: {still_meta}")
    return model.eval()


def model_from_tensors(config: GPTConfig, tensors: Iterable[tuple[str, torch.Tensor]], *, source: str | Path,
                       quantize: str | None = None, weights: str = "float32", device: str | torch.device = "cpu",
                       dtype: torch.dtype | None = None) -> GPTModel:
    """A ``GPTModel`` built from (name, tensor) pairs as they come, whose linears are made smaller as they arrive:
    each float weight is turned into its small module at once and can be freed before the next is read, so the
    float weights are never whole in memory.

    ``quantize`` (``quantize.QUANTIZE_CHOICES``): the block linears become ``NF4Linear`` (QLoRA's loader; the bytes
    ``quantize.quantize_linears`` gives the float model). ``weights`` (``"bfloat16"`` or ``"int8"``, inference):
    the block linears and the head become ``fast.weights``' ``Bf16Linear`` / ``Int8Linear``, the values
    ``convert_weights`` gives the float model (a tied head gets its own small copy of the embedding, which stays
    float32). The other tensors become the model's parameters as in ``model_from_state_dict`` (moved/cast only when
    asked). Names and shapes are checked as there.
    """
    from torch import nn

    from .quantize import NF4Linear, block_linears, is_double_quant, replace_linear

    if (quantize is None) == (weights == "float32"):
        raise ValueError(f"model_from_tensors makes the linears small one way: quantize={quantize!r} or weights="
                         f"{weights!r} (bfloat16, int8), exactly one")
    device = torch.device(device)
    with torch.device("meta"):
        model = GPTModel(config)
    expected = _expected_shapes(model)
    linears = set(block_linears(model))
    if quantize is not None:
        def small(weight: torch.Tensor) -> nn.Module:
            return NF4Linear(weight, None, double_quant=is_double_quant(quantize))
    else:
        from .fast.weights import Bf16Linear, Int8Linear, check_weight_type

        check_weight_type(weights)
        kind = Bf16Linear if weights == "bfloat16" else Int8Linear

        def small(weight: torch.Tensor) -> nn.Module:
            return kind(weight, None)
        if not config.tie_weights:
            linears.add("out_head")
    shapes: dict[str, torch.Size] = {}
    state: dict[str, torch.Tensor] = {}
    for name, tensor in tensors:
        if name in shapes:
            raise ValueError(f"{source}: tensor {name!r} appears twice")
        shapes[name] = tensor.shape
        module, _, leaf = name.rpartition(".")
        if name in expected and tuple(tensor.shape) != tuple(expected[name]):
            check_names_and_shapes(source, {name: tensor.shape}, {name: expected[name]})
        tensor = _floating(source, name, tensor).to(device=device, dtype=dtype or tensor.dtype)
        if module in linears and leaf == "weight":
            replace_linear(model, module, small(tensor))
        else:
            state[name] = tensor
            if name == "tok_emb.weight" and config.tie_weights and quantize is None:
                replace_linear(model, "out_head", small(tensor))  # the tied head's own small copy
        del tensor  # a small linear's float weight is gone before the next tensor is read
    check_names_and_shapes(source, shapes, expected)
    for module in linears:
        bias = state.pop(f"{module}.bias", None)
        if bias is not None:
            layer = model.get_submodule(module)
            if quantize is not None:
                layer.bias = nn.Parameter(bias, requires_grad=False)
            else:
                layer.bias = bias.float()  # the small types keep a float32 bias buffer
    if config.tie_weights and quantize is not None:
        state[_TIED_KEY] = state["tok_emb.weight"]
    model.load_state_dict(state, strict=False, assign=True)  # the small modules already hold their tensors
    state.clear()
    if quantize is None:
        model.weight_type = weights  # as ``convert_weights`` marks a converted model
        return _tie_and_check(model, config, tied_head=False)
    return _tie_and_check(model, config)


def model_from_state_dict(config: GPTConfig, state: dict[str, torch.Tensor], *, source: str | Path,
                          device: str | torch.device = "cpu", dtype: torch.dtype | None = None) -> GPTModel:
    """A ``GPTModel`` whose parameters *are* the tensors of ``state`` (moved/cast only when asked), in eval mode.

    ``state`` is consumed (its entries are replaced one by one, so a cast never holds two full copies). It must
    hold exactly the persistent tensors of ``GPTModel(config)``, without ``out_head.weight`` when tied; anything
    else is a ``ValueError`` naming ``source`` and the key.
    """
    device = torch.device(device)
    with torch.device("meta"):
        model = GPTModel(config)  # shapes only: no memory, no random init cost
    check_names_and_shapes(source, {name: t.shape for name, t in state.items()}, _expected_shapes(model))
    for name in list(state):
        tensor = _floating(source, name, state[name])
        state[name] = tensor.to(device=device, dtype=dtype or tensor.dtype)
    if config.tie_weights:
        state[_TIED_KEY] = state["tok_emb.weight"]
    model.load_state_dict(state, strict=True, assign=True)
    state.clear()
    return _tie_and_check(model, config)


def load_model(directory: str | Path, *, device: str | torch.device = "cpu", dtype: torch.dtype | None = None,
               quantize: str | None = None, weights: str = "float32") -> GPTModel:
    """Load a checkpoint written by ``save_model`` into a ``GPTModel`` on ``device`` (in eval mode).

    ``dtype`` converts the floating tensors (default: as stored). ``quantize`` (``"nf4"``, ``"nf4-dq"``): the block
    linears become ``NF4Linear``; ``weights`` (``"bfloat16"``, ``"int8"``, for inference): the block linears and the
    head become ``fast.weights``' small types. Either way each is made small as it is read (``model_from_tensors``),
    never as a whole float model first. Strict: see the module docstring.
    """
    directory = Path(directory)
    if not directory.is_dir():
        raise ValueError(f"checkpoint directory {directory} does not exist")
    config = load_config(directory)
    path = directory / WEIGHTS_FILE
    if _whole_header(path):  # a damaged file gets the reader's own error below
        check_config_fits(config, path.stat().st_size, directory / CONFIG_FILE)
    with torch.device("meta"):
        expected = _expected_shapes(GPTModel(config))
    if weights != "float32" and (quantize is not None or dtype is not None):
        raise ValueError(f"weights={weights!r} takes neither quantize nor dtype: the weight type is the linears' dtype")
    if quantize is not None or weights != "float32":
        from .quantize import block_linears, check_quantize

        if quantize is not None:
            check_quantize(quantize)
        if not path.is_file():
            raise ValueError(f"{directory} is not a tinygpt checkpoint: {WEIGHTS_FILE} is missing")
        with torch.device("meta"):
            converted = {f"{name}.weight" for name in block_linears(GPTModel(config))}
        if weights != "float32" and not config.tie_weights:
            converted.add(_TIED_KEY)  # the head's own weight (a tied head's is the embedding, which stays)
        return model_from_tensors(config, read_safetensors(path, converted.__contains__), source=path,
                                  quantize=quantize, weights=weights, device=device, dtype=dtype)
    state = _read_weights(path, expected, str(device))
    return model_from_state_dict(config, state, source=path, device=device, dtype=dtype)


def load_weights_into(model: GPTModel, directory: str | Path) -> None:
    """Copy the weights of the checkpoint ``directory`` into ``model`` in place (a resume: the model is built once,
    as nanoGPT's one ``load_state_dict``). The file must hold exactly the model's tensors (names and shapes checked
    from its header before a tensor is read); each is read onto the model's device and copied into its dtype."""
    path = Path(directory) / WEIGHTS_FILE
    state = _read_weights(path, _expected_shapes(model), str(next(model.parameters()).device))
    for name, tensor in state.items():
        _floating(path, name, tensor)
    if model.config.tie_weights:
        state[_TIED_KEY] = state["tok_emb.weight"]
    model.load_state_dict(state)


def load_checkpoint_tokenizer(directory: str | Path) -> Tokenizer | None:
    """The tokenizer saved beside a checkpoint, or None when the checkpoint has none."""
    if find_descriptor(directory) is None:
        return None
    return load_tokenizer(directory)


def count_stored_parameters(directory: str | Path) -> int:
    """Elements stored in ``model.safetensors`` (from its header; no tensor is read). A tied head counts once."""
    from safetensors import safe_open

    path = Path(directory) / WEIGHTS_FILE
    if not path.is_file():
        raise ValueError(f"{Path(directory)} is not a tinygpt checkpoint: {WEIGHTS_FILE} is missing")
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            return sum(math.prod(f.get_slice(name).get_shape()) for name in f.keys())
    except Exception as err:  # SafetensorError is not a ValueError
        raise ValueError(f"{path}: not a valid safetensors file (truncated or corrupt): {err}") from None
