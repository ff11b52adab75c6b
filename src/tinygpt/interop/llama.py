"""Hugging Face Llama <-> tinygpt: configs, weight names, and loading a saved HF Llama folder.

A Llama is the GPT skeleton with RMSNorm, SwiGLU, no biases, RoPE and grouped-query attention, so it maps onto one
``GPTConfig`` (``norm="rmsnorm", ffn="swiglu", bias=False, pos_emb="rope", n_kv_heads=...``). The weights map as

    model.embed_tokens                          <-> tok_emb
    model.layers.{i}.input_layernorm            <-> trf_blocks.{i}.norm1            (weight <-> scale)
    model.layers.{i}.self_attn.{q,k,v}_proj     <-> trf_blocks.{i}.att.qkv          (stacked q, k, v along the rows)
    model.layers.{i}.self_attn.o_proj           <-> trf_blocks.{i}.att.out_proj
    model.layers.{i}.post_attention_layernorm   <-> trf_blocks.{i}.norm2
    model.layers.{i}.mlp.{gate,up}_proj         <-> trf_blocks.{i}.ff.layers.0      (stacked gate, up)
    model.layers.{i}.mlp.down_proj              <-> trf_blocks.{i}.ff.layers.2
    model.norm / lm_head                        <-> final_norm / out_head

Both sides store linears as [out, in], so nothing is transposed. Nothing is permuted either: HF's q/k rows are
already laid out for the rotate_half pairing that ``tinygpt.rope`` uses (HF's conversion script permuted Meta's
interleaved layout once, when the checkpoints were converted).

This module needs neither transformers nor a network: configs are plain dicts (``config.json`` or
``LlamaConfig.to_dict()``), weights are ``safetensors`` files or in-memory state dicts.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from ..checkpoint import model_from_state_dict
from ..config import GPTConfig
from ..fileio import read_json_object
from ..model import GPTModel

_REQUIRED = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
             "max_position_embeddings")


def _as_dict(hf_config: Any) -> dict[str, Any]:
    if hasattr(hf_config, "to_dict"):  # a transformers LlamaConfig
        return hf_config.to_dict()
    if isinstance(hf_config, Mapping):
        return dict(hf_config)
    raise TypeError(f"expected a LlamaConfig or a config dict, got {type(hf_config).__name__}")


def _rope_theta(data: dict[str, Any]) -> float:
    """The RoPE base; anything but plain RoPE (linear/dynamic/yarn/llama3 scaling) is refused."""
    params = data.get("rope_parameters")  # transformers 5.x
    if params is None:  # transformers 4.x config.json: rope_theta and rope_scaling at the top level
        params = dict(data.get("rope_scaling") or {}, rope_theta=data.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        raise ValueError(f"RoPE scaling {rope_type!r} is not supported; tinygpt implements plain RoPE (rope_type "
                         f"'default') only")
    return float(params.get("rope_theta", 10000.0))


def llama_config_to_tinygpt(hf_config: Any) -> GPTConfig:
    """A HF ``LlamaConfig`` (or its dict / ``config.json`` content) -> the equivalent ``GPTConfig``.

    Raises ``ValueError`` for what the skeleton cannot express: another activation than SiLU, a head_dim other
    than hidden_size / num_attention_heads, biases on attention but not on the MLP (or the reverse), RoPE scaling.
    """
    data = _as_dict(hf_config)
    if data.get("model_type", "llama") != "llama":
        raise ValueError(f"model_type={data['model_type']!r} is not a Llama config")
    missing = [key for key in _REQUIRED if key not in data]
    if missing:
        raise ValueError(f"the Llama config lacks {', '.join(missing)}")
    d, heads = data["hidden_size"], data["num_attention_heads"]
    if data.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act={data['hidden_act']!r}: only 'silu' (SwiGLU) is supported")
    head_dim = data.get("head_dim")
    if head_dim is not None and head_dim * heads != d:
        raise ValueError(f"head_dim={head_dim} with num_attention_heads={heads} does not give hidden_size={d}; "
                         f"tinygpt needs head_dim == hidden_size / num_attention_heads")
    attention_bias, mlp_bias = bool(data.get("attention_bias", False)), bool(data.get("mlp_bias", False))
    if attention_bias != mlp_bias:
        raise ValueError(f"attention_bias={attention_bias} with mlp_bias={mlp_bias}: tinygpt's bias switch covers "
                         f"the attention output and the MLP together")
    return GPTConfig(
        vocab_size=data["vocab_size"],
        context_length=data["max_position_embeddings"],
        emb_dim=d,
        n_heads=heads,
        n_layers=data["num_hidden_layers"],
        n_kv_heads=data.get("num_key_value_heads") or heads,
        drop_rate=0.0,
        qkv_bias=attention_bias,
        bias=attention_bias,
        tie_weights=bool(data.get("tie_word_embeddings", False)),
        norm="rmsnorm",
        norm_eps=float(data.get("rms_norm_eps", 1e-6)),
        ffn="swiglu",
        ffn_hidden=data["intermediate_size"],
        pos_emb="rope",
        rope_theta=_rope_theta(data),
    )


def tinygpt_to_llama_config(config: GPTConfig) -> dict[str, Any]:
    """The ``LlamaConfig`` keyword arguments of a Llama-shaped ``GPTConfig``; ``ValueError`` for any other."""
    wanted = dict(norm="rmsnorm", ffn="swiglu", pos_emb="rope", pre_ln=True, qk_norm=False)
    wrong = [f"{k}={getattr(config, k)!r} (Llama: {v!r})" for k, v in wanted.items() if getattr(config, k) != v]
    if config.qkv_bias != config.bias:
        wrong.append(f"qkv_bias={config.qkv_bias} with bias={config.bias} (Llama: equal)")
    if wrong:
        raise ValueError(f"this config is not a Llama: {'; '.join(wrong)}")
    return dict(
        vocab_size=config.vocab_size, hidden_size=config.emb_dim, intermediate_size=config.ffn_dim,
        num_hidden_layers=config.n_layers, num_attention_heads=config.n_heads, num_key_value_heads=config.kv_heads,
        head_dim=config.head_dim, max_position_embeddings=config.context_length, hidden_act="silu",
        rms_norm_eps=config.norm_eps, rope_parameters={"rope_type": "default", "rope_theta": config.rope_theta},
        rope_theta=config.rope_theta,  # transformers 4.x reads this one, 5.x the rope_parameters above
        attention_bias=config.bias, mlp_bias=config.bias, tie_word_embeddings=config.tie_weights,
        attention_dropout=config.attn_dropout,
    )


def _take(hf: Mapping[str, torch.Tensor], name: str, used: set[str]) -> torch.Tensor:
    if name not in hf:
        raise ValueError(f"the Llama state dict lacks {name!r}")
    used.add(name)
    return hf[name]


def llama_to_tinygpt(hf: Mapping[str, torch.Tensor], config: GPTConfig) -> dict[str, torch.Tensor]:
    """A ``LlamaForCausalLM`` state dict -> a ``GPTModel`` state dict (without ``out_head.weight`` when tied).

    Every HF tensor must be used (rotary ``inv_freq`` buffers of old checkpoints excepted): a leftover is a
    ``ValueError``, so a config that does not match the weights is caught here, not by wrong numbers later.
    """
    used: set[str] = set()
    out = {"tok_emb.weight": _take(hf, "model.embed_tokens.weight", used),
           "final_norm.scale": _take(hf, "model.norm.weight", used)}
    if config.tie_weights:
        used.add("lm_head.weight")  # a tied checkpoint may carry the (identical) head or omit it
    else:
        out["out_head.weight"] = _take(hf, "lm_head.weight", used)
    for i in range(config.n_layers):
        src, dst = f"model.layers.{i}.", f"trf_blocks.{i}."
        out[dst + "norm1.scale"] = _take(hf, src + "input_layernorm.weight", used)
        out[dst + "norm2.scale"] = _take(hf, src + "post_attention_layernorm.weight", used)
        qkv = [src + f"self_attn.{p}_proj" for p in "qkv"]
        out[dst + "att.qkv.weight"] = torch.cat([_take(hf, n + ".weight", used) for n in qkv])
        if config.qkv_bias:
            out[dst + "att.qkv.bias"] = torch.cat([_take(hf, n + ".bias", used) for n in qkv])
        out[dst + "att.out_proj.weight"] = _take(hf, src + "self_attn.o_proj.weight", used)
        gate_up = [src + "mlp.gate_proj", src + "mlp.up_proj"]
        out[dst + "ff.layers.0.weight"] = torch.cat([_take(hf, n + ".weight", used) for n in gate_up])
        out[dst + "ff.layers.2.weight"] = _take(hf, src + "mlp.down_proj.weight", used)
        if config.bias:
            out[dst + "att.out_proj.bias"] = _take(hf, src + "self_attn.o_proj.bias", used)
            out[dst + "ff.layers.0.bias"] = torch.cat([_take(hf, n + ".bias", used) for n in gate_up])
            out[dst + "ff.layers.2.bias"] = _take(hf, src + "mlp.down_proj.bias", used)
    unused = sorted(k for k in hf if k not in used and not k.endswith("rotary_emb.inv_freq"))
    if unused:
        more = f" (and {len(unused) - 1} more)" if len(unused) > 1 else ""
        raise ValueError(f"the Llama state dict has tensors this config does not use: {unused[0]!r}{more}")
    return out


def tinygpt_to_llama(ours: Mapping[str, torch.Tensor], config: GPTConfig) -> dict[str, torch.Tensor]:
    """A ``GPTModel`` state dict of a Llama-shaped config -> a ``LlamaForCausalLM`` state dict (head included)."""
    tinygpt_to_llama_config(config)  # refuses configs Llama cannot express
    d, kv_dim, f = config.emb_dim, config.kv_heads * config.head_dim, config.ffn_dim
    out = {"model.embed_tokens.weight": ours["tok_emb.weight"], "model.norm.weight": ours["final_norm.scale"],
           "lm_head.weight": ours["out_head.weight"] if "out_head.weight" in ours else ours["tok_emb.weight"]}
    for i in range(config.n_layers):
        src, dst = f"trf_blocks.{i}.", f"model.layers.{i}."
        out[dst + "input_layernorm.weight"] = ours[src + "norm1.scale"]
        out[dst + "post_attention_layernorm.weight"] = ours[src + "norm2.scale"]
        for suffix in ("weight", "bias") if config.bias else ("weight",):
            q, k, v = ours[f"{src}att.qkv.{suffix}"].split((d, kv_dim, kv_dim))
            out.update({f"{dst}self_attn.q_proj.{suffix}": q, f"{dst}self_attn.k_proj.{suffix}": k,
                        f"{dst}self_attn.v_proj.{suffix}": v})
            out[f"{dst}self_attn.o_proj.{suffix}"] = ours[f"{src}att.out_proj.{suffix}"]
            gate, up = ours[f"{src}ff.layers.0.{suffix}"].split((f, f))
            out[f"{dst}mlp.gate_proj.{suffix}"], out[f"{dst}mlp.up_proj.{suffix}"] = gate, up
            out[f"{dst}mlp.down_proj.{suffix}"] = ours[f"{src}ff.layers.2.{suffix}"]
    return out


def from_llama_state_dict(hf_config: Any, hf_state: Mapping[str, torch.Tensor], *,
                          device: str | torch.device = "cpu", dtype: torch.dtype | None = None) -> GPTModel:
    """A ``GPTModel`` (eval mode) from a Llama config (``LlamaConfig`` or dict) and its state dict.

    ``LlamaForCausalLM`` in memory: ``from_llama_state_dict(hf.config, hf.state_dict())``.
    """
    config = llama_config_to_tinygpt(hf_config)
    state = llama_to_tinygpt(hf_state, config)
    return model_from_state_dict(config, state, source="Llama state dict", device=device, dtype=dtype)


def load_llama_folder(directory: str | Path, *, device: str | torch.device = "cpu",
                      dtype: torch.dtype | None = None) -> GPTModel:
    """A ``GPTModel`` from a folder written by ``LlamaForCausalLM.save_pretrained``: ``config.json`` plus
    ``model.safetensors`` or sharded ``model-*.safetensors`` with their ``model.safetensors.index.json``."""
    from safetensors.torch import load_file

    directory = Path(directory)
    config_path = directory / "config.json"
    if not config_path.is_file():
        raise ValueError(f"{directory} is not a Hugging Face model folder: config.json is missing")
    hf_config = read_json_object(config_path)
    single, index = directory / "model.safetensors", directory / "model.safetensors.index.json"
    if single.is_file():
        files = [single]
    elif index.is_file():
        weight_map = read_json_object(index).get("weight_map", {})
        files = [directory / name for name in sorted(set(weight_map.values()))]
    else:
        raise ValueError(f"{directory} has no model.safetensors (nor a sharded index); only safetensors weights "
                         f"are read (re-save with safe_serialization=True)")
    state: dict[str, torch.Tensor] = {}
    for path in files:
        state.update(load_file(str(path), device=str(device)))
    return from_llama_state_dict(hf_config, state, device=device, dtype=dtype)
