"""A GGUF file's header checked against the file before anything is built from it.

gguf-py's ``GGUFReader`` trusts the counts a header declares: a metadata array that claims 2^62 items is walked
item by item (memory grows until the process dies), a 2 M-token list in a 31 MB file becomes millions of small
arrays, and tensors are views of wherever their offsets point, overlapping or not. ``check_gguf_header`` walks the
header with ``struct`` first (the layout: llama.cpp's ``docs/gguf.md``) and refuses, with one line naming the file
and the field:

- any count (keys, tensors, array items, string bytes, dimensions) that the bytes left in the file cannot hold;
- arrays of more than ``MAX_ARRAY_ITEMS`` items (every real vocabulary and merge list is well under it), and arrays
  longer than twice the vocabulary (``token_embd``'s rows) plus ``ARRAY_SLACK``;
- tensors of more than ``MAX_DIMS`` dimensions, of a type gguf-py does not know, whose data runs past the end of
  the file, that are not aligned, or that overlap another tensor.
"""

from __future__ import annotations

import mmap
import struct
from pathlib import Path
from typing import Any

MAX_ARRAY_ITEMS = 1 << 20  # Gemma's 256,000 tokens and Llama 3's 280,147 merges fit four times over
ARRAY_SLACK = 1024
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_KEY_BYTES = 65535
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


class _Header:
    """A cursor over the file's bytes that refuses to read past the end."""

    def __init__(self, data: Any, path: Path) -> None:
        self.data, self.path, self.at, self.order = data, path, 0, "<"

    def fail(self, message: str) -> ValueError:
        return ValueError(f"{self.path}: not a readable GGUF file (truncated or corrupt): {message} (at byte "
                          f"{self.at} of {len(self.data)})")

    def read(self, fmt: str) -> Any:
        size = struct.calcsize(fmt)
        if self.at + size > len(self.data):
            raise self.fail("the header runs past the end of the file")
        value = struct.unpack_from(self.order + fmt, self.data, self.at)[0]
        self.at += size
        return value

    def count(self, what: str, n: int, item_bytes: int, limit: int | None = None) -> int:
        """``n`` items of at least ``item_bytes`` each: refused if the rest of the file cannot hold them."""
        left = len(self.data) - self.at
        if n * item_bytes > left:
            raise self.fail(f"{what} claims {n} items of at least {item_bytes} bytes; {left} bytes are left")
        if limit is not None and n > limit:
            raise self.fail(f"{what} has {n} items; at most {limit} are read")
        return n

    def string(self, what: str, limit: int | None = None) -> bytes:
        n = self.count(what, self.read("Q"), 1, limit)
        start = self.at
        self.at = start + n
        return bytes(self.data[start:self.at])

    def skip_value(self, kind: int, what: str) -> int | None:
        """Skip one value of type ``kind``; returns an array's length (None for a scalar or a string)."""
        if kind in _SCALARS:
            self.read(_SCALARS[kind])
            return None
        if kind == _STRING:
            self.string(what)
            return None
        if kind != _ARRAY:
            raise self.fail(f"{what} has the unknown value type {kind}")
        item = self.read("I")
        n = self.read("Q")
        if item in _SCALARS:
            size = struct.calcsize(_SCALARS[item])
            self.count(what, n, size, MAX_ARRAY_ITEMS)
            self.at += n * size
        elif item == _STRING:
            self.count(what, n, 8, MAX_ARRAY_ITEMS)
            for _ in range(n):  # lengths only: no string is copied
                length = self.count(what, self.read("Q"), 1)
                self.at += length
        elif item == _ARRAY:
            self.count(what, n, 12, MAX_ARRAY_ITEMS)
            for _ in range(n):
                self.skip_value(_ARRAY, what)
        else:
            raise self.fail(f"{what} is an array of the unknown value type {item}")
        return n


def check_gguf_header(path: str | Path) -> None:
    """Walk ``path``'s header and tensor table; ``ValueError`` naming the file and the field for any count the
    file cannot hold or the limits refuse, and for tensors out of the file, misaligned or overlapping."""
    from gguf import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGMLQuantizationType

    path = Path(path)
    with open(path, "rb") as file:
        size = file.seek(0, 2)
        if size < 24:
            raise ValueError(f"{path}: not a readable GGUF file: {size} bytes is shorter than a GGUF header")
        with mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as data:
            h = _Header(data, path)
            if h.read("4s") != b"GGUF":
                raise h.fail("it does not start with GGUF")
            if h.read("I") > 0xFFFF:
                h.order = ">"  # a big-endian file (gguf-py reads both)
            n_tensors = h.count("the tensor count", h.read("Q"), 24)
            n_keys = h.count("the metadata key count", h.read("Q"), 12)
            arrays: dict[str, int] = {}
            alignment = GGUF_DEFAULT_ALIGNMENT
            for _ in range(n_keys):
                key = h.string("a metadata key", MAX_KEY_BYTES).decode("utf-8", "replace")
                kind = h.read("I")
                if key == "general.alignment" and kind == 4:
                    alignment = h.read("I")
                    continue
                n = h.skip_value(kind, f"metadata {key!r}")
                if n is not None:
                    arrays[key] = n
            tensors = []
            for _ in range(n_tensors):
                name = h.string("a tensor name", MAX_KEY_BYTES).decode("utf-8", "replace")
                dims = [h.read("Q") for _ in range(h.count(f"tensor {name!r}'s dimensions", h.read("I"), 8,
                                                            MAX_DIMS))]
                kind, offset = h.read("I"), h.read("Q")
                try:
                    block, type_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(kind)]
                except (ValueError, KeyError):
                    raise h.fail(f"tensor {name!r} has the unknown type {kind}") from None
                elements = 1
                for d in dims:
                    elements *= d
                tensors.append((offset, elements * type_bytes // block, name, dims))
            if alignment == 0 or alignment & (alignment - 1):
                raise h.fail(f"general.alignment={alignment} is not a power of two")
            start = -(-h.at // alignment) * alignment
            _check_tensors(path, tensors, size - start, alignment)
            embd = next((dims for _, _, name, dims in tensors if name == "token_embd.weight"), None)
            if embd is not None and len(embd) == 2:
                limit = 2 * embd[1] + ARRAY_SLACK  # GGUF lists the rows (the vocabulary) last
                for key, n in arrays.items():
                    if n > limit:
                        raise ValueError(f"{path}: metadata {key!r} has {n} items, more than twice the vocabulary "
                                         f"of token_embd.weight ({embd[1]} rows): not a GGUF tinygpt reads")


def _check_tensors(path: Path, tensors: list[tuple[int, int, str, list[int]]], data_bytes: int,
                   alignment: int) -> None:
    """Every tensor inside the data section, aligned, and none overlapping the next one (sorted by offset)."""
    end_of_last, last = 0, None
    for offset, n_bytes, name, dims in sorted(tensors):
        if offset % alignment:
            raise ValueError(f"{path}: tensor {name!r} starts at {offset}, not a multiple of the alignment "
                             f"{alignment}")
        if offset + n_bytes > data_bytes:
            raise ValueError(f"{path}: not a readable GGUF file (truncated or corrupt): tensor {name!r} ({dims}, "
                             f"{n_bytes} bytes at offset {offset}) runs past the end of the file's {data_bytes} "
                             f"bytes of tensor data")
        if offset < end_of_last:
            raise ValueError(f"{path}: tensors {last!r} and {name!r} overlap (the second starts at {offset}, "
                             f"before the first ends at {end_of_last}); every tensor needs its own bytes")
        end_of_last, last = offset + n_bytes, name
