import json
import pickle
import random

import pytest
import torch
from safetensors.torch import load_file, save_file

from tinygpt import GPTConfig, GPTModel, generate_greedy
from tinygpt.interop.hf import (
    export_hf,
    gpt2_to_tinygpt,
    hf_config_to_tinygpt,
    import_hf,
    resolve_hf_source,
    tinygpt_to_gpt2,
)

transformers = pytest.importorskip("transformers")
transformers.logging.set_verbosity_error()
from transformers import GPT2Config, GPT2LMHeadModel  # noqa: E402


def _random_hf_configs(n: int = 3) -> list[GPT2Config]:
    rng = random.Random(1234)
    configs = []
    for _ in range(n):
        heads = rng.choice([1, 2, 4])
        configs.append(GPT2Config(
            vocab_size=rng.randint(20, 120), n_positions=rng.choice([16, 24, 32]), n_embd=heads * rng.choice([4, 8]),
            n_layer=rng.randint(1, 3), n_head=heads, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
            bos_token_id=None, eos_token_id=None,
        ))
    return configs


HF_CONFIGS = _random_hf_configs()


def _hf_model(config: GPT2Config, dtype: torch.dtype = torch.float32, seed: int = 0) -> GPT2LMHeadModel:
    torch.manual_seed(seed)
    model = GPT2LMHeadModel(config).to(dtype).eval()
    with torch.no_grad():  # HF init leaves norms at 1/0 and biases at 0: perturb them so every tensor counts
        for name, p in model.named_parameters():
            if name.endswith("bias") or ".ln_" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model


def _hf_greedy(model, idx: torch.Tensor, steps: int) -> torch.Tensor:
    with torch.no_grad():
        for _ in range(steps):
            logits = model(idx[:, -model.config.n_positions:]).logits
            idx = torch.cat((idx, logits[:, -1].argmax(-1, keepdim=True)), dim=1)
    return idx


def _ids(vocab: int, shape=(2, 7)) -> torch.Tensor:
    return torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(7))


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.float64, 1e-10)])
@pytest.mark.parametrize("index", range(len(HF_CONFIGS)))
def test_import_matches_hf(tmp_path, index, dtype, tol):
    hf_config = HF_CONFIGS[index]
    hf = _hf_model(hf_config, dtype, seed=index)
    hf.save_pretrained(tmp_path)
    ours = import_hf(tmp_path)
    assert ours.config.qkv_bias and ours.config.tie_weights and ours.out_head.weight is ours.tok_emb.weight
    assert {p.dtype for p in ours.parameters()} == {dtype}
    idx = _ids(hf_config.vocab_size)
    with torch.no_grad():
        diff = (ours(idx) - hf(idx).logits).abs().max().item()
    assert diff <= tol
    steps = hf_config.n_positions - idx.shape[1] + 3  # past the context window: the crop path too
    assert torch.equal(generate_greedy(ours, idx, steps), _hf_greedy(hf, idx, steps))


def test_import_without_prefix_with_legacy_buffers_and_bin(tmp_path):
    hf = _hf_model(HF_CONFIGS[1])
    hf.save_pretrained(tmp_path / "hf")
    reference = import_hf(tmp_path / "hf")
    state = load_file(tmp_path / "hf" / "model.safetensors")
    stripped = {k.removeprefix("transformer."): v for k, v in state.items()}
    n_pos = HF_CONFIGS[1].n_positions
    for i in range(HF_CONFIGS[1].n_layer):  # what transformers < 4.3x saved: mask buffers in the state dict
        stripped[f"h.{i}.attn.bias"] = torch.tril(torch.ones(n_pos, n_pos)).view(1, 1, n_pos, n_pos)
        stripped[f"h.{i}.attn.masked_bias"] = torch.tensor(-1e4)
    stripped["lm_head.weight"] = stripped["wte.weight"].clone()
    for name, writer in (("st", lambda d: save_file(stripped, d / "model.safetensors")),
                         ("bin", lambda d: torch.save(stripped, d / "pytorch_model.bin"))):
        folder = tmp_path / name
        folder.mkdir()
        (folder / "config.json").write_text((tmp_path / "hf" / "config.json").read_text())
        writer(folder)
        loaded = import_hf(folder)
        for key, tensor in reference.state_dict().items():
            assert torch.equal(loaded.state_dict()[key], tensor), (name, key)


