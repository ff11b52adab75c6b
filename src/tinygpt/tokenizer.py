"""Tokenizers: text <-> token ids, with one interface for the GPT-2 BPE, a character vocabulary and a trained BPE.

- ``GPT2Tokenizer``: OpenAI's GPT-2 byte-level BPE (50,257 tokens, ``<|endoftext|>`` = 50256) through tiktoken.
  The vocabulary comes from, in this order: an explicit directory holding ``encoder.json`` + ``vocab.bpe``, the
  directory named by ``$TINYGPT_GPT2_VOCAB``, or tiktoken's own cache/download. Offline with none of them, a
  ``GPT2VocabularyError`` says what to provide.
- ``CharTokenizer``: one id per character seen in the training text (ids in sorted character order).
- ``BPETokenizer``: a byte-level BPE trained with Hugging Face ``tokenizers`` (GPT-2's pre-tokenizer regex and
  byte alphabet, so every string is encodable), with ``<|endoftext|>`` as its only special token.

A tokenizer saved into a directory (beside a checkpoint) writes ``tinygpt_tokenizer.json``, a small descriptor naming
its kind and any files it needs, and ``load_tokenizer`` reads it back (checkpoints written before this name read
their ``tokenizer.json`` descriptor the same way). Nothing is unpickled. ``tokenizer.json`` is Hugging Face's name
for a fast-tokenizer file: ``tokenizer_from_dir`` reads one (a folder saved by current transformers has no other
tokenizer file) as a ``BPETokenizer``, and ``write_hf_tokenizer`` writes a tokenizer in the form transformers loads.
"""

from __future__ import annotations

import abc
import copy
import json
import os
import shutil
from pathlib import Path
from typing import Any, Iterable, Iterator, Sequence

from .chat_template import TOKENIZER_CONFIG, ChatTemplate, chat_template_config, read_chat_template
from .fileio import atomic_write_bytes, atomic_write_text, atomic_write_with, json_object_or_none, read_json_object

ENDOFTEXT = "<|endoftext|>"
DESCRIPTOR = "tinygpt_tokenizer.json"
LEGACY_DESCRIPTOR = "tokenizer.json"  # the descriptor's name before it made room for Hugging Face's file of that name
HF_TOKENIZER_FILE = "tokenizer.json"  # Hugging Face ``tokenizers``' serialization (transformers' fast tokenizers)
GPT2_FILES = ("encoder.json", "vocab.bpe")
HF_GPT2_FILES = ("vocab.json", "merges.txt")  # a Hugging Face GPT-2 folder holds the same two files under these names
GPT2_VOCAB_ENV = "TINYGPT_GPT2_VOCAB"
DEFAULT_BPE_VOCAB = 4096
TOKENIZER_SPECS = ("gpt2", "char", "bpe", "bpe:VOCAB")
BPE_FILE = "bpe.json"
# Every file a tinygpt tokenizer may write beside a checkpoint (a later save without them removes them); the
# tokenizer_config.json holds its chat template, when it has one.
TOKENIZER_FILES = (DESCRIPTOR, LEGACY_DESCRIPTOR, BPE_FILE, *GPT2_FILES, TOKENIZER_CONFIG)

# The URLs and sha256 values tiktoken_ext.openai_public.gpt2() loads (tiktoken 0.14); used to fetch the two files
# from tiktoken's cache when a tokenizer that came from get_encoding("gpt2") is saved beside a checkpoint.
_GPT2_URLS = {
    "vocab.bpe": ("https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/vocab.bpe",
                  "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5"),
    "encoder.json": ("https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/encoder.json",
                     "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783"),
}


class GPT2VocabularyError(ValueError):
    """The GPT-2 vocabulary files could not be found locally nor downloaded."""


