"""LoRA layers: step 0 equals the base, only the adapters train, switching off, merge, the SwiGLU halves."""

from __future__ import annotations

import contextlib

import pytest
import torch

from tinygpt import GPTConfig, GPTModel
from tinygpt import lora
from tinygpt.fast import Linear
from tinygpt.quantize import NF4Linear

CONFIG = GPTConfig(vocab_size=50, context_length=16, emb_dim=32, n_heads=4, n_layers=2, qkv_bias=True)
LLAMA = CONFIG.replace(norm="rmsnorm", ffn="swiglu", bias=False, qkv_bias=False, pos_emb="rope", n_kv_heads=2)


def _ids(batch: int = 2, t: int = 10) -> torch.Tensor:
    return torch.randint(0, CONFIG.vocab_size, (batch, t), generator=torch.Generator().manual_seed(1))


def _randomize_b(model: GPTModel, seed: int = 3) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, module in lora.lora_modules(model):
            for b in module.lora_B.values():
                b.copy_(torch.randn(b.shape, generator=g, dtype=b.dtype) * 0.1)


def test_step_zero_is_the_base_and_only_adapters_train():
    model = GPTModel(CONFIG).eval()
    ids = _ids()
    base = model(ids)
    lora.apply_lora(model, lora.LoRAConfig(r=4, alpha=8, targets=("qkv", "out_proj", "ffn_in", "ffn_out")))
    torch.testing.assert_close(model(ids), base, rtol=0, atol=0)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    # r (in + out) per target: qkv 4*(32+96), out_proj 4*(32+32), ffn_in 4*(32+128), ffn_out 4*(128+32); 2 layers
    assert model.num_parameters() == 2 * 4 * ((32 + 96) + (32 + 32) + (32 + 128) + (128 + 32))
    assert isinstance(model.trf_blocks[0].att.qkv.base, Linear)  # the fast linear stays the base product


def test_update_is_scaling_times_b_a_and_gradients_reach_only_adapters():
    model = GPTModel(CONFIG).eval()
    lora.apply_lora(model, lora.LoRAConfig(r=2, alpha=6, targets=("qkv",)))
    _randomize_b(model)
    module = model.trf_blocks[0].att.qkv
    x = torch.randn(3, 32, dtype=torch.float32)
    a, b = module.lora_A["qkv"], module.lora_B["qkv"]
    want = x @ module.base.weight.T + module.base.bias + 3.0 * (x @ a.T @ b.T)
    torch.testing.assert_close(module(x), want, rtol=1e-5, atol=1e-6)
    model.train()
    model(_ids(), targets=_ids()).backward()
    assert module.lora_A["qkv"].grad is not None and module.lora_B["qkv"].grad is not None
    assert module.base.weight.grad is None and model.tok_emb.weight.grad is None


def test_adapter_gradients_are_the_plain_ones_through_the_fast_frozen_base():
    # The frozen base runs on oneDNN both ways and SFT's ignored targets skip the head: the loss and every adapter's
    # gradient must be what plain PyTorch (nn.Linear, logits, F.cross_entropy) gives.
    from tinygpt import fast

    torch.manual_seed(0)
    model = GPTModel(CONFIG).train()
    lora.apply_lora(model, lora.LoRAConfig(r=4, alpha=8, targets=("qkv", "out_proj", "ffn_in", "ffn_out")))
    _randomize_b(model)
    targets = _ids()
    targets[:, :6] = -100  # a prompt: no loss there
    results = []
    for plain_pytorch in (True, False):
        with fast.disabled() if plain_pytorch else contextlib.nullcontext():
            model.zero_grad(set_to_none=True)
            loss = model(_ids(), targets=targets)
            loss.backward()
        results.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}))
    (plain_loss, plain), (fast_loss, fast_grads) = results
    torch.testing.assert_close(fast_loss, plain_loss, rtol=1e-5, atol=1e-6)
    assert plain.keys() == fast_grads.keys() and len(plain) == 2 * 2 * 4
    for name in plain:
        torch.testing.assert_close(fast_grads[name], plain[name], rtol=1e-4, atol=1e-6, msg=lambda m: f"{name}: {m}")


def test_adapters_disabled_gives_the_base_and_restores():
    model = GPTModel(CONFIG).eval()
    ids = _ids()
    base = model(ids)
    lora.apply_lora(model, lora.LoRAConfig(r=4))
    _randomize_b(model)
    adapted = model(ids)
    assert (adapted - base).abs().max() > 1e-3
    with lora.adapters_disabled(model):
        torch.testing.assert_close(model(ids), base, rtol=0, atol=0)
    torch.testing.assert_close(model(ids), adapted, rtol=0, atol=0)
    lora.merge(model)
    with lora.adapters_disabled(model):  # a merged model gives its base back too
        torch.testing.assert_close(model(ids), base, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(model(ids), adapted, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float64, 1e-10)])