def test_bin_with_code_is_refused(tmp_path):
    hf = _hf_model(HF_CONFIGS[0])
    hf.save_pretrained(tmp_path)
    (tmp_path / "model.safetensors").unlink()

    class Payload:
        def __reduce__(self):
            return (print, ("pickle code ran",))

    with open(tmp_path / "pytorch_model.bin", "wb") as f:
        pickle.dump({"wte.weight": Payload()}, f, protocol=2)
    with pytest.raises(ValueError, match=r"pytorch_model\.bin: cannot be read as plain tensors"):
        import_hf(tmp_path)


def _saved_hf(tmp_path):
    _hf_model(HF_CONFIGS[0]).save_pretrained(tmp_path)
    return load_file(tmp_path / "model.safetensors")


def test_unknown_missing_and_misshaped_tensors(tmp_path):
    state = _saved_hf(tmp_path)
    path = tmp_path / "model.safetensors"
    save_file({**state, "transformer.h.0.attn.rotary.weight": torch.zeros(2)}, path)
    with pytest.raises(ValueError, match=r"model\.safetensors: unexpected tensor 'h\.0\.attn\.rotary\.weight'"):
        import_hf(tmp_path)
    save_file({**state, "transformer.h.9.ln_1.weight": torch.zeros(2)}, path)  # a layer the config does not have
    with pytest.raises(ValueError, match="unexpected tensor 'h.9.ln_1.weight'"):
        import_hf(tmp_path)
    save_file({k: v for k, v in state.items() if k != "transformer.h.0.mlp.c_fc.bias"}, path)
    with pytest.raises(ValueError, match=r"missing tensor 'trf_blocks\.0\.ff\.layers\.0\.bias'"):
        import_hf(tmp_path)
    save_file({**state, "transformer.wpe.weight": torch.zeros(3, state["transformer.wpe.weight"].shape[1])}, path)
    with pytest.raises(ValueError, match="'pos_emb.weight' has shape"):
        import_hf(tmp_path)
    save_file({**state, "lm_head.weight": torch.zeros_like(state["transformer.wte.weight"])}, path)
    with pytest.raises(ValueError, match="'lm_head.weight' differs from 'wte.weight'"):
        import_hf(tmp_path)
    path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(ValueError, match="not a valid safetensors file"):
        import_hf(tmp_path)


