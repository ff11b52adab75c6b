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

import torch

from ..config import GPTConfig

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
