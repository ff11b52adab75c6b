"""Where a corpus's documents come from: text files, JSON Lines, Parquet, and Hugging Face ``datasets`` on disk.

Every reader streams: text in newline-ended chunks of about ``chunk_bytes``, JSON Lines one line at a time, Parquet
one record batch at a time (``pyarrow.parquet.ParquetFile.iter_batches``), a saved dataset one batch at a time
from its memory-mapped Arrow files -- so memory stays bounded whatever the corpus size.

- A text file is one document.
- In the record formats each record's ``text_field`` is one document (its value must be a string): a JSON Lines
  file (``.jsonl`` / ``.ndjson``: one JSON object per line, blank lines skipped), a Parquet file (``.parquet``: the
  column of that name), a folder written by ``Dataset.save_to_disk`` (``state.json`` + ``dataset_info.json``) or
  ``DatasetDict.save_to_disk`` (``dataset_dict.json``; its ``split``, ``train`` by default). A folder that is none of
  these is searched recursively (a hub dataset's snapshot: its ``.parquet`` / ``.jsonl`` files are read as such,
  other files as text; hidden entries and other binary files skipped).

A bad record is a ``ValueError`` naming the file, the line (JSON Lines) or row (Parquet, datasets) and why.
pyarrow and datasets are optional (``pip install 'tinygpt[data]'``); a missing one is an ``ImportError`` saying so.
"""

from __future__ import annotations

import codecs
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

from ..fileio import read_json_object

FORMATS = ("auto", "text", "jsonl", "parquet", "hf")
DEFAULT_TEXT_FIELD = "text"
_JSONL_SUFFIXES = (".jsonl", ".ndjson")
_BINARY_PROBE = 8192
_BATCH_ROWS = 1024  # rows per Parquet / Arrow batch: a few MB of text at most


@dataclass(frozen=True)
class Source:
    """One input of a corpus: a file or a saved-dataset folder, and how it is read."""

    path: Path
    format: str  # text | jsonl | parquet | hf

    def data_files(self) -> list[Path]:
        """The files whose bytes make this source (a saved dataset's Arrow files; otherwise the file itself)."""
        return _hf_arrow_files(self.path, split=None) if self.format == "hf" else [self.path]

    @property
    def size(self) -> int:
        return sum(f.stat().st_size for f in self.data_files())


def _is_hf_dataset(path: Path) -> bool:
    return path.is_dir() and ((path / "state.json").is_file() and (path / "dataset_info.json").is_file()
                              or (path / "dataset_dict.json").is_file())


def _format_of(path: Path) -> str:
    if _is_hf_dataset(path):
        return "hf"
    suffix = path.suffix.lower()
    return "jsonl" if suffix in _JSONL_SUFFIXES else "parquet" if suffix == ".parquet" else "text"


def _looks_binary(path: Path) -> bool:
    with open(path, "rb") as f:
        return b"\0" in f.read(_BINARY_PROBE)


def find_sources(paths: Sequence[str | os.PathLike] | str | os.PathLike, format: str = "auto") -> list[Source]:
    """The sources of ``paths``: files as given, saved datasets as one source each, other folders searched
    recursively (sorted). ``format`` other than ``auto`` reads every file as that format. A missing path is
    ``FileNotFoundError``; nothing to read is ``ValueError``."""
    if format not in FORMATS:
        raise ValueError(f"format={format!r} is not one of {', '.join(FORMATS)}")
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    if not paths:
        raise ValueError("no data paths given; pass one or more text files or folders")
    sources: list[Source] = []
    for raw in paths:
        path = Path(raw)
        if path.is_file() or _is_hf_dataset(path):
            sources.append(Source(path, _format_of(path) if format == "auto" else format))
        elif path.is_dir():
            found = list(_walk(path, format))
            if not found:
                raise ValueError(f"folder {path} holds no text files")
            sources.extend(found)
        else:
            raise FileNotFoundError(f"data path {path} does not exist")
    return sources


