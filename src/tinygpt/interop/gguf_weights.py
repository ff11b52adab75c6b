"""A GGUF file's weights read straight into the weight types of ``fast.weights``, never as a float32 model first.

``load_gguf(path, weights="bfloat16" | "int8")`` comes here. The linears of the blocks and the output head are read
from the file a few rows at a time (``CHUNK_BYTES`` of float32 at most), dequantised by gguf-py's own
``gguf.quants.dequantize`` and turned at once into their small type, so the float32 block weights never exist in
memory; the tensors are read with ``os.pread`` rather than through the file's memory map, so the file's pages do not
stay resident either. Embeddings, norms and biases stay float32 (as ``convert_weights`` leaves them).

- ``bfloat16`` (``Bf16Linear``): each value rounded once to bfloat16. An f16 value goes f16 -> float32 (exact) ->
  bfloat16 (round to nearest even), as torch's own f16 -> bf16 cast does; a bf16 file's values are kept as stored.
- ``int8`` (``Int8Linear``, one scale per output row): ``quantize_int8`` of the file's values. A q8_0 file's
  blocks (32 int8 values and one f16 scale each) are dequantised exactly and requantised per row: the weight each
  row gets is within half its row step (absmax / 254) of the file's value. Kept per row because torch's int8 kernel
  (``_weight_int8pack_mm``) takes one scale per row; the exact per-block products torch offers (the block
  dequantised into float32 per call, or two 4-bit kernels per block) are slower than float32 itself, as
  ``python -m benchmarks.gguf_load --products`` measures.

The rows of a linear are independent in both types (a bf16 value, a per-row scale), so reading by rows, llama's q/k
row permutation and the concatenations of ``_tinygpt_state`` give the same bytes as converting the float32 model.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Iterator

import numpy as np
import torch
from torch import nn

from ..fast.weights import Bf16Linear, Int8Linear, check_weight_type, quantize_int8

CHUNK_BYTES = 1 << 20  # float32 bytes dequantised at a time


def _raw_rows(fd: int, tensor: Any, start: int, stop: int) -> np.ndarray:
    """Rows ``start:stop`` of a 2-D GGUF tensor as its stored bytes, [stop - start, row_bytes] uint8."""
    rows = int(tensor.shape[-1])  # GGUF lists the fastest dimension first
    row_bytes = int(tensor.n_bytes) // rows
    data = os.pread(fd, (stop - start) * row_bytes, int(tensor.data_offset) + start * row_bytes)
    return np.frombuffer(data, dtype=np.uint8).reshape(stop - start, row_bytes)


def float_rows(fd: int, tensor: Any, rows: int | None = None) -> Iterator[tuple[int, np.ndarray]]:
    """(first row, float32 rows [n, cols]) of a 2-D GGUF tensor's first ``rows`` rows (all by default), a chunk at
    a time, as ``gguf.quants.dequantize`` gives them."""
    from gguf import GGMLQuantizationType, quants

    rows, cols = int(tensor.shape[-1]) if rows is None else rows, int(tensor.shape[0])
    step = max(1, CHUNK_BYTES // (4 * cols))
    kind = GGMLQuantizationType(tensor.tensor_type)
    view = {GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16}.get(kind)
    for start in range(0, rows, step):
        raw = _raw_rows(fd, tensor, start, min(rows, start + step))
        values = quants.dequantize(raw.view(view) if view is not None else raw, kind)
        yield start, np.array(values, dtype=np.float32).reshape(-1, cols)  # a copy: writable, the buffer freed


def read_float32(fd: int, tensor: Any, rows: int | None = None) -> torch.Tensor:
    """A GGUF tensor (any dimensions; of a 2-D one, the first ``rows`` rows) as float32, slowest dimension first."""
    shape = tuple(int(n) for n in reversed(tensor.shape.tolist()))
    if rows is not None:
        shape = (rows, *shape[1:])
    if len(shape) == 1:
        from gguf import GGMLQuantizationType, quants

        raw = os.pread(fd, int(tensor.n_bytes), int(tensor.data_offset))
        kind = GGMLQuantizationType(tensor.tensor_type)
        view = {GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16}.get(kind, np.uint8)
        return torch.from_numpy(np.array(quants.dequantize(np.frombuffer(raw, view), kind), np.float32))
    out = torch.empty(shape, dtype=torch.float32)
    for start, values in float_rows(fd, tensor, shape[0]):
        out[start:start + len(values)] = torch.from_numpy(values)
    return out


def read_small(fd: int, tensor: Any, weight_type: str, rows: int | None = None
               ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A linear's weight [out, in] (its first ``rows`` rows) in ``weight_type``'s stored form: (bf16 weight, None)
    or (int8 q, float32 per-row scale), built chunk by chunk (no float32 copy of the tensor)."""
    rows, cols = int(tensor.shape[-1]) if rows is None else rows, int(tensor.shape[0])
    if weight_type == "bfloat16":
        out = torch.empty(rows, cols, dtype=torch.bfloat16)
        for start, values in float_rows(fd, tensor, rows):
            out[start:start + len(values)] = torch.from_numpy(values)  # one rounding, float32 -> bf16
        return out, None
    q, scale = torch.empty(rows, cols, dtype=torch.int8), torch.empty(rows)
    for start, values in float_rows(fd, tensor, rows):
        q[start:start + len(values)], scale[start:start + len(values)] = quantize_int8(torch.from_numpy(values))
    return q, scale


