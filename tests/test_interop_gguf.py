"""GGUF export/import (tinygpt.interop.gguf): transformers' GGUF loader as the reference, exact round trips,
gguf.quants for the quantised bytes, the tokenizer rebuilt from the metadata, refusals, and llama.cpp itself."""

import json

import numpy as np
import pytest
from conftest import one_line_error
import torch

from tinygpt import GPTConfig, GPTModel, generate_greedy, load_model, save_model
from tinygpt.cli import main
from tinygpt.tokenizer import BPETokenizer, CharTokenizer, gpt2_tokenizer

gguf = pytest.importorskip("gguf")
from tinygpt.interop.gguf import (gguf_architecture, gguf_tensors, load_gguf, quantize_tensor,  # noqa: E402
                                  read_gguf, write_gguf)
from tinygpt.interop.gguf_vocab import tokenizer_from_metadata  # noqa: E402

TEXT = "Hello, world! GGUF carries tinygpt into llama.cpp: naïve café, 1234 tokens.\n  Twice  spaced."
CHAR_TEXT = "first citizen:\nbefore we proceed any further, hear me speak. café €5!"
LLAMA = dict(norm="rmsnorm", ffn="swiglu", pos_emb="rope", bias=False)


def _model(vocab_size: int, **kw) -> GPTModel:
    base = dict(vocab_size=vocab_size, context_length=32, emb_dim=64, n_heads=4, n_layers=2)
    return GPTModel(GPTConfig(**{**base, **kw})).eval()


def _logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor([ids]))


def _same_weights(a: GPTModel, b: GPTModel) -> bool:
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


@pytest.fixture
def gpt2_tok(gpt2_vocab_dir):
    return gpt2_tokenizer(gpt2_vocab_dir)


# ------------------------------------------------------------------------------------------------ f32: references
@pytest.mark.parametrize("variant", ["default", "gpt2"])
def test_f32_export_loads_in_transformers_with_the_same_logits(tmp_path, variant):
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    # default: no QKV bias (written as zeros), untied head; gpt2: GPT-2's own choices, QKV bias and a tied head (no
    # output.weight in the file). The character vocabulary keeps the file small; the GPT-2 vocabulary's metadata is
    # checked below.
    kw = {} if variant == "default" else dict(qkv_bias=True, tie_weights=True)
    tokenizer = CharTokenizer(CHAR_TEXT)
    model = _model(tokenizer.vocab_size, **kw)
    write_gguf(model, tmp_path / "m.gguf", tokenizer)
    # transformers reads n_ctx from the GGUF but leaves n_positions at 1024: the config is passed (context 32)
    # (and the character vocabulary's extra rows: tests/test_interop_gguf_char.py)
    rows = read_gguf(tmp_path / "m.gguf").shapes["token_embd.weight"][0]
    config = transformers.GPT2Config(vocab_size=rows, n_positions=32, n_ctx=32, n_embd=64, n_layer=2, n_head=4)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="m.gguf", config=config).eval()
    ids = tokenizer.encode(CHAR_TEXT)[:32]
    with torch.no_grad():
        theirs = hf(torch.tensor([ids])).logits[..., :tokenizer.vocab_size]
    torch.testing.assert_close(_logits(model, ids), theirs, rtol=0, atol=1e-6)  # float32


def test_llama_export_loads_in_transformers_with_the_same_logits(tmp_path):
    transformers = pytest.importorskip("transformers")
    from tinygpt.interop.llama import tinygpt_to_llama_config

    transformers.logging.set_verbosity_error()
    tokenizer = CharTokenizer(CHAR_TEXT)
    model = _model(tokenizer.vocab_size, n_kv_heads=2, **LLAMA)
    write_gguf(model, tmp_path / "m.gguf", tokenizer)
    assert read_gguf(tmp_path / "m.gguf").architecture == "llama"
    rows = read_gguf(tmp_path / "m.gguf").shapes["token_embd.weight"][0]  # the characters' extra tokens too
    config = transformers.LlamaConfig(**{**tinygpt_to_llama_config(model.config), "vocab_size": rows})
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="m.gguf", config=config).eval()
    ids = tokenizer.encode(CHAR_TEXT[:32])
    with torch.no_grad():
        theirs = hf(torch.tensor([ids])).logits[..., :tokenizer.vocab_size]
    torch.testing.assert_close(_logits(model, ids), theirs, rtol=0, atol=1e-5)  # float32; q/k rows permuted


