"""Adapters in PEFT's format, both ways, checked with peft itself on tiny random GPT-2 models."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from tinygpt import GPTConfig, GPTModel, lora
from tinygpt.interop.hf import export_hf, import_hf
from tinygpt.interop.peft import is_adapter, load_adapter, read_adapter, save_adapter

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
transformers.logging.set_verbosity_error()
from transformers import GPT2Config, GPT2LMHeadModel  # noqa: E402

CONFIG = GPTConfig(vocab_size=50, context_length=16, emb_dim=32, n_heads=4, n_layers=2, qkv_bias=True)
ALL = ("qkv", "out_proj", "ffn_in", "ffn_out")


def _ids() -> torch.Tensor:
    return torch.randint(0, CONFIG.vocab_size, (2, 9), generator=torch.Generator().manual_seed(5))


def _adapted(targets=ALL, seed: int = 0) -> GPTModel:
    torch.manual_seed(seed)
    model = lora.apply_lora(GPTModel(CONFIG).eval(), lora.LoRAConfig(r=4, alpha=12, targets=targets))
    with torch.no_grad():  # B = 0 would make any adapter (or none) give the base's logits
        for _, module in lora.lora_modules(model):
            for b in module.lora_B.values():
                b.normal_(0, 0.2)
    return model


def test_tinygpt_adapter_loads_in_peft_with_the_same_logits(tmp_path):
    model = _adapted()
    save_adapter(model, tmp_path / "adapter", base=tmp_path / "hf")
    export_hf(_base_of(model), tmp_path / "hf")
    keys = set(load_file(tmp_path / "adapter" / "adapter_model.safetensors"))
    assert "base_model.model.transformer.h.1.attn.c_attn.lora_A.weight" in keys
    assert "base_model.model.transformer.h.0.mlp.c_proj.lora_B.weight" in keys and len(keys) == 2 * 4 * 2
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["fan_in_fan_out"] is True and config["r"] == 4 and config["lora_alpha"] == 12
    hf = GPT2LMHeadModel.from_pretrained(tmp_path / "hf").eval()
    ids = _ids()
    with torch.no_grad():
        base_logits = hf(ids).logits
        peft_model = peft.PeftModel.from_pretrained(hf, tmp_path / "adapter").eval()
        peft_logits = peft_model(ids).logits
        ours = model(ids)
    # peft leaves an adapter it cannot name at B = 0: the base's logits. Those must differ from the adapted ones.
    assert (ours - base_logits).abs().max() > 1e-2
    torch.testing.assert_close(peft_logits, ours, rtol=0, atol=1e-5)


def _base_of(model: GPTModel) -> GPTModel:
    with lora.adapters_disabled(model):
        return lora.merged_model(model)


def test_peft_trained_adapter_loads_into_tinygpt_with_the_same_logits(tmp_path):
    torch.manual_seed(0)
    hf = GPT2LMHeadModel(GPT2Config(vocab_size=50, n_positions=16, n_embd=32, n_layer=2, n_head=4,
                                    bos_token_id=None, eos_token_id=None, resid_pdrop=0.0, embd_pdrop=0.0,
                                    attn_pdrop=0.0))
    hf.save_pretrained(tmp_path / "hf")
    # The short name "c_proj" matches both attn.c_proj and mlp.c_proj, as it does for peft's users.
    peft_config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["c_attn", "c_proj"], fan_in_fan_out=True,
                                  lora_dropout=0.0, task_type="CAUSAL_LM")
    trained = peft.get_peft_model(hf, peft_config)
    optimizer = torch.optim.AdamW([p for p in trained.parameters() if p.requires_grad], lr=1e-2)
    ids = _ids()
    for _ in range(3):
        optimizer.zero_grad()
        trained(ids, labels=ids).loss.backward()
        optimizer.step()
    trained.save_pretrained(tmp_path / "adapter")
    trained.eval()
    ours = load_adapter(import_hf(tmp_path / "hf"), tmp_path / "adapter")
    assert ours.lora_config.targets == ("qkv", "out_proj", "ffn_out") and ours.lora_config.scaling == 2.0
    base = import_hf(tmp_path / "hf")
    with torch.no_grad():
        want = trained(ids).logits
        assert (want - base(ids)).abs().max() > 1e-3  # the training moved the adapter off B = 0
        torch.testing.assert_close(ours(ids), want, rtol=0, atol=1e-5)


def test_round_trip_in_tinygpt_and_the_llama_variant(tmp_path):
    model = _adapted(targets=("qkv", "ffn_out"))
    save_adapter(model, tmp_path / "a", base="some/hub-name")
    assert is_adapter(tmp_path / "a")
    adapter = read_adapter(tmp_path / "a")
    assert adapter.base == "some/hub-name" and adapter.config == model.lora_config
    again = load_adapter(_base_of(model), tmp_path / "a")
    torch.testing.assert_close(again(_ids()), model(_ids()), rtol=0, atol=0)
    llama = CONFIG.replace(norm="rmsnorm", ffn="swiglu", bias=False, qkv_bias=False, pos_emb="rope")
    torch.manual_seed(1)
    base = GPTModel(llama).eval()
    adapted = lora.apply_lora(_clone(base), lora.LoRAConfig(r=2, targets=("gate", "up", "qkv")))
    with torch.no_grad():
        for _, module in lora.lora_modules(adapted):
            for b in module.lora_B.values():
                b.normal_(0, 0.2)
    save_adapter(adapted, tmp_path / "b")
    back = load_adapter(_clone(base), tmp_path / "b")
    torch.testing.assert_close(back(_ids()), adapted(_ids()), rtol=0, atol=0)
    with pytest.raises(ValueError, match="another config"):
        load_adapter(GPTModel(CONFIG), tmp_path / "b")


def _clone(model: GPTModel) -> GPTModel:
    clone = GPTModel(model.config).eval()
    clone.load_state_dict(model.state_dict())
    return clone


def test_wrong_names_and_unsupported_features_are_errors(tmp_path):
    save_adapter(_adapted(), tmp_path / "a")
    weights = tmp_path / "a" / "adapter_model.safetensors"
    state = load_file(weights)
    save_file({k.replace("base_model.model.", "base_model."): v for k, v in state.items()}, weights)
    with pytest.raises(ValueError, match="unexpected tensor 'base_model.transformer"):
        read_adapter(tmp_path / "a")
    save_adapter(_adapted(), tmp_path / "b")
    config_path = tmp_path / "b" / "adapter_config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**config, "use_dora": True}))
    with pytest.raises(ValueError, match="use_dora"):
        read_adapter(tmp_path / "b")
    with pytest.raises(ValueError, match="not a LoRA adapter"):
        read_adapter(tmp_path)
    with pytest.raises(ValueError, match="no LoRA adapters"):
        save_adapter(GPTModel(CONFIG), tmp_path / "c")
