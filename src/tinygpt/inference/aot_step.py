"""The batch-1 decode step compiled ahead of time (AOTInductor): one call into C++ per token.

Through ``torch.compile`` a compiled step still pays, every token, Python whose cost does not depend on the model's
size: dynamo's guards on every weight, the AOT and inductor wrappers, a Python call per kernel and per output
buffer. On a small model that is most of the step (llama.cpp pays none of it). Here the one-row step is exported
once (``torch.export``) with the weights and the paged cache's tensors as its inputs, so the compiled library holds
no copy of them and writes each token's keys and values into the engine's own cache, and compiled by AOTInductor
into a shared library; a token is then one call (``boxed_run``) with a list of tensors.

The library depends on the model's code, its tensors' shapes and dtypes, the compile options, the thread count and
torch's version, not on the weights' values: it is kept in inductor's cache folder under a key of those (written
atomically), so a later process, or another model of the same shapes, loads it in milliseconds instead of compiling
again. The keys' count and the cache's slot count are dynamic; a call outside what the library was built for
raises, and the runner falls back (``runner.ModelRunner``).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import tempfile
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch
from torch import nn

from .batch import Batch, DecodeGroup
from .kv_cache import PagedKVCache

PACKAGE_FOLDER = "tinygpt_aot_steps"  # under inductor's cache folder


def model_tensors(model: nn.Module) -> tuple[list[str], list[torch.Tensor]]:
    """The model's parameters and buffers (tied ones once), by name: the step's weight inputs."""
    named = dict(model.named_parameters())
    named.update(model.named_buffers())
    return list(named), list(named.values())


@contextlib.contextmanager
def _cache_tensors(cache: PagedKVCache, tensors: Sequence[torch.Tensor]) -> Iterator[None]:
    """The cache's layers read and write ``tensors`` (keys, values of layer 0, then layer 1, ...) for a while: how
    the export sees them as inputs, not as constants of the traced graph."""
    saved = [(layer.keys, layer.values) for layer in cache.layers]
    try:
        for i, layer in enumerate(cache.layers):
            layer.keys, layer.values = tensors[2 * i], tensors[2 * i + 1]
        yield
    finally:
        for layer, (keys, values) in zip(cache.layers, saved):
            layer.keys, layer.values = keys, values


class _Step(nn.Module):
    """What is exported: a flat list of tensors [weights..., keys/values per layer..., idx [1, 1], positions [1],
    write_slots [1], key slots [1, L], logits_at [1]] -> logits [1, 1, V]. The model and cache are kept out of
    the module's attributes, so none of their tensors is lifted as a constant."""

    def __init__(self, model: nn.Module, cache: PagedKVCache, names: list[str]) -> None:
        super().__init__()
        self.parts = (model, cache, names)

    def forward(self, tensors: list[torch.Tensor]) -> torch.Tensor:
        model, cache, names = self.parts
        n, m = len(names), 2 * len(cache.layers)
        idx, positions, write_slots, keys, logits_at = tensors[n + m:]
        batch = Batch(positions, write_slots, 1, (DecodeGroup(1, keys, None),), (), logits_at)
        with _cache_tensors(cache, tensors[n:n + m]):
            return torch.func.functional_call(model, dict(zip(names, tensors[:n])), (idx,),
                                              {"cache": cache, "pos": batch})


class AotStep:
    """One model's batch-1 decode step, exported and compiled ahead of time; call it as the model:
    ``step(idx [1, 1], cache=cache, pos=batch)`` -> logits [1, 1, V]."""

    def __init__(self, model: nn.Module, cache: PagedKVCache, options: dict[str, Any]) -> None:
        self.names, self.weights = model_tensors(model)  # read every call, as they are: no copy in the library
        self.loader = _load_or_build(model, cache, self.names, self.weights, options)

    @staticmethod
    def fits(batch: Batch) -> bool:
        """Whether a forward is the step this compiles: one decode row, nothing else."""
        return (batch.num_tokens == 1 and batch.decode_rows == 1 and not batch.spans and len(batch.logits_at) == 1
                and len(batch.decode_groups) == 1 and batch.decode_groups[0].mask is None)

    def __call__(self, idx: torch.Tensor, *, cache: PagedKVCache, pos: Batch) -> torch.Tensor:
        kv = [t for layer in cache.layers for t in (layer.keys, layer.values)]
        group = pos.decode_groups[0]
        flat = [*self.weights, *kv, idx, pos.positions, pos.write_slots, group.keys, pos.logits_at]
        return self.loader.boxed_run(flat)[0]  # boxed_run empties the list it is given