@pytest.mark.parametrize("kw", [{}, dict(qkv_bias=True, tie_weights=True), dict(bias=False, ffn_hidden=96),
                                dict(**LLAMA, n_kv_heads=2), dict(**LLAMA, tie_weights=True)],
                         ids=["default", "tied", "bias-free", "llama-gqa", "llama-tied"])
def test_round_trip_through_gguf_is_exact(tmp_path, kw):
    tokenizer = CharTokenizer(CHAR_TEXT)
    model = _model(tokenizer.vocab_size, **kw)
    write_gguf(model, tmp_path / "m.gguf", tokenizer)
    back, tok, template = load_gguf(tmp_path / "m.gguf")
    assert back.config == model.config and _same_weights(model, back)
    assert tok.chars == tokenizer.chars and template is None


def test_the_cli_round_trip_with_a_chat_template(tmp_path, capsys):
    tokenizer = CharTokenizer(CHAR_TEXT)
    from tinygpt.training import DEFAULT_MODEL

    # the default `tinygpt train` model: its sizes, a char vocabulary, no QKV bias, untied head
    model = GPTModel(GPTConfig(vocab_size=tokenizer.vocab_size, **DEFAULT_MODEL)).eval()
    save_model(model, tmp_path / "ckpt", tokenizer=tokenizer)
    template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    (tmp_path / "ckpt" / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    out = tmp_path / "m.gguf"
    assert main(["convert", "--to-gguf", str(out), "--model", str(tmp_path / "ckpt")]) == 0
    assert read_gguf(out).fields["tokenizer.chat_template"] == template
    assert main(["convert", "--from-gguf", str(out), "--out", str(tmp_path / "back")]) == 0
    capsys.readouterr()
    assert _same_weights(model, load_model(tmp_path / "back"))
    assert json.loads((tmp_path / "back" / "tokenizer_config.json").read_text())["chat_template"] == template
    assert main(["generate", "--model", str(tmp_path / "back"), "--prompt", "first", "--max-new-tokens", "8"]) == 0
    expected = generate_greedy(model, torch.tensor([tokenizer.encode("first")]), 8)
    assert capsys.readouterr().out == tokenizer.decode(expected[0].tolist()) + "\n"
    assert main(["generate", "--model", str(out), "--prompt", "first", "--max-new-tokens", "8"]) == 0  # the file
    assert capsys.readouterr().out == tokenizer.decode(expected[0].tolist()) + "\n"


# ------------------------------------------------------------------------------------------------ quantised
def test_quantised_bytes_are_gguf_quants_of_the_same_tensors(tmp_path):
    model = _model(96, emb_dim=64, ffn_hidden=80)  # ffn_down's rows are 80 values: not whole 32-blocks
    expected = {name: t.numpy() for name, t in gguf_tensors(model.state_dict(), model.config).items()}
    Q = gguf.GGMLQuantizationType
    for kind, qtype in (("q8_0", Q.Q8_0), ("q4_0", Q.Q4_0), ("f16", Q.F16)):
        write_gguf(model, tmp_path / f"{kind}.gguf", type=kind)
        reader = gguf.GGUFReader(tmp_path / f"{kind}.gguf")
        assert reader.fields["general.file_type"].contents() == {"q8_0": 7, "q4_0": 2, "f16": 1}[kind]
        for tensor in reader.tensors:
            data = expected[tensor.name]
            if data.ndim == 1 or tensor.name.endswith("_norm.weight") or tensor.name == "position_embd.weight":
                wanted = Q.F32
            elif tensor.name.endswith("ffn_down.weight") and kind != "f16":
                wanted = Q.F16  # llama.cpp's converter's fallback
            else:
                wanted = qtype
            assert tensor.tensor_type == wanted, tensor.name
            assert np.array_equal(np.asarray(tensor.data).reshape(-1).view(np.uint8),
                                  gguf.quants.quantize(data, wanted).reshape(-1).view(np.uint8)), tensor.name
        assert quantize_tensor("blk.0.attn_qkv.weight", expected["blk.0.attn_qkv.weight"], kind)[1] == qtype


def test_quantised_logits_error_and_greedy_text(tmp_path):
    tokenizer = CharTokenizer(CHAR_TEXT)
    model = _model(tokenizer.vocab_size, emb_dim=128, qkv_bias=True, tie_weights=True)
    ids = tokenizer.encode(CHAR_TEXT[:24])
    exact = _logits(model, ids)
    errors = {}
    for kind in ("f16", "q8_0", "q4_0"):
        write_gguf(model, tmp_path / f"{kind}.gguf", tokenizer, type=kind)
        back = load_gguf(tmp_path / f"{kind}.gguf")[0]
        errors[kind] = (_logits(back, ids) - exact).abs().max().item()
    # each format's rounding: f16 ~ 2^-11 relative, q8_0 ~ 2^-8 per block, q4_0 ~ 2^-4 per block
    assert 0 < errors["f16"] < errors["q8_0"] < errors["q4_0"] < 0.5, errors
    greedy = generate_greedy(load_gguf(tmp_path / "q8_0.gguf")[0], torch.tensor([ids[:8]]), 8)
    assert greedy[0].tolist() == generate_greedy(model, torch.tensor([ids[:8]]), 8)[0].tolist()


# ------------------------------------------------------------------------------------------------ tokenizers
@pytest.mark.slow  # transformers converts the 50,257 tokens and 50,000 merges in Python
def test_transformers_reads_the_gpt2_vocabulary_of_the_export(tmp_path, gpt2_tok):
    transformers = pytest.importorskip("transformers")
    write_gguf(_model(50257, n_layers=1), tmp_path / "m.gguf", gpt2_tok)
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file="m.gguf")
    assert theirs(TEXT, add_special_tokens=False)["input_ids"] == gpt2_tok.encode(TEXT)
    fields = read_gguf(tmp_path / "m.gguf").fields  # and tinygpt rebuilds it from the metadata alone
    assert fields["tokenizer.ggml.model"] == "gpt2" and fields["tokenizer.ggml.pre"] == "gpt-2"
    assert fields["tokenizer.ggml.eos_token_id"] == fields["tokenizer.ggml.bos_token_id"] == 50256
    assert fields["tokenizer.ggml.token_type"][50256] == 3 and len(fields["tokenizer.ggml.merges"]) == 50000
    rebuilt = tokenizer_from_metadata(fields, tmp_path, pytest.fail)  # what load_gguf does, without a re-parse
    assert rebuilt.kind == "gpt2" and rebuilt.encode(TEXT) == gpt2_tok.encode(TEXT)


