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

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

import numpy as np
from tqdm.auto import tqdm

from ..fileio import read_json_object
from ..tokenizer import TOKENIZER_FILES
from .sources import DEFAULT_TEXT_FIELD, Source, find_sources, iter_documents, iter_text_chunks  # noqa: F401

HEADER_NAME = "prepared.json"
TOKENS_NAME = "tokens.bin"
TOKENIZER_DIR = "tokenizer"
FORMAT = "tinygpt-tokens-v1"
# The files a prepared corpus consists of beyond its header: a corpus saved over an older one removes those of them
# it does not write again (a BPE's file when the new tokenizer is char).
_OWN_FILES = (TOKENS_NAME, *(f"{TOKENIZER_DIR}/{name}" for name in TOKENIZER_FILES))


def find_text_files(paths: Sequence[str | os.PathLike]) -> list[Path]:
    """The files and saved-dataset folders ``prepare_corpus`` would read from ``paths`` (``sources.find_sources``):
    files as given; folders searched recursively (sorted, hidden entries and binary files skipped)."""
    return [source.path for source in find_sources(paths)]


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
        header = read_json_object(header_path)
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
    format: str = "auto",
    text_field: str = DEFAULT_TEXT_FIELD,
    split: str = "train",
    workers: int = 1,
) -> PreparedCorpus:
    """Tokenize ``paths`` with ``tokenizer`` ("gpt2" | "char" | "bpe" | "bpe:VOCAB", trained on the same documents
    when it needs training) into ``out_dir``.

    ``paths`` are text files, JSON Lines, Parquet files, saved ``datasets`` folders or folders of them
    (``training.sources``; ``text_field`` names the records' text, ``split`` a saved DatasetDict's split). Each
    document (a text file, a record) is followed by the end-of-text id when the tokenizer has one. ``workers`` > 1
    encodes batches of documents in that many processes; the tokens are the same, in the same order, byte for byte.

    ``out_dir`` is checked before any text is read (``fileio.check_save_target``: not a file, writable, room for the
    tokens, not inside an input, not a folder of another kind or of unrelated files unless ``overwrite``); the
    files are then saved by ``fileio.save_into``: a failure (a bad record included) leaves an earlier corpus there
    untouched, and files the corpus does not own are never deleted."""
    from .. import checks
    from ..fileio import PREPARED_CORPUS, atomic_write_text, check_save_target, save_into
    from ..tokenizer import train_tokenizer

    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction={val_fraction!r} must be in (0, 1)")
    checks.positive_int("workers", workers)
    sources = find_sources(paths, format)
    total_bytes = sum(source.size for source in sources)
    if total_bytes == 0:
        raise ValueError(f"the corpus is empty: {len(sources)} file(s), 0 bytes")
    # At most one token per byte, 2 bytes each (uint16) for every vocabulary but a BPE above 65,536.
    save = dict(overwrite=overwrite, inputs=list(paths) if not isinstance(paths, (str, os.PathLike)) else [paths],
                needed_bytes=2 * total_bytes, what="--out")
    check_save_target(out_dir, PREPARED_CORPUS, **save)
    read = dict(text_field=text_field, split=split, chunk_bytes=chunk_bytes, total_bytes=total_bytes)

    tok = train_tokenizer(tokenizer, (text for _, text, _ in _stream(sources, desc="tokenizer", progress=progress,
                                                                       **read) if text))
    dtype = token_dtype(tok.vocab_size)
    out_dir = Path(out_dir)
    records: list[dict[str, Any]] = []
    with save_into(out_dir, PREPARED_CORPUS, replaces=_OWN_FILES, **save) as tmp:
        tok.save(tmp / TOKENIZER_DIR)  # first: the workers load the tokenizer from here
        counts = 0
        with open(tmp / TOKENS_NAME, "wb") as f:
            jobs = _jobs(_stream(sources, desc="encode", progress=progress, **read), chunk_bytes)
            for index, ids in _encode_jobs(jobs, tok, tmp / TOKENIZER_DIR, workers, dtype):
                if ids is None:  # the end of source ``index``
                    records.append(_source_record(sources[index], counts))
                    counts = 0
                    continue
                ids.tofile(f)
                counts += ids.size
            f.flush()
            os.fsync(f.fileno())
        total = sum(r["tokens"] for r in records)
        if total < 2:
            raise ValueError(f"the corpus encodes to {total} token(s); at least 2 are needed")
        n_train = min(total - 1, max(1, int(round(total * (1.0 - val_fraction)))))
        header = {
            "format": FORMAT,
            "tokenizer": {"spec": tokenizer, "kind": tok.kind, "vocab_size": tok.vocab_size, "eot_id": tok.eot_id},
            "dtype": dtype.name,
            "total_tokens": total,
            "train_tokens": n_train,
            "val_tokens": total - n_train,
            "val_fraction": val_fraction,
            "total_bytes": total_bytes,
            "sources": records,
        }
        if any(s.format != "text" for s in sources):
            header["text_field"] = text_field
        atomic_write_text(tmp / HEADER_NAME, json.dumps(header, indent=2) + "\n")
    return PreparedCorpus.open(out_dir)