def _example(cache: PagedKVCache) -> list[torch.Tensor]:
    """A one-row forward's tensors for tracing: token 0 at position 1, its key slots [block 1's 0, 1]."""
    b = cache.block_size
    slots = torch.tensor([[b, b + 1]]) if b > 1 else torch.tensor([[1, 2]])
    return [torch.zeros(1, 1, dtype=torch.long), torch.tensor([1]), slots[0, 1:].clone(), slots, torch.tensor([0])]


_LOADED: dict[str, Any] = {}  # key -> loaded library, shared by the models and engines of this process


@functools.cache
def _source_digest() -> str:
    """A digest of tinygpt's own code, which the traced step runs (part of the key)."""
    root = Path(__file__).resolve().parents[1]
    digest = hashlib.sha256()
    for file in sorted(root.rglob("*.py")):
        digest.update(str(file.relative_to(root)).encode() + b"\0" + file.read_bytes())
    return digest.hexdigest()


def library_key(model: nn.Module, cache: PagedKVCache, names: Sequence[str], weights: Sequence[torch.Tensor],
                options: dict[str, Any]) -> str:
    """What the compiled library depends on, hashed: everything but the weights' values."""
    from torch._inductor import cpu_vec_isa

    from ..fast import row_kernels

    kv = [layer.keys for layer in cache.layers for _ in "kv"]  # dtype and [*, Hkv, hd]: the slot count is dynamic
    described = [f"{name}:{t.dtype}:{tuple(t.shape)}:{t.stride()}" for name, t in zip(names, weights)]
    described += [f"kv:{t.dtype}:{tuple(t.shape[1:])}:{t.stride()[1:]}" for t in kv]
    return hashlib.sha256("\n".join([
        torch.__version__, str(cpu_vec_isa.pick_vec_isa()), repr(sorted(options.items())),
        f"row kernels: {row_kernels.ready()}", f"training: {model.training}",
        f"threads: {torch.get_num_threads()}",  # inductor writes the thread count into its parallel loops
        _source_digest(), *described]).encode()).hexdigest()[:32]


def _load_or_build(model: nn.Module, cache: PagedKVCache, names: list[str], weights: list[torch.Tensor],
                   options: dict[str, Any]) -> Any:
    """The compiled library for this model's step: loaded already, in inductor's cache folder, or else exported,
    compiled and saved there first (seconds to a minute)."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    key = library_key(model, cache, names, weights, options)
    if key not in _LOADED:
        path = Path(cache_dir()) / PACKAGE_FOLDER / f"{key}.pt2"
        if not path.exists():
            _build(model, cache, names, weights, options, path)
        _LOADED[key] = torch._inductor.aoti_load_package(str(path)).loader
    return _LOADED[key]


def _build(model: nn.Module, cache: PagedKVCache, names: list[str], weights: list[torch.Tensor],
           options: dict[str, Any], path: Path) -> None:
    """Export the step with example inputs of this cache's shapes, compile it, write the package atomically."""
    slots = 3 * cache.block_size  # a small pool stands in for the engine's: its size is dynamic
    kv = [torch.zeros(slots, *t.shape[1:], dtype=t.dtype) for layer in cache.layers for t in (layer.keys, layer.values)]
    example = _example(cache)
    tensors = [w.detach() for w in weights] + kv + example
    pool = torch.export.Dim("slots", min=2)  # the pool's size: any engine's cache
    keys = torch.export.Dim("keys", min=1)  # the row's key count, growing every token
    dims = [None] * len(weights) + [{0: pool}] * len(kv) + [None, None, None, {1: keys}, None]
    with torch.no_grad():
        program = torch.export.export(_Step(model, cache, names), (tensors,), dynamic_shapes=(dims,))
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".pt2", dir=path.parent)
    os.close(fd)
    try:
        torch._inductor.aoti_compile_and_package(program, package_path=tmp, inductor_configs=dict(options))
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
