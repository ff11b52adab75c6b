"""Corpus preparation: text files or folders -> one flat token file (numpy memmap) + a JSON header + the tokenizer.

Layout of a prepared directory::

    prepared.json    header: format, tokenizer spec and vocab size, dtype, token counts, the train/val split,
                     and each source file's path, size and sha256
    tokens.bin       every token id, file after file (each file followed by the tokenizer's end-of-text id when it
                     has one), uint16 when the vocabulary fits, else uint32; the first ``train_tokens`` are the
                     training split, the rest the validation split
    tokenizer/       the tokenizer, as ``Tokenizer.save`` writes it

Text is read in chunks of ``chunk_bytes`` and encoded chunk by chunk, so memory stays bounded whatever the corpus
size (a chunk ends after a newline, where no BPE merge crosses). A literal ``<|endoftext|>`` in the text is read as
the end-of-text token: the usual document separator of GPT-2 style corpora.
"""

from __future__ import annotations

import codecs
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import numpy as np
from tqdm.auto import tqdm

from ..tokenizer import TOKENIZER_FILES

HEADER_NAME = "prepared.json"
TOKENS_NAME = "tokens.bin"
TOKENIZER_DIR = "tokenizer"
FORMAT = "tinygpt-tokens-v1"
# The files a prepared corpus consists of beyond its header: a corpus saved over an older one removes those of them
# it does not write again (a BPE's file when the new tokenizer is char).
_OWN_FILES = (TOKENS_NAME, *(f"{TOKENIZER_DIR}/{name}" for name in TOKENIZER_FILES))
_BINARY_PROBE = 8192


def find_text_files(paths: Sequence[str | os.PathLike]) -> list[Path]:
    """Files as given; folders searched recursively (sorted, hidden entries and binary files -- a NUL byte in the
    first 8 KiB -- skipped). A missing path is ``FileNotFoundError``; nothing to read is ``ValueError``."""
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    if not paths:
        raise ValueError("no data paths given; pass one or more text files or folders")
    files: list[Path] = []
    for raw in paths:
        path = Path(raw)
        if path.is_file():
            files.append(path)
        elif path.is_dir():
            found = [
                p for p in sorted(path.rglob("*"))
                if p.is_file()
                and not any(part.startswith(".") for part in p.relative_to(path).parts)
                and not _looks_binary(p)
            ]
            if not found:
                raise ValueError(f"folder {path} holds no text files")
            files.extend(found)
        else:
            raise FileNotFoundError(f"data path {path} does not exist")
    return files


def _looks_binary(path: Path) -> bool:
    with open(path, "rb") as f:
        return b"\0" in f.read(_BINARY_PROBE)


