"""A LoRA reward model is saved as its adapter and its head alone (PEFT's format, naming the base): no base weights,
the same rewards as the merged model in ``ppo --reward``, and peft loads it onto the base's Hugging Face export."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from conftest import INSTRUCTION_DATA
from tinygpt import GPTConfig, GPTModel, lora
from tinygpt.alignment.reward import RewardModel, load_reward_model, save_reward_model
from tinygpt.cli import main

pytestmark = pytest.mark.usefixtures("one_thread")


def _adapted_reward_model(base: GPTModel, base_dir, bias: float = 0.0) -> RewardModel:
    """``base`` with random adapters (B != 0, else the adapter changes nothing) and a random head."""
    torch.manual_seed(3)
    trunk = lora.apply_lora(base, lora.LoRAConfig(r=4, alpha=8, targets=("qkv", "out_proj", "ffn_in", "ffn_out")))
    with torch.no_grad():
        for _, module in lora.lora_modules(trunk):
            for b in module.lora_B.values():
                b.normal_(0, 0.2)
    trunk.lora_base = str(base_dir)  # what ``finetune.adapt`` records: the base the adapter names
    model = RewardModel(trunk, seed=1)
    with torch.no_grad():
        model.head.weight.normal_(0, 0.5)
        model.head.bias.fill_(bias)
    return model.eval()


def _rewards(metrics_path) -> list[float]:
    return [r["reward"] for r in map(json.loads, metrics_path.read_text().splitlines()) if "reward" in r]


def test_lora_reward_model_holds_no_base_weights_and_ppo_reads_the_same_rewards(tmp_path, alignment_model_dir,
                                                                               alignment_tokenizer):
    from tinygpt import load_model

    model = _adapted_reward_model(load_model(alignment_model_dir), alignment_model_dir)
    save_reward_model(model, tmp_path / "rm", alignment_tokenizer)
    merged = RewardModel(lora.merged_model(model.trunk), model.head).eval()
    save_reward_model(merged, tmp_path / "merged", alignment_tokenizer)  # what --lora-r used to write
    files = {p.name for p in (tmp_path / "rm").iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors", "tinygpt_adapter.json"} <= files
    assert not files & {"model.safetensors", "config.json", "reward_head.safetensors"}
    keys = set(load_file(tmp_path / "rm" / "adapter_model.safetensors"))
    assert "base_model.model.score.weight" in keys
    assert all(".lora_A." in k or ".lora_B." in k for k in keys - {"base_model.model.score.weight"})  # key check
    size = sum(p.stat().st_size for p in (tmp_path / "rm").iterdir())
    base_size = (alignment_model_dir / "model.safetensors").stat().st_size
    assert size < base_size / 2  # size check: the adapter and the head, not the base
    config = json.loads((tmp_path / "rm" / "adapter_config.json").read_text())
    assert config["modules_to_save"] == ["score"] and config["task_type"] == "SEQ_CLS"
    assert config["base_model_name_or_path"] == "../base"  # relative: the two move together
    loaded, tokenizer = load_reward_model(tmp_path / "rm")
    reference, _ = load_reward_model(tmp_path / "merged")
    assert tokenizer is not None and tokenizer.vocab_size == alignment_tokenizer.vocab_size
    sequences = [alignment_tokenizer.encode(t) for t in ("Give three tips.", "Name a colour: red", "2 + 2 = 4")]
    pad = alignment_tokenizer.eot_id
    torch.testing.assert_close(loaded.score(sequences, pad), reference.score(sequences, pad), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(loaded.score(sequences, pad), model.score(sequences, pad), rtol=1e-5, atol=1e-5)
    assert float((loaded.score(sequences, pad) - loaded.score(sequences, pad).mean()).abs().max()) > 1e-3
    # ppo --reward reads either folder and sees the same rewards
    for name in ("rm", "merged"):
        code = main(["ppo", "--policy", str(alignment_model_dir), "--reward", str(tmp_path / name), "--data",
                     str(INSTRUCTION_DATA), "--limit", "6", "--out", str(tmp_path / f"ppo-{name}"), "--max-steps",
                     "2", "--batch-size", "3", "--max-new-tokens", "3", "--ppo-epochs", "1", "--no-progress"])
        assert code == 0
    got, want = _rewards(tmp_path / "ppo-rm" / "metrics.jsonl"), _rewards(tmp_path / "ppo-merged" / "metrics.jsonl")
    assert len(got) == 2 and got == pytest.approx(want, abs=1e-5)


def test_peft_loads_the_reward_adapter_and_head_onto_the_hf_base_with_the_same_scores(tmp_path):
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    transformers.logging.set_verbosity_error()
    from tinygpt.interop.hf import export_hf

    config = GPTConfig(vocab_size=50, context_length=16, emb_dim=32, n_heads=4, n_layers=2, qkv_bias=True)
    torch.manual_seed(0)
    base = GPTModel(config).eval()
    export_hf(base, tmp_path / "hf")
    model = _adapted_reward_model(base, tmp_path / "hf", bias=0.25)
    save_reward_model(model, tmp_path / "rm")
    assert json.loads((tmp_path / "rm" / "tinygpt_adapter.json").read_text())["reward_head"]["bias"] == 0.25
    hf = transformers.GPT2ForSequenceClassification.from_pretrained(tmp_path / "hf", num_labels=1,
                                                                    pad_token_id=None).eval()
    peft_model = peft.PeftModel.from_pretrained(hf, tmp_path / "rm").eval()
    generator = torch.Generator().manual_seed(5)
    sequences = [torch.randint(0, 50, (n,), generator=generator).tolist() for n in (5, 9, 16)]
    ours = model.score(sequences, pad_id=0)
    with torch.no_grad():  # one row at a time: with no pad id, GPT-2's head reads the last token as ours does
        theirs = torch.stack([peft_model(torch.tensor([s])).logits[0, 0] for s in sequences])
    # GPT-2's score layer has no bias: peft's scores are ours less the bias (0 for a trained head: the module doc)
    torch.testing.assert_close(theirs + 0.25, ours, rtol=1e-5, atol=1e-5)
    loaded, _ = load_reward_model(tmp_path / "rm")  # and tinygpt reads it back from the HF base it names
    torch.testing.assert_close(loaded.score(sequences, 0), ours, rtol=1e-5, atol=1e-5)


def test_an_adapter_without_a_head_is_no_reward_model_and_other_modules_to_save_are_refused(tmp_path,
                                                                                          alignment_model_dir):
    from tinygpt import load_model
    from tinygpt.interop.peft import read_adapter, save_adapter

    model = _adapted_reward_model(load_model(alignment_model_dir), alignment_model_dir)
    save_adapter(model.trunk, tmp_path / "sft-like")  # an SFT adapter: no score head
    with pytest.raises(ValueError, match="without a reward head"):
        load_reward_model(tmp_path / "sft-like")
    with pytest.raises(ValueError, match="modules_to_save"):
        save_adapter(model.trunk, tmp_path / "bad", modules={"lm_head.weight": torch.zeros(3, 32)})
    save_reward_model(model, tmp_path / "rm")
    config = json.loads((tmp_path / "rm" / "adapter_config.json").read_text())
    (tmp_path / "rm" / "adapter_config.json").write_text(json.dumps({**config, "modules_to_save": ["lm_head"]}))
    with pytest.raises(ValueError, match="modules_to_save=\\['lm_head'\\] is not supported"):
        read_adapter(tmp_path / "rm")
