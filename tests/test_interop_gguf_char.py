"""A character vocabulary in GGUF (tinygpt.interop.gguf_vocab): an end-of-text token that is no character, rows for
it (and for the merges' byte pieces) whose logits never win, transformers' GGUF loader reading the model and the
tokenizer, and llama.cpp's server writing newlines with the default-shaped model (opt-in)."""

import os
from pathlib import Path

import pytest
import torch

from tinygpt import GPTConfig, GPTModel, generate_greedy
from tinygpt.tokenizer import CharTokenizer
from tinygpt.training.options import DEFAULT_MODEL

gguf = pytest.importorskip("gguf")
from tinygpt.interop.gguf import load_gguf, read_gguf, write_gguf  # noqa: E402

TEXT = "first citizen:\nbefore we proceed any further,\n\nhear me speak. café €5!\n"


def _model(vocab_size: int, **kw) -> GPTModel:
    torch.manual_seed(0)
    base = dict(vocab_size=vocab_size, context_length=32, emb_dim=64, n_heads=4, n_layers=2)
    return GPTModel(GPTConfig(**{**base, **kw})).eval()


def test_the_end_of_text_token_is_no_character_and_the_extra_rows_are_dropped_on_import(tmp_path):
    tokenizer = CharTokenizer(TEXT)
    n = tokenizer.vocab_size
    write_gguf(_model(n + 2), tmp_path / "m.gguf", tokenizer)  # two padding rows, as a model may have
    fields = read_gguf(tmp_path / "m.gguf").fields
    tokens, types = fields["tokenizer.ggml.tokens"], fields["tokenizer.ggml.token_type"]
    eot = fields["tokenizer.ggml.eos_token_id"]
    assert eot == fields["tokenizer.ggml.bos_token_id"] == n + 2  # past the model's rows, padding included
    assert tokens[eot] == "<|endoftext|>" and types[eot] == 3  # a control token
    assert "\n" in tokenizer.chars and tokens[tokenizer.chars.index("\n")] == "Ċ" and types[:n] == [1] * n
    # é = C3 A9 ("Ã©"), € = E2 82 AC ("âĤ¬"): the merges' sides that are not characters, as unused tokens
    assert tokens[eot + 1:] == ["Ã", "©", "â", "Ĥ", "âĤ", "¬"] and types[eot + 1:] == [5] * 6
    assert fields["tinygpt.extra_rows"] == 7
    shapes = read_gguf(tmp_path / "m.gguf").shapes
    assert shapes["token_embd.weight"][0] == shapes["output.weight"][0] == n + 2 + 7
    back, tok, _ = load_gguf(tmp_path / "m.gguf")
    assert back.config.vocab_size == n + 2 and tok.chars == tokenizer.chars


@pytest.mark.parametrize("tied", [False, True])
def test_transformers_loads_the_char_model_and_its_logits_match_on_the_real_tokens(tmp_path, tied):
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    tokenizer = CharTokenizer(TEXT)
    n = tokenizer.vocab_size
    model = _model(n, qkv_bias=tied, tie_weights=tied)
    write_gguf(model, tmp_path / "m.gguf", tokenizer)
    rows = n + read_gguf(tmp_path / "m.gguf").fields["tinygpt.extra_rows"]
    # transformers reads n_ctx from the GGUF but leaves n_positions at 1024: the config is passed (context 32)
    config = transformers.GPT2Config(vocab_size=rows, n_positions=32, n_ctx=32, n_embd=64, n_layer=2, n_head=4)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file="m.gguf", config=config).eval()
    ids = torch.tensor([tokenizer.encode(TEXT[:32])])
    with torch.no_grad():
        theirs, ours = hf(ids).logits, model(ids)  # [1, 32, rows], [1, 32, n]
    torch.testing.assert_close(theirs[..., :n], ours, rtol=0, atol=1e-5)
    # the extra rows' logit is the mean of the characters': below the largest, so greedy never ends a text
    assert bool((theirs[..., n:] < ours.max(dim=-1, keepdim=True).values).all())
    torch.testing.assert_close(theirs[..., n], ours.mean(dim=-1), rtol=0, atol=1e-5)


@pytest.mark.parametrize("text", ["hear me:\n\nbefore café,\n€5 further.\n", "hear me:\n\nbefore, further.\n"],
                         ids=["utf8", "ascii"])  # ascii: no merges of its own, only the one that never applies
def test_transformers_rebuilds_the_char_tokenizer(tmp_path, text):
    """transformers' tokenizer from the GGUF alone gives tinygpt's ids and decodes them back, newlines included;
    its end of text is the control token, which no character encodes to."""
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    tokenizer = CharTokenizer(text)
    write_gguf(_model(tokenizer.vocab_size), tmp_path / "m.gguf", tokenizer)
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path, gguf_file="m.gguf")
    ids = theirs(text, add_special_tokens=False)["input_ids"]
    assert ids == tokenizer.encode(text) and theirs.decode(ids) == text
    assert theirs.eos_token == "<|endoftext|>" and theirs.eos_token_id == tokenizer.vocab_size
    assert theirs.eos_token_id not in theirs("".join(tokenizer.chars), add_special_tokens=False)["input_ids"]


# ------------------------------------------------------------------------------------------------ llama.cpp
LLAMA_BIN = os.environ.get("TINYGPT_LLAMA_BIN")
CODE = "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\n"


def _trained_char_model() -> tuple[GPTModel, CharTokenizer]:
    """The default ``tinygpt train`` model's shape on a character vocabulary, trained a few steps on short Python
    functions, so that its greedy text has line ends."""
    tokenizer = CharTokenizer(CODE)
    torch.manual_seed(0)
    model = GPTModel(GPTConfig(vocab_size=tokenizer.vocab_size, **DEFAULT_MODEL))
    data = torch.tensor(tokenizer.encode(CODE * 20))
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(0)
    for _ in range(60):
        starts = torch.randint(0, len(data) - 65, (8,), generator=g)
        batch = torch.stack([data[s:s + 65] for s in starts.tolist()])  # [8, 65]
        logits = model(batch[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model.eval(), tokenizer


@pytest.mark.llamacpp
@pytest.mark.skipif(LLAMA_BIN is None or not (Path(LLAMA_BIN or ".") / "llama-server").is_file(),
                    reason="set TINYGPT_LLAMA_BIN to a llama.cpp build's bin folder holding llama-server (the recipe: "
                           "benchmarks/llamacpp.py)")
def test_llama_server_writes_newlines_with_the_char_model(tmp_path):
    """The issue: the export named the newline as end of text, so llama.cpp stopped at the first line end. Now its
    greedy continuation runs to the length asked for, lines and all, and is tinygpt's."""
    from benchmarks.llamacpp import completion, llama_server

    model, tokenizer = _trained_char_model()
    write_gguf(model, tmp_path / "m.gguf", tokenizer)
    prompt, n = "def add(a, b):\n", 40
    ours = generate_greedy(model, torch.tensor([tokenizer.encode(prompt)]), n)[0, len(prompt):].tolist()
    with llama_server(Path(LLAMA_BIN), tmp_path / "m.gguf", threads=1, context=128) as url:
        answer = completion(url, {"prompt": prompt, "n_predict": n, "temperature": 0, "top_k": 1,
                                  "cache_prompt": False, "return_tokens": True})  # no ignore_eos: may it stop?
    assert answer["content"].count("\n") >= 2, answer["content"]
    assert answer["stop_type"] == "limit" and answer["tokens"] == ours, (answer["stop_type"], answer["content"])
    assert answer["content"] == tokenizer.decode(ours)