def iter_text_chunks(
    path: Path, chunk_bytes: int = 1 << 20, on_bytes: Callable[[bytes], None] | None = None
) -> Iterator[str]:
    """Decode ``path`` as UTF-8 in pieces of about ``chunk_bytes``; ``on_bytes`` sees every raw byte block (for
    hashing and progress). Each piece but the last ends just after a newline that is followed by a non-space
    character, so no line and no run of blank lines is split between two pieces.

    Bytes that are not UTF-8 are a ``ValueError`` naming the file and the byte offset: replacing them with U+FFFD
    would train the model on a character the text never had."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="strict")
    carry = ""
    offset = 0  # bytes of the file before ``block``
    with open(path, "rb") as f:
        while True:
            block = f.read(chunk_bytes)
            if on_bytes is not None and block:
                on_bytes(block)
            pending = len(decoder.getstate()[0])  # bytes of an unfinished character held from the previous block
            try:
                decoded = decoder.decode(block, final=not block)
            except UnicodeDecodeError as err:
                position = offset - pending + err.start
                raise ValueError(
                    f"{path} is not UTF-8 text: byte 0x{err.object[err.start]:02x} at byte offset {position} "
                    f"({err.reason}); convert the file to UTF-8 (e.g. iconv -f latin1 -t utf-8) or leave it out"
                ) from None
            offset += len(block)
            text = carry + decoded
            if not block:
                if text:
                    yield text
                return
            cut = _last_safe_cut(text)
            carry = text[cut:]
            if cut:
                yield text[:cut]


def _last_safe_cut(text: str) -> int:
    i = len(text) - 1
    while True:
        i = text.rfind("\n", 0, i)
        if i < 0:
            return 0
        if i + 1 < len(text) and not text[i + 1].isspace():
            return i + 1


@dataclass(frozen=True)
class PreparedCorpus:
    """A prepared directory opened read-only: ``train`` and ``val`` are memmapped 1-D token arrays."""

    directory: Path
    header: dict[str, Any]
    train: np.ndarray
    val: np.ndarray

    @property
    def vocab_size(self) -> int:
        return int(self.header["tokenizer"]["vocab_size"])

    @property
    def tokenizer_dir(self) -> Path:
        return self.directory / TOKENIZER_DIR

    def load_tokenizer(self):
        from ..tokenizer import load_tokenizer

        return load_tokenizer(self.tokenizer_dir)

    @classmethod
    def open(cls, directory: str | os.PathLike) -> "PreparedCorpus":
        directory = Path(directory)
        header_path = directory / HEADER_NAME
        if not header_path.is_file():
            raise FileNotFoundError(
                f"{directory} is not a prepared corpus (no {HEADER_NAME}); make one with `tinygpt prepare`"
            )
        header = json.loads(header_path.read_text(encoding="utf-8"))
        if header.get("format") != FORMAT:
            raise ValueError(f"{header_path}: format {header.get('format')!r} is not {FORMAT!r}")
        dtype = np.dtype(header["dtype"])
        total, n_train = int(header["total_tokens"]), int(header["train_tokens"])
        tokens_path = directory / TOKENS_NAME
        size = tokens_path.stat().st_size if tokens_path.is_file() else -1
        if size != total * dtype.itemsize:
            raise ValueError(
                f"{tokens_path}: expected {total} {dtype.name} tokens ({total * dtype.itemsize} bytes), "
                f"found {max(size, 0)} bytes; prepare the corpus again"
            )
        tokens = np.memmap(tokens_path, dtype=dtype, mode="r", shape=(total,))
        return cls(directory, header, tokens[:n_train], tokens[n_train:])


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id fits in 16 bits, else uint32."""
    return np.dtype(np.uint16) if vocab_size <= 1 << 16 else np.dtype(np.uint32)