def test_trained_bpe_and_char_vocabularies_rebuilt_from_the_metadata(tmp_path):
    bpe = BPETokenizer.train([TEXT * 3, CHAR_TEXT * 3], vocab_size=300)
    write_gguf(_model(bpe.vocab_size + 3), tmp_path / "bpe.gguf", bpe)  # 3 padding rows: [PAD] tokens
    fields = read_gguf(tmp_path / "bpe.gguf").fields
    assert fields["tokenizer.ggml.tokens"][-1] == f"[PAD{bpe.vocab_size + 2}]"
    assert fields["tokenizer.ggml.token_type"][-3:] == [5, 5, 5]
    back = load_gguf(tmp_path / "bpe.gguf")[1]
    assert back.kind == "bpe" and back.encode(TEXT + CHAR_TEXT) == bpe.encode(TEXT + CHAR_TEXT)
    char = CharTokenizer(CHAR_TEXT)
    write_gguf(_model(char.vocab_size), tmp_path / "char.gguf", char)
    fields = read_gguf(tmp_path / "char.gguf").fields
    tokens = fields["tokenizer.ggml.tokens"]
    assert tokens[char.chars.index(" ")] == "Ġ" and tokens[char.chars.index("é")] == "Ã©"
    assert fields["tokenizer.ggml.eos_token_id"] == char.vocab_size and tokens[char.vocab_size] == "<|endoftext|>"
    assert load_gguf(tmp_path / "char.gguf")[1].encode(CHAR_TEXT) == char.encode(CHAR_TEXT)