def _source_record(source: Source, tokens: int) -> dict[str, Any]:
    """A source's entry in the header: path, format, size, sha256 of its bytes, and its token count."""
    sha = hashlib.sha256()
    for path in source.data_files():
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                sha.update(block)
    return {"path": str(source.path.resolve()), "format": source.format, "bytes": source.size,
            "sha256": sha.hexdigest(), "tokens": tokens}


def _stream(sources: list[Source], *, text_field: str, split: str, chunk_bytes: int, total_bytes: int, desc: str,
            progress: bool) -> Iterator[tuple[int, str | None, bool]]:
    """(source index, text, ends a document) for every piece of every source, then (index, None, False) at the end
    of each source."""
    with tqdm(total=total_bytes, unit="B", unit_scale=True, desc=desc, disable=not progress) as bar:
        for index, source in enumerate(sources):
            seen = [0]

            def on_bytes(n: int, seen: list[int] = seen) -> None:
                seen[0] += n
                bar.update(n)

            for text, ends in iter_documents(source, text_field=text_field, split=split, chunk_bytes=chunk_bytes,
                                             on_bytes=on_bytes):
                yield index, text, ends
            bar.update(max(0, source.size - seen[0]))
            yield index, None, False


# A job is a list of texts of one source, each followed by the end-of-text id or not; jobs hold about chunk_bytes of
# text, and how they are cut does not depend on the number of workers, nor does what a job encodes to.
_Job = tuple[int, list[tuple[str, bool]] | None]


def _jobs(stream: Iterator[tuple[int, str | None, bool]], chunk_bytes: int) -> Iterator[_Job]:
    items: list[tuple[str, bool]] = []
    size = 0
    for index, text, ends in stream:
        if text is None:
            if items:
                yield index, items
            items, size = [], 0
            yield index, None
            continue
        items.append((text, ends))
        size += len(text)
        if size >= chunk_bytes:
            yield index, items
            items, size = [], 0


def _encode(tok: Any, items: list[tuple[str, bool]], dtype: np.dtype) -> np.ndarray:
    """One job's token ids: each text encoded (``<|endoftext|>`` in it read as the end-of-text id), then the
    end-of-text id after each document that ends here (when the tokenizer has one)."""
    pieces = []
    for ids, (_, ends) in zip(tok.encode_batch([text for text, _ in items], allowed_special=True), items):
        if ends and tok.eot_id is not None:
            ids = [*ids, tok.eot_id]
        pieces.append(np.asarray(ids, dtype=np.int64))
    ids = np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int64)
    if ids.size and (ids.min() < 0 or ids.max() >= tok.vocab_size):
        raise ValueError(f"the tokenizer produced an id outside [0, {tok.vocab_size})")
    return ids.astype(dtype)


_WORKER_TOKENIZER: Any = None


def _worker_start(tokenizer_dir: str) -> None:
    global _WORKER_TOKENIZER
    from ..tokenizer import load_tokenizer

    _WORKER_TOKENIZER = load_tokenizer(tokenizer_dir)


def _worker_encode(items: list[tuple[str, bool]], dtype: str) -> np.ndarray:
    return _encode(_WORKER_TOKENIZER, items, np.dtype(dtype))


def _encode_jobs(jobs: Iterator[_Job], tok: Any, tokenizer_dir: Path, workers: int, dtype: np.dtype
                 ) -> Iterator[tuple[int, np.ndarray | None]]:
    """(source index, ids) per job in order, and (index, None) at each source's end. With ``workers`` > 1 the jobs
    run in a process pool (spawned: no fork of a process that holds tokenizer threads), at most 2 per worker in
    flight, so memory stays bounded whatever the corpus size."""
    if workers == 1:
        for index, items in jobs:
            yield index, None if items is None else _encode(tok, items, dtype)
        return
    import collections
    import multiprocessing

    with multiprocessing.get_context("spawn").Pool(workers, _worker_start, (str(tokenizer_dir),)) as pool:
        pending: collections.deque = collections.deque()
        for index, items in jobs:
            pending.append((index, None if items is None else pool.apply_async(_worker_encode, (items, dtype.str))))
            while len(pending) > 2 * workers:
                done_index, result = pending.popleft()
                yield done_index, None if result is None else result.get()
        while pending:
            done_index, result = pending.popleft()
            yield done_index, None if result is None else result.get()


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
    sources = find_sources(paths)
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
            == [(str(s.path.resolve()), s.size) for s in sources]
        )
        if same:
            return existing
    return prepare_corpus(paths, tokenizer, out_dir, val_fraction=val_fraction, progress=progress)
