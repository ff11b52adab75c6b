"""Text streaming: whole characters, stop texts held back until they can be ruled out, eot handling."""

import pytest
import torch

from tinygpt import GPTConfig, GPTModel, generate_text, stream, stream_text
from tinygpt.text_stream import TextStreamer, _text_pieces


class ByteCodec:
    """One token per UTF-8 byte: multi-byte characters are always split across tokens."""

    eot_id = None

    def encode(self, text):
        return list(text.encode("utf-8"))

    def decode(self, ids):
        return bytes(ids).decode("utf-8", errors="replace")


def _scripted(text, extra=()):
    return iter([[b] for b in list(text.encode("utf-8")) + list(extra)])


class _Closable:
    def __init__(self, it):
        self.it, self.closed = it, False

    def __iter__(self):
        return self

    def __next__(self):
        return next(self.it)

    def close(self):
        self.closed = True


def test_pieces_are_whole_characters_and_stop_before_the_stop_text():
    steps = _Closable(_scripted("naïve ☃ café END and more"))
    pieces = list(_text_pieces(steps, ByteCodec(), None, ["END"]))
    assert "".join(pieces) == "naïve ☃ café "
    assert all("\ufffd" not in p for p in pieces)
    assert len(pieces) > 5  # it streamed, not one piece at the end
    assert steps.closed


def test_a_partial_stop_text_is_held_back_then_released():
    pieces = list(_text_pieces(_Closable(_scripted("say EN then EX")), ByteCodec(), None, ["END", "EXIT"]))
    assert "".join(pieces) == "say EN then EX"
    assert "EN " in pieces  # "E" and "EN" could begin "END": shown only once the space ruled it out
    assert pieces[-1] == "EX"  # still a possible "EXIT" when the tokens ran out: flushed at the end


def test_eos_ends_the_text_without_showing_it():
    pieces = list(_text_pieces(_Closable(_scripted("ab", extra=[0, 99])), ByteCodec(), 0, []))
    assert "".join(pieces) == "ab"


def test_stream_text_with_a_model_matches_the_token_stream():
    torch.manual_seed(0)
    model = GPTModel(GPTConfig(vocab_size=256, context_length=32, emb_dim=16, n_heads=2, n_layers=1))
    codec = ByteCodec()
    tokens = [step[0] for step in stream(model, codec.encode("hi"), max_new_tokens=12)]
    text = codec.decode(tokens)
    assert generate_text(model, codec, "hi", max_new_tokens=12) == text
    stop = text[4:6]
    if stop and "\ufffd" not in stop:
        assert generate_text(model, codec, "hi", max_new_tokens=12, stop_texts=[stop]) == text[: text.find(stop)]


def test_stream_text_bad_arguments():
    model = GPTModel(GPTConfig(vocab_size=256, context_length=8, emb_dim=8, n_heads=2, n_layers=1))
    with pytest.raises(ValueError, match="empty"):
        stream_text(model, ByteCodec(), "")
    with pytest.raises(ValueError, match="stop_texts"):
        stream_text(model, ByteCodec(), "a", stop_texts=[""])
    with pytest.raises(TypeError, match="str"):
        stream_text(model, ByteCodec(), [1, 2])


# ------------------------------------------------------------------------------------------- TextStreamer
def _whole_decode(tokenizer, tokens, stop_texts):
    """The reference: decode the whole continuation after every token, stop at the first token whose text holds a
    stop text and cut it there. Returns (text, stopped)."""
    for i in range(1, len(tokens) + 1):
        text = tokenizer.decode(tokens[:i])
        hits = [j for j in (text.find(s) for s in stop_texts) if j >= 0]
        if hits:
            return text[: min(hits)], True
    return tokenizer.decode(tokens), False


def _streamed(tokenizer, tokens, stop_texts):
    """(pieces, stopped, tokens consumed) from feeding ``tokens`` to a TextStreamer one at a time."""
    streamer = TextStreamer(tokenizer, stop_texts)
    pieces = []
    for n, tok in enumerate(tokens, 1):
        piece, stopped = streamer.add(tok)
        pieces.append(piece)
        if stopped:
            return pieces, True, n
    pieces.append(streamer.finish())
    return pieces, False, len(tokens)


def _check_equal(tokenizer, tokens, stop_texts):
    pieces, stopped, used = _streamed(tokenizer, tokens, stop_texts)
    assert ("".join(pieces), stopped) == _whole_decode(tokenizer, tokens, stop_texts)
    if stopped:  # it stopped at the first token whose text completes a stop text
        assert _whole_decode(tokenizer, tokens[:used - 1], stop_texts)[1] is False
    return pieces


class _CountingCodec:
    """Wraps a tokenizer and records how many ids each ``decode`` call was given."""

    def __init__(self, inner):
        self.inner, self.calls = inner, []

    def encode(self, text):
        return self.inner.encode(text)

    def decode(self, ids):
        self.calls.append(len(ids))
        return self.inner.decode(ids)