# ------------------------------------------------------------------------------------------------ llama.cpp's files
def _write_like_llama_cpps_converter(path, hf_model, tokenizer):
    """What llama.cpp's convert_hf_to_gguf.py writes for GPT2LMHeadModel (its GPT2Model class): Conv1D weights
    transposed, no output.weight (tied), the gpt2 metadata and GPT-2's vocabulary, no tinygpt keys."""
    from tinygpt.interop.gguf_vocab import tokenizer_metadata

    c = hf_model.config
    writer = gguf.GGUFWriter(path, "gpt2")
    writer.add_type("model")
    writer.add_name("Hf")
    writer.add_block_count(c.n_layer)
    writer.add_context_length(c.n_positions)
    writer.add_embedding_length(c.n_embd)
    writer.add_feed_forward_length(4 * c.n_embd)
    writer.add_head_count(c.n_head)
    writer.add_layer_norm_eps(c.layer_norm_epsilon)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    vocab = tokenizer_metadata(tokenizer, c.vocab_size)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(vocab["tokens"])
    writer.add_token_types(vocab["token_type"])
    writer.add_token_merges(vocab["merges"])
    writer.add_bos_token_id(50256)
    writer.add_eos_token_id(50256)
    names = {"wte": "token_embd", "wpe": "position_embd", "ln_f": "output_norm"}
    block = {"ln_1": "attn_norm", "attn.c_attn": "attn_qkv", "attn.c_proj": "attn_output", "ln_2": "ffn_norm",
             "mlp.c_fc": "ffn_up", "mlp.c_proj": "ffn_down"}
    for name, tensor in hf_model.state_dict().items():
        if name == "lm_head.weight" or name.endswith((".attn.bias", ".attn.masked_bias")):
            continue
        parts = name.removeprefix("transformer.").split(".")
        if parts[0] == "h":
            module, kind = ".".join(parts[2:-1]), parts[-1]
            new = f"blk.{parts[1]}.{block[module]}.{kind}"
            if kind == "weight" and module.startswith(("attn.", "mlp.")):
                tensor = tensor.t()  # Conv1D [in, out] -> [out, in]
        else:
            new = f"{names[parts[0]]}.{parts[1]}"
        writer.add_tensor(new, tensor.contiguous().numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_import_of_a_file_written_as_llama_cpps_converter_writes_it(tmp_path, gpt2_tok):
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    hf = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_positions=32, n_embd=64, n_layer=2, n_head=4)).eval()
    _write_like_llama_cpps_converter(tmp_path / "gpt2.gguf", hf, gpt2_tok)
    assert main(["convert", "--from-gguf", str(tmp_path / "gpt2.gguf"), "--out", str(tmp_path / "ckpt")]) == 0
    model = load_model(tmp_path / "ckpt")
    assert model.config.qkv_bias and model.config.tie_weights and model.config.norm_eps == 1e-5
    ids = gpt2_tok.encode(TEXT)[:32]
    with torch.no_grad():
        theirs = hf(torch.tensor([ids])).logits
    torch.testing.assert_close(_logits(model, ids), theirs, rtol=0, atol=1e-5)  # float32
    assert (tmp_path / "ckpt" / "encoder.json").is_file()
    assert gpt2_tokenizer(tmp_path / "ckpt").encode(TEXT) == gpt2_tok.encode(TEXT)


