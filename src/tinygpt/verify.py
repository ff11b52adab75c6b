"""Alignment checks: the same weights in tinygpt and in a reference implementation give the same numbers.

As the chapter says: equal parameter counts do not prove equal computation; copy the weights over and compare logits
(strings alone can hide differences, since two different score vectors may share an argmax).

References (test extras, never runtime dependencies):
- ``upstream``: ``llms_from_scratch.ch04.GPTModel`` (LLMs-from-scratch ch04), with its three separate Q/K/V linears;
- ``hf``: ``transformers.GPT2LMHeadModel`` (pre-LN), ``transformers.OpenAIGPTModel`` (GPT-1, post-LN) and
  ``transformers.LlamaForCausalLM`` (RMSNorm, SwiGLU, RoPE, GQA, no bias), the last imported through
  ``tinygpt.interop.llama``.
"""

from __future__ import annotations

import importlib.util
from dataclasses import asdict, dataclass

import torch

from .config import GPTConfig, get_config
from .generation import generate, generate_greedy
from .interop.hf import block_to_hf, tinygpt_to_gpt2
from .interop.llama import from_llama_state_dict
from .model import GPTModel

REFERENCE_PACKAGES = {"upstream": "llms_from_scratch", "hf": "transformers"}


class MissingReferenceError(RuntimeError):
    """The reference package for a check is not installed."""


@dataclass
class CheckResult:
    name: str
    dtype: str
    max_abs_diff: float
    tolerance: float
    tokens_match: bool | None

    @property
    def passed(self) -> bool:
        return self.max_abs_diff <= self.tolerance and self.tokens_match is not False

    def to_dict(self) -> dict:
        return {**asdict(self), "passed": self.passed}


def _require(package: str, extra: str) -> None:
    if importlib.util.find_spec(package) is None:
        raise MissingReferenceError(
            f"the reference package {package!r} is not installed; install it with: pip install 'tinygpt[test]' "
            f"(or: pip install {extra})"
        )


def _random_model(config: GPTConfig, dtype: torch.dtype, seed: int) -> GPTModel:
    torch.manual_seed(seed)
    model = GPTModel(config).to(dtype).eval()
    # The GPT-2 init leaves norms at 1/0 and biases at 0; perturb them so every tensor is really checked.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("bias", "scale", "shift")):
                p.add_(0.1 * torch.randn_like(p))
    return model


def _inputs(config: GPTConfig, seed: int, shape: tuple[int, int] = (2, 6)) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, config.vocab_size, shape, generator=generator)


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()


def _greedy_reference(model: torch.nn.Module, idx: torch.Tensor, steps: int, context: int) -> torch.Tensor:
    """The chapter's greedy loop over any model whose call returns logits (or an object with ``.logits``)."""
    with torch.no_grad():
        for _ in range(steps):
            out = model(idx[:, -context:])
            logits = out.logits if hasattr(out, "logits") else out
            idx = torch.cat((idx, logits[:, -1].argmax(-1, keepdim=True)), dim=1)
    return idx


def check_upstream(config: GPTConfig, dtype: torch.dtype, tolerance: float, seed: int = 123) -> CheckResult:
    """Copy a random tinygpt model into ``llms_from_scratch.ch04.GPTModel``; compare logits and greedy tokens."""
    _require("llms_from_scratch", "llms-from-scratch --no-deps")
    from llms_from_scratch.ch04 import GPTModel as UpstreamGPT

    ours = _random_model(config, dtype, seed)
    upstream_cfg = dict(
        vocab_size=config.vocab_size,
        context_length=config.context_length,
        emb_dim=config.emb_dim,
        n_heads=config.n_heads,
        n_layers=config.n_layers,
        drop_rate=0.0,
        qkv_bias=config.qkv_bias,
    )
    ref = UpstreamGPT(upstream_cfg).to(dtype).eval()
    sd = ours.state_dict()
    d = config.emb_dim
    mapped = {
        "tok_emb.weight": sd["tok_emb.weight"],
        "pos_emb.weight": sd["pos_emb.weight"],
        "final_norm.scale": sd["final_norm.scale"],
        "final_norm.shift": sd["final_norm.shift"],
        "out_head.weight": sd["out_head.weight"],
    }
    for i in range(config.n_layers):
        ob, ub = f"trf_blocks.{i}.", f"trf_blocks.{i}."
        # The fused QKV weight [3D, D] splits along its output axis into W_query, W_key, W_value (upstream's).
        for part, chunk in zip(("W_query", "W_key", "W_value"), sd[ob + "att.qkv.weight"].split(d, dim=0)):
            mapped[f"{ub}att.{part}.weight"] = chunk
        if config.qkv_bias:
            for part, chunk in zip(("W_query", "W_key", "W_value"), sd[ob + "att.qkv.bias"].split(d, dim=0)):
                mapped[f"{ub}att.{part}.bias"] = chunk
        for name in ("att.out_proj.weight", "att.out_proj.bias", "ff.layers.0.weight", "ff.layers.0.bias",
                     "ff.layers.2.weight", "ff.layers.2.bias", "norm1.scale", "norm1.shift", "norm2.scale",
                     "norm2.shift"):
            mapped[ub + name] = sd[ob + name]
    ref.load_state_dict(mapped, strict=False)  # strict=False only for upstream's mask buffers, checked next
    missing = [k for k in ref.state_dict() if k not in mapped and not k.endswith("att.mask")]
    if missing:
        raise RuntimeError(f"weights not copied into the upstream model: {missing}")

    idx = _inputs(config, seed)
    with torch.no_grad():
        diff = _max_diff(ours(idx), ref(idx))
    steps = min(10, config.context_length - idx.shape[1])
    tokens_match = torch.equal(
        generate_greedy(ours, idx, steps), _greedy_reference(ref, idx, steps, config.context_length)
    )
    return CheckResult(f"upstream ch04.GPTModel, {_describe(config)}", str(dtype).removeprefix("torch."),
                       diff, tolerance, tokens_match)