def _walk(root: Path, format: str) -> Iterator[Source]:
    for entry in sorted(root.iterdir()):
        if entry.name.startswith("."):
            continue
        if _is_hf_dataset(entry):
            yield Source(entry, "hf")
        elif entry.is_dir():
            yield from _walk(entry, format)
        elif entry.is_file():
            kind = _format_of(entry) if format == "auto" else format
            if kind == "parquet" or not _looks_binary(entry):
                yield Source(entry, kind)


# ------------------------------------------------------------------------------------------------ text
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


# ------------------------------------------------------------------------------------------------ records
def _record_text(value: Any, where: str, field: str, present: bool) -> str:
    if not present:
        raise ValueError(f"{where}: no field {field!r}")
    if not isinstance(value, str):
        kind = "null" if value is None else type(value).__name__
        raise ValueError(f"{where}: field {field!r} is {kind}, not text")
    return value


MAX_RECORD_BYTES = 1 << 24  # one JSON Lines record (a book is ~1 MB); parsing one takes ~25x its size in memory


def iter_jsonl(path: Path, field: str, on_bytes: Callable[[bytes], None] | None = None, *,
               max_record_bytes: int = MAX_RECORD_BYTES) -> Iterator[str]:
    """The ``field`` of each JSON object of a JSON Lines file, line by line; a line longer than
    ``max_record_bytes``, nested too deep to parse, or not an object is a ``ValueError`` naming it."""
    with open(path, "rb") as f:
        number = 0
        while raw := f.readline(max_record_bytes + 1):
            number += 1
            where = f"{path}: line {number}"
            if len(raw) > max_record_bytes and not raw.endswith(b"\n"):
                raise ValueError(f"{where} is longer than {max_record_bytes} bytes, the most one record may have "
                                 f"(split the document, or store it as a text file)")
            if on_bytes is not None:
                on_bytes(raw)
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise ValueError(f"{where} is not UTF-8 ({err.reason} at byte {err.start} of the line)") from None
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{where} is not valid JSON ({err.msg} at column {err.colno}); a JSON Lines file "
                                 f"holds one object per line") from None
            except RecursionError:
                raise ValueError(f"{where} is nested too deeply to parse; a record is an object with a {field!r} "
                                 f"field") from None
            if not isinstance(record, dict):
                raise ValueError(f"{where} is a JSON {type(record).__name__}, not an object with a {field!r} field")
            yield _record_text(record.get(field), where, field, field in record)


def _require(module: str) -> Any:
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        package = module.split(".")[0]
        raise ImportError(f"reading this data needs {package}: pip install 'tinygpt[data]' (or pip install "
                          f"{package})") from None


def _iter_arrow_batches(batches: Iterator[Any], field: str, where: str, on_rows: Callable[[int], None] | None
                        ) -> Iterator[str]:
    row = 0
    for batch in batches:
        column = batch.column(batch.schema.get_field_index(field))
        for value in column.to_pylist():
            row += 1
            yield _record_text(value, f"{where}: row {row}", field, True)
        if on_rows is not None:
            on_rows(batch.num_rows)


def _check_column(schema: Any, field: str, where: str) -> None:
    pa = _require("pyarrow")
    if field not in schema.names:
        raise ValueError(f"{where}: no column {field!r} (columns: {', '.join(schema.names)}); choose one with "
                         f"--text-field")
    kind = schema.field(field).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
        raise ValueError(f"{where}: column {field!r} holds {kind}, not text")


def iter_parquet(path: Path, field: str, on_rows: Callable[[int], None] | None = None) -> Iterator[str]:
    """The ``field`` column of a Parquet file, one record batch of ``_BATCH_ROWS`` rows at a time."""
    pq = _require("pyarrow.parquet")
    try:
        handle = pq.ParquetFile(path)
    except Exception as err:  # pyarrow raises ArrowInvalid (a ValueError) or OSError for a damaged file
        raise ValueError(f"{path}: not a readable Parquet file ({err})") from None
    _check_column(handle.schema_arrow, field, str(path))
    yield from _iter_arrow_batches(handle.iter_batches(batch_size=_BATCH_ROWS, columns=[field]), field, str(path),
                                   on_rows)


