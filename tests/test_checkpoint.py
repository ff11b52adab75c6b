import json
import pickle
import struct
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import variant_configs
from memory_support import load_growth
from tinygpt import GPTConfig, GPTModel
from tinygpt.checkpoint import load_checkpoint_tokenizer, load_model, model_from_tensors, read_safetensors, save_model
from tinygpt.tokenizer import CharTokenizer, GPT2Tokenizer, gpt2_tokenizer

CONFIGS = variant_configs()


def _random_model(config: GPTConfig) -> GPTModel:
    model = GPTModel(config).eval()
    with torch.no_grad():  # move norms and biases off their 1/0 init so every tensor is really compared
        for name, p in model.named_parameters():
            if name.endswith(("bias", "scale", "shift")):
                p.add_(0.1 * torch.randn_like(p))
    return model


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"qkv{c.qkv_bias:d}-tie{c.tie_weights:d}-pre{c.pre_ln:d}")
def test_round_trip_is_exact(config, tmp_path):
    model = _random_model(config)
    save_model(model, tmp_path / "ckpt")
    loaded = load_model(tmp_path / "ckpt")
    assert loaded.config == config and not loaded.training
    assert loaded.state_dict().keys() == model.state_dict().keys()
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    assert all(not t.is_meta for t in [*loaded.parameters(), *loaded.buffers()])
    assert (loaded.out_head.weight is loaded.tok_emb.weight) == config.tie_weights
    assert loaded.num_parameters() == model.num_parameters()
    idx = torch.randint(0, config.vocab_size, (2, config.context_length))
    with torch.no_grad():
        assert torch.equal(loaded(idx), model(idx))


def test_tied_weight_is_written_once(tmp_path):
    config = CONFIGS[0].replace(tie_weights=True)
    save_model(_random_model(config), tmp_path)
    stored = load_file(tmp_path / "model.safetensors")
    assert "out_head.weight" not in stored and "tok_emb.weight" in stored
    assert json.loads((tmp_path / "config.json").read_text()) == config.to_dict()


def test_load_dtype_and_training_after_load(tmp_path):
    model = _random_model(CONFIGS[-1])
    save_model(model, tmp_path)
    loaded = load_model(tmp_path, dtype=torch.float64)
    assert {p.dtype for p in loaded.parameters()} == {torch.float64}
    idx = torch.randint(0, model.config.vocab_size, (1, 5))
    with torch.no_grad():
        torch.testing.assert_close(loaded(idx), model(idx).double(), atol=1e-5, rtol=0)
    loaded.train()  # assigned tensors are trainable parameters
    loaded(idx).sum().backward()
    assert loaded.tok_emb.weight.grad is not None


def _saved(tmp_path, config=None):
    config = config or CONFIGS[0]
    save_model(_random_model(config), tmp_path)
    return load_file(tmp_path / "model.safetensors")


def test_missing_tensor(tmp_path):
    state = _saved(tmp_path)
    del state["trf_blocks.1.norm2.shift"]
    save_file(state, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"model\.safetensors: missing tensor 'trf_blocks\.1\.norm2\.shift'"):
        load_model(tmp_path)


def test_unexpected_tensor(tmp_path):
    state = _saved(tmp_path)
    state["trf_blocks.0.att.extra"] = torch.zeros(3)
    save_file(state, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"model\.safetensors: unexpected tensor 'trf_blocks\.0\.att\.extra'"):
        load_model(tmp_path)


def test_untied_head_in_a_tied_checkpoint_is_unexpected(tmp_path):
    state = _saved(tmp_path, CONFIGS[0].replace(tie_weights=True))
    state["out_head.weight"] = state["tok_emb.weight"].clone()
    save_file(state, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="unexpected tensor 'out_head.weight'"):
        load_model(tmp_path)


def test_wrong_shape(tmp_path):
    state = _saved(tmp_path)
    state["pos_emb.weight"] = torch.zeros(5, 24)
    save_file(state, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"'pos_emb\.weight' has shape \[5, 24\], the config needs \[12, 24\]"):
        load_model(tmp_path)


def test_integer_tensor(tmp_path):
    state = _saved(tmp_path)
    state["final_norm.shift"] = torch.zeros(24, dtype=torch.int64)
    save_file(state, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="'final_norm.shift' has dtype torch.int64"):
        load_model(tmp_path)