def _describe(config: GPTConfig) -> str:
    return (f"V={config.vocab_size} C={config.context_length} D={config.emb_dim} H={config.n_heads} "
            f"L={config.n_layers} qkv_bias={config.qkv_bias} tied={config.tie_weights} pre_ln={config.pre_ln}")


def check_hf_gpt2(config: GPTConfig, dtype: torch.dtype, tolerance: float, seed: int = 123) -> CheckResult:
    """Copy a random tinygpt model into ``transformers.GPT2LMHeadModel``; compare logits and greedy tokens."""
    _require("transformers", "transformers")
    from transformers import GPT2Config, GPT2LMHeadModel

    if not config.pre_ln or not config.tie_weights:
        raise ValueError("GPT2LMHeadModel is pre-LN with a tied head: use pre_ln=True, tie_weights=True")
    ours = _random_model(config, dtype, seed)
    hf_config = GPT2Config(
        vocab_size=config.vocab_size, n_positions=config.context_length, n_embd=config.emb_dim,
        n_layer=config.n_layers, n_head=config.n_heads, activation_function="gelu_new",
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, layer_norm_epsilon=1e-5, tie_word_embeddings=True,
        bos_token_id=None, eos_token_id=None,
    )
    ref = GPT2LMHeadModel(hf_config).to(dtype).eval()
    _load_strict(ref, tinygpt_to_gpt2(ours.state_dict(), config))
    idx = _inputs(config, seed)
    with torch.no_grad():
        diff = _max_diff(ours(idx), ref(idx).logits)
    steps = min(10, config.context_length - idx.shape[1])
    tokens_match = torch.equal(
        generate_greedy(ours, idx, steps), _greedy_reference(ref, idx, steps, config.context_length)
    )
    return CheckResult(f"transformers GPT2LMHeadModel, {_describe(config)}", str(dtype).removeprefix("torch."),
                       diff, tolerance, tokens_match)


def check_hf_openai_gpt(config: GPTConfig, dtype: torch.dtype, tolerance: float, seed: int = 123) -> CheckResult:
    """Post-LN: copy into ``transformers.OpenAIGPTModel`` (GPT-1 blocks, gelu_new) and compare the hidden states of
    the block stack (GPT-1 has no final norm, so ours is left out of the comparison)."""
    _require("transformers", "transformers")
    from transformers import OpenAIGPTConfig, OpenAIGPTModel
    from transformers.models.openai import modeling_openai

    # transformers 4.x names the tanh GELU "gelu_new" here; 5.x maps "gelu" to that same function.
    afn = "gelu_new" if "gelu_new" in modeling_openai.ACT_FNS else "gelu"

    if config.pre_ln or not config.qkv_bias:
        raise ValueError("OpenAIGPTModel is post-LN with a QKV bias: use pre_ln=False, qkv_bias=True")
    ours = _random_model(config, dtype, seed)
    hf_config = OpenAIGPTConfig(
        vocab_size=config.vocab_size, n_positions=config.context_length, n_embd=config.emb_dim,
        n_layer=config.n_layers, n_head=config.n_heads, afn=afn,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, layer_norm_epsilon=1e-5,
    )
    ref = OpenAIGPTModel(hf_config).to(dtype).eval()
    sd = ours.state_dict()
    mapped = {"tokens_embed.weight": sd["tok_emb.weight"], "positions_embed.weight": sd["pos_emb.weight"]}
    for i in range(config.n_layers):
        mapped.update(block_to_hf(sd, f"trf_blocks.{i}.", f"h.{i}."))
    _load_strict(ref, mapped)
    idx = _inputs(config, seed)
    with torch.no_grad():
        x, _ = ours.embed(idx)  # [B, T, D]
        for block in ours.trf_blocks:
            x = block(x)
        diff = _max_diff(x, ref(idx).last_hidden_state)
    return CheckResult(f"transformers OpenAIGPTModel (block stack), {_describe(config)}",
                       str(dtype).removeprefix("torch."), diff, tolerance, None)


