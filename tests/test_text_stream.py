"""Text streaming: whole characters, stop texts held back until they can be ruled out, eot handling."""

import pytest
import torch

from tinygpt import GPTConfig, GPTModel, generate_text, stream, stream_text
from tinygpt.text_stream import _text_pieces


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