@pytest.mark.parametrize("field, value", [
    ("activation_function", "relu"),
    ("scale_attn_by_inverse_layer_idx", True),
    ("scale_attn_weights", False),
    ("add_cross_attention", True),
    ("n_inner", 7),
    ("model_type", "gpt_neo"),
    ("architectures", ["GPT2DoubleHeadsModel"]),
])
def test_config_fields_tinygpt_cannot_compute_are_refused(tmp_path, field, value):
    _saved_hf(tmp_path)
    data = json.loads((tmp_path / "config.json").read_text())
    data[field] = value
    (tmp_path / "config.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match=field) as exc:
        import_hf(tmp_path)
    assert "config.json" in str(exc.value)


def test_dropout_and_tying_come_from_the_config():
    config = hf_config_to_tinygpt({"vocab_size": 10, "n_positions": 8, "n_embd": 8, "n_layer": 1, "n_head": 2,
                                   "resid_pdrop": 0.1, "embd_pdrop": 0.2, "attn_pdrop": 0.3,
                                   "tie_word_embeddings": False})
    assert (config.shortcut_dropout, config.emb_dropout, config.attn_dropout) == (0.1, 0.2, 0.3)
    assert not config.tie_weights and config.qkv_bias and config.pre_ln and config.norm_eps == 1e-5


def test_layer_norm_epsilon_round_trips(tmp_path):
    hf_config = GPT2Config(**{**HF_CONFIGS[0].to_dict(), "layer_norm_epsilon": 1e-3})
    hf = _hf_model(hf_config)
    hf.save_pretrained(tmp_path / "a")
    ours = import_hf(tmp_path / "a")
    assert ours.config.norm_eps == 1e-3
    idx = _ids(hf_config.vocab_size)
    with torch.no_grad():
        assert (ours(idx) - hf(idx).logits).abs().max().item() <= 1e-5
    export_hf(ours, tmp_path / "b")
    assert json.loads((tmp_path / "b" / "config.json").read_text())["layer_norm_epsilon"] == 1e-3


def _random_ours(config: GPTConfig) -> GPTModel:
    model = GPTModel(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("bias", "scale", "shift")):
                p.add_(0.1 * torch.randn_like(p))
    return model


@pytest.mark.parametrize("tied", [True, False])
def test_export_loads_in_hf_and_round_trips_bit_identically(tmp_path, tied):
    config = GPTConfig(vocab_size=50, context_length=16, emb_dim=24, n_heads=3, n_layers=2, qkv_bias=True,
                       tie_weights=tied, drop_rate=0.1, drop_rate_attn=0.2)
    ours = _random_ours(config)
    export_hf(ours, tmp_path / "hf")
    hf, info = GPT2LMHeadModel.from_pretrained(tmp_path / "hf", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    hf.eval()
    assert (hf.config.resid_pdrop, hf.config.attn_pdrop, hf.config.embd_pdrop) == (0.1, 0.2, 0.1)
    idx = _ids(50)
    with torch.no_grad():
        assert (ours(idx) - hf(idx).logits).abs().max().item() <= 1e-5
    back = import_hf(tmp_path / "hf")
    assert back.config == config
    assert back.state_dict().keys() == ours.state_dict().keys()
    for key, tensor in ours.state_dict().items():
        assert torch.equal(back.state_dict()[key], tensor), key
    assert (back.out_head.weight is back.tok_emb.weight) == tied


def test_hf_import_export_keeps_hf_logits_identical(tmp_path):
    hf = _hf_model(HF_CONFIGS[2])
    hf.save_pretrained(tmp_path / "a")
    export_hf(import_hf(tmp_path / "a"), tmp_path / "b")
    again = GPT2LMHeadModel.from_pretrained(tmp_path / "b").eval()
    idx = _ids(HF_CONFIGS[2].vocab_size)
    with torch.no_grad():
        assert torch.equal(again(idx).logits, hf(idx).logits)


def test_export_without_qkv_bias_writes_zero_bias(tmp_path):
    config = GPTConfig(vocab_size=30, context_length=8, emb_dim=8, n_heads=2, n_layers=1, tie_weights=True)
    ours = _random_ours(config)
    export_hf(ours, tmp_path)
    hf = GPT2LMHeadModel.from_pretrained(tmp_path).eval()
    assert torch.count_nonzero(hf.transformer.h[0].attn.c_attn.bias) == 0
    idx = _ids(30)
    with torch.no_grad():
        assert (ours(idx) - hf(idx).logits).abs().max().item() <= 1e-5


def test_export_refuses_what_gpt2_cannot_express(tmp_path):
    with pytest.raises(ValueError, match="pre-LN"):
        export_hf(GPTModel(GPTConfig(vocab_size=30, context_length=8, emb_dim=8, n_heads=2, n_layers=1,
                                     pre_ln=False)), tmp_path)
    assert not tmp_path.joinpath("config.json").exists()


def test_name_mapping_used_by_verify_still_inverts():
    config = GPTConfig(vocab_size=30, context_length=8, emb_dim=8, n_heads=2, n_layers=2, qkv_bias=True)
    sd = GPTModel(config).state_dict()
    back = gpt2_to_tinygpt(tinygpt_to_gpt2(sd, config), config)
    assert back.keys() == sd.keys() and all(torch.equal(back[k], sd[k]) for k in sd)


def test_hub_name_offline_is_a_clear_error(tmp_path, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ValueError, match="cannot fetch 'gpt2' from the Hugging Face hub") as exc:
        resolve_hf_source("gpt2", cache_dir=tmp_path)
    assert "HF_HUB_OFFLINE is set, and it is not in the local cache" in str(exc.value)
    assert "pass a folder holding config.json + model.safetensors + vocab.json + merges.txt" in str(exc.value)
    with pytest.raises(ValueError, match=r"^\S+/no/such/dir: no such folder$"):  # a path, never a hub lookup
        resolve_hf_source(str(tmp_path / "no" / "such" / "dir"))
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="neither a directory"):
        resolve_hf_source(tmp_path / "file")
    with pytest.raises(ValueError, match="config.json is missing"):
        import_hf(tmp_path / "empty" if (tmp_path / "empty").mkdir() is None else None)


def _fake_hub(monkeypatch, repo_dir, missing_error=None):
    """hf_hub_download served from a local folder: files it lacks raise ``missing_error`` (remote 404 by default)."""
    import huggingface_hub
    from huggingface_hub.errors import EntryNotFoundError

    fetched = []

    def fake_download(repo_id, filename, **kwargs):
        fetched.append(filename)
        if not (repo_dir / filename).is_file():
            raise (missing_error or EntryNotFoundError)(f"{repo_id}/{filename} not found")
        return str(repo_dir / filename)

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", fake_download)
    return fetched


def test_hub_name_downloads_and_imports(tmp_path, monkeypatch):
    hf = _hf_model(HF_CONFIGS[0])
    hf.save_pretrained(tmp_path)
    torch.save(load_file(tmp_path / "model.safetensors"), tmp_path / "pytorch_model.bin")
    (tmp_path / "model.safetensors").unlink()  # an older repository: only the .bin
    fetched = _fake_hub(monkeypatch, tmp_path)
    ours = import_hf("someone/tiny-gpt2")
    assert fetched == ["config.json", "model.safetensors", "pytorch_model.bin", "vocab.json", "merges.txt",
                       "tokenizer.json"]
    idx = _ids(HF_CONFIGS[0].vocab_size)
    with torch.no_grad():
        assert (ours(idx) - hf(idx).logits).abs().max().item() <= 1e-5


def test_hub_cached_config_without_weights_offline(tmp_path, monkeypatch):
    from huggingface_hub.errors import LocalEntryNotFoundError

    _saved_hf(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    _fake_hub(monkeypatch, tmp_path, missing_error=LocalEntryNotFoundError)
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ValueError, match="cannot fetch 'gpt2' from the Hugging Face hub"):
        import_hf("gpt2")


def test_hub_name_without_network_fails_at_once_without_retries(tmp_path, monkeypatch):
    """No network and no HF_HUB_OFFLINE: one connection attempt decides; huggingface_hub's retry loop never runs."""
    import socket

    from huggingface_hub import constants
    from huggingface_hub.errors import LocalEntryNotFoundError

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    calls = []

    def fake_download(repo_id, filename, local_files_only=False, **kwargs):
        calls.append(local_files_only)
        raise LocalEntryNotFoundError(f"{filename} is not cached")

    def no_route(address, timeout=None):
        assert timeout is not None and timeout <= 5  # bounded, not a default that waits minutes
        raise OSError(101, "Network is unreachable")

    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", fake_download)
    monkeypatch.setattr(socket, "create_connection", no_route)
    with pytest.raises(ValueError, match="no connection to huggingface.co: Network is unreachable") as exc:
        resolve_hf_source("gpt2", cache_dir=tmp_path)
    assert "set HF_HUB_OFFLINE=1" in str(exc.value) and "vocab.json + merges.txt" in str(exc.value)
    assert calls == [True]  # only the cache was asked; no download was attempted
