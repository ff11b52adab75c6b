"""tinygpt <-> GGUF, the one-file format of llama.cpp (and Ollama, LM Studio): export and import.

A GPT-2-shaped model (LayerNorm, tanh-GELU FFN, learned positions, pre-LN, one key/value head per query head) is
GGUF's ``gpt2`` architecture, as llama.cpp's converter writes OpenAI's GPT-2; a Llama-shaped one (RMSNorm, SwiGLU,
RoPE, grouped-query, no biases) is its ``llama`` architecture. Tensor names (GGUF's on the left):

    token_embd / position_embd                 <-> tok_emb / pos_emb
    blk.{i}.attn_norm / ffn_norm               <-> trf_blocks.{i}.norm1 / norm2     (weight/bias <-> scale/shift)
    blk.{i}.attn_qkv                           <-> trf_blocks.{i}.att.qkv           (gpt2: fused as ours)
    blk.{i}.attn_q / attn_k / attn_v           <-> the rows of trf_blocks.{i}.att.qkv (llama; q, k row-permuted)
    blk.{i}.attn_output                        <-> trf_blocks.{i}.att.out_proj
    blk.{i}.ffn_up / ffn_down                  <-> trf_blocks.{i}.ff.layers.0 / 2   (llama: layers.0 = gate + up)
    output_norm / output                       <-> final_norm / out_head            (no ``output``: tied to token_embd)

GGUF lists a tensor's dimensions fastest-first, so a [rows, cols] numpy array is a {cols, rows} GGUF tensor: our
``nn.Linear`` weights ([out, in]) are already what llama.cpp expects, and nothing is transposed (llama.cpp's
converter transposes GPT-2's Conv1D weights for the same reason). llama.cpp's ``llama`` graph rotates neighbouring
feature pairs (Meta's layout) where tinygpt pairs i with i + hd/2, so q and k rows are permuted on export and back on
import, as llama.cpp's converter does to Hugging Face Llama weights. The ``gpt2`` graph needs every bias: a model
without them (tinygpt's default ``qkv_bias=False``) is written with zero biases, which compute the same.

``tinygpt.config`` holds the exact ``GPTConfig``, so tinygpt -> GGUF -> tinygpt gives back the same model (zero
biases dropped again); a file without it (llama.cpp's converter's) gets its config from the architecture's keys.
Quantisation follows llama.cpp's converter: 1-D tensors, norms, biases and the position table stay float32; every
other weight is q8_0 / q4_0 / f16 (``gguf.quants.quantize``), or f16 when its rows are not whole 32-value blocks.
``load_gguf(path, weights="bfloat16" | "int8")`` reads the linears straight into ``fast.weights``' types
(``interop.gguf_weights``); a character vocabulary's extra rows are ``gguf_vocab``'s.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import torch

from ..checkpoint import check_config_fits, model_from_state_dict
from ..config import GPTConfig
from ..model import GPTModel
from ..tokenizer import Tokenizer
from .gguf_header import check_gguf_header
from .gguf_vocab import EXTRA_ROWS_KEY, KIND_KEY, tokenizer_from_metadata, tokenizer_metadata

GGUF_TYPES = ("f32", "f16", "q8_0", "q4_0")
CONFIG_KEY = "tinygpt.config"
ARCHITECTURES = ("gpt2", "llama")
_GPT2_NEEDS = dict(norm="layernorm", ffn="gelu", pos_emb="learned", pre_ln=True, qk_norm=False)
_LLAMA_NEEDS = dict(norm="rmsnorm", ffn="swiglu", pos_emb="rope", pre_ln=True, bias=False, qkv_bias=False,
                    qk_norm=False)


def require_gguf() -> Any:
    """The ``gguf`` package, or an ``ImportError`` that says how to install it."""
    try:
        import gguf
    except ImportError:
        raise ImportError("GGUF files need the gguf package: pip install 'tinygpt[gguf]' (or pip install gguf)"
                          ) from None
    return gguf


def gguf_architecture(config: GPTConfig) -> str:
    """``gpt2`` or ``llama``: the GGUF architecture that computes what ``config`` does; ``ValueError`` naming the
    fields that match neither."""
    gqa = config.kv_heads != config.n_heads
    wrong_gpt2 = [f"{k}={getattr(config, k)!r} (gpt2 needs {v!r})" for k, v in _GPT2_NEEDS.items()
                  if getattr(config, k) != v]
    if not wrong_gpt2 and not gqa:
        return "gpt2"
    wrong_llama = [f"{k}={getattr(config, k)!r} (llama needs {v!r})" for k, v in _LLAMA_NEEDS.items()
                   if getattr(config, k) != v]
    if not wrong_llama:
        return "llama"
    if gqa:
        wrong_gpt2.append(f"n_kv_heads={config.n_kv_heads} (gpt2 needs one key/value head per query head)")
    raise ValueError(f"this model is neither GGUF's gpt2 nor its llama architecture: for gpt2 it has "
                     f"{'; '.join(wrong_gpt2)}; for llama {'; '.join(wrong_llama)}")


def _permute_rope(weight: torch.Tensor, heads: int, to_gguf: bool) -> torch.Tensor:
    """q or k rows [heads * hd, ...] between tinygpt's half-split pairs and llama.cpp's neighbouring pairs."""
    hd = weight.shape[0] // heads
    if to_gguf:  # row (h, half, j) -> (h, j, half)
        return weight.reshape(heads, 2, hd // 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)
    return weight.reshape(heads, hd // 2, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape)


# Per-block tensors that map one to one (GGUF name after "blk.{i}." -> ours after "trf_blocks.{i}.").
_BLOCK_NAMES = {"attn_norm.weight": "norm1.scale", "ffn_norm.weight": "norm2.scale",
                "attn_output.weight": "att.out_proj.weight", "ffn_down.weight": "ff.layers.2.weight"}
# The gpt2 graph's biases: (GGUF name, ours, the config switch that gives the model one).
_GPT2_BIASES = (("attn_norm.bias", "norm1.shift", "bias"), ("ffn_norm.bias", "norm2.shift", "bias"),
                ("attn_qkv.bias", "att.qkv.bias", "qkv_bias"), ("attn_output.bias", "att.out_proj.bias", "bias"),
                ("ffn_up.bias", "ff.layers.0.bias", "bias"), ("ffn_down.bias", "ff.layers.2.bias", "bias"))


def gguf_tensors(state: dict[str, torch.Tensor], config: GPTConfig) -> dict[str, torch.Tensor]:
    """A ``GPTModel`` state dict -> GGUF tensor names of ``gguf_architecture(config)`` (no ``output`` when the
    head is tied; zeros for the biases the gpt2 graph needs and the model lacks)."""
    arch = gguf_architecture(config)
    d, kv = config.emb_dim, config.kv_heads * config.head_dim
    device = state["tok_emb.weight"].device
    rows = {"attn_qkv.bias": 3 * d, "ffn_up.bias": config.ffn_dim}  # every other bias has emb_dim rows

    out = {"token_embd.weight": state["tok_emb.weight"], "output_norm.weight": state["final_norm.scale"]}
    if arch == "gpt2":
        out["position_embd.weight"] = state["pos_emb.weight"]
        out["output_norm.bias"] = state.get("final_norm.shift", torch.zeros(d, device=device))
    if not config.tie_weights:
        out["output.weight"] = state["out_head.weight"]
    for i in range(config.n_layers):
        ours, blk = f"trf_blocks.{i}.", f"blk.{i}."
        out.update({blk + theirs: state[ours + mine] for theirs, mine in _BLOCK_NAMES.items()})
        if arch == "gpt2":
            out[blk + "attn_qkv.weight"] = state[ours + "att.qkv.weight"]
            out[blk + "ffn_up.weight"] = state[ours + "ff.layers.0.weight"]
            for theirs, mine, _ in _GPT2_BIASES:
                zeros = torch.zeros(rows.get(theirs, d), device=device)
                out[blk + theirs] = state.get(ours + mine, zeros)
        else:
            q, k, v = state[ours + "att.qkv.weight"].split((d, kv, kv))
            out[blk + "attn_q.weight"] = _permute_rope(q, config.n_heads, to_gguf=True)
            out[blk + "attn_k.weight"] = _permute_rope(k, config.kv_heads, to_gguf=True)
            out[blk + "attn_v.weight"] = v
            out[blk + "ffn_gate.weight"], out[blk + "ffn_up.weight"] = state[ours + "ff.layers.0.weight"].chunk(2)
    return {name: t.detach() for name, t in out.items()}


def _tensor_type(gguf: Any, name: str, data: np.ndarray, wanted: str) -> Any:
    """llama.cpp's converter's rule: what stays float32, and the fallback when rows are not whole blocks."""
    types = gguf.GGMLQuantizationType
    if data.ndim <= 1 or name.endswith("_norm.weight") or not name.endswith(".weight") or "position_embd" in name:
        return types.F32
    return {"f32": types.F32, "f16": types.F16, "q8_0": types.Q8_0, "q4_0": types.Q4_0}[wanted]


def quantize_tensor(name: str, data: np.ndarray, wanted: str) -> tuple[np.ndarray, Any]:
    """(the bytes or array written for tensor ``name``, its GGML type) at file type ``wanted``."""
    gguf = require_gguf()
    qtype = _tensor_type(gguf, name, data, wanted)
    try:
        return gguf.quants.quantize(data, qtype), qtype
    except gguf.QuantError:  # rows not a multiple of the block size: llama.cpp's converter falls back to f16
        qtype = gguf.GGMLQuantizationType.F16
        return gguf.quants.quantize(data, qtype), qtype


def _with_extra_rows(tensors: dict[str, torch.Tensor], n_tokens: int, extra: int) -> dict[str, torch.Tensor]:
    """``token_embd`` and ``output`` (when untied) with ``extra`` rows appended, each the mean of the first
    ``n_tokens`` rows (the tokenizer's): the logit of such a row is the mean of the real tokens' logits, never above
    their largest (``gguf_vocab``'s extra tokens)."""
    out = {}
    for name in ("token_embd.weight", "output.weight"):
        if name in tensors:
            rows = tensors[name]
            mean = rows[:n_tokens].double().mean(dim=0).to(rows.dtype)  # [emb_dim]
            out[name] = torch.cat((rows, mean.expand(extra, -1)))
    return out


_FILE_TYPES = {"f32": "ALL_F32", "f16": "MOSTLY_F16", "q8_0": "MOSTLY_Q8_0", "q4_0": "MOSTLY_Q4_0"}


def write_gguf(model: GPTModel, path: str | Path, tokenizer: Tokenizer | None = None, *, type: str = "f32",
               chat_template: str | None = None, name: str = "tinygpt") -> None:
    """Write ``model`` (and its tokenizer and chat template) as one GGUF file at ``path``, atomically.

    ``type``: f32, f16, q8_0 or q4_0 (see the module docstring for what each tensor gets)."""
    from ..fileio import atomic_write_with

    gguf = require_gguf()
    if type not in GGUF_TYPES:
        raise ValueError(f"type={type!r} is not a GGUF type tinygpt writes; allowed: {', '.join(GGUF_TYPES)}")
    config = model.config
    arch = gguf_architecture(config)
    vocab = tokenizer_metadata(tokenizer, config.vocab_size) if tokenizer is not None else None
    tensors = gguf_tensors(model.state_dict(), config)
    extra = vocab["extra_rows"] if vocab is not None else 0
    if extra:
        tensors.update(_with_extra_rows(tensors, tokenizer.vocab_size, extra))

    def write(tmp: Path) -> None:
        writer = gguf.GGUFWriter(tmp, arch)
        writer.add_name(name)
        writer.add_context_length(config.context_length)
        writer.add_embedding_length(config.emb_dim)
        writer.add_feed_forward_length(config.ffn_dim)
        writer.add_block_count(config.n_layers)
        writer.add_head_count(config.n_heads)
        if arch == "gpt2":
            writer.add_layer_norm_eps(config.norm_eps)
        else:
            writer.add_head_count_kv(config.kv_heads)
            writer.add_layer_norm_rms_eps(config.norm_eps)
            writer.add_rope_freq_base(config.rope_theta)
            writer.add_rope_dimension_count(config.head_dim)
            writer.add_key_length(config.head_dim)
            writer.add_value_length(config.head_dim)
            writer.add_vocab_size(config.vocab_size + extra)
        writer.add_file_type(getattr(gguf.LlamaFileType, _FILE_TYPES[type]))
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)  # llama.cpp's converter writes it at every type
        writer.add_string(CONFIG_KEY, config.to_json())
        if vocab is not None:
            writer.add_tokenizer_model(vocab["model"])
            writer.add_tokenizer_pre(vocab["pre"])
            writer.add_token_list(vocab["tokens"])
            writer.add_token_types(vocab["token_type"])
            writer.add_token_merges(vocab["merges"])
            if vocab["eos_token_id"] is not None:
                writer.add_bos_token_id(vocab["bos_token_id"])
                writer.add_eos_token_id(vocab["eos_token_id"])
            writer.add_add_bos_token(False)  # GPT-2 adds no token at the start of a text
            writer.add_string(KIND_KEY, vocab["kind"])
            if extra:
                writer.add_uint32(EXTRA_ROWS_KEY, extra)
        if chat_template is not None:
            writer.add_chat_template(chat_template)
        for tensor_name, tensor in tensors.items():
            data, qtype = quantize_tensor(tensor_name, tensor.to("cpu", torch.float32).contiguous().numpy(), type)
            writer.add_tensor(tensor_name, data, raw_dtype=qtype)
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()

    atomic_write_with(path, write)


# ------------------------------------------------------------------------------------------------ reading
def _field_value(field: Any) -> Any:
    """A GGUFReader field as a Python value (str, number, bool, or a list of them)."""
    value = field.contents()
    return value.tolist() if isinstance(value, np.ndarray) else value


@dataclasses.dataclass
class GGUFContents:
    """What ``read_gguf`` found: the architecture, the metadata (key -> Python value), and for each tensor its
    numpy shape ([rows, cols], slowest dimension first) and a function that reads and dequantises it."""

    path: Path
    architecture: str
    fields: dict[str, Any]
    shapes: dict[str, tuple[int, ...]]
    readers: dict[str, Callable[[], np.ndarray]]
    entries: dict[str, Any] = dataclasses.field(default_factory=dict)  # gguf-py's ReaderTensor, for direct reads


def read_gguf(path: str | Path) -> GGUFContents:
    """Parse a GGUF file's header (tensors stay in the file's memory map until read); ``ValueError`` for a file
    that is not GGUF, is truncated, or is of an architecture other than gpt2 / llama."""
    gguf = require_gguf()
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"{path}: no such file")
    check_gguf_header(path)  # counts, sizes and offsets against the file, before the reader trusts them
    try:
        reader = gguf.GGUFReader(path, "r")
    except Exception as err:  # the reader raises ValueError, struct.error, IndexError... on a damaged file
        raise ValueError(f"{path}: not a readable GGUF file (truncated or corrupt): {type(err).__name__}: {err}"
                         ) from None
    fields = {name: _field_value(field) for name, field in reader.fields.items() if not name.startswith("GGUF.")}
    arch = fields.get("general.architecture")
    if arch not in ARCHITECTURES:
        raise ValueError(f"{path}: architecture {arch!r} is not supported; tinygpt reads {', '.join(ARCHITECTURES)}")
    shapes, readers = {}, {}
    for tensor in reader.tensors:
        shape = tuple(int(n) for n in reversed(tensor.shape.tolist()))  # GGUF lists the fastest dimension first
        shapes[tensor.name] = shape

        def load(tensor: Any = tensor, shape: tuple[int, ...] = shape) -> np.ndarray:
            # a copy: the file's memory map is read-only, and an f32 tensor would otherwise alias it
            return np.array(gguf.quants.dequantize(tensor.data, tensor.tensor_type), dtype=np.float32).reshape(shape)

        readers[tensor.name] = load
    return GGUFContents(path, arch, fields, shapes, readers, {tensor.name: tensor for tensor in reader.tensors})