@pytest.mark.parametrize("keep", [0, 5, 100, -16])
def test_truncated_file(tmp_path, keep):
    _saved(tmp_path)
    path = tmp_path / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[:keep] if keep >= 0 else data[:keep])
    with pytest.raises(ValueError, match=r"model\.safetensors: not a valid safetensors file"):
        load_model(tmp_path)


@pytest.mark.parametrize(
    "text, message",
    [
        ("{oops", "not valid JSON"),
        ('{"vocab_size": 37, "context_length": 12, "emb_dim": 24, "n_heads": 5, "n_layers": 2}', "divisible"),
        ('{"vocab_size": 37, "context_length": 12, "emb_dim": 24, "n_heads": 3, "n_layers": 2, "rope": true}',
         "unknown config key 'rope'"),
    ],
)
def test_bad_config(tmp_path, text, message):
    _saved(tmp_path)
    (tmp_path / "config.json").write_text(text)
    with pytest.raises(ValueError, match=message) as exc:
        load_model(tmp_path)
    assert "config.json" in str(exc.value)


def test_config_that_disagrees_with_the_weights(tmp_path):
    _saved(tmp_path)
    (tmp_path / "config.json").write_text(CONFIGS[0].replace(emb_dim=48).to_json())
    with pytest.raises(ValueError, match="has shape"):
        load_model(tmp_path)


def test_missing_files(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_model(tmp_path / "nope")
    with pytest.raises(ValueError, match="config.json is missing"):
        load_model(tmp_path)
    (tmp_path / "config.json").write_text(CONFIGS[0].to_json())
    with pytest.raises(ValueError, match="model.safetensors is missing"):
        load_model(tmp_path)


def test_crash_mid_write_keeps_previous_checkpoint(tmp_path, monkeypatch):
    import safetensors.torch

    old = _random_model(CONFIGS[0])
    save_model(old, tmp_path / "ckpt")

    def crash(tensors, filename, metadata=None):
        with open(filename, "wb") as f:
            f.write(b"\x10\x00\x00\x00half")
        raise OSError("disk full")

    monkeypatch.setattr(safetensors.torch, "save_file", crash)
    with pytest.raises(OSError, match="disk full"):
        save_model(_random_model(CONFIGS[0]), tmp_path / "ckpt")
    monkeypatch.undo()
    loaded = load_model(tmp_path / "ckpt")
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in old.state_dict().items())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_crash_in_tokenizer_save_keeps_previous_checkpoint(tmp_path, monkeypatch):
    old = _random_model(CONFIGS[0])
    save_model(old, tmp_path / "ckpt", tokenizer=CharTokenizer("abc"))

    def crash(self, directory):
        raise RuntimeError("killed")

    monkeypatch.setattr(CharTokenizer, "save", crash)
    with pytest.raises(RuntimeError):
        save_model(_random_model(CONFIGS[1]), tmp_path / "ckpt", tokenizer=CharTokenizer("xyz"))
    monkeypatch.undo()
    assert load_model(tmp_path / "ckpt").config == CONFIGS[0]
    assert load_checkpoint_tokenizer(tmp_path / "ckpt").chars == ["a", "b", "c"]


def test_no_pickle_on_save_or_load(tmp_path, monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError("pickle used")

    monkeypatch.setattr(pickle, "load", forbidden)
    monkeypatch.setattr(pickle, "loads", forbidden)
    monkeypatch.setattr(pickle, "Unpickler", forbidden)
    monkeypatch.setattr(torch, "load", forbidden)
    monkeypatch.setattr(torch, "save", forbidden)
    save_model(_random_model(CONFIGS[0]), tmp_path)
    load_model(tmp_path)
    data = (tmp_path / "model.safetensors").read_bytes()
    (header_len,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + header_len])  # safetensors: a JSON header, then raw tensor bytes
    assert header["__metadata__"]["format"] == "pt"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.json", "model.safetensors"]


def test_tokenizer_beside_checkpoint(tmp_path, gpt2_vocab_dir, monkeypatch):
    monkeypatch.delenv("TINYGPT_GPT2_VOCAB", raising=False)
    model = _random_model(GPTConfig(vocab_size=50257, context_length=8, emb_dim=8, n_heads=2, n_layers=1))
    assert load_checkpoint_tokenizer(tmp_path) is None
    save_model(model, tmp_path / "ckpt", tokenizer=gpt2_tokenizer(gpt2_vocab_dir))
    tok = load_checkpoint_tokenizer(tmp_path / "ckpt")
    assert isinstance(tok, GPT2Tokenizer) and tok.encode("Hello, I am") == [15496, 11, 314, 716]
    save_model(model, tmp_path / "ckpt", tokenizer=tok)  # re-save over the directory its files come from
    assert load_checkpoint_tokenizer(tmp_path / "ckpt").encode("Hello, I am") == [15496, 11, 314, 716]