class Tokenizer(abc.ABC):
    """The common interface. ``kind`` is "gpt2", "char" or "bpe"; ``eot_id`` is the end-of-text id (or None);
    ``chat_template`` the conversation format of the model it belongs to (``tinygpt.chat_template``), or None."""

    kind: str = ""
    vocab_size: int
    eot_id: int | None = None
    chat_template: ChatTemplate | None = None

    def with_chat_template(self, template: str | ChatTemplate | None) -> "Tokenizer":
        """A copy of this tokenizer with ``template`` (Jinja text: it sees this tokenizer's special tokens, GPT-2's
        convention of ``<|endoftext|>`` as bos, eos and unk, as ``write_hf_tokenizer`` writes them)."""
        if isinstance(template, str):
            tokens = {} if self.eot_id is None else {k: ENDOFTEXT for k in ("bos_token", "eos_token", "unk_token")}
            template = ChatTemplate(template, tokens)
        other = copy.copy(self)
        other.chat_template = template
        return other

    @abc.abstractmethod
    def encode(self, text: str, *, allowed_special: bool = False) -> list[int]:
        """Text -> ids. ``<|endoftext|>`` in the text becomes ``eot_id`` only with ``allowed_special=True``;
        otherwise its presence is a ``ValueError`` (it would silently mean two different things)."""

    @abc.abstractmethod
    def decode(self, ids: Sequence[int]) -> str:
        """Ids -> text. An id outside [0, vocab_size) is a ``ValueError``."""

    def encode_batch(self, texts: Sequence[str], *, allowed_special: bool = False) -> list[list[int]]:
        return [self.encode(t, allowed_special=allowed_special) for t in texts]

    def token_bytes(self, token: int) -> bytes:
        """The bytes of one token (a byte-level BPE token may hold part of a UTF-8 character, which ``decode``
        shows as U+FFFD)."""
        return self.decode([token]).encode("utf-8")

    @abc.abstractmethod
    def save(self, directory: str | Path) -> None:
        """Write ``tokenizer.json`` (and the files it names) into ``directory``, each file atomically."""

    def _check_ids(self, ids: Sequence[int]) -> list[int]:
        ids = [int(i) for i in ids]
        for i in ids:
            if not 0 <= i < self.vocab_size:
                raise ValueError(
                    f"token id {i} is out of range: ids must satisfy 0 <= id < vocab_size={self.vocab_size}"
                )
        return ids

    def _check_special(self, text: str, allowed_special: bool) -> None:
        if not allowed_special and ENDOFTEXT in text:
            raise ValueError(
                f"the text contains the special token {ENDOFTEXT!r}; pass allowed_special=True to encode it as "
                f"the end-of-text id, or remove it"
            )

    def __repr__(self) -> str:
        return f"{type(self).__name__}(vocab_size={self.vocab_size}, eot_id={self.eot_id})"


def _write_descriptor(directory: Path, data: dict[str, Any], template: ChatTemplate | None) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    atomic_write_text(directory / DESCRIPTOR, json.dumps({"format": "tinygpt-tokenizer", **data}, indent=2) + "\n")
    if template is not None:
        atomic_write_text(directory / TOKENIZER_CONFIG, json.dumps(chat_template_config(template), indent=2) + "\n")