def _float32(value: Any) -> float:
    """A float32 metadata value as the shortest decimal that rounds to it (1e-05, not 9.999999747378752e-06)."""
    return float(np.format_float_positional(np.float32(value), unique=True, trim="-"))


def _int(contents: GGUFContents, key: str) -> int:
    full = f"{contents.architecture}.{key}"
    if full not in contents.fields:
        raise ValueError(f"{contents.path}: the {contents.architecture} metadata key {full!r} is missing")
    return int(contents.fields[full])


def config_from_gguf(contents: GGUFContents) -> GPTConfig:
    """The ``GPTConfig`` of a GGUF: ``tinygpt.config`` when tinygpt wrote it, else from the architecture's keys."""
    if CONFIG_KEY in contents.fields:
        try:
            return GPTConfig.from_json(contents.fields[CONFIG_KEY])
        except ValueError as err:
            raise ValueError(f"{contents.path}: {CONFIG_KEY}: {err}") from None
    arch, fields = contents.architecture, contents.fields
    if "token_embd.weight" not in contents.shapes:
        raise ValueError(f"{contents.path}: tensor 'token_embd.weight' is missing")
    d = _int(contents, "embedding_length")
    common = dict(vocab_size=contents.shapes["token_embd.weight"][0], context_length=_int(contents, "context_length"),
                  emb_dim=d, n_heads=_int(contents, "attention.head_count"), n_layers=_int(contents, "block_count"),
                  tie_weights="output.weight" not in contents.shapes, drop_rate=0.0)
    f = _int(contents, "feed_forward_length")
    try:
        if arch == "gpt2":
            return GPTConfig(**common, qkv_bias=True, bias=True, ffn_hidden=None if f == 4 * d else f,
                             norm_eps=_float32(fields.get("gpt2.attention.layer_norm_epsilon", 1e-5)))
        heads = common["n_heads"]
        scaling = fields.get("llama.rope.scaling.type", "none")
        if scaling not in ("none", None) or "llama.expert_count" in fields:
            raise ValueError(f"llama.rope.scaling.type={scaling!r} / experts are not supported (plain RoPE only)")
        rope_dim = fields.get("llama.rope.dimension_count", d // heads)
        if rope_dim != d // heads:
            raise ValueError(f"llama.rope.dimension_count={rope_dim}: tinygpt rotates whole heads ({d // heads})")
        biases = sorted(n for n in contents.shapes if n.endswith(".bias"))
        if biases:
            raise ValueError(f"tensor {biases[0]!r}: tinygpt reads bias-free llama models only")
        return GPTConfig(**common, n_kv_heads=int(fields.get("llama.attention.head_count_kv", heads)),
                         norm="rmsnorm", ffn="swiglu", ffn_hidden=f, bias=False, pos_emb="rope",
                         norm_eps=_float32(fields.get("llama.attention.layer_norm_rms_epsilon", 1e-5)),
                         rope_theta=_float32(fields.get("llama.rope.freq_base", 10000.0)))
    except ValueError as err:
        raise ValueError(f"{contents.path}: {err}") from None


def _expected_gguf_shapes(config: GPTConfig) -> dict[str, tuple[int, ...]]:
    with torch.device("meta"):
        state = GPTModel(config).state_dict()
    return {name: tuple(t.shape) for name, t in gguf_tensors(state, config).items()}


def _without_extra_rows(contents: GGUFContents) -> dict[str, tuple[int, ...]]:
    """The tensor shapes, less the rows a character vocabulary's extra tokens added (``tinygpt.extra_rows``)."""
    extra = int(contents.fields.get(EXTRA_ROWS_KEY, 0))
    shapes = dict(contents.shapes)
    for name in ("token_embd.weight", "output.weight"):
        if extra and name in shapes:
            shapes[name] = (shapes[name][0] - extra, *shapes[name][1:])
    return shapes


def drop_extra_rows(tensors: dict[str, torch.Tensor], vocab_size: int) -> dict[str, torch.Tensor]:
    """``tensors`` with ``token_embd`` and ``output`` cut back to the model's ``vocab_size`` rows (in place)."""
    for name in ("token_embd.weight", "output.weight"):
        if name in tensors and tensors[name].shape[0] > vocab_size:
            tensors[name] = tensors[name][:vocab_size].clone()
    return tensors


def model_from_gguf(contents: GGUFContents, *, dtype: torch.dtype | None = None, weights: str = "float32"
                    ) -> GPTModel:
    """The ``GPTModel`` of a parsed GGUF (dequantised to float32, or ``dtype``); every tensor name and shape is
    checked against the config before any is read. ``weights`` ``bfloat16`` or ``int8``: the block linears and the
    head read straight into ``fast.weights``' types, a few rows at a time (``interop.gguf_weights``)."""
    from ..checkpoint import check_names_and_shapes

    config = config_from_gguf(contents)
    blocks = {name.split(".")[1] for name in contents.shapes if name.startswith("blk.")}
    if config.n_layers != len(blocks):
        raise ValueError(f"{contents.path}: the config has n_layers={config.n_layers}, the file's tensors "
                         f"{len(blocks)} blocks")
    check_config_fits(config, contents.path.stat().st_size, contents.path)
    if gguf_architecture(config) != contents.architecture:
        raise ValueError(f"{contents.path}: {CONFIG_KEY} describes a {gguf_architecture(config)} model, but the file "
                         f"is {contents.architecture}")
    check_names_and_shapes(contents.path, _without_extra_rows(contents), _expected_gguf_shapes(config))
    if weights != "float32":
        from .gguf_weights import small_model_from_gguf

        if dtype is not None:
            raise ValueError(f"dtype={dtype} and weights={weights!r}: the small weight types take no dtype")
        return small_model_from_gguf(contents, config, weights, _tinygpt_state)
    tensors = {name: torch.from_numpy(read()) for name, read in contents.readers.items()}
    state = _tinygpt_state(drop_extra_rows(tensors, config.vocab_size), config, contents.path)
    return model_from_state_dict(config, state, source=contents.path, dtype=dtype)


def _tinygpt_state(t: dict[str, torch.Tensor], config: GPTConfig, source: Path) -> dict[str, torch.Tensor]:
    """GGUF tensors -> a ``GPTModel`` state dict (``t`` is consumed, so each tensor can be freed as soon as it is
    used); the zero biases an export added for the gpt2 graph are dropped (one that is not zero means the config
    does not describe the weights)."""
    def keep(name: str, ours: str, wanted: bool) -> Iterator[tuple[str, torch.Tensor]]:
        if wanted:
            yield ours, t.pop(name)
        elif torch.count_nonzero(t.pop(name)):
            raise ValueError(f"{source}: tensor {name!r} is not zero, but {CONFIG_KEY} has no such bias")

    out = {"tok_emb.weight": t.pop("token_embd.weight"), "final_norm.scale": t.pop("output_norm.weight")}
    if "position_embd.weight" in t:
        out["pos_emb.weight"] = t.pop("position_embd.weight")
    if not config.tie_weights:
        out["out_head.weight"] = t.pop("output.weight")
    if "output_norm.bias" in t:
        out.update(keep("output_norm.bias", "final_norm.shift", config.bias))
    for i in range(config.n_layers):
        ours, blk = f"trf_blocks.{i}.", f"blk.{i}."
        out.update({ours + mine: t.pop(blk + theirs) for theirs, mine in _BLOCK_NAMES.items()})
        if blk + "attn_qkv.weight" in t:
            out[ours + "att.qkv.weight"] = t.pop(blk + "attn_qkv.weight")
            out[ours + "ff.layers.0.weight"] = t.pop(blk + "ffn_up.weight")
            for theirs, mine, switch in _GPT2_BIASES:
                out.update(keep(blk + theirs, ours + mine, getattr(config, switch)))
        else:
            q = _permute_rope(t.pop(blk + "attn_q.weight"), config.n_heads, to_gguf=False)
            k = _permute_rope(t.pop(blk + "attn_k.weight"), config.kv_heads, to_gguf=False)
            out[ours + "att.qkv.weight"] = torch.cat((q, k, t.pop(blk + "attn_v.weight")))
            gate, up = t.pop(blk + "ffn_gate.weight"), t.pop(blk + "ffn_up.weight")
            out[ours + "ff.layers.0.weight"] = torch.cat((gate, up))
    return out


def load_gguf(path: str | Path, *, dtype: torch.dtype | None = None, weights: str = "float32",
              warn: Callable[[str], None] = lambda message: None
              ) -> tuple[GPTModel, Tokenizer | None, str | None]:
    """(model, tokenizer or None, chat template or None) of a GGUF file; ``weights``: as ``model_from_gguf``;
    ``warn`` says why a tokenizer is not carried over. A GPT-2 vocabulary is rebuilt as its two files in a
    temporary folder that lives as long as the tokenizer (saving it copies them)."""
    import tempfile

    contents = read_gguf(path)
    model = model_from_gguf(contents, dtype=dtype, weights=weights)
    folder = tempfile.TemporaryDirectory(prefix="tinygpt-gguf-vocab-")
    tokenizer = tokenizer_from_metadata(contents.fields, Path(folder.name), warn)
    if tokenizer is not None:
        tokenizer._gguf_files = folder  # removed when the tokenizer is
    else:
        folder.cleanup()
    return model, tokenizer, contents.fields.get("tokenizer.chat_template")