def prepare_corpus(
    paths: Sequence[str | os.PathLike],
    tokenizer: str,
    out_dir: str | os.PathLike,
    *,
    val_fraction: float = 0.1,
    chunk_bytes: int = 1 << 20,
    progress: bool = True,
    overwrite: bool = False,
) -> PreparedCorpus:
    """Tokenize ``paths`` with ``tokenizer`` ("gpt2" | "char" | "bpe" | "bpe:VOCAB", trained on the same files when
    it needs training) into ``out_dir``.

    ``out_dir`` is checked before any text is read (``fileio.check_save_target``: not a file, writable, room for the
    tokens, not inside an input, not a folder of another kind or of unrelated files unless ``overwrite``); the
    files are then saved by ``fileio.save_into``: a failure leaves an earlier corpus there untouched, and files
    the corpus does not own are never deleted."""
    from ..fileio import PREPARED_CORPUS, atomic_write_text, check_save_target, save_into
    from ..tokenizer import train_tokenizer

    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction={val_fraction!r} must be in (0, 1)")
    files = find_text_files(paths)
    total_bytes = sum(f.stat().st_size for f in files)
    if total_bytes == 0:
        raise ValueError(f"the corpus is empty: {len(files)} file(s), 0 bytes")
    # At most one token per byte, 2 bytes each (uint16) for every vocabulary but a BPE above 65,536.
    save = dict(overwrite=overwrite, inputs=list(paths) if not isinstance(paths, (str, os.PathLike)) else [paths],
                needed_bytes=2 * total_bytes, what="--out")
    check_save_target(out_dir, PREPARED_CORPUS, **save)

    tok = train_tokenizer(tokenizer, (t for _, t, _ in _stream(files, chunk_bytes, total_bytes, "tokenizer", progress)
                                      if t is not None))
    dtype = token_dtype(tok.vocab_size)
    out_dir = Path(out_dir)
    sources: list[dict[str, Any]] = []
    with save_into(out_dir, PREPARED_CORPUS, replaces=_OWN_FILES, **save) as tmp:
        counts, file_tokens = 0, 0
        with open(tmp / TOKENS_NAME, "wb") as f:
            for index, text, sha256 in _stream(files, chunk_bytes, total_bytes, "encode", progress):
                if text is not None:
                    ids = np.asarray(tok.encode(text, allowed_special=True), dtype=np.int64)
                    if ids.size and (ids.min() < 0 or ids.max() >= tok.vocab_size):
                        raise ValueError(f"tokenizer {tokenizer!r} produced an id outside [0, {tok.vocab_size})")
                    ids.astype(dtype).tofile(f)
                    file_tokens += ids.size
                    continue
                if tok.eot_id is not None:  # documents stay apart: a window crossing files sees the boundary
                    np.asarray([tok.eot_id], dtype=dtype).tofile(f)
                    file_tokens += 1
                path = files[index]
                sources.append({"path": str(path.resolve()), "bytes": path.stat().st_size, "sha256": sha256,
                                "tokens": file_tokens})
                counts += file_tokens
                file_tokens = 0
            f.flush()
            os.fsync(f.fileno())
        if counts < 2:
            raise ValueError(f"the corpus encodes to {counts} token(s); at least 2 are needed")
        n_train = min(counts - 1, max(1, int(round(counts * (1.0 - val_fraction)))))
        tok.save(tmp / TOKENIZER_DIR)
        header = {
            "format": FORMAT,
            "tokenizer": {"spec": tokenizer, "kind": tok.kind, "vocab_size": tok.vocab_size, "eot_id": tok.eot_id},
            "dtype": dtype.name,
            "total_tokens": counts,
            "train_tokens": n_train,
            "val_tokens": counts - n_train,
            "val_fraction": val_fraction,
            "total_bytes": total_bytes,
            "sources": sources,
        }
        atomic_write_text(tmp / HEADER_NAME, json.dumps(header, indent=2) + "\n")
    return PreparedCorpus.open(out_dir)


def _stream(
    files: list[Path], chunk_bytes: int, total_bytes: int, desc: str, progress: bool
) -> Iterator[tuple[int, str | None, str | None]]:
    """(file index, text chunk, None) for each chunk, then (file index, None, sha256 hex) at the end of each file."""
    with tqdm(total=total_bytes, unit="B", unit_scale=True, desc=desc, disable=not progress) as bar:
        for index, path in enumerate(files):
            sha = hashlib.sha256()

            def on_bytes(block: bytes, sha=sha) -> None:
                sha.update(block)
                bar.update(len(block))

            for text in iter_text_chunks(path, chunk_bytes, on_bytes):
                yield index, text, None
            yield index, None, sha.hexdigest()


def prepare_or_reuse(
    paths: Sequence[str | os.PathLike],
    tokenizer: str,
    out_dir: str | os.PathLike,
    *,
    val_fraction: float = 0.1,
    progress: bool = True,
) -> PreparedCorpus:
    """``prepare_corpus``, unless ``out_dir`` already holds these files (same paths and sizes) prepared with this
    tokenizer and split -- as on a resume, where re-encoding would waste time and re-training a BPE could change it."""
    files = find_text_files(paths)
    try:
        existing = PreparedCorpus.open(out_dir)
    except (FileNotFoundError, ValueError, KeyError, json.JSONDecodeError):
        existing = None
    if existing is not None:
        h = existing.header
        same = (
            h["tokenizer"]["spec"] == tokenizer
            and h["val_fraction"] == val_fraction
            and [(s["path"], s["bytes"]) for s in h["sources"]]
            == [(str(f.resolve()), f.stat().st_size) for f in files]
        )
        if same:
            return existing
    return prepare_corpus(files, tokenizer, out_dir, val_fraction=val_fraction, progress=progress)