# ------------------------------------------------------------------------------------------------ GPT-2
class GPT2Tokenizer(Tokenizer):
    """GPT-2's byte-level BPE via a ``tiktoken.Encoding``. ``source_dir`` is where encoder.json/vocab.bpe (or
    their Hugging Face names vocab.json/merges.txt) came from; None when tiktoken loaded them from its cache."""

    kind = "gpt2"

    def __init__(self, encoding: Any, source_dir: Path | None = None) -> None:
        self.encoding = encoding
        self.source_dir = source_dir
        self.vocab_size = encoding.n_vocab
        self.eot_id = encoding.eot_token

    def encode(self, text: str, *, allowed_special: bool = False) -> list[int]:
        self._check_special(text, allowed_special)
        if allowed_special:
            return self.encoding.encode(text, allowed_special={ENDOFTEXT})
        return self.encoding.encode_ordinary(text)

    def encode_batch(self, texts: Sequence[str], *, allowed_special: bool = False) -> list[list[int]]:
        for text in texts:
            self._check_special(text, allowed_special)
        if allowed_special:
            return self.encoding.encode_batch(list(texts), allowed_special={ENDOFTEXT})
        return self.encoding.encode_ordinary_batch(list(texts))

    def decode(self, ids: Sequence[int]) -> str:
        return self.encoding.decode(self._check_ids(ids))

    def token_bytes(self, token: int) -> bytes:
        return self.encoding.decode_single_token_bytes(self._check_ids([token])[0])

    def save(self, directory: str | Path) -> None:
        self.write_files(directory)
        _write_descriptor(Path(directory), {"kind": "gpt2", "encoder": GPT2_FILES[0], "vocab": GPT2_FILES[1]},
                          self.chat_template)

    def write_files(self, directory: str | Path, names: tuple[str, str] = GPT2_FILES) -> None:
        """Write the (encoder, merges) files into ``directory`` under ``names`` (OpenAI's or ``HF_GPT2_FILES``)."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        for index, name in enumerate(names):
            target = directory / name
            if self.source_dir is not None:
                source = self.source_dir / _gpt2_file_names(self.source_dir)[index]
                if source.resolve() != target.resolve():
                    atomic_write_with(target, lambda tmp, source=source: shutil.copyfile(source, tmp))
            else:
                atomic_write_bytes(target, _read_tiktoken_cached(GPT2_FILES[index]))


def _read_tiktoken_cached(name: str) -> bytes:
    import tiktoken.load

    url, sha256 = _GPT2_URLS[name]
    try:
        return tiktoken.load.read_file_cached(url, sha256)
    except (OSError, ValueError, ImportError) as err:
        raise GPT2VocabularyError(f"cannot fetch the GPT-2 file {name} to save it ({err}); {_GPT2_HELP}") from None


_GPT2_HELP = (
    f"provide a directory holding the GPT-2 files encoder.json and vocab.bpe (--tokenizer-dir DIR, "
    f"the environment variable {GPT2_VOCAB_ENV}=DIR, or gpt2_tokenizer(DIR)), or go online once so tiktoken can "
    f"download and cache them"
)


def _gpt2_file_names(directory: Path) -> tuple[str, str]:
    """(encoder, merges) file names in ``directory``: OpenAI's names, or the same files as Hugging Face names them."""
    for names in (GPT2_FILES, HF_GPT2_FILES):
        if all((directory / name).is_file() for name in names):
            return names
    if not directory.is_dir():
        raise GPT2VocabularyError(f"GPT-2 vocabulary directory {directory} does not exist; {_GPT2_HELP}")
    raise GPT2VocabularyError(
        f"{directory} holds neither encoder.json + vocab.bpe nor vocab.json + merges.txt; {_GPT2_HELP}"
    )


def _encoding_from_dir(directory: Path) -> Any:
    """tiktoken's GPT-2 encoding built offline, straight from the two local files (no download, no cache)."""
    import tiktoken
    import tiktoken.load
    from tiktoken_ext.openai_public import r50k_pat_str

    encoder_file, merges_file = _gpt2_file_names(directory)
    # An empty TIKTOKEN_CACHE_DIR turns tiktoken's cache off, so it does not store copies of local files.
    saved = os.environ.get("TIKTOKEN_CACHE_DIR")
    os.environ["TIKTOKEN_CACHE_DIR"] = ""
    try:
        ranks = tiktoken.load.data_gym_to_mergeable_bpe_ranks(
            vocab_bpe_file=str(directory / merges_file), encoder_json_file=str(directory / encoder_file)
        )
        return tiktoken.Encoding(name="gpt2", pat_str=r50k_pat_str, mergeable_ranks=ranks,
                                 special_tokens={ENDOFTEXT: 50256}, explicit_n_vocab=50257)
    except (AssertionError, ValueError, KeyError, UnicodeDecodeError) as err:
        raise GPT2VocabularyError(
            f"{directory}: {encoder_file} and {merges_file} are not a valid GPT-2 vocabulary "
            f"({type(err).__name__}: {err})"
        ) from None
    finally:
        if saved is None:
            del os.environ["TIKTOKEN_CACHE_DIR"]
        else:
            os.environ["TIKTOKEN_CACHE_DIR"] = saved


def gpt2_tokenizer(vocab_dir: str | Path | None = None) -> GPT2Tokenizer:
    """The GPT-2 tokenizer from ``vocab_dir``, else ``$TINYGPT_GPT2_VOCAB``, else tiktoken's cache/download."""
    if vocab_dir is None and os.environ.get(GPT2_VOCAB_ENV):
        vocab_dir = os.environ[GPT2_VOCAB_ENV]
    if vocab_dir is not None:
        directory = Path(vocab_dir)
        return GPT2Tokenizer(_encoding_from_dir(directory), source_dir=directory)
    import tiktoken

    try:
        encoding = tiktoken.get_encoding("gpt2")
    except (OSError, ValueError, ImportError) as err:  # requests' connection errors are OSErrors
        raise GPT2VocabularyError(
            f"the GPT-2 vocabulary is not in tiktoken's cache and could not be downloaded "
            f"({type(err).__name__}); {_GPT2_HELP}"
        ) from None
    return GPT2Tokenizer(encoding)