# ------------------------------------------------------------------------------------------------ refusals
def test_models_gguf_cannot_express_are_refused_naming_what_is_missing():
    assert gguf_architecture(GPTConfig()) == "gpt2"
    with pytest.raises(ValueError, match=r"pre_ln=False \(gpt2 needs True\).*norm='layernorm' \(llama needs"):
        gguf_architecture(GPTConfig(pre_ln=False))
    with pytest.raises(ValueError, match=r"n_kv_heads=4 \(gpt2 needs one key/value head.*bias=True \(llama"):
        gguf_architecture(GPTConfig(**{**LLAMA, "bias": True}, n_kv_heads=4))
    with pytest.raises(ValueError, match=r"ffn='relu' \(gpt2 needs 'gelu'\)"):
        gguf_architecture(GPTConfig(ffn="relu"))


def _write_header_only(path, arch, tensors):
    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(1)
    for name, array in tensors.items():
        writer.add_tensor(name, array)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_bad_gguf_files_are_one_line_errors_and_write_nothing(tmp_path, capsys):
    tokenizer = CharTokenizer(CHAR_TEXT)
    model = _model(tokenizer.vocab_size)
    write_gguf(model, tmp_path / "good.gguf", tokenizer)
    data = (tmp_path / "good.gguf").read_bytes()
    (tmp_path / "truncated.gguf").write_bytes(data[: len(data) // 2])
    _write_header_only(tmp_path / "bert.gguf", "bert", {"token_embd.weight": np.zeros((4, 8), np.float32)})
    # a tensor of the wrong shape: the tinygpt config says emb_dim=64, the file's embedding has 48 columns
    wrong = gguf_tensors(model.state_dict(), model.config)
    writer = gguf.GGUFWriter(tmp_path / "shape.gguf", "gpt2")
    writer.add_string("tinygpt.config", model.config.to_json())
    for name, tensor in wrong.items():
        writer.add_tensor(name, tensor[:, :48].contiguous().numpy() if name == "token_embd.weight" else tensor.numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    (tmp_path / "text.gguf").write_text("not a gguf file at all")
    cases = {"truncated.gguf": "truncated or corrupt", "bert.gguf": "architecture 'bert' is not supported",
             "shape.gguf": "'token_embd.weight' has shape [", "text.gguf": "not a readable GGUF file",
             "missing.gguf": "no such file"}
    for name, fragment in cases.items():
        out = tmp_path / f"out-{name}"
        assert main(["convert", "--from-gguf", str(tmp_path / name), "--out", str(out)]) == 2
        one_line_error(capsys, "tinygpt convert: error:", fragment)
        assert not out.exists()


def test_export_refusals_are_one_line_errors_and_write_nothing(tmp_path, capsys):
    tokenizer = CharTokenizer(CHAR_TEXT)
    save_model(_model(tokenizer.vocab_size, pre_ln=False), tmp_path / "postln", tokenizer=tokenizer)
    save_model(_model(tokenizer.vocab_size), tmp_path / "ok", tokenizer=tokenizer)
    (tmp_path / "exists.gguf").write_bytes(b"keep")
    cases = [
        (["--to-gguf", str(tmp_path / "a.gguf"), "--model", str(tmp_path / "postln")], "pre_ln=False", "a.gguf"),
        (["--to-gguf", str(tmp_path / "exists.gguf"), "--model", str(tmp_path / "ok")], "pass --force", None),
        (["--to-gguf", str(tmp_path / "b.gguf")], "--model DIR", "b.gguf"),
        (["--from-gguf", str(tmp_path / "exists.gguf")], "--out DIR is required", None),
    ]
    for args, fragment, absent in cases:
        assert main(["convert", *args]) == 2
        one_line_error(capsys, "tinygpt convert: error:", fragment)
        if absent:
            assert not (tmp_path / absent).exists()
    assert (tmp_path / "exists.gguf").read_bytes() == b"keep"
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temporary left


# ------------------------------------------------------------------------------------------------ llama.cpp
@pytest.mark.llamacpp
@pytest.mark.parametrize("vocab, kind", [("gpt2", "f32"), ("gpt2", "q8_0"), ("char", "f32"), ("bpe", "f32")])
def test_llama_cpp_runs_the_export_as_tinygpt_does(tmp_path, gpt2_vocab_dir, vocab, kind):
    """llama.cpp (llama-cpp-python) on the export: its own tokenizer gives tinygpt's ids, its logits match, and its
    greedy tokens are tinygpt's -- for a quantised file, tinygpt's on the same (dequantised) weights."""
    llama_cpp = pytest.importorskip("llama_cpp")
    text = TEXT + CHAR_TEXT
    tokenizer = {"gpt2": lambda: gpt2_tokenizer(gpt2_vocab_dir), "char": lambda: CharTokenizer(text),
                 "bpe": lambda: BPETokenizer.train([text * 3], vocab_size=300)}[vocab]()
    model = _model(tokenizer.vocab_size, emb_dim=128, context_length=128)
    write_gguf(model, tmp_path / "m.gguf", tokenizer, type=kind)
    reference = load_gguf(tmp_path / "m.gguf")[0]  # = model for f32; the dequantised weights otherwise
    llm = llama_cpp.Llama(str(tmp_path / "m.gguf"), n_ctx=128, logits_all=True, verbose=False, n_threads=1)
    ids = tokenizer.encode(text)
    assert llm.tokenize(text.encode(), add_bos=False, special=False) == ids  # llama.cpp's own tokenizer
    assert llm.detokenize(ids).decode() == text
    ids = ids[:16]
    llm.eval(ids)
    theirs = torch.tensor(np.array(llm.scores[: len(ids)]))
    # ggml's GELU is a float16 lookup table; with q8_0 weights ggml also rounds the activations to 8 bits
    tolerance = {"f32": 1e-3, "q8_0": 3e-2}[kind]
    torch.testing.assert_close(theirs, _logits(reference, ids)[0], rtol=0, atol=tolerance)
    llm.reset()
    greedy = [int(t) for t, _ in zip(llm.generate(ids, temp=0.0, top_k=1), range(8))]
    if kind == "f32":
        assert greedy == generate_greedy(reference, torch.tensor([ids]), 8)[0, len(ids):].tolist()
    else:  # random weights give near-ties that 8-bit activations may flip: each pick must be a near-best one
        steps = _logits(reference, ids + greedy)[0, len(ids) - 1:-1]  # [8, V]: the logits each pick was made from
        picked = steps.gather(1, torch.tensor(greedy)[:, None])[:, 0]
        assert (picked >= steps.max(dim=1).values - 2 * tolerance).all(), (picked, steps.max(dim=1).values)
    assert llm.token_eos() == (tokenizer.eot_id if vocab != "char" else tokenizer.vocab_size)  # its <|endoftext|>


# ------------------------------------------------------------------------------ hostile files (issue 43: E5, E7, E8)
def _raw_gguf(keys: bytes, n_keys: int, tensors: list[tuple[str, list[int], int]], data: bytes) -> bytes:
    """A GGUF v3 file by hand: ``keys`` (already encoded), f32 tensors (name, GGUF dims, offset), then ``data``."""
    import struct

    def string(text: str) -> bytes:
        return struct.pack("<Q", len(text.encode())) + text.encode()

    out = b"GGUF" + struct.pack("<IQQ", 3, len(tensors), n_keys + 1)
    out += string("general.architecture") + struct.pack("<I", 8) + string("gpt2") + keys
    for name, dims, offset in tensors:
        out += string(name) + struct.pack("<I", len(dims)) + struct.pack(f"<{len(dims)}Q", *dims)
        out += struct.pack("<IQ", 0, offset)
    return out + b"\0" * (-len(out) % 32) + data


def _write_with(path, model, config_json: str, tokens: list[str] | None = None) -> None:
    """``model``'s tensors under the ``tinygpt.config`` ``config_json`` (and a token list), whatever they say."""
    writer = gguf.GGUFWriter(path, "gpt2")
    writer.add_string("tinygpt.config", config_json)
    if tokens is not None:
        writer.add_token_list(tokens)
    for name, tensor in gguf_tensors(model.state_dict(), model.config).items():
        writer.add_tensor(name, tensor.numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_a_metadata_array_the_file_cannot_hold_is_refused_at_once(tmp_path):
    """E5: an array claiming 2^62 items was walked item by item (memory grew ~100 MB/s, forever)."""
    import struct
    import time

    claims = {"numbers": struct.pack("<Q", 5) + b"x" * 5 + struct.pack("<IIQ", 9, 0, 2 ** 62),
              "strings": struct.pack("<Q", 5) + b"y" * 5 + struct.pack("<IIQ", 9, 8, 2 ** 62)}
    for name, key in claims.items():
        (tmp_path / f"{name}.gguf").write_bytes(_raw_gguf(key, 1, [], b""))
        start = time.monotonic()
        with pytest.raises(ValueError, match=r"claims 4611686018427387904 items of at least \d+ bytes"):
            read_gguf(tmp_path / f"{name}.gguf")
        assert time.monotonic() - start < 5


def test_a_token_list_far_longer_than_the_vocabulary_is_refused(tmp_path):
    """E5: a 31 MB file with a 2 M-token list cost 186 s and 2.9 GB; a list over twice the embedding's rows (plus
    slack) is refused before gguf-py builds it."""
    tokenizer = CharTokenizer(CHAR_TEXT)
    model = _model(tokenizer.vocab_size)
    _write_with(tmp_path / "long.gguf", model, model.config.to_json(), tokens=[""] * 5000)
    with pytest.raises(ValueError, match=r"metadata 'tokenizer.ggml.tokens' has 5000 items, more than twice the "
                                         r"vocabulary"):
        read_gguf(tmp_path / "long.gguf")


def test_overlapping_tensors_are_refused(tmp_path):
    """E8: a 4.3 MB file whose 1,925 tensors all start at offset 0 loaded as a 2 GB model."""
    tensors = [(f"blk.{i}.attn_norm.weight", [8], 0) for i in range(50)]
    (tmp_path / "overlap.gguf").write_bytes(_raw_gguf(b"", 0, tensors, b"\0" * 32))
    with pytest.raises(ValueError, match="overlap"):
        read_gguf(tmp_path / "overlap.gguf")
    (tmp_path / "past.gguf").write_bytes(_raw_gguf(b"", 0, [("token_embd.weight", [8, 1000], 0)], b"\0" * 32))
    with pytest.raises(ValueError, match="runs past the end"):
        read_gguf(tmp_path / "past.gguf")


@pytest.mark.parametrize("change, match", [
    ({"n_layers": 20000}, "the config has n_layers=20000, the file's tensors 2 blocks"),
    ({"emb_dim": 2 ** 40, "n_heads": 1}, "parameters, which need at least"),
])
def test_a_config_the_file_cannot_hold_is_refused_before_a_model_is_built(tmp_path, change, match):
    """E7: a config claiming 20,000 blocks cost 260 s and 1.27 GB before its refusal; emb_dim 2^40 was a
    traceback. Now both are refused from the formula and the file's size (GGUF and checkpoint alike)."""
    import time

    tokenizer = CharTokenizer(CHAR_TEXT)
    model = _model(tokenizer.vocab_size)
    config = json.loads(model.config.to_json()) | change
    _write_with(tmp_path / "big.gguf", model, json.dumps(config))
    start = time.monotonic()
    with pytest.raises(ValueError, match=match):
        load_gguf(tmp_path / "big.gguf")
    save_model(model, tmp_path / "ckpt")
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="parameters, which need at least"):
        load_model(tmp_path / "ckpt")
    assert time.monotonic() - start < 10