def test_tokenizer_larger_than_vocab_is_refused(tmp_path):
    with pytest.raises(ValueError, match="vocab_size is 37"):
        save_model(_random_model(CONFIGS[0]), tmp_path, tokenizer=CharTokenizer([chr(65 + i) for i in range(40)]))


def test_round_trip_of_a_llama_style_variant(tmp_path):
    config = GPTConfig(vocab_size=37, context_length=12, emb_dim=24, n_heads=4, n_layers=2, norm="rmsnorm",
                       ffn="swiglu", pos_emb="rope", n_kv_heads=2, bias=False, tie_weights=True)
    model = _random_model(config)
    save_model(model, tmp_path)
    loaded = load_model(tmp_path)
    assert loaded.config == config
    idx = torch.randint(0, 37, (2, 12))
    with torch.no_grad():
        assert torch.equal(loaded(idx), model(idx))


def test_a_broken_tie_is_refused_not_silently_dropped(tmp_path):
    model = _random_model(CONFIGS[0].replace(tie_weights=True))
    model.out_head.weight = torch.nn.Parameter(model.tok_emb.weight.detach().clone())
    with pytest.raises(ValueError, match="re-tie"):
        save_model(model, tmp_path / "ckpt")
    assert not (tmp_path / "ckpt").exists()