def test_merge_and_merged_model_equal_unmerged(dtype, tol):
    model = GPTModel(CONFIG).to(dtype).eval()
    lora.apply_lora(model, lora.LoRAConfig(r=4, alpha=4, targets=tuple(lora.DEFAULT_TARGETS) + ("ffn_out",)))
    _randomize_b(model)
    ids = _ids()
    unmerged = model(ids)
    plain = lora.merged_model(model)
    assert type(plain) is GPTModel and not any(True for _ in lora.lora_modules(plain))
    torch.testing.assert_close(plain(ids), unmerged, rtol=0, atol=tol)
    lora.merge(model)
    torch.testing.assert_close(model(ids), unmerged, rtol=0, atol=tol)
    lora.unmerge(model)
    torch.testing.assert_close(model(ids), unmerged, rtol=0, atol=tol)


def test_swiglu_gate_up_down_are_their_own_adapters():
    model = GPTModel(LLAMA).eval()
    ids = _ids()
    base = model(ids)
    lora.apply_lora(model, lora.LoRAConfig(r=2, targets=("gate", "up", "down")))
    torch.testing.assert_close(model(ids), base, rtol=0, atol=0)
    fused = model.trf_blocks[0].ff.layers[0]
    f = LLAMA.ffn_dim
    assert fused.parts == {"gate": (0, f), "up": (f, 2 * f)}
    assert fused.lora_B["gate"].shape == (f, 2)
    _randomize_b(model)
    x = torch.randn(4, 32)
    want = fused.base(x)
    want[:, :f] += fused.scaling * x @ fused.lora_A["gate"].T @ fused.lora_B["gate"].T
    want[:, f:] += fused.scaling * x @ fused.lora_A["up"].T @ fused.lora_B["up"].T
    torch.testing.assert_close(fused(x), want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lora.merged_model(model)(ids), model(ids), rtol=0, atol=1e-5)


def test_qlora_base_is_nf4_and_step_zero_is_the_dequantised_base():
    model = GPTModel(CONFIG).eval()
    ids = _ids()
    lora.apply_lora(model, lora.LoRAConfig(r=4, quantize="nf4"))
    assert isinstance(model.trf_blocks[0].att.qkv.base, NF4Linear)
    assert isinstance(model.trf_blocks[0].ff.layers[0], NF4Linear)  # untargeted linears are quantised too
    plain = lora.merged_model(model)  # B = 0: the dequantised base
    torch.testing.assert_close(model(ids), plain(ids), rtol=0, atol=1e-5)
    model.train()
    model(ids, targets=ids).backward()
    assert model.trf_blocks[0].att.qkv.lora_A["qkv"].grad is not None


def test_lora_state_dict_round_trip_and_errors():
    model = GPTModel(CONFIG).eval()
    lora.apply_lora(model, lora.LoRAConfig(r=4))
    _randomize_b(model)
    state = {k: v.clone() for k, v in lora.lora_state_dict(model).items()}
    assert set(state) == {f"trf_blocks.{i}.att.{m}.lora_{ab}.{m}" for i in range(2) for m in ("qkv", "out_proj")
                          for ab in "AB"}
    other = lora.apply_lora(GPTModel(CONFIG).eval(), lora.LoRAConfig(r=4))
    lora.load_lora_state_dict(other, state)
    other.load_state_dict(model.state_dict())
    torch.testing.assert_close(other(_ids()), model(_ids()), rtol=0, atol=0)
    with pytest.raises(ValueError, match="shape"):
        lora.load_lora_state_dict(lora.apply_lora(GPTModel(CONFIG), lora.LoRAConfig(r=2)), state)
    with pytest.raises(ValueError, match="missing tensor"):
        lora.load_lora_state_dict(other, {k: v for k, v in state.items() if "out_proj" not in k})


@pytest.mark.parametrize("kwargs,match", [
    ({"r": 0}, "lora_r"), ({"alpha": -1}, "lora_alpha"), ({"dropout": 1.0}, "lora_dropout"),
    ({"targets": ("wq",)}, "lora_targets"), ({"targets": ()}, "lora_targets"), ({"quantize": "int8"}, "quantize"),
])
def test_config_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        lora.LoRAConfig(**kwargs)


def test_target_errors():
    with pytest.raises(ValueError, match="SwiGLU"):
        lora.apply_lora(GPTModel(CONFIG), lora.LoRAConfig(targets=("gate",)))
    with pytest.raises(ValueError, match="same weights"):
        lora.apply_lora(GPTModel(LLAMA), lora.LoRAConfig(targets=("ffn_in", "up")))
    model = lora.apply_lora(GPTModel(CONFIG), lora.LoRAConfig())
    with pytest.raises(ValueError, match="already has"):
        lora.apply_lora(model, lora.LoRAConfig())