def make_linear(weight_type: str, weight: torch.Tensor, scale: torch.Tensor | None,
                bias: torch.Tensor | None) -> nn.Module:
    """The ``fast.weights`` linear holding ``weight`` (bf16) or ``weight``/``scale`` (int8) as they are."""
    check_weight_type(weight_type)
    if weight_type == "bfloat16":
        return Bf16Linear(weight, bias)
    return Int8Linear.from_int8(weight, scale, bias)


_LINEAR_SUFFIXES = ("attn_qkv.weight", "attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight",
                    "ffn_up.weight", "ffn_gate.weight", "ffn_down.weight")


def is_linear_weight(name: str) -> bool:
    """Whether the GGUF tensor ``name`` is the weight of a block linear or of the output head."""
    return name == "output.weight" or (name.startswith("blk.") and name.endswith(_LINEAR_SUFFIXES))


def small_model_from_gguf(contents: Any, config: Any, weight_type: str,
                          to_state: Callable[[dict[str, torch.Tensor], Any, Any], dict[str, torch.Tensor]]) -> Any:
    """The ``GPTModel`` of a parsed, checked GGUF (``gguf.model_from_gguf``) with its block linears and head in
    ``weight_type`` (bfloat16 or int8), read as the module docstring says. ``to_state``: GGUF tensor names ->
    the model's state dict (``gguf.model_from_gguf`` passes its own, so that this module never imports it back)."""
    from ..model import GPTModel
    from ..quantize import block_linears, replace_linear

    check_weight_type(weight_type)
    if weight_type == "float32":
        raise ValueError("small_model_from_gguf builds bfloat16 or int8 linears; float32 is model_from_gguf's")
    vocab = config.vocab_size  # the file may hold more rows: a character vocabulary's extra tokens (gguf_vocab)
    fd = os.open(contents.path, os.O_RDONLY)
    try:
        # The head first, while little else is held: packing it for oneDNN briefly needs two copies of the largest
        # matrix. A tied head is read from token_embd's stored values, as convert_weights rounds the embedding.
        head_name = "token_embd.weight" if config.tie_weights else "output.weight"
        weight, scale = read_small(fd, contents.entries[head_name], weight_type, vocab)
        head = make_linear(weight_type, weight, scale, None)
        del weight
        stored: dict[str, torch.Tensor] = {"output.weight": torch.empty(0)} if not config.tie_weights else {}
        scales: dict[str, torch.Tensor] = dict(stored)
        for name, tensor in contents.entries.items():
            if name == "output.weight":
                continue
            if is_linear_weight(name):
                stored[name], scale = read_small(fd, tensor, weight_type)
                scales[name] = scale if scale is not None else torch.empty(0)
            else:
                rows = vocab if name == "token_embd.weight" else None
                stored[name] = scales[name] = read_float32(fd, tensor, rows)
    finally:
        os.close(fd)
    # The same renaming, permutation and concatenation as the float32 load, once on the stored weights and (int8)
    # once on their per-row scales, which follow the rows.
    state = to_state(stored, config, contents.path)
    if weight_type == "int8":
        scales = to_state(scales, config, contents.path)
    state.pop("out_head.weight", None)  # a placeholder: the head is built
    with torch.device("meta"):
        model = GPTModel(config)
    for module in block_linears(model):
        weight = state.pop(f"{module}.weight")
        bias = state.pop(f"{module}.bias", None)
        replace_linear(model, module, make_linear(weight_type, weight, scales.get(f"{module}.weight"), bias))
        del weight  # a bf16 weight's unpacked copy is freed as soon as oneDNN has packed it
    model.out_head = head  # its own weights, tied or not (as convert_weights gives a tied head)
    model.load_state_dict(state, strict=False, assign=True)
    still_meta = [name for name, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if still_meta:
        raise RuntimeError(f"{contents.path}: the direct load left tensors on the meta device: {still_meta}")
    model.weight_type = weight_type
    return model.eval()