# ------------------------------------------------------------------------------------------------ char
class CharTokenizer(Tokenizer):
    """One id per character, in sorted order of the characters seen in training. No special tokens."""

    kind = "char"

    def __init__(self, chars: Iterable[str]) -> None:
        chars = sorted(set(chars))
        if not chars:
            raise ValueError("a character tokenizer needs at least one character of training text")
        if any(len(c) != 1 for c in chars):
            raise ValueError("the vocabulary of a character tokenizer must be single characters")
        self.chars = chars
        self.vocab_size = len(chars)
        self._index = {c: i for i, c in enumerate(chars)}

    def encode(self, text: str, *, allowed_special: bool = False) -> list[int]:
        index = self._index
        try:
            return [index[c] for c in text]
        except KeyError as err:
            raise ValueError(
                f"character {err.args[0]!r} is not in this character tokenizer's vocabulary "
                f"({self.vocab_size} characters seen in training)"
            ) from None

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(self.chars[i] for i in self._check_ids(ids))

    def save(self, directory: str | Path) -> None:
        _write_descriptor(Path(directory), {"kind": "char", "chars": self.chars}, self.chat_template)


# ------------------------------------------------------------------------------------------------ BPE
def _byte_level_bytes() -> dict[str, int]:
    """GPT-2's byte-level alphabet inverted (``bytes_to_unicode`` in openai/gpt-2's encoder.py): printable bytes
    stand for themselves, the other 68 are moved to U+0100 onwards in byte order."""
    kept = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), 256)]
    moved = [b for b in range(256) if b not in kept]
    return {**{chr(b): b for b in kept}, **{chr(256 + i): b for i, b in enumerate(moved)}}


class BPETokenizer(Tokenizer):
    """A byte-level BPE (``tokenizers.Tokenizer``) with ``<|endoftext|>``; decodes its own encodings exactly."""

    kind = "bpe"
    FILE = BPE_FILE

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        self.eot_id = tokenizer.token_to_id(ENDOFTEXT)
        if self.eot_id is None:
            raise ValueError(f"a BPE tokenizer must define the special token {ENDOFTEXT!r}")

    def encode(self, text: str, *, allowed_special: bool = False) -> list[int]:
        self._check_special(text, allowed_special)
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str], *, allowed_special: bool = False) -> list[list[int]]:
        for text in texts:
            self._check_special(text, allowed_special)
        return [e.ids for e in self.tokenizer.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(self._check_ids(ids), skip_special_tokens=False)

    def token_bytes(self, token: int) -> bytes:
        piece = self.tokenizer.id_to_token(self._check_ids([token])[0])
        if token == self.eot_id:
            return piece.encode("utf-8")
        table = _byte_level_bytes()
        return bytes(table[c] for c in piece)

    def save(self, directory: str | Path) -> None:
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        atomic_write_text(directory / self.FILE, self.tokenizer.to_str())
        _write_descriptor(directory, {"kind": "bpe", "file": self.FILE}, self.chat_template)

    @classmethod
    def train(cls, texts: Iterable[str], vocab_size: int = DEFAULT_BPE_VOCAB) -> "BPETokenizer":
        """Train on an iterable of text chunks; ``tokenizers`` consumes it lazily, so a large corpus can stream."""
        from tokenizers import Tokenizer as HFTokenizer
        from tokenizers import decoders, models, pre_tokenizers, trainers

        tokenizer = HFTokenizer(models.BPE())
        # GPT-2's scheme: its regex splits words/numbers/punctuation, bytes map to printable characters, no prefix
        # space (so decode(encode(s)) == s exactly).
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tokenizer.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size, special_tokens=[ENDOFTEXT], show_progress=False,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        )
        tokenizer.train_from_iterator(_as_chunks(texts), trainer=trainer)
        return cls(tokenizer)


