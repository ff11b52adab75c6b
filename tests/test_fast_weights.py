"""bfloat16 and int8 weight types for inference: each product equals a float64 reference computed from the stored
bytes (within one bfloat16 rounding of the result), the logits stay close to float32's, the engine's random
schedules still give every row what it gives alone, and a converted model refuses to train."""

from __future__ import annotations

import copy
import random

import pytest
import torch

from inference_support import VARIANTS, variant_model
from test_inference_engine import _alone, _schedule
from tinygpt import generate
from tinygpt.fast.weights import Bf16Linear, Int8Linear, convert_weights, onednn_bf16, plain_weights, quantize_int8

def _inputs(seed: int = 0, rows: int = 5, d_in: int = 48, d_out: int = 40):
    g = torch.Generator().manual_seed(seed)
    x, w = torch.randn(rows, d_in, generator=g), torch.randn(d_out, d_in, generator=g) * 0.1
    return x, w, torch.randn(d_out, generator=g)


def _check_product(layer, x: torch.Tensor, exact: torch.Tensor, bias: torch.Tensor) -> None:
    """The layer's product is the exact product of the bytes it stores (float64 here), rounded once to bfloat16;
    on this small shape float32 accumulation loses nothing, so the two are equal bit for bit; the bias is then
    added in float32."""
    product = layer.product(x.to(torch.bfloat16))
    assert torch.equal(product, exact.to(torch.bfloat16))
    assert torch.equal(layer(x), product.float() + bias)


def test_bf16_product_equals_the_stored_bytes_reference():
    x, w, b = _inputs()
    layer = Bf16Linear(w, b)
    exact = x.to(torch.bfloat16).double() @ w.to(torch.bfloat16).double().T  # [5, 40]
    _check_product(layer, x, exact, b)
    assert layer.packed == onednn_bf16()


@pytest.mark.parametrize("d_in", [48, 24])  # torch's int8 kernel (widths that are multiples of 16); the plain route
def test_int8_product_equals_the_stored_bytes_reference(d_in):
    x, w, b = _inputs(1, d_in=d_in)
    layer = Int8Linear(w, b)
    q, scale = quantize_int8(w)
    assert torch.equal(layer.qweight, q) and q.dtype == torch.int8 and int(q.abs().max()) == 127
    assert bool(((q.float() * scale[:, None] - w).abs() <= scale[:, None] / 2 + 1e-7).all())  # round to nearest
    # the kernel applies the scale as bf16 (the dtype of its input)
    exact = (x.to(torch.bfloat16).double() @ q.double().T) * scale.to(torch.bfloat16).double()
    _check_product(layer, x, exact, b)


def test_int8_zero_channel_and_leading_dimensions():
    w = torch.zeros(3, 32)
    w[1] = torch.arange(32.0)
    layer = Int8Linear(w)
    assert layer.scale[0] == 1 and layer(torch.ones(2, 4, 32)).shape == (2, 4, 3)


@pytest.mark.parametrize("weight_type,bound", [("bfloat16", 0.02), ("int8", 0.03)])
@pytest.mark.parametrize("variant", VARIANTS)
def test_logits_stay_close_to_float32(variant, weight_type, bound):
    model = variant_model(variant, torch.float32)
    idx = torch.randint(0, 53, (2, 30), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = model(idx)
        converted = copy.deepcopy(model)
        assert convert_weights(converted, weight_type) == 2 * 4 + 1  # qkv, out_proj, two FFN linears; the head
        got = converted(idx)
    scale = float(ref.abs().max())
    assert float((got - ref).abs().max()) <= bound * scale


@pytest.mark.parametrize("weight_type", ["bfloat16", "int8"])
def test_engine_schedules_with_each_weight_type(weight_type):
    model = variant_model("llama", torch.float32)
    convert_weights(model, weight_type)
    for seed in range(2):
        engine, rows = _schedule(model, random.Random(seed))
        assert engine.blocks.all_free()
        for row in rows:
            if row.finish_reason != "cancelled":
                assert row.tokens[row.prompt_len:] == _alone(model, row)


def test_a_converted_model_is_for_inference_only():
    model = variant_model("gpt2", torch.float32)
    assert convert_weights(model, "float32") == 0
    convert_weights(model, "int8")
    assert generate(model, [[1, 2]], max_new_tokens=3).lengths == [3]
    with pytest.raises(RuntimeError, match="inference only"):
        model(torch.zeros(1, 4, dtype=torch.long), targets=torch.zeros(1, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="use one of float32, bfloat16, int8"):
        convert_weights(model, "fp8")


def test_plain_weights_lays_bf16_weights_out_plain_with_the_same_values():
    model = variant_model("gpt2", torch.float32)
    rounded = model.trf_blocks[0].ff.layers[0].weight.detach().to(torch.bfloat16)
    convert_weights(model, "bfloat16")
    idx = torch.randint(0, 53, (1, 12), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        before = model(idx)
        assert plain_weights(model) == (9 if onednn_bf16() else 0)
        assert plain_weights(model) == 0  # nothing left packed
        layer = model.trf_blocks[0].ff.layers[0]
        assert not layer.packed and layer.weight.layout == torch.strided and torch.equal(layer.weight, rounded)
        after = model(idx)
    assert torch.allclose(after, before, atol=1e-2 * float(before.abs().max()))  # same bf16 products, other kernel
