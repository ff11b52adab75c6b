"""LoRA and QLoRA in every stage: what a checkpoint holds, exact resume, DPO/PPO's reference is the base."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from conftest import INSTRUCTION_DATA, PREFERENCE_DATA
from tinygpt import GPTModel, load_model, lora
from tinygpt.alignment.data import ALPACA_CHAT_TEMPLATE, load_preference_data
from tinygpt.alignment.dpo import DPOStage
from tinygpt.alignment.finetune import reference_model
from tinygpt.alignment.reward import load_reward_model
from tinygpt.cli import main
from tinygpt.interop.pretrained import load_pretrained

pytestmark = pytest.mark.usefixtures("one_thread")


def _run(command: str, model_dir, data, out, *extra: str) -> int:
    return main([command, "--model", str(model_dir), "--data", str(data), "--limit", "12", "--out", str(out),
                 "--batch-size", "4", "--no-progress", "--lr", "1e-2", *extra])


def _adapter(run_step) -> dict[str, torch.Tensor]:
    return load_file(run_step / "adapter_model.safetensors")


@pytest.mark.parametrize("command,data", [("sft", INSTRUCTION_DATA), ("dpo", PREFERENCE_DATA),
                                          ("reward", PREFERENCE_DATA)])
def test_lora_checkpoints_hold_the_adapter_and_resume_exactly(tmp_path, alignment_model_dir, capsys, command, data):
    flags = ("--lora-r", "4", "--lora-targets", "qkv", "out_proj", "ffn_out", "--max-steps", "4",
             "--eval-every", "2", "--keep-last", "4")
    assert _run(command, alignment_model_dir, data, tmp_path / "a", *flags) == 0
    assert _run(command, alignment_model_dir, data, tmp_path / "b", *flags, "--stop-after", "2") == 0
    assert _run(command, alignment_model_dir, data, tmp_path / "b", *flags, "--resume", "auto") == 0
    capsys.readouterr()
    step = tmp_path / "a" / "step-2"
    names = {p.name for p in step.iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors", "tinygpt_adapter.json", "training_state.pt"} <= names
    assert not names & {"model.safetensors", "config.json"}  # no base weights (the tokenizer's files are there)
    config = json.loads((step / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == "../../base" and config["r"] == 4  # relative: they move together
    for name in ("step-4", "."):  # the last checkpoint and the exported adapter
        a, b = _adapter(tmp_path / "a" / name), _adapter(tmp_path / "b" / name)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert any(float(t.abs().max()) > 0 for k, t in a.items() if "lora_B" in k)  # it trained
    if command == "reward":  # the head, trained whole, beside the adapter: PEFT's modules_to_save
        assert a["base_model.model.score.weight"].shape == (1, 32)
        assert json.loads((tmp_path / "a" / "adapter_config.json").read_text())["modules_to_save"] == ["score"]
        ours = json.loads((tmp_path / "a" / "tinygpt_adapter.json").read_text())
        assert ours["reward_head"]["bias"] == 0.0  # frozen (Bradley-Terry has no use for it): GPT-2 has none
        assert not {"model.safetensors", "reward_head.safetensors"} & {p.name for p in (tmp_path / "a").iterdir()}
    metrics = [json.loads(line) for line in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    straight = [json.loads(line) for line in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    assert [r["loss"] for r in metrics] == [r["loss"] for r in straight]
    if command == "reward":
        return
    # the run folder is a model to run (chat, generate): the base with the adapter merged in
    model, tokenizer = load_pretrained(tmp_path / "a")
    assert type(model) is GPTModel and tokenizer.chat_template.source == ALPACA_CHAT_TEMPLATE  # it chats
    # resuming with other LoRA settings is refused, not silently mixed
    assert _run(command, alignment_model_dir, data, tmp_path / "b", "--lora-r", "8", "--max-steps", "6",
                "--resume", "auto") == 2
    assert "resume with the run's --lora-* flags" in capsys.readouterr().err


def _storage_bytes(*objects) -> int:
    """Bytes of the distinct storages behind every parameter and buffer of ``objects`` (shared ones once)."""
    seen: dict[int, int] = {}
    for obj in objects:
        for t in [*obj.parameters(), *obj.buffers()]:
            s = t.untyped_storage()
            seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def test_dpo_with_lora_holds_one_base_and_its_reference_is_the_base(alignment_tokenizer, alignment_config):
    torch.manual_seed(0)
    examples = load_preference_data(PREFERENCE_DATA, limit=8)
    base = GPTModel(alignment_config).eval()
    plain = DPOStage(GPTModel(alignment_config), alignment_tokenizer, examples, val_fraction=0.0)
    policy = GPTModel(alignment_config)
    policy.load_state_dict(base.state_dict())
    lora.apply_lora(policy, lora.LoRAConfig(r=4), seed=0)
    stage = DPOStage(policy, alignment_tokenizer, examples, val_fraction=0.0)
    held = _storage_bytes(stage.policy)  # the reference is the policy itself
    assert stage.reference is None
    assert _storage_bytes(plain.policy, plain.reference) == 2 * _storage_bytes(base)  # full DPO: two copies
    adapters = sum(t.numel() * 4 for t in lora.lora_state_dict(policy).values())
    assert held == _storage_bytes(base) + adapters
    with torch.no_grad():
        for _, module in lora.lora_modules(policy):
            for b in module.lora_B.values():
                b.normal_(0, 0.2)
    policy.train()
    ids = torch.randint(0, alignment_config.vocab_size, (2, 9))
    with torch.no_grad(), reference_model(stage.reference, policy) as reference:
        torch.testing.assert_close(reference(ids), base(ids), rtol=0, atol=0)
        assert not reference.training
    assert policy.training and (policy.eval()(ids) - base(ids)).abs().max() > 1e-3


def test_reward_and_ppo_train_with_qlora_from_the_cli(tmp_path, alignment_model_dir, capsys):
    qlora = ("--lora-r", "4", "--quantize", "nf4", "--max-steps", "2")
    assert _run("reward", alignment_model_dir, PREFERENCE_DATA, tmp_path / "rm", *qlora) == 0
    reward_model, _ = load_reward_model(tmp_path / "rm")  # the adapter and head, on the base it names, merged
    assert type(reward_model.trunk) is GPTModel
    assert "model.safetensors" not in {p.name for p in (tmp_path / "rm").iterdir()}
    step = tmp_path / "rm" / "step-2"
    assert "model.safetensors" not in {p.name for p in step.iterdir()}
    state = torch.load(step / "training_state.pt", weights_only=True)
    assert set(state["heads"]) == {"reward.weight", "reward.bias"}  # the head trains whole
    code = main(["ppo", "--policy", str(alignment_model_dir), "--reward", str(tmp_path / "rm"), "--data",
                 str(INSTRUCTION_DATA), "--limit", "6", "--out", str(tmp_path / "ppo"), "--max-steps", "1",
                 "--batch-size", "3", "--max-new-tokens", "3", "--ppo-epochs", "1", "--no-progress", *qlora[:4]])
    assert code == 0 and "val_reward" in capsys.readouterr().out
    assert (tmp_path / "ppo" / "adapter_model.safetensors").is_file()
    assert json.loads((tmp_path / "ppo" / "tinygpt_adapter.json").read_text())["lora"]["quantize"] == "nf4"
    base = load_model(alignment_model_dir)
    merged, _ = load_pretrained(tmp_path / "ppo")
    assert merged.config == base.config


def test_sft_trains_on_a_double_quantised_base(tmp_path, alignment_model_dir):
    assert _run("sft", alignment_model_dir, INSTRUCTION_DATA, tmp_path / "sft", "--lora-r", "2", "--quantize",
                "nf4-dq", "--max-steps", "1") == 0
    saved = json.loads((tmp_path / "sft" / "tinygpt_adapter.json").read_text())
    assert saved["lora"]["quantize"] == "nf4-dq"
    assert set(_adapter(tmp_path / "sft")) and all("lora_" in name for name in _adapter(tmp_path / "sft"))
    _, tokenizer = load_pretrained(tmp_path / "sft")  # a QLoRA run chats too: its folder carries the template
    assert tokenizer.chat_template.source == ALPACA_CHAT_TEMPLATE


def test_lora_flag_errors(tmp_path, alignment_model_dir, capsys):
    assert _run("sft", alignment_model_dir, INSTRUCTION_DATA, tmp_path / "x", "--quantize", "nf4") == 2
    assert "--quantize" in capsys.readouterr().err and not (tmp_path / "x").exists()
    assert _run("sft", alignment_model_dir, INSTRUCTION_DATA, tmp_path / "x", "--lora-r", "0") == 2
    assert "--lora-r 0 must be an integer >= 1" in capsys.readouterr().err
    assert _run("sft", alignment_model_dir, INSTRUCTION_DATA, tmp_path / "x", "--lora-r", "2",
                "--lora-targets", "gate") == 2
    assert "needs a SwiGLU feed-forward" in capsys.readouterr().err