def _as_chunks(texts: Iterable[str] | str) -> Iterator[str]:
    if isinstance(texts, str):  # one string, not an iterable of its characters
        yield texts
        return
    for chunk in texts:
        if not isinstance(chunk, str):
            raise TypeError(f"training texts must be strings, got {type(chunk).__name__}")
        yield chunk


# ------------------------------------------------------------------------------------------------ train / load
def train_tokenizer(spec: str, texts: Iterable[str] | str = ()) -> Tokenizer:
    """Build a tokenizer from ``spec``: "gpt2" (pretrained; texts unused), "char", "bpe" or "bpe:VOCAB".

    ``texts`` may be any iterable of text chunks (a generator over a large file); it is read once.
    """
    allowed = f"allowed: {', '.join(TOKENIZER_SPECS)} (VOCAB an integer >= 257)"
    if not isinstance(spec, str):
        raise ValueError(f"tokenizer spec must be a string; {allowed}")
    if spec == "gpt2":
        return gpt2_tokenizer()
    if spec == "char":
        seen: set[str] = set()
        for chunk in _as_chunks(texts):
            seen.update(chunk)
        return CharTokenizer(seen)
    if spec == "bpe" or spec.startswith("bpe:"):
        vocab = DEFAULT_BPE_VOCAB
        if spec != "bpe":
            text = spec.removeprefix("bpe:")
            # 256 byte tokens + <|endoftext|> is the smallest byte-level vocabulary.
            if not text.isdigit() or int(text) < 257:
                raise ValueError(f"bad tokenizer spec {spec!r}; {allowed}")
            vocab = int(text)
        return BPETokenizer.train(texts, vocab)
    raise ValueError(f"unknown tokenizer spec {spec!r}; {allowed}")


def _is_descriptor(path: Path) -> bool:
    return (json_object_or_none(path) or {}).get("format") == "tinygpt-tokenizer"


def find_descriptor(directory: str | Path) -> Path | None:
    """``directory``'s tinygpt tokenizer descriptor: ``tinygpt_tokenizer.json``, or in a checkpoint written before
    that name, a ``tokenizer.json`` that is a tinygpt descriptor (not Hugging Face's file). None when there is none."""
    directory = Path(directory)
    if (directory / DESCRIPTOR).is_file():
        return directory / DESCRIPTOR
    legacy = directory / LEGACY_DESCRIPTOR
    return legacy if legacy.is_file() and _is_descriptor(legacy) else None


def load_tokenizer(directory: str | Path) -> Tokenizer:
    """Read the tokenizer saved in ``directory`` (its ``tinygpt_tokenizer.json`` and the files it names), with the
    chat template of its ``tokenizer_config.json`` when there is one."""
    tokenizer = _load_descriptor(directory)
    template = read_chat_template(directory)
    return tokenizer if template is None else tokenizer.with_chat_template(template)


def _load_descriptor(directory: str | Path) -> Tokenizer:
    directory = Path(directory)
    path = find_descriptor(directory) or directory / DESCRIPTOR
    if not path.is_file():
        raise ValueError(f"no tokenizer in {directory}: {DESCRIPTOR} is missing")
    data = read_json_object(path)
    if data.get("format") != "tinygpt-tokenizer":
        raise ValueError(f"{path} is not a tinygpt tokenizer descriptor (expected \"format\": \"tinygpt-tokenizer\")")
    kind = data.get("kind")
    if kind == "gpt2":
        return gpt2_tokenizer(directory)
    if kind == "char":
        chars = data.get("chars")
        if not isinstance(chars, list) or not all(isinstance(c, str) for c in chars):
            raise ValueError(f"{path}: key 'chars' must be a list of characters")
        return CharTokenizer(chars)
    if kind == "bpe":
        from tokenizers import Tokenizer as HFTokenizer

        file = directory / str(data.get("file", BPETokenizer.FILE))
        try:
            return BPETokenizer(HFTokenizer.from_file(str(file)))
        except Exception as err:  # tokenizers raises its own Exception type for any parse failure
            raise ValueError(f"{file}: cannot load the BPE tokenizer ({err})") from None
    raise ValueError(f"{path}: unknown tokenizer kind {kind!r}; allowed: gpt2, char, bpe")


