import json

import pytest

from conftest import VERDICT
from tinygpt.tokenizer import (
    BPETokenizer,
    CharTokenizer,
    GPT2Tokenizer,
    GPT2VocabularyError,
    gpt2_tokenizer,
    load_tokenizer,
    train_tokenizer,
)



@pytest.fixture
def verdict() -> str:
    return VERDICT.read_text(encoding="utf-8")


@pytest.fixture
def gpt2(gpt2_vocab_dir) -> GPT2Tokenizer:
    return gpt2_tokenizer(gpt2_vocab_dir)


def test_gpt2_known_ids(gpt2):
    assert gpt2.kind == "gpt2" and gpt2.vocab_size == 50257 and gpt2.eot_id == 50256
    assert gpt2.encode("Hello, I am") == [15496, 11, 314, 716]
    assert gpt2.decode([15496, 11, 314, 716]) == "Hello, I am"


def test_gpt2_verdict_round_trip(gpt2, verdict):
    ids = gpt2.encode(verdict)
    assert len(ids) == 5145
    assert gpt2.decode(ids) == verdict
    assert gpt2.encode_batch([verdict, "Hello, I am"]) == [ids, [15496, 11, 314, 716]]


def test_gpt2_special_token_only_when_allowed(gpt2):
    text = "tea? <|endoftext|> In"
    with pytest.raises(ValueError, match="allowed_special"):
        gpt2.encode(text)
    ids = gpt2.encode(text, allowed_special=True)
    assert ids.count(50256) == 1 and gpt2.decode(ids) == text


def test_gpt2_decode_out_of_range(gpt2):
    with pytest.raises(ValueError, match="50257"):
        gpt2.decode([50257])


def test_gpt2_from_env_var(gpt2_vocab_dir, monkeypatch):
    monkeypatch.setenv("TINYGPT_GPT2_VOCAB", str(gpt2_vocab_dir))
    tok = gpt2_tokenizer()
    assert tok.source_dir == gpt2_vocab_dir and tok.encode("Hello, I am") == [15496, 11, 314, 716]


def test_gpt2_dir_missing_files(tmp_path):
    (tmp_path / "vocab.bpe").write_text("#version: 0.2\n")
    with pytest.raises(GPT2VocabularyError, match="encoder.json") as exc:
        gpt2_tokenizer(tmp_path)
    assert isinstance(exc.value, ValueError) and "--tokenizer-dir" in str(exc.value)


def test_gpt2_offline_without_files_is_a_clear_error(tmp_path, monkeypatch):
    import requests
    import tiktoken.registry

    attempts = []

    def no_network(url, *args, **kwargs):
        attempts.append(url)
        raise requests.exceptions.ConnectionError(f"offline: {url}")

    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("TINYGPT_GPT2_VOCAB", raising=False)
    monkeypatch.setattr(requests, "get", no_network)
    monkeypatch.setattr(tiktoken.registry, "ENCODINGS", {})  # forget an encoding loaded earlier in this process
    with pytest.raises(GPT2VocabularyError) as exc:
        gpt2_tokenizer()
    message = str(exc.value)
    assert "encoder.json and vocab.bpe" in message and "TINYGPT_GPT2_VOCAB" in message
    assert attempts and all("openaipublic" in url for url in attempts)  # the only network use went to requests


def test_gpt2_via_tiktoken_cache_saves_the_files(gpt2_vocab_dir, tmp_path, monkeypatch):
    import hashlib
    import shutil

    import tiktoken.registry

    from tinygpt.tokenizer import _GPT2_URLS

    cache = tmp_path / "cache"
    cache.mkdir()
    for name, (url, _sha) in _GPT2_URLS.items():
        shutil.copyfile(gpt2_vocab_dir / name, cache / hashlib.sha1(url.encode()).hexdigest())
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(cache))
    monkeypatch.delenv("TINYGPT_GPT2_VOCAB", raising=False)
    monkeypatch.setattr(tiktoken.registry, "ENCODINGS", {})
    tok = gpt2_tokenizer()
    assert tok.source_dir is None and tok.encode("Hello, I am") == [15496, 11, 314, 716]
    tok.save(tmp_path / "saved")
    for name in ("encoder.json", "vocab.bpe"):
        assert (tmp_path / "saved" / name).read_bytes() == (gpt2_vocab_dir / name).read_bytes()


def test_gpt2_save_load_copies_files(gpt2, tmp_path, monkeypatch):
    gpt2.save(tmp_path / "ckpt")
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["encoder.json", "tinygpt_tokenizer.json", "vocab.bpe"]
    monkeypatch.delenv("TINYGPT_GPT2_VOCAB", raising=False)
    loaded = load_tokenizer(tmp_path / "ckpt")
    assert isinstance(loaded, GPT2Tokenizer) and loaded.source_dir == tmp_path / "ckpt"
    assert loaded.encode("Hello, I am") == [15496, 11, 314, 716]


def test_char_round_trip_and_unseen(verdict, tmp_path):
    tok = train_tokenizer("char", (verdict[i : i + 1000] for i in range(0, len(verdict), 1000)))
    assert tok.kind == "char" and tok.eot_id is None
    assert tok.chars == sorted(set(verdict)) and tok.vocab_size == len(set(verdict))
    ids = tok.encode(verdict)
    assert len(ids) == len(verdict) and tok.decode(ids) == verdict
    with pytest.raises(ValueError, match="'☃'"):
        tok.encode("snow ☃")
    tok.save(tmp_path)
    loaded = load_tokenizer(tmp_path)
    assert isinstance(loaded, CharTokenizer) and loaded.encode(verdict) == ids


