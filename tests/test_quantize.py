"""NF4: the same bytes and scales as bitsandbytes' NF4, and the dequantised weight within NF4's error; double
quantisation: bitsandbytes' dynamic map, scales and mean, and the nearest code."""

from __future__ import annotations

import pytest
import torch

from tinygpt.quantize import (NF4_LEVELS, NF4Linear, block_linears, dequantize_absmax, dequantize_nf4,
                              dynamic_levels, quantize_absmax, quantize_linears, quantize_nf4)


@pytest.mark.parametrize("shape", [(96, 32), (7, 13), (3, 64)])  # whole blocks, a short last block, an odd count
def test_bytes_equal_bitsandbytes(shape):
    bnb = pytest.importorskip("bitsandbytes.functional")
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(shape, generator=g) * 0.05
    weight.view(-1)[5] = 0.0
    # Values exactly on a midpoint between two levels (times the block's absmax): both must round the same way.
    weight.view(-1)[1] = weight.view(-1)[:64].abs().max() * (NF4_LEVELS[9] + NF4_LEVELS[10]) / 2
    packed, absmax = quantize_nf4(weight)
    ref_packed, state = bnb.quantize_4bit(weight, blocksize=64, quant_type="nf4")
    assert torch.equal(packed, ref_packed.reshape(-1))
    assert torch.equal(absmax, state.absmax)
    # bitsandbytes' reference dequantisation (its CPU kernel assumes another layout for some shapes).
    from bitsandbytes.backends.default.ops import _dequantize_4bit_compute
    from bitsandbytes.backends.utils import _get_4bit_code

    want = _dequantize_4bit_compute(ref_packed.reshape(-1), state.absmax, _get_4bit_code("nf4", "cpu"), 64,
                                    weight.shape, torch.float32)
    assert torch.equal(dequantize_nf4(packed, absmax, weight.shape), want)


def test_dequantised_error_is_within_half_a_level_gap():
    weight = torch.randn(64, 64) * 0.02
    packed, absmax = quantize_nf4(weight)
    assert packed.dtype == torch.uint8 and packed.numel() == 64 * 64 // 2 and absmax.numel() == 64
    back = dequantize_nf4(packed, absmax, weight.shape)
    widest_gap = max(b - a for a, b in zip(NF4_LEVELS, NF4_LEVELS[1:]))
    err = (back - weight).abs().view(64, 64) / absmax.view(64, 1)  # each row is one block here
    assert float(err.max()) <= widest_gap / 2 + 1e-6
    assert torch.equal(back.abs().view(64, 64).amax(dim=1), absmax)  # each block's extreme value is exact


def test_nf4_linear_is_the_product_with_the_dequantised_weight():
    linear = torch.nn.Linear(32, 48)
    q = NF4Linear.from_linear(linear)
    x = torch.randn(5, 32)
    torch.testing.assert_close(q(x), x @ q.dequantized_weight().T + linear.bias, rtol=1e-5, atol=1e-6)
    assert not any(p.requires_grad for p in q.parameters())
    assert sum(b.numel() * b.element_size() for b in q.buffers()) < linear.weight.numel() * 4 / 7