def _greedy_cached(model: GPTModel, idx: torch.Tensor, steps: int) -> torch.Tensor:
    """Greedy decoding as the product runs it: ``generate`` on the inference engine (its paged KV cache, one
    prefill, then one token per forward); idx [B, T] -> [B, T + steps]."""
    return torch.cat((idx, generate(model, idx, max_new_tokens=steps).tokens), dim=1)


def _rmsnorm_in_input_dtype(module: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """HF's LlamaRMSNorm formula without its float32 cast: weight * x / sqrt(mean(x^2) + eps), in x's dtype."""
    return module.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + module.variance_epsilon))


def check_hf_llama(tied: bool, dtype: torch.dtype, tolerance: float, seed: int = 123) -> CheckResult:
    """Import a tiny random ``transformers.LlamaForCausalLM`` (RMSNorm, SwiGLU, RoPE theta 500, 6 query heads over
    2 key/value heads, no bias) through ``interop.llama``; compare logits, and greedy tokens of the reference, of
    tinygpt without a cache and of tinygpt's ``generate`` (the inference engine's paged KV cache); all three must
    agree.

    HF's RMSNorm computes in float32 even in a float64 model (~1e-7 from exact); in float64 that one cast is lifted
    on the reference's norm instances, so the check measures everything else to ~1e-15.
    """
    _require("transformers", "transformers")
    import types

    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    hf_config = LlamaConfig(
        vocab_size=96, hidden_size=48, intermediate_size=80, num_hidden_layers=3, num_attention_heads=6,
        num_key_value_heads=2, max_position_embeddings=32, rms_norm_eps=1e-6, rope_theta=500.0,
        tie_word_embeddings=tied, attention_bias=False, mlp_bias=False,
        bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )
    ref = LlamaForCausalLM(hf_config).to(dtype).eval()
    with torch.no_grad():  # HF inits the norms to 1: perturb them so the scales are really checked
        for name, p in ref.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.1 * torch.randn_like(p))
    if dtype == torch.float64:
        for module in ref.modules():
            if type(module).__name__ == "LlamaRMSNorm":
                module.forward = types.MethodType(_rmsnorm_in_input_dtype, module)
    ours = from_llama_state_dict(ref.config, ref.state_dict())
    config = ours.config
    idx = _inputs(config, seed)
    with torch.no_grad():
        diff = _max_diff(ours(idx), ref(idx).logits)
    steps = min(10, config.context_length - idx.shape[1])
    expected = _greedy_reference(ref, idx, steps, config.context_length)
    tokens_match = torch.equal(generate_greedy(ours, idx, steps), expected) and torch.equal(
        _greedy_cached(ours, idx, steps), expected)
    norm = "RMSNorm float32 cast lifted, " if dtype == torch.float64 else ""
    return CheckResult(f"transformers LlamaForCausalLM ({norm}cached + uncached greedy), {_describe(config)} "
                       f"H_kv={config.kv_heads}", str(dtype).removeprefix("torch."), diff, tolerance, tokens_match)


def _load_strict(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Load ``state``, allowing only non-persistent buffers to be absent; anything else is an error."""
    result = model.load_state_dict(state, strict=False)
    missing = [k for k in result.missing_keys if k != "lm_head.weight"]  # tied to wte in HF
    if missing or result.unexpected_keys:
        raise RuntimeError(f"weight copy mismatch: missing {missing}, unexpected {result.unexpected_keys}")


def verify_upstream() -> list[CheckResult]:
    """The chapter's alignment check (tiny config, float64, <= 1e-7) plus a gpt2-small shape with qkv_bias in float32."""
    return [
        check_upstream(get_config("tiny"), torch.float64, 1e-7),
        check_upstream(get_config("gpt2-small", qkv_bias=True), torch.float32, 1e-4),
    ]


def verify_hf() -> list[CheckResult]:
    """GPT-2 (pre-LN), GPT-1 (post-LN) and Llama (untied and tied) from small random configs, float64 (<= 1e-10)
    and float32 (<= 1e-5)."""
    gpt2 = GPTConfig(vocab_size=96, context_length=32, emb_dim=48, n_heads=4, n_layers=3,
                     qkv_bias=True, tie_weights=True)
    gpt1 = gpt2.replace(pre_ln=False, tie_weights=False)
    results = []
    for dtype, tol in ((torch.float64, 1e-10), (torch.float32, 1e-5)):
        results.append(check_hf_gpt2(gpt2, dtype, tol))
        results.append(check_hf_openai_gpt(gpt1, dtype, tol))
        results.extend(check_hf_llama(tied, dtype, tol) for tied in (False, True))
    return results


CHECKS = {"upstream": verify_upstream, "hf": verify_hf}