def _hf_arrow_files(path: Path, split: str | None) -> list[Path]:
    """The Arrow files of a saved ``Dataset`` (``state.json``'s ``_data_files``) or of one split of a saved
    ``DatasetDict`` (``split=None``: every split, for sizes)."""
    if (path / "dataset_dict.json").is_file():
        splits = read_json_object(path / "dataset_dict.json").get("splits", [])
        if not isinstance(splits, list) or not all(isinstance(s, str) and s for s in splits):
            raise ValueError(f"{path / 'dataset_dict.json'}: 'splits' must be a list of split names")
        if split is not None and split not in splits:
            raise ValueError(f"{path}: no split {split!r} (splits: {', '.join(splits)}); choose one with --split")
        return [f for s in (splits if split is None else [split]) for f in _hf_arrow_files(path / s, None)]
    files = read_json_object(path / "state.json").get("_data_files", [])
    if not isinstance(files, list) or not all(isinstance(e, dict) and isinstance(e.get("filename"), str)
                                              for e in files):
        raise ValueError(f"{path / 'state.json'}: '_data_files' must be a list of {{\"filename\": ...}} objects")
    return [path / entry["filename"] for entry in files]


def iter_hf_dataset(path: Path, field: str, split: str = "train", on_rows: Callable[[int], None] | None = None
                    ) -> Iterator[str]:
    """The ``field`` column of a dataset saved by ``datasets`` (``save_to_disk``), batch by batch from its memory-
    mapped Arrow files (``datasets.load_from_disk``)."""
    datasets = _require("datasets")
    try:
        data = datasets.load_from_disk(str(path))
    except Exception as err:  # datasets raises FileNotFoundError / ValueError / its own errors
        raise ValueError(f"{path}: cannot load the saved dataset ({err})") from None
    where = str(path)
    if isinstance(data, datasets.DatasetDict):
        if split not in data:
            raise ValueError(f"{path}: no split {split!r} (splits: {', '.join(data)}); choose one with --split")
        data, where = data[split], f"{path} (split {split})"
    _check_column(data.data.schema, field, where)
    batches = data.data.select([field]).to_batches(max_chunksize=_BATCH_ROWS)
    yield from _iter_arrow_batches(iter(batches), field, where, on_rows)


def iter_documents(source: Source, *, text_field: str = DEFAULT_TEXT_FIELD, split: str = "train",
                   chunk_bytes: int = 1 << 20, on_bytes: Callable[[int], None] | None = None
                   ) -> Iterator[tuple[str, bool]]:
    """(text, ends a document) pairs of ``source``, in order; ``on_bytes`` is told how many of its bytes each step
    consumed (for progress). A text file's chunks end a document only at the end of the file (with an empty text
    when the file is empty); each record is one document."""
    if source.format == "text":
        pending = None
        for chunk in iter_text_chunks(source.path, chunk_bytes, on_bytes and (lambda b: on_bytes(len(b)))):
            if pending is not None:
                yield pending, False
            pending = chunk
        yield pending or "", True
        return
    if source.format == "jsonl":
        texts = iter_jsonl(source.path, text_field, on_bytes and (lambda b: on_bytes(len(b))))
    else:
        size, rows = source.size, _row_count(source, split)
        per_row = size / rows if rows else 0.0
        report = on_bytes and (lambda n: on_bytes(int(round(n * per_row))))
        texts = (iter_parquet(source.path, text_field, report) if source.format == "parquet"
                 else iter_hf_dataset(source.path, text_field, split, report))
    for text in texts:
        yield text, True


def _row_count(source: Source, split: str) -> int:
    if source.format == "parquet":
        try:
            return _require("pyarrow.parquet").ParquetFile(source.path).metadata.num_rows
        except ImportError:
            raise
        except Exception:  # a damaged file: iter_parquet says why
            return 0
    return 0