def test_nf4_linear_gradient_is_the_plain_products_and_keeps_no_float_weight():
    linear = torch.nn.Linear(64, 32)
    q = NF4Linear.from_linear(linear)
    x = torch.randn(3, 5, 64, requires_grad=True)
    plain = torch.nn.functional.linear(x, q.dequantized_weight(), linear.bias)
    (want,) = torch.autograd.grad(plain.square().sum(), x)
    out = q(x)
    torch.testing.assert_close(out, plain, rtol=0, atol=1e-6)
    # what autograd keeps from the forward: no [32, 64] float tensor (the weight is dequantised again)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.shape) or t, lambda t: t):
        out = q(x)
    assert (32, 64) not in [tuple(s) for s in saved]
    (got,) = torch.autograd.grad(out.square().sum(), x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_dynamic_levels_are_bitsandbytes_map():
    bnb = pytest.importorskip("bitsandbytes.functional")
    levels = dynamic_levels()
    assert levels.shape == (256,) and bool((levels[1:] > levels[:-1]).all())
    assert torch.equal(levels, bnb.create_dynamic_map(signed=True))


def _absmax(blocks: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return quantize_nf4(torch.randn(blocks * 64, generator=g) * 0.05)[1]


@pytest.mark.parametrize("blocks", [512, 300])  # whole 256-blocks of absmax values, a short last one
def test_double_quant_codes_are_the_nearest_level(blocks):
    absmax = _absmax(blocks)
    codes, scales, offset = quantize_absmax(absmax)
    assert codes.dtype == torch.uint8 and codes.shape == absmax.shape and scales.shape == (-(-blocks // 256),)
    assert torch.equal(offset, absmax.mean())
    scaled = torch.cat([block / scale for block, scale in zip((absmax - offset).split(256), scales)])
    distance = (dynamic_levels()[:, None] - scaled).abs()  # [256, n]
    torch.testing.assert_close(distance[codes.long(), torch.arange(blocks)], distance.min(dim=0).values,
                               rtol=0, atol=0)
    back = dequantize_absmax(codes, scales, offset)
    gap = (dynamic_levels()[1:] - dynamic_levels()[:-1]).max()
    assert float((back - absmax).abs().max()) <= float(gap / 2 * scales.max()) + 1e-7


def test_double_quant_matches_bitsandbytes_compressed_statistics():
    bnb = pytest.importorskip("bitsandbytes.functional")
    g = torch.Generator().manual_seed(2)
    weight = torch.randn(96, 640, generator=g) * 0.05  # 960 blocks of 64: four absmax blocks, the last short
    packed, absmax = quantize_nf4(weight)
    ref_packed, state = bnb.quantize_4bit(weight, blocksize=64, quant_type="nf4", compress_statistics=True)
    codes, scales, offset = quantize_absmax(absmax)
    assert torch.equal(packed, ref_packed.reshape(-1))
    assert torch.equal(offset, state.offset) and torch.equal(scales, state.state2.absmax)
    assert state.state2.blocksize == 256 and torch.equal(state.state2.code, dynamic_levels())
    # bitsandbytes' CPU kernel searches the map approximately: where its code differs, it is a neighbour of ours,
    # and ours is strictly nearer (bitsandbytes' own pure-torch kernel takes the nearest, as here).
    differ = codes != state.absmax
    assert int(differ.sum()) <= codes.numel() // 100
    assert int((codes.int() - state.absmax.int()).abs().max()) <= 1
    scaled = (absmax - offset) / scales.repeat_interleave(256)[: absmax.numel()]
    levels = dynamic_levels()
    assert bool(((levels[codes.long()] - scaled).abs() < (levels[state.absmax.long()] - scaled).abs())[differ].all())
    # decoding our codes with bitsandbytes' dequantisation gives our absmax back
    torch.testing.assert_close(dequantize_absmax(codes, scales, offset),
                               bnb.dequantize_blockwise(codes, state.state2) + state.offset, rtol=0, atol=1e-7)


def test_double_quant_linear_is_smaller_and_within_the_scales_error():
    linear = torch.nn.Linear(256, 128)
    plain, dq = NF4Linear.from_linear(linear), NF4Linear.from_linear(linear, double_quant=True)
    assert torch.equal(dq.weight_nf4, plain.weight_nf4)
    size = lambda m: sum(b.numel() * b.element_size() for b in m.buffers())  # noqa: E731
    blocks = 256 * 128 // 64
    assert size(plain) - size(dq) == blocks * 4 - (blocks + 4 * -(-blocks // 256) + 4)  # float32 absmax -> 8 bits
    codes, scales, offset = quantize_absmax(plain.weight_absmax)
    assert torch.equal(dq.absmax(), dequantize_absmax(codes, scales, offset))
    x = torch.randn(4, 256)
    torch.testing.assert_close(dq(x), x @ dq.dequantized_weight().T + linear.bias, rtol=1e-5, atol=1e-6)
    assert "double-quantised" in repr(dq)


@pytest.mark.parametrize("double_quant", [False, True])
def test_quantize_linears_replaces_only_the_block_linears(double_quant):
    from tinygpt import GPTModel, get_config

    torch.manual_seed(0)
    model = GPTModel(get_config("tiny")).eval()
    names, head = block_linears(model), model.out_head.weight
    assert names and all(n.startswith("trf_blocks.") for n in names)
    assert quantize_linears(model, double_quant=double_quant) == len(names)
    assert all(isinstance(model.get_submodule(n), NF4Linear) for n in names)
    assert not any(isinstance(m, torch.nn.Linear) for m in model.trf_blocks.modules())
    assert model.out_head.weight is head  # the head (and the embeddings) stay float
    assert all(m.double_quant == double_quant for m in model.modules() if isinstance(m, NF4Linear))