def test_a_hugging_face_folder_is_recognised(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_embd": 8, "n_layer": 1}))
    with pytest.raises(ValueError, match="holds a Hugging Face model.*convert --from-hf"):
        load_model(tmp_path)


# ------------------------------------------------------------------------------------------------ saving safely
def _names(directory):
    return sorted(p.name for p in directory.iterdir())


def test_save_model_never_deletes_a_foreign_file(tmp_path):
    model = _random_model(CONFIGS[0])
    out = tmp_path / "ckpt"
    out.mkdir()
    (out / "notes.txt").write_text("the user's")
    with pytest.raises(ValueError, match="already holds unrelated files.*overwrite=True"):
        save_model(model, out)
    assert _names(out) == ["notes.txt"]
    save_model(model, out, overwrite=True)
    assert _names(out) == ["config.json", "model.safetensors", "notes.txt"]
    save_model(model, out, CharTokenizer("abc"))  # now a checkpoint: saving over it needs no flag, keeps the file
    assert _names(out) == ["config.json", "model.safetensors", "notes.txt", "tinygpt_tokenizer.json"]
    assert (out / "notes.txt").read_text() == "the user's"
    save_model(model, out)  # without a tokenizer: the old one would pair with the wrong model, so it goes
    assert _names(out) == ["config.json", "model.safetensors", "notes.txt"]
    assert load_checkpoint_tokenizer(out) is None


def test_save_model_refuses_other_kinds_of_folder(tmp_path):
    model = _random_model(CONFIGS[0])
    hf = tmp_path / "hf"
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_embd": 8}))
    (hf / "model.safetensors").write_bytes(b"their weights")
    prepared = tmp_path / "prepared"
    prepared.mkdir()
    (prepared / "prepared.json").write_text("{}")
    (prepared / "tokens.bin").write_bytes(b"\0\0")
    for folder, kind in ((hf, "a Hugging Face model"), (prepared, "a prepared corpus")):
        before = {p.name: p.read_bytes() for p in folder.iterdir()}
        with pytest.raises(ValueError, match=f"already holds {kind}, not a tinygpt checkpoint"):
            save_model(model, folder)
        assert {p.name: p.read_bytes() for p in folder.iterdir()} == before


def test_save_model_into_the_working_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    model = _random_model(CONFIGS[0])
    save_model(model, ".")
    save_model(model, "sub/ckpt")
    assert _names(tmp_path) == ["config.json", "model.safetensors", "sub"]
    assert load_model(".").config == load_model("sub/ckpt").config == CONFIGS[0]


def test_a_failed_save_leaves_the_old_checkpoint_and_no_temporary(tmp_path, monkeypatch):
    import safetensors.torch

    model = _random_model(CONFIGS[0])
    save_model(model, tmp_path / "ckpt")
    before = {p.name: p.read_bytes() for p in (tmp_path / "ckpt").iterdir()}

    def broken(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(safetensors.torch, "save_file", broken)
    with pytest.raises(ValueError, match="No space left on device"):
        save_model(_random_model(CONFIGS[1]), tmp_path / "ckpt")
    assert {p.name: p.read_bytes() for p in (tmp_path / "ckpt").iterdir()} == before
    with pytest.raises(ValueError, match="No space left on device"):
        save_model(model, tmp_path / "new")
    assert _names(tmp_path) == ["ckpt"]


@pytest.mark.skipif(not hasattr(__import__("os"), "umask"), reason="POSIX permission bits")
def test_every_saved_file_gets_the_umask_mode(tmp_path):
    import os

    mask = os.umask(0o022)
    try:
        save_model(_random_model(CONFIGS[0]), tmp_path / "ckpt", CharTokenizer("abc"))
    finally:
        os.umask(mask)
    modes = {p.name: p.stat().st_mode & 0o777 for p in (tmp_path / "ckpt").iterdir()}
    assert modes == {"config.json": 0o644, "model.safetensors": 0o644, "tinygpt_tokenizer.json": 0o644}
    assert (tmp_path / "ckpt").stat().st_mode & 0o777 == 0o755


def test_a_checkpoint_with_the_old_descriptor_name_still_loads_its_tokenizer(tmp_path):
    model = _random_model(CONFIGS[0])
    save_model(model, tmp_path, CharTokenizer("abc"))
    (tmp_path / "tinygpt_tokenizer.json").rename(tmp_path / "tokenizer.json")  # as tinygpt wrote it before
    tokenizer = load_checkpoint_tokenizer(tmp_path)
    assert isinstance(tokenizer, CharTokenizer) and tokenizer.chars == ["a", "b", "c"]
    save_model(model, tmp_path, tokenizer)  # re-saved: the new name only
    assert _names(tmp_path) == ["config.json", "model.safetensors", "tinygpt_tokenizer.json"]


@pytest.mark.parametrize("quantize", ["nf4", "nf4-dq"])
@pytest.mark.parametrize("config", CONFIGS[:2], ids=lambda c: f"qkv{c.qkv_bias:d}-tie{c.tie_weights:d}")
def test_quantised_load_equals_quantising_the_loaded_model(config, quantize, tmp_path):
    from tinygpt.quantize import NF4Linear, quantize_linears

    save_model(_random_model(config), tmp_path / "ckpt")
    want = load_model(tmp_path / "ckpt")
    quantize_linears(want, double_quant=quantize == "nf4-dq")
    got = load_model(tmp_path / "ckpt", quantize=quantize)
    assert got.state_dict().keys() == want.state_dict().keys()
    for name, tensor in want.state_dict().items():
        assert torch.equal(got.state_dict()[name], tensor), name
    assert sum(isinstance(m, NF4Linear) for m in got.modules()) == sum(isinstance(m, NF4Linear) for m in want.modules())
    assert not any(p.requires_grad for m in got.modules() if isinstance(m, NF4Linear) for p in m.parameters())
    idx = torch.randint(0, config.vocab_size, (2, 5))
    with torch.no_grad():
        assert torch.equal(got(idx), want(idx))
    if config.tie_weights:
        assert got.out_head.weight is got.tok_emb.weight


def test_quantised_load_holds_one_float_block_weight_at_a_time(tmp_path):
    import gc
    import weakref

    from tinygpt.quantize import block_linears

    config = CONFIGS[0]
    save_model(_random_model(config), tmp_path / "ckpt")
    with torch.device("meta"):
        linears = {f"{name}.weight" for name in block_linears(GPTModel(config))}
    live: list[weakref.ref] = []
    most = 0

    def tensors():
        nonlocal most
        for name, tensor in read_safetensors(tmp_path / "ckpt" / "model.safetensors", linears.__contains__):
            most = max(most, sum(ref() is not None for ref in live))  # float block weights still held (refcounts)
            if name in linears:
                live.append(weakref.ref(tensor))
            yield name, tensor
            del tensor

    model = model_from_tensors(config, tensors(), source="test", quantize="nf4")
    assert len(live) == len(linears) and most <= 1
    gc.collect()
    assert all(ref() is None for ref in live)  # none survives in the model
    assert sum(b.numel() for n, b in model.named_buffers() if n.endswith("weight_nf4")) * 2 == sum(
        read.numel() for read in (load_file(tmp_path / "ckpt" / "model.safetensors")[n] for n in linears))


def test_quantised_load_refuses_an_unknown_kind(tmp_path):
    save_model(_random_model(CONFIGS[0]), tmp_path / "ckpt")
    with pytest.raises(ValueError, match="quantize.*nf4"):
        load_model(tmp_path / "ckpt", quantize="int8")


def test_load_weights_into_fills_the_given_model_and_builds_none(tmp_path, monkeypatch):
    """A resume's load (``checkpoint.load_weights_into``): the checkpoint's tensors copied into the model the stage
    built, with no second ``GPTModel`` (nanoGPT: one build, one ``load_state_dict``)."""
    from tinygpt.checkpoint import load_weights_into

    config = CONFIGS[0].replace(tie_weights=True)
    saved = _random_model(config)
    save_model(saved, tmp_path / "ckpt")
    torch.manual_seed(99)
    target = GPTModel(config)

    def no_second_model(*args, **kwargs):
        raise AssertionError("load_weights_into built a GPTModel")

    monkeypatch.setattr(GPTModel, "__init__", no_second_model)
    load_weights_into(target, tmp_path / "ckpt")
    assert all(torch.equal(p, q) for p, q in zip(target.state_dict().values(), saved.state_dict().values()))
    assert target.out_head.weight is target.tok_emb.weight
    with pytest.raises(ValueError, match="model.safetensors"):
        load_weights_into(target, tmp_path)


@pytest.mark.parametrize("weights", ["bfloat16", "int8"])
@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("variant", ["gpt2", "llama"])
def test_load_model_reads_the_linears_straight_into_small_weights(tmp_path, variant, tied, weights):
    from inference_support import VARIANTS
    from tinygpt.fast.weights import Bf16Linear, Int8Linear, convert_weights

    torch.manual_seed(0)
    save_model(GPTModel(VARIANTS[variant].replace(tie_weights=tied)).eval(), tmp_path / "m")
    direct = load_model(tmp_path / "m", weights=weights)
    converted = load_model(tmp_path / "m")
    convert_weights(converted, weights)
    kind = Bf16Linear if weights == "bfloat16" else Int8Linear
    assert direct.weight_type == weights and isinstance(direct.out_head, kind)
    assert all(isinstance(m, kind) for block in direct.trf_blocks for m in block.modules()
               if isinstance(m, (torch.nn.Linear, Bf16Linear, Int8Linear)))
    assert direct.tok_emb.weight.dtype == torch.float32 and not direct.training
    idx = torch.randint(0, 53, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(direct(idx), converted(idx))  # the values convert_weights gives the float32 load


def test_load_model_small_weights_refuse_what_they_cannot_take(tmp_path):
    save_model(GPTModel(GPTConfig(vocab_size=11, context_length=8, emb_dim=8, n_heads=2, n_layers=1)), tmp_path / "m")
    with pytest.raises(ValueError, match="use one of float32, bfloat16, int8"):
        load_model(tmp_path / "m", weights="fp8")
    with pytest.raises(ValueError, match="takes neither quantize nor dtype"):
        load_model(tmp_path / "m", weights="int8", dtype=torch.float16)


@pytest.mark.slow  # a 28 M-weight checkpoint and four fresh interpreters
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status (Linux)")
def test_small_weights_load_peak_memory_stays_under_the_float32_block_weights(tmp_path):
    """gpt2-small's block shapes (4 of its 12 blocks, a character vocabulary): loading a float32 checkpoint with
    bfloat16 / int8 weights grows the process by the small weights and one weight's conversion at a time, never by
    a float32 copy of the block weights; the float32 load and convert holds at least the float32 ones."""
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=64, context_length=64, emb_dim=768, n_heads=12, n_layers=4, qkv_bias=True,
                       tie_weights=True)
    model = GPTModel(config)
    float32_blocks = 4 * sum(p.numel() for p in model.trf_blocks.parameters())
    save_model(model, tmp_path / "m")
    save_model(GPTModel(config.replace(emb_dim=16, n_heads=2, n_layers=1)), tmp_path / "tiny")
    del model
    grew = {how: load_growth("checkpoint", how, tmp_path / "tiny", tmp_path / "m")
            for how in ("bfloat16", "int8", "float32-then-convert")}
    # seen: int8 41 MB, bfloat16 93 MB (its 57 MB, the read buffer, the copy oneDNN packs), float32 blocks 113 MB
    assert grew["int8"] < 0.5 * float32_blocks and grew["bfloat16"] < 0.9 * float32_blocks, grew
    assert float32_blocks <= grew["float32-then-convert"], grew
