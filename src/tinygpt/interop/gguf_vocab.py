"""tinygpt tokenizers <-> GGUF's tokenizer metadata (``tokenizer.ggml.*``), in the form llama.cpp reads.

All three tinygpt tokenizers become llama.cpp's byte-level BPE vocabulary (``tokenizer.ggml.model = "gpt2"``): a list
of token strings in GPT-2's byte-to-unicode alphabet (a space is ``Ġ``, a newline ``Ċ``), a token type per token, the
merges as ``"left right"`` strings in rank order, and a pre-tokenizer name that llama.cpp knows:

- GPT-2's vocabulary: its 50,257 tokens and 50,000 merges, pre-tokenizer ``gpt-2`` (the name llama.cpp's own
  converter gives it), ``<|endoftext|>`` a control token and the bos/eos id.
- a trained BPE: tinygpt trains it with GPT-2's regex and byte alphabet, so it is written the same way, pre-tokenizer
  ``gpt-2``, with its own tokens and merges.
- a character vocabulary: each character is the token of its UTF-8 bytes in the byte alphabet (``é`` is ``Ã©``); the
  only merges are those that join the bytes of one multi-byte character, so llama.cpp's BPE yields exactly one token
  per character (UTF-8 is prefix-free: no merge can reach across two characters). An ASCII vocabulary has no such
  merges, and llama.cpp refuses a BPE vocabulary without any: it gets ``NEVER_MERGED``, which no text meets.

  Past the model's rows come the extra tokens: ``<|endoftext|>`` (a control token, the bos/eos id: a character
  model has no end of text, and naming a character -- the newline, say -- stopped llama.cpp at its first one), then
  the sides and results of merges that are not characters (for ``é``: ``Ã`` and ``©``, a lead and a continuation
  byte; for ``NEVER_MERGED``: ``ÿ`` and ``ÿÿ``), unused tokens that a BPE built by ``tokenizers`` (transformers'
  GGUF loader) needs in its vocabulary. ``write_gguf`` gives each a row of the embedding and the head: the mean of
  the characters' rows, so its logit is the mean of theirs, never above their largest (equal only when all are, and
  then argmax picks the lower id): the model never ends a text, as in tinygpt, and every character's logit is what
  it was. ``tinygpt.extra_rows`` counts them; the import drops them again.

Model rows beyond the tokenizer's vocabulary are written as ``[PAD{i}]`` tokens of type UNUSED, as llama.cpp's
converter does. ``tinygpt.tokenizer.kind`` records which tokenizer it was, so that the import rebuilds the same one;
a file without it (one from llama.cpp's converter) is read as GPT-2's vocabulary when it is GPT-2's, otherwise as a
byte-level BPE.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any, Callable

from ..tokenizer import ENDOFTEXT, BPETokenizer, CharTokenizer, GPT2Tokenizer, Tokenizer, _byte_level_bytes

KIND_KEY = "tinygpt.tokenizer.kind"
EXTRA_ROWS_KEY = "tinygpt.extra_rows"
NEVER_MERGED = "ÿ ÿ"  # the byte 0xFF twice: no UTF-8 text holds that byte
PRE_TOKENIZER = "gpt-2"
GPT2_EOT = 50256
# gguf.TokenType values (llama.cpp's llama_token_type): written as plain ints so this module needs no gguf import.
NORMAL, CONTROL, UNUSED = 1, 3, 5


def _to_unicode() -> dict[int, str]:
    return {b: c for c, b in _byte_level_bytes().items()}


def byte_level(data: bytes) -> str:
    """Bytes -> their GPT-2 byte-level string (each byte one printable character)."""
    table = _to_unicode()
    return "".join(table[b] for b in data)


def _from_byte_level(text: str) -> bytes:
    table = _byte_level_bytes()
    try:
        return bytes(table[c] for c in text)
    except KeyError as err:
        raise ValueError(f"token {text!r} holds {err.args[0]!r}, which is not in GPT-2's byte alphabet") from None


def _bpe_merges(tokenizer: Any) -> list[str]:
    """The merges of a ``tokenizers`` BPE model as ``"left right"`` strings (both serialisations of the list)."""
    merges = json.loads(tokenizer.to_str())["model"]["merges"]
    return [m if isinstance(m, str) else " ".join(m) for m in merges]


def tokenizer_metadata(tokenizer: Tokenizer, n_vocab: int) -> dict[str, Any]:
    """The ``tokenizer.ggml.*`` fields of ``tokenizer`` for a model of ``n_vocab`` rows, as plain Python values:
    ``model``, ``pre``, ``tokens``, ``token_type``, ``merges``, ``bos_token_id``, ``eos_token_id`` (or None), and
    ``extra_rows``: how many tokens follow the model's rows (a character vocabulary's, see the module docstring)."""
    if tokenizer.vocab_size > n_vocab:
        raise ValueError(f"the tokenizer has {tokenizer.vocab_size} tokens but the model only {n_vocab} rows")
    eos: int | None = tokenizer.eot_id
    if isinstance(tokenizer, GPT2Tokenizer):
        with tempfile.TemporaryDirectory() as tmp:
            tokenizer.write_files(tmp)
            encoder = json.loads((Path(tmp) / "encoder.json").read_text(encoding="utf-8"))
            lines = (Path(tmp) / "vocab.bpe").read_text(encoding="utf-8").split("\n")
        tokens = [""] * tokenizer.vocab_size
        for token, index in encoder.items():
            tokens[index] = token
        merges = [line for line in lines[1:] if line]  # the first line is "#version: 0.2"
    elif isinstance(tokenizer, BPETokenizer):
        hf = tokenizer.tokenizer
        tokens = [hf.id_to_token(i) for i in range(tokenizer.vocab_size)]
        merges = _bpe_merges(hf)
    elif isinstance(tokenizer, CharTokenizer):
        tokens = [byte_level(c.encode("utf-8")) for c in tokenizer.chars]
        merges = []
        for token in tokens:  # join the bytes of each multi-byte character, left to right
            for end in range(2, len(token) + 1):
                merges.append(f"{token[:end - 1]} {token[end - 1]}")
        merges = list(dict.fromkeys(merges))  # two characters may share a lead-byte prefix
        if not merges:  # llama.cpp refuses a BPE vocabulary without merges: one that valid UTF-8 never meets
            merges = [NEVER_MERGED]
    else:
        raise ValueError(f"a {tokenizer.kind!r} tokenizer has no GGUF form (gpt2, bpe and char do)")
    types = [CONTROL if tokenizer.kind != "char" and i == tokenizer.eot_id else NORMAL for i in range(len(tokens))]
    extra: list[str] = []
    if tokenizer.kind == "char":
        eos = n_vocab
        known = set(tokens)  # the two sides of every merge, as tokenizers' BPE wants them in the vocabulary
        parts = (part for merge in merges for part in merge.split(" "))
        pieces = [part for part in dict.fromkeys(parts) if part not in known]
        extra = [ENDOFTEXT] + pieces + (["".join(NEVER_MERGED.split(" "))] if merges == [NEVER_MERGED] else [])
    tokens += [f"[PAD{i}]" for i in range(len(tokens), n_vocab)]
    types += [UNUSED] * (n_vocab - len(types))
    tokens += extra
    types += ([CONTROL] + [UNUSED] * (len(extra) - 1)) if extra else []
    return {"model": "gpt2", "pre": PRE_TOKENIZER, "tokens": tokens, "token_type": types, "merges": merges,
            "bos_token_id": eos, "eos_token_id": eos, "kind": tokenizer.kind, "extra_rows": len(extra)}


def tokenizer_from_metadata(fields: dict[str, Any], directory: Path, warn: Callable[[str], None]
                            ) -> Tokenizer | None:
    """The tinygpt tokenizer described by a GGUF's ``tokenizer.ggml.*`` ``fields`` (already read into Python
    values); files it needs (GPT-2's encoder.json + vocab.bpe) are written into ``directory``, which must outlive it.
    None, with a ``warn``, for a vocabulary tinygpt cannot run (not byte-level BPE)."""
    model = fields.get("tokenizer.ggml.model")
    tokens = fields.get("tokenizer.ggml.tokens")
    if tokens is None:
        warn("the GGUF holds no tokenizer (no tokenizer.ggml.tokens)")
        return None
    if model != "gpt2":
        warn(f"tokenizer.ggml.model={model!r} is not carried over: tinygpt reads byte-level BPE ('gpt2') vocabularies")
        return None
    types = list(fields.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens))
    used = [t for t, kind in zip(tokens, types) if kind != UNUSED]
    merges = list(fields.get("tokenizer.ggml.merges") or [])
    kind = fields.get(KIND_KEY)
    if kind is None:  # not written by tinygpt: GPT-2's own vocabulary, else a byte-level BPE
        is_gpt2 = len(used) == GPT2_EOT + 1 and used[GPT2_EOT] == ENDOFTEXT and len(merges) == 50000
        kind = "gpt2" if is_gpt2 and fields.get("tokenizer.ggml.pre", PRE_TOKENIZER) == PRE_TOKENIZER else "bpe"
    if kind == "char":  # the characters are the normal tokens (not the end of text, prefixes or padding)
        chars = []
        for token in [t for t, kind in zip(tokens, types) if kind == NORMAL]:
            text = _from_byte_level(token).decode("utf-8", errors="strict")
            if len(text) != 1:
                raise ValueError(f"the GGUF's character vocabulary holds {token!r}, which is not one character")
            chars.append(text)
        if chars != sorted(chars):
            raise ValueError("the GGUF's character vocabulary is not in tinygpt's order (sorted characters)")
        return CharTokenizer(chars)
    if kind == "gpt2":
        from ..tokenizer import gpt2_tokenizer

        (directory / "encoder.json").write_text(json.dumps({t: i for i, t in enumerate(used)}), encoding="utf-8")
        (directory / "vocab.bpe").write_text("#version: 0.2\n" + "\n".join(merges) + "\n", encoding="utf-8")
        return gpt2_tokenizer(directory)
    if kind == "bpe":
        return _bpe_tokenizer(used, merges, warn)
    raise ValueError(f"{KIND_KEY}={kind!r} is not a tinygpt tokenizer kind (gpt2, bpe, char)")


def _bpe_tokenizer(tokens: list[str], merges: list[str], warn: Callable[[str], None]) -> BPETokenizer | None:
    from tokenizers import AddedToken, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as HFTokenizer

    if ENDOFTEXT not in tokens:
        warn(f"the GGUF's BPE vocabulary has no {ENDOFTEXT!r}, which tinygpt uses as end of text: no tokenizer")
        return None
    vocab = {t: i for i, t in enumerate(tokens)}
    pairs = [tuple(m.split(" ", 1)) for m in merges]
    hf = HFTokenizer(models.BPE(vocab=vocab, merges=pairs))
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    hf.add_special_tokens([AddedToken(ENDOFTEXT, special=True)])
    return BPETokenizer(hf)
