"""NF4: the same bytes and scales as bitsandbytes' NF4, and the dequantised weight within NF4's error."""

from __future__ import annotations

import pytest
import torch

from tinygpt.quantize import NF4_LEVELS, NF4Linear, dequantize_nf4, quantize_nf4


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
