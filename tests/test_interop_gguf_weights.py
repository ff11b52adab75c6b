"""A GGUF's f16 / bf16 / q8_0 tensors read straight into bfloat16 and int8 linears (tinygpt.interop.gguf_weights):
the stored values are the file's (exactly, against gguf-py's own reader and dequantiser), the model equals the
float32 load converted afterwards, its logits stay near float32's, the commands use it, and the load's peak memory
stays under the float32 block weights (a subprocess's VmHWM)."""

import copy
import sys

import numpy as np
import pytest
import torch

from memory_support import load_growth
from tinygpt import GPTConfig, GPTModel
from tinygpt.cli import main
from tinygpt.fast.weights import Bf16Linear, Int8Linear, convert_weights, quantize_int8
from tinygpt.tokenizer import CharTokenizer

gguf = pytest.importorskip("gguf")
from tinygpt.interop import gguf_weights  # noqa: E402
from tinygpt.interop.gguf import gguf_tensors, load_gguf, write_gguf  # noqa: E402

TEXT = "the quick brown fox jumps over the lazy dog\nthe end.\n"
LLAMA = dict(norm="rmsnorm", ffn="swiglu", pos_emb="rope", bias=False, n_kv_heads=2)


def _model(**kw) -> GPTModel:
    torch.manual_seed(0)
    base = dict(vocab_size=40, context_length=32, emb_dim=64, n_heads=4, n_layers=2)
    return GPTModel(GPTConfig(**{**base, **kw})).eval()


def _stored_bf16(layer: Bf16Linear) -> torch.Tensor:
    """The bf16 weight [out, in] a layer multiplies by, read back through its own product: row i of I @ W^T is
    column i of W^T, one stored value times one (exact in any kernel)."""
    return layer.product(torch.eye(layer.in_features, dtype=torch.bfloat16)).T


def _file_tensor(path, name: str):
    return next(t for t in gguf.GGUFReader(path).tensors if t.name == name)


@pytest.mark.parametrize("kind", ["f16", "q8_0"])
def test_stored_values_are_the_files_own(tmp_path, kind):
    model = _model(emb_dim=96)
    write_gguf(model, tmp_path / "m.gguf", type=kind)
    tensor = _file_tensor(tmp_path / "m.gguf", "blk.1.ffn_down.weight")
    assert tensor.tensor_type == {"f16": gguf.GGMLQuantizationType.F16, "q8_0": gguf.GGMLQuantizationType.Q8_0}[kind]
    if kind == "f16":  # the f16 value, widened exactly, rounded once to bf16 (round to nearest even)
        values = torch.from_numpy(np.array(tensor.data)).float()
    else:  # q8_0 blocks (an f16 scale, then 32 int8) by hand, and gguf's own dequantiser: the same values
        blocks = np.array(tensor.data).reshape(-1, 34)
        by_hand = blocks[:, :2].copy().view(np.float16).astype(np.float32) * blocks[:, 2:].copy().view(np.int8)
        values = torch.from_numpy(gguf.quants.dequantize(tensor.data, tensor.tensor_type)).reshape(96, -1)
        assert torch.equal(values, torch.from_numpy(by_hand).reshape(96, -1))
    bf16 = load_gguf(tmp_path / "m.gguf", weights="bfloat16")[0].trf_blocks[1].ff.layers[2]
    assert isinstance(bf16, Bf16Linear) and torch.equal(_stored_bf16(bf16), values.to(torch.bfloat16))
    int8 = load_gguf(tmp_path / "m.gguf", weights="int8")[0].trf_blocks[1].ff.layers[2]
    q, scale = quantize_int8(values)
    assert isinstance(int8, Int8Linear) and torch.equal(int8.qweight, q) and torch.equal(int8.scale, scale)
    # per-row requantisation: within half a row step of the file's value (q8_0: the error it adds to the file)
    assert bool(((int8.qweight.float() * int8.scale[:, None] - values).abs() <= int8.scale[:, None] / 2 + 1e-7).all())


