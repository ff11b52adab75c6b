"""`tinygpt merge`, and an adapter folder as a model to run."""

from __future__ import annotations

import pytest
import torch

from tinygpt import GPTConfig, GPTModel, load_model, lora, save_model
from tinygpt.cli import main
from tinygpt.interop.peft import save_adapter
from tinygpt.interop.pretrained import load_pretrained

CONFIG = GPTConfig(vocab_size=50, context_length=16, emb_dim=32, n_heads=4, n_layers=2)


def _base_and_adapter(tmp_path, dtype: torch.dtype, quantize: str | None = None) -> GPTModel:
    base = GPTModel(CONFIG).to(dtype).eval()
    save_model(base, tmp_path / "base")
    adapted = GPTModel(CONFIG).to(dtype).eval()
    adapted.load_state_dict(base.state_dict())
    lora.apply_lora(adapted, lora.LoRAConfig(r=4, targets=("qkv", "out_proj", "ffn_in"), quantize=quantize))
    with torch.no_grad():
        for _, module in lora.lora_modules(adapted):
            for b in module.lora_B.values():
                b.normal_(0, 0.1)
    save_adapter(adapted, tmp_path / "adapter", base=tmp_path / "base")
    return adapted


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float64, 1e-10)])
def test_merge_writes_a_plain_checkpoint_with_the_adapted_logits(tmp_path, capsys, dtype, tol):
    adapted = _base_and_adapter(tmp_path, dtype)
    assert main(["merge", "--adapter", str(tmp_path / "adapter"), "--out", str(tmp_path / "merged")]) == 0
    assert "merged" in capsys.readouterr().out
    merged = load_model(tmp_path / "merged")
    ids = torch.randint(0, 50, (2, 11))
    with torch.no_grad():
        want = adapted(ids)
        assert (want - load_model(tmp_path / "base")(ids)).abs().max() > 1e-3
        torch.testing.assert_close(merged(ids), want, rtol=0, atol=tol)
        # an adapter folder is also a model to run (generate, chat, eval): its base with the adapter merged in
        model, _ = load_pretrained(tmp_path / "adapter")
        torch.testing.assert_close(model(ids), want, rtol=0, atol=tol)


def test_merge_of_a_qlora_adapter_is_the_dequantised_base_plus_update(tmp_path):
    adapted = _base_and_adapter(tmp_path, torch.float32, quantize="nf4")
    assert main(["merge", "--adapter", str(tmp_path / "adapter"), "--base", str(tmp_path / "base"),
                 "--out", str(tmp_path / "merged")]) == 0
    ids = torch.randint(0, 50, (2, 11))
    with torch.no_grad():
        torch.testing.assert_close(load_model(tmp_path / "merged")(ids), adapted(ids), rtol=0, atol=1e-5)


def test_merge_errors(tmp_path, capsys):
    adapted = _base_and_adapter(tmp_path, torch.float32)
    save_adapter(adapted, tmp_path / "nobase")
    assert main(["merge", "--adapter", str(tmp_path / "nobase"), "--out", str(tmp_path / "m")]) == 2
    assert "names no base model" in capsys.readouterr().err
    assert main(["merge", "--adapter", str(tmp_path / "base"), "--out", str(tmp_path / "m")]) == 2
    assert "not a LoRA adapter" in capsys.readouterr().err


def test_an_adapter_names_its_base_relative_to_itself_and_base_overrides_it(tmp_path, capsys):
    import json
    import shutil

    from tinygpt.tokenizer import CharTokenizer

    _base_and_adapter(tmp_path / "both", torch.float32)
    recorded = json.loads((tmp_path / "both" / "adapter" / "adapter_config.json").read_text())
    assert recorded["base_model_name_or_path"] == "../base"
    shutil.move(tmp_path / "both", tmp_path / "moved")  # adapter and base move together: still found
    model, _ = load_pretrained(tmp_path / "moved" / "adapter")
    shutil.move(tmp_path / "moved" / "base", tmp_path / "elsewhere")  # the base alone moves: the error says so
    with pytest.raises(ValueError, match=r"names its base .*base, which is not there .*--base DIR\|HUBNAME"):
        load_pretrained(tmp_path / "moved" / "adapter")
    moved, _ = load_pretrained(tmp_path / "moved" / "adapter", base=tmp_path / "elsewhere")
    ids = torch.randint(0, 50, (1, 9))
    with torch.no_grad():
        torch.testing.assert_close(moved(ids), model(ids), rtol=0, atol=0)
    # the command line: generate and chat take --base; without it, one line naming the adapter's base
    tokenizer = CharTokenizer([chr(65 + i) for i in range(50)])  # one character per id of the 50
    save_model(load_model(tmp_path / "elsewhere"), tmp_path / "elsewhere", tokenizer, overwrite=True)
    argv = ["generate", "--model", str(tmp_path / "moved" / "adapter"), "--prompt", "AB", "--max-new-tokens", "3"]
    assert main(argv) == 2
    assert "is not there" in capsys.readouterr().err
    assert main([*argv, "--base", str(tmp_path / "elsewhere")]) == 0
    assert capsys.readouterr().out.startswith("AB")
    assert main(["generate", "--model", str(tmp_path / "elsewhere"), "--base", "x", "--prompt", "a"]) == 2
    assert "applies to a LoRA adapter folder only" in capsys.readouterr().err


def test_a_mistyped_local_folder_is_no_such_folder_not_a_hub_lookup(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "runs").mkdir()
    for path in ("runs/nope", "./nope", str(tmp_path / "nope"), "nope.gguf"):
        assert main(["generate", "--model", path, "--prompt", "a"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"{path}: no such" in err and "HF_HUB" not in err, err