def test_char_ids_follow_sorted_characters():
    tok = train_tokenizer("char", "hello")
    assert tok.chars == ["e", "h", "l", "o"] and tok.encode("hole") == [1, 3, 2, 0]


def test_bpe_round_trip_save_load(verdict, tmp_path):
    tok = train_tokenizer("bpe:400", iter([verdict[:10000], verdict[10000:]]))
    assert isinstance(tok, BPETokenizer) and tok.kind == "bpe" and tok.vocab_size == 400
    ids = tok.encode(verdict)
    assert len(ids) < len(verdict.encode("utf-8")) and max(ids) < 400  # merges were learnt
    assert tok.decode(ids) == verdict
    unseen = "Grüße ☃ 日本語\n\t  x"  # byte-level: characters never seen in training still round-trip
    assert tok.decode(tok.encode(unseen)) == unseen
    with_eot = tok.encode("a<|endoftext|>b", allowed_special=True)
    assert tok.eot_id in with_eot and tok.decode(with_eot) == "a<|endoftext|>b"
    with pytest.raises(ValueError, match="allowed_special"):
        tok.encode("a<|endoftext|>b")
    tok.save(tmp_path)
    loaded = load_tokenizer(tmp_path)
    assert isinstance(loaded, BPETokenizer) and loaded.encode(verdict) == ids and loaded.eot_id == tok.eot_id


@pytest.mark.parametrize("spec", ["bpe:10", "bpe:x", "wordpiece", "bpe:", "char:5"])
def test_bad_spec_lists_allowed_forms(spec):
    with pytest.raises(ValueError, match="allowed: gpt2, char, bpe, bpe:VOCAB"):
        train_tokenizer(spec, ["abc"])


def test_char_needs_text():
    with pytest.raises(ValueError, match="at least one character"):
        train_tokenizer("char", [])


def test_load_missing_or_invalid(tmp_path):
    with pytest.raises(ValueError, match="tinygpt_tokenizer.json is missing"):
        load_tokenizer(tmp_path)
    (tmp_path / "tinygpt_tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match="not a readable JSON file"):
        load_tokenizer(tmp_path)
    (tmp_path / "tinygpt_tokenizer.json").write_text(json.dumps({"format": "tinygpt-tokenizer", "kind": "sentencepiece"}))
    with pytest.raises(ValueError, match="unknown tokenizer kind 'sentencepiece'"):
        load_tokenizer(tmp_path)
    (tmp_path / "tinygpt_tokenizer.json").write_text(json.dumps({"format": "tinygpt-tokenizer", "kind": "bpe"}))
    with pytest.raises(ValueError, match="bpe.json"):
        load_tokenizer(tmp_path)


def test_gpt2_from_hugging_face_file_names(gpt2_vocab_dir, tmp_path):
    import shutil

    from tinygpt.tokenizer import tokenizer_from_dir

    shutil.copyfile(gpt2_vocab_dir / "encoder.json", tmp_path / "vocab.json")
    shutil.copyfile(gpt2_vocab_dir / "vocab.bpe", tmp_path / "merges.txt")
    (tmp_path / "tokenizer.json").write_text('{"version": "1.0", "model": {}}')  # an HF fast-tokenizer file
    tok = tokenizer_from_dir(tmp_path)
    assert isinstance(tok, GPT2Tokenizer) and tok.encode("Hello, I am") == [15496, 11, 314, 716]
    tok.save(tmp_path / "saved")  # saved under OpenAI's names
    assert (tmp_path / "saved" / "vocab.bpe").read_bytes() == (gpt2_vocab_dir / "vocab.bpe").read_bytes()
    assert isinstance(tokenizer_from_dir(tmp_path / "saved"), GPT2Tokenizer)


def test_tokenizer_from_dir_prefers_a_saved_tinygpt_tokenizer(tmp_path):
    from tinygpt.tokenizer import tokenizer_from_dir

    CharTokenizer("abc").save(tmp_path)
    assert isinstance(tokenizer_from_dir(tmp_path), CharTokenizer)


def test_corrupt_gpt2_files(tmp_path, gpt2_vocab_dir):
    import shutil

    shutil.copyfile(gpt2_vocab_dir / "encoder.json", tmp_path / "encoder.json")
    (tmp_path / "vocab.bpe").write_text("#version: 0.2\nĠ t\n")
    with pytest.raises(GPT2VocabularyError, match="not a valid GPT-2 vocabulary"):
        gpt2_tokenizer(tmp_path)


def test_token_bytes_rebuild_the_utf8_text_even_where_a_token_splits_a_character(gpt2_vocab_dir):
    from tinygpt.tokenizer import BPETokenizer, CharTokenizer, gpt2_tokenizer

    text = "naïve café → 東京"
    for tok in (gpt2_tokenizer(gpt2_vocab_dir), BPETokenizer.train([text * 3], 270), CharTokenizer(text)):
        ids = tok.encode(text)
        assert b"".join(tok.token_bytes(i) for i in ids) == text.encode("utf-8"), tok
    gpt2 = gpt2_tokenizer(gpt2_vocab_dir)
    assert gpt2.token_bytes(gpt2.eot_id) == b"<|endoftext|>"