def test_a_bf16_file_is_kept_as_stored(tmp_path):
    """llama.cpp's converter writes bf16 too: those values are kept bit for bit."""
    model = _model()
    writer = gguf.GGUFWriter(tmp_path / "m.gguf", "gpt2")
    writer.add_string("tinygpt.config", model.config.to_json())
    for name, tensor in gguf_tensors(model.state_dict(), model.config).items():
        data = tensor.numpy()
        bf16 = gguf_weights.is_linear_weight(name)
        writer.add_tensor(name, gguf.quants.quantize(data, gguf.GGMLQuantizationType.BF16) if bf16 else data,
                          raw_dtype=gguf.GGMLQuantizationType.BF16 if bf16 else None)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    layer = load_gguf(tmp_path / "m.gguf", weights="bfloat16")[0].trf_blocks[0].att.qkv
    assert torch.equal(_stored_bf16(layer), model.trf_blocks[0].att.qkv.weight.detach().to(torch.bfloat16))


@pytest.mark.parametrize("kw", [dict(qkv_bias=True, tie_weights=True), dict(), LLAMA],
                         ids=["gpt2-tied", "untied", "llama-gqa"])
@pytest.mark.parametrize("kind", ["f16", "q8_0"])
def test_direct_load_equals_float32_load_converted(tmp_path, kw, kind):
    """The same bytes as loading float32 and converting (llama's q/k row permutation and concatenations
    included), so the logits are equal; and within the weight types' bound of the float32 load's
    (tests/test_fast_weights.py: 0.02 / 0.03 of the largest logit)."""
    model = _model(**kw)
    write_gguf(model, tmp_path / "m.gguf", type=kind)
    reference = load_gguf(tmp_path / "m.gguf")[0]
    idx = torch.randint(0, 40, (2, 24), generator=torch.Generator().manual_seed(1))
    for weights, bound in (("bfloat16", 0.02), ("int8", 0.03)):
        direct = load_gguf(tmp_path / "m.gguf", weights=weights)[0]
        converted = copy.deepcopy(reference)
        convert_weights(converted, weights)
        assert direct.weight_type == weights and type(direct.out_head) is type(converted.out_head)
        with torch.no_grad():
            got, want, exact = direct(idx), converted(idx), reference(idx)
        assert torch.equal(got, want)
        assert float((got - exact).abs().max()) <= bound * float(exact.abs().max())


def test_generate_reads_the_gguf_straight_into_the_weight_type(tmp_path, capsys, monkeypatch):
    tokenizer = CharTokenizer(TEXT)
    model = _model(vocab_size=tokenizer.vocab_size)
    write_gguf(model, tmp_path / "m.gguf", tokenizer, type="q8_0")
    calls = []
    real = gguf_weights.small_model_from_gguf
    monkeypatch.setattr(gguf_weights, "small_model_from_gguf", lambda *a: calls.append(a[2]) or real(*a))
    for weights in ("bfloat16", "int8"):
        converted = load_gguf(tmp_path / "m.gguf")[0]
        convert_weights(converted, weights)
        from tinygpt import generate_greedy

        ids = generate_greedy(converted, torch.tensor([tokenizer.encode("the")]), 8)[0].tolist()
        code = main(["generate", "--model", str(tmp_path / "m.gguf"), "--prompt", "the", "--max-new-tokens", "8",
                     "--weights", weights])
        assert code == 0 and capsys.readouterr().out == tokenizer.decode(ids) + "\n"
    assert calls == ["bfloat16", "int8"]


@pytest.mark.slow  # a 28 M-weight file and two fresh interpreters
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status (Linux)")
def test_direct_load_peak_memory_stays_under_the_float32_block_weights(tmp_path):
    """gpt2-small's block shapes (4 of its 12 blocks, a character vocabulary): the direct bf16 load's peak grows
    by the bf16 weights (half the float32 ones) and the allocator's slack (seen: ~10 MB), never by a float32
    copy of the block weights; the float32 load and convert holds at least the float32 ones."""
    model = _model(vocab_size=64, context_length=64, emb_dim=768, n_heads=12, n_layers=4)
    float32_blocks = 4 * sum(p.numel() for p in model.trf_blocks.parameters())
    write_gguf(model, tmp_path / "m.gguf", type="f16")
    write_gguf(_model(), tmp_path / "tiny.gguf", type="f16")
    del model
    grew = {how: load_growth("gguf", how, tmp_path / "tiny.gguf", tmp_path / "m.gguf")
            for how in ("bfloat16", "float32-then-convert")}
    assert grew["bfloat16"] < 0.75 * float32_blocks < float32_blocks <= grew["float32-then-convert"], grew
