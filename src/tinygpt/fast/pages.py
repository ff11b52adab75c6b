"""The weights in huge pages: a decode step reads every weight once, and with the usual 4 KiB pages every 4 KiB of
it costs the core a page-table walk (a TLB miss) on top of the memory read.

A plain loop reads gpt2-small's 49 product weights markedly faster from 2 MiB pages than from 4 KiB ones
(``python -m benchmarks.decode_bound`` times both). llama.cpp gets large pages for free: it maps the GGUF file,
and the kernel's page cache backs the mapping with large folios. torch allocates with ``malloc``, which on Linux
gets 4 KiB pages unless transparent huge pages are ``always`` (most distributions say ``madvise``; torch's own
``THP_MEM_ALLOC_ENABLE`` variable must be set before the process starts, and applies to every allocation).

``huge_pages(model)`` copies the model's large parameters and buffers, storage by storage, into one anonymous
mapping marked ``MADV_HUGEPAGE`` and points the tensors at their copies (``param.data``, the module's buffer): the
values, shapes, strides and ties stay as they were; only the addresses move. Where the kernel gives no huge pages
(THP ``never``, another OS) it does nothing harmful and on a system without ``madvise`` it does nothing at all.
``interop.load_pretrained`` calls it for every model it loads onto a CPU, and the engine's runner after it lays
weights out for a compiled step (``fast.weights.plain_weights`` makes new tensors).
"""

from __future__ import annotations

import mmap
import sys
import weakref

import torch
from torch import nn

HUGE_PAGE = 2 << 20  # x86-64 and arm64 (4 KiB base pages): the transparent huge page's size
MIN_BYTES = 64 << 10  # smaller storages cost a few TLB entries at most: not worth moving
_ALIGN = 64  # each storage starts on a cache line, which also suits every dtype's alignment

# [start, end) of the mappings made so far, while they live: a tensor inside one is already in huge pages
_ARENAS: dict[int, tuple[int, int]] = {}


def supported() -> bool:
    """Whether this system can be asked for huge pages (Linux's ``madvise(MADV_HUGEPAGE)``)."""
    return sys.platform.startswith("linux") and hasattr(mmap, "MADV_HUGEPAGE")


def in_huge_pages(tensor: torch.Tensor) -> bool:
    """Whether ``tensor``'s storage lies in a mapping ``huge_pages`` made."""
    start = tensor.untyped_storage().data_ptr()
    return any(lo <= start < hi for lo, hi in _ARENAS.values())


def _movable(tensor: torch.Tensor | None) -> bool:
    return (tensor is not None and tensor.device.type == "cpu" and tensor.layout == torch.strided
            and not tensor.is_mkldnn and tensor.untyped_storage().nbytes() >= MIN_BYTES and not in_huge_pages(tensor))


def huge_pages(model: nn.Module) -> int:
    """Move ``model``'s CPU parameters and buffers of at least ``MIN_BYTES`` into one mapping backed by 2 MiB pages
    (see the module docstring). Idempotent; oneDNN's packed weights stay where oneDNN put them. Returns the bytes
    moved (0: nothing to move, or no huge pages on this system)."""
    if not supported():
        return 0
    groups: dict[int, list[tuple[nn.Module, str, str, torch.Tensor]]] = {}  # storage address -> its tensors
    for module in model.modules():
        for kind, table in (("param", module._parameters), ("buffer", module._buffers)):
            for name, tensor in table.items():
                if _movable(tensor):
                    groups.setdefault(tensor.untyped_storage().data_ptr(), []).append((module, kind, name, tensor))
    if not groups:
        return 0
    sizes = {address: on_it[0][3].untyped_storage().nbytes() for address, on_it in groups.items()}
    offsets, total = {}, 0
    for address, nbytes in sizes.items():
        offsets[address] = total
        total += -(-nbytes // _ALIGN) * _ALIGN
    length = -(-total // HUGE_PAGE) * HUGE_PAGE
    try:
        # private: a shared anonymous mapping is shmem, whose huge pages are a separate setting (often never)
        arena = mmap.mmap(-1, length + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # + room to align
    except OSError as err:
        print(f"tinygpt: no memory for the weights' huge pages ({err}); they stay where they are", file=sys.stderr)
        return 0
    raw = torch.frombuffer(arena, dtype=torch.uint8)  # the tensors made from it keep the mapping alive
    base = -raw.data_ptr() % HUGE_PAGE
    arena.madvise(mmap.MADV_HUGEPAGE, base, length)  # before the copies: the first touch faults in 2 MiB pages
    start = raw.data_ptr() + base
    _ARENAS[id(arena)] = (start, start + length)
    weakref.finalize(arena, _ARENAS.pop, id(arena), None)
    with torch.no_grad():
        for address in list(groups):
            # every tensor on this storage (a tied weight, views of one buffer) is re-pointed at the one copy
            on_it = groups.pop(address)  # the old storage goes with these: the peak stays one storage above the model
            at = base + offsets[address]
            raw[at:at + sizes[address]].copy_(torch.empty(0, dtype=torch.uint8).set_(on_it[0][3].untyped_storage()))
            for module, kind, name, tensor in on_it:
                size = tensor.element_size()
                moved = raw[:raw.numel() // size * size].view(tensor.dtype).as_strided(
                    tensor.shape, tensor.stride(), at // size + tensor.storage_offset())
                if kind == "param":
                    tensor.data = moved
                else:
                    module._buffers[name] = moved
    return sum(sizes.values())
