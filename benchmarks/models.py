"""The models under test, built with the same weights: tinygpt, Hugging Face GPT-2 (sdpa), llms_from_scratch ch04.

The references are test extras; a missing one is reported as "not available", never a crash of the whole suite.
Each builder returns a callable ``idx [B, T] -> logits [B, T, V]`` plus the module, so cases can time them alike.
"""

from __future__ import annotations

import importlib.util
from typing import Callable

import torch
from torch import nn

from tinygpt import GPTConfig, GPTModel, get_config
from tinygpt.interop.hf import tinygpt_to_gpt2

Forward = Callable[[torch.Tensor], torch.Tensor]


def gpt2_small() -> GPTConfig:
    """GPT-2 small as released: biased QKV, head tied to the token embedding, no dropout."""
    return get_config("gpt2-small", qkv_bias=True, tie_weights=True)


def quick_config() -> GPTConfig:
    """Tiny sizes for the smoke mode: seconds, not minutes."""
    return GPTConfig(vocab_size=320, context_length=64, emb_dim=64, n_heads=4, n_layers=2,
                     qkv_bias=True, tie_weights=True)


def available(reference: str) -> bool:
    package = {"hf": "transformers", "upstream": "llms_from_scratch"}[reference]
    return importlib.util.find_spec(package) is not None


def build_tinygpt(config: GPTConfig, seed: int = 0) -> GPTModel:
    torch.manual_seed(seed)
    return GPTModel(config).eval()


def hf_config(config: GPTConfig):
    from transformers import GPT2Config

    return GPT2Config(
        vocab_size=config.vocab_size, n_positions=config.context_length, n_embd=config.emb_dim,
        n_layer=config.n_layers, n_head=config.n_heads, activation_function="gelu_new",
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, layer_norm_epsilon=1e-5, tie_word_embeddings=True,
        bos_token_id=None, eos_token_id=None, attn_implementation="sdpa",
    )


def build_hf(config: GPTConfig, weights_from: GPTModel | None = None) -> nn.Module:
    """``GPT2LMHeadModel`` with sdpa attention; with ``weights_from``, loaded with that model's weights."""
    from transformers import GPT2LMHeadModel

    if not (config.qkv_bias and config.tie_weights and config.pre_ln):
        raise ValueError("GPT2LMHeadModel needs qkv_bias=True, tie_weights=True, pre_ln=True")
    model = GPT2LMHeadModel(hf_config(config)).eval()
    if weights_from is not None:
        result = model.load_state_dict(tinygpt_to_gpt2(weights_from.state_dict(), config), strict=False)
        missing = [k for k in result.missing_keys if k != "lm_head.weight"]  # tied to wte
        if missing or result.unexpected_keys:
            raise RuntimeError(f"weight copy mismatch: missing {missing}, unexpected {result.unexpected_keys}")
    return model


def build_upstream(config: GPTConfig, weights_from: GPTModel | None = None) -> nn.Module:
    """``llms_from_scratch.ch04.GPTModel`` (separate Q/K/V linears, untied head) with ``weights_from``'s weights."""
    from llms_from_scratch.ch04 import GPTModel as UpstreamGPT

    cfg = dict(vocab_size=config.vocab_size, context_length=config.context_length, emb_dim=config.emb_dim,
               n_heads=config.n_heads, n_layers=config.n_layers, drop_rate=0.0, qkv_bias=config.qkv_bias)
    model = UpstreamGPT(cfg).eval()
    if weights_from is None:
        return model
    sd = weights_from.state_dict()
    d = config.emb_dim
    mapped = {name: sd[name] for name in ("tok_emb.weight", "pos_emb.weight", "final_norm.scale",
                                          "final_norm.shift", "out_head.weight")}
    for i in range(config.n_layers):
        p = f"trf_blocks.{i}."
        # Our fused QKV [3D, D] splits along its output axis into upstream's W_query, W_key, W_value.
        for kind in ("weight", "bias") if config.qkv_bias else ("weight",):
            for part, chunk in zip(("W_query", "W_key", "W_value"), sd[f"{p}att.qkv.{kind}"].split(d, dim=0)):
                mapped[f"{p}att.{part}.{kind}"] = chunk
        for name in ("att.out_proj.weight", "att.out_proj.bias", "ff.layers.0.weight", "ff.layers.0.bias",
                     "ff.layers.2.weight", "ff.layers.2.bias", "norm1.scale", "norm1.shift", "norm2.scale",
                     "norm2.shift"):
            mapped[p + name] = sd[p + name]
    result = model.load_state_dict(mapped, strict=False)
    missing = [k for k in result.missing_keys if not k.endswith("att.mask")]
    if missing or result.unexpected_keys:
        raise RuntimeError(f"weight copy mismatch: missing {missing}, unexpected {result.unexpected_keys}")
    return model


def logits_of(model: nn.Module) -> Forward:
    """A uniform ``idx -> logits`` call (HF returns an output object)."""
    if isinstance(model, GPTModel):
        return model
    if hasattr(model, "transformer"):  # Hugging Face
        return lambda idx: model(input_ids=idx, use_cache=False).logits
    return model


def forward_flops(config: GPTConfig, batch: int, tokens: int, *, head_positions: int | None = None) -> float:
    """FLOPs of one forward over [batch, tokens] (a multiply-add counts 2).

    Per layer and position the four projections cost 2 * 12 D^2; causal attention costs 2 * 2 * D * (i + 1) for the
    query at position i (scores and the weighted sum over the keys it may see: the useful half of T x T, which is
    what flash-style kernels compute); the head costs 2 * D * V per position it is applied to.
    """
    d, v, n_layers = config.emb_dim, config.vocab_size, config.n_layers
    positions = batch * tokens
    projections = 2 * 12 * d * d * n_layers * positions
    attention = 2 * 2 * d * n_layers * batch * tokens * (tokens + 1) / 2
    head = 2 * d * v * batch * (tokens if head_positions is None else head_positions)
    return float(projections + attention + head)