def test_streamer_pieces_are_whole_characters_and_the_stop_text_spans_tokens():
    codec = ByteCodec()
    tokens = codec.encode("naïve ☃ 😀 漢字 STOP after")
    pieces = _check_equal(codec, tokens, ["STOP"])
    assert "".join(pieces) == "naïve ☃ 😀 漢字 "
    assert all("\ufffd" not in p for p in pieces)
    assert "" in pieces  # the first bytes of a multi-byte character release nothing
    streamer = TextStreamer(codec, ["STOP"])
    for tok in tokens:
        streamer.add(tok)
    assert streamer.add(65) == ("", True) and streamer.finish() == ""  # after the stop: nothing more


def test_streamer_finish_releases_a_held_stop_prefix_and_an_incomplete_character():
    codec = ByteCodec()
    streamer = TextStreamer(codec, ["<end>"])
    released = [streamer.add(t)[0] for t in codec.encode("ab<en")]
    assert "".join(released) == "ab"
    assert streamer.finish() == "<en"
    streamer = TextStreamer(codec, [])
    assert [streamer.add(t) for t in "é".encode()[:1]] == [("", False)]
    assert streamer.finish() == "\ufffd"  # what decoding the whole continuation shows


def test_streamer_decodes_a_window_not_the_whole_continuation():
    codec = _CountingCodec(ByteCodec())
    text = "long ascii text ☃ with a few multi-byte characters 😀 " * 40  # ~2,300 bytes
    pieces, stopped, _ = _streamed(codec, codec.encode(text), ["never there"])
    assert "".join(pieces) == text and not stopped
    assert max(codec.calls) <= 4  # a 4-byte character is the longest window a byte tokenizer needs


def test_streamer_matches_whole_decoding_on_random_byte_streams():
    import random

    rng = random.Random(0)
    codec = ByteCodec()
    alphabet = "ab c" + "é☃😀漢"
    for case in range(300):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30)))
        data = list(text.encode())
        if rng.random() < 0.3 and data:  # break the UTF-8 somewhere: lone continuation or cut-off lead bytes
            data.insert(rng.randrange(len(data) + 1), rng.choice([0x80, 0xBF, 0xE2, 0xF0, 0xC3]))
        stops = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(0, 3))]
        _check_equal(codec, data, stops)


def test_streamer_matches_whole_decoding_with_the_char_tokenizer():
    import random

    from tinygpt.tokenizer import CharTokenizer

    rng = random.Random(1)
    tok = CharTokenizer("abc de\n漢😀")
    for _ in range(200):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randint(0, 40))]
        text = tok.decode(ids)
        starts = [rng.randrange(len(text) + 1) for _ in range(2)] if text else []
        stops = [text[i:i + rng.randint(1, 5)] for i in starts]
        stops = [s for s in stops if s] or ["zz"[: rng.randint(1, 2)]]
        pieces = _check_equal(tok, ids, stops)
        assert all(len(p) <= 6 for p in pieces[:-1])  # pieces stream: at most a held stop prefix + one character


def test_streamer_matches_whole_decoding_with_gpt2_bpe(gpt2_vocab_dir):
    import random

    from tinygpt.tokenizer import gpt2_tokenizer

    tok = gpt2_tokenizer(gpt2_vocab_dir)
    text = "Emoji 😀🎉 and CJK 漢字かな, café ☃, then the END of it 😀"
    ids = tok.encode(text)
    # the point of the test: GPT-2's tokens split these characters between them
    assert any(tok.token_bytes(i).decode("utf-8", errors="replace").count("\ufffd") for i in ids)
    pieces = _check_equal(tok, ids, ["END"])
    assert "".join(pieces) == "Emoji 😀🎉 and CJK 漢字かな, café ☃, then the "
    assert all("\ufffd" not in p for p in pieces)
    assert _check_equal(tok, ids, ["D of", "☃, t"])  # stop texts spanning several tokens
    rng = random.Random(2)
    byte_tokens = [i for i in range(256) if not tok.token_bytes(i).isascii()][:40] + [220, 64, 32, 50256]
    for _ in range(150):  # random ids, many of them lone bytes: invalid and split UTF-8, as a random model writes
        ids = [rng.choice(byte_tokens) if rng.random() < 0.5 else rng.randrange(tok.vocab_size)
               for _ in range(rng.randint(1, 25))]
        whole = tok.decode(ids)
        stops = [s for s in (whole[j:j + 3] for j in (rng.randrange(len(whole)),) if whole) if "\ufffd" not in s]
        _check_equal(tok, ids, stops)


def test_streamer_matches_whole_decoding_with_a_trained_bpe(alignment_tokenizer):
    import random

    rng = random.Random(3)
    tok = alignment_tokenizer
    ids = tok.encode("### Response:\nA café ☃ 漢字 answer.\n### Instruction:")
    assert "".join(_check_equal(tok, ids, ["\n### Instruction:"])) == "### Response:\nA café ☃ 漢字 answer."
    for _ in range(100):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randint(1, 30))]
        _check_equal(tok, ids, ["###", "e a"])


def test_streamer_bad_stop_texts():
    with pytest.raises(ValueError, match="stop_texts"):
        TextStreamer(ByteCodec(), "END")
    with pytest.raises(ValueError, match="stop_texts"):
        TextStreamer(ByteCodec(), ["END", ""])