def hf_tokenizer_from_file(path: str | Path) -> BPETokenizer:
    """A Hugging Face ``tokenizer.json`` (the fast-tokenizer file transformers saves) as a ``BPETokenizer``; it must
    define ``<|endoftext|>`` (GPT-2's end of text), else a ``ValueError`` says so."""
    from tokenizers import Tokenizer as HFTokenizer

    try:
        tokenizer = HFTokenizer.from_file(str(path))
    except Exception as err:  # tokenizers raises its own Exception type for any parse failure
        raise ValueError(f"{path}: cannot load the Hugging Face tokenizer ({err})") from None
    if tokenizer.token_to_id(ENDOFTEXT) is None:
        raise ValueError(f"{path}: the tokenizer has no {ENDOFTEXT!r} token, which tinygpt uses as end of text")
    return BPETokenizer(tokenizer)


def tokenizer_from_dir(directory: str | Path) -> Tokenizer:
    """The tokenizer of a folder: tinygpt's own (its descriptor), else Hugging Face's ``tokenizer.json``, else GPT-2's
    from encoder.json + vocab.bpe or vocab.json + merges.txt."""
    directory = Path(directory)
    if find_descriptor(directory) is not None:
        return load_tokenizer(directory)
    if (directory / HF_TOKENIZER_FILE).is_file() and not all((directory / n).is_file() for n in HF_GPT2_FILES):
        tokenizer: Tokenizer = hf_tokenizer_from_file(directory / HF_TOKENIZER_FILE)
    else:
        tokenizer = gpt2_tokenizer(directory)
    template = read_chat_template(directory)  # a Hugging Face folder's own template, as transformers reads it
    return tokenizer if template is None else tokenizer.with_chat_template(template)


def has_tokenizer_files(directory: str | Path) -> bool:
    """True when ``tokenizer_from_dir`` has files to read in ``directory`` (it may still find them invalid)."""
    directory = Path(directory)
    return (find_descriptor(directory) is not None or (directory / HF_TOKENIZER_FILE).is_file()
            or any(all((directory / n).is_file() for n in names) for names in (GPT2_FILES, HF_GPT2_FILES)))


# Files a Hugging Face folder's tokenizer consists of (``write_hf_tokenizer`` writes them; an export over an older
# export removes those it does not write again).
HF_TOKENIZER_FILES = (HF_TOKENIZER_FILE, *HF_GPT2_FILES, TOKENIZER_CONFIG, "special_tokens_map.json")


def write_hf_tokenizer(tokenizer: Tokenizer, directory: str | Path, model_max_length: int) -> list[str]:
    """Write ``tokenizer`` in the form ``transformers.AutoTokenizer`` loads: GPT-2's as vocab.json + merges.txt, a
    trained BPE as tokenizer.json; both with tokenizer_config.json naming the end-of-text token. Returns the names
    written. The tokenizer's chat template goes into tokenizer_config.json, where ``AutoTokenizer`` reads it. A
    character tokenizer has no such form: ``ValueError``."""
    directory = Path(directory)
    if isinstance(tokenizer, GPT2Tokenizer):
        tokenizer.write_files(directory, HF_GPT2_FILES)
        config = {"tokenizer_class": "GPT2Tokenizer"}
        names = [*HF_GPT2_FILES]
    elif isinstance(tokenizer, BPETokenizer):
        atomic_write_text(directory / HF_TOKENIZER_FILE, tokenizer.tokenizer.to_str())
        config = {"tokenizer_class": "PreTrainedTokenizerFast"}
        names = [HF_TOKENIZER_FILE]
    else:
        raise ValueError(f"a {tokenizer.kind} tokenizer has no Hugging Face form (only GPT-2's and a trained BPE do)")
    # GPT-2's convention: <|endoftext|> is bos, eos and unk at once; no prefix space, so decode(encode(s)) == s.
    config.update(bos_token=ENDOFTEXT, eos_token=ENDOFTEXT, unk_token=ENDOFTEXT, add_prefix_space=False,
                  model_max_length=model_max_length, clean_up_tokenization_spaces=False)
    if tokenizer.chat_template is not None:
        config["chat_template"] = tokenizer.chat_template.source
    atomic_write_text(directory / TOKENIZER_CONFIG, json.dumps(config, indent=2) + "\n")
    return [*names, TOKENIZER_CONFIG]
