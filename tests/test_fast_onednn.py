"""tinygpt.fast.onednn: the linear layers' product, oneDNN where it applies, always what F.linear computes."""

import itertools

import pytest
import torch

from tinygpt import fast
from tinygpt.fast import Linear, linear, onednn


def _spy_kernel(monkeypatch) -> list[tuple[int, ...]]:
    """Replace the oneDNN kernel by ``F.linear`` that records each call's weight shape (so machines without oneDNN
    test the route choice too); returns the list it fills."""
    calls: list[tuple[int, ...]] = []

    def spy(x, weight, bias, *attrs):
        calls.append(tuple(weight.shape))
        return torch.nn.functional.linear(x, weight, bias)

    monkeypatch.setattr(onednn, "KERNEL", spy)
    return calls


@pytest.mark.parametrize("shape", [(1, 1), (2, 3), (4, 32), (3, 100)])  # 1 row (decoding) .. 300 rows
@pytest.mark.parametrize("with_bias", [True, False])
def test_linear_equals_f_linear(shape, with_bias):
    torch.manual_seed(0)
    x = torch.randn(*shape, 40)
    weight = torch.randn(97, 40)  # an odd width, like V = 50257
    bias = torch.randn(97) if with_bias else None
    with torch.no_grad():
        got = linear(x, weight, bias)
    assert got.shape == (*shape, 97) and got.dtype == torch.float32
    torch.testing.assert_close(got, torch.nn.functional.linear(x, weight, bias), rtol=1e-6, atol=1e-5)


def test_linear_takes_any_layout():
    # Weights that are views (a transpose, as one might assign from an [in, out] checkpoint; every other row),
    # strided and broadcast biases (oneDNN alone gets these wrong: linear must hand it a contiguous one), inputs that
    # are transposed, sliced or broadcast, and no rows at all.
    torch.manual_seed(0)
    weight_t, weight_2, x = torch.randn(24, 50), torch.randn(100, 24)[::2], torch.randn(6, 24)
    weights = {"transposed": weight_t.t(), "every other row": weight_2}
    biases = {"none": None, "strided": torch.randn(100)[::2], "broadcast": torch.randn(1).expand(50)}
    inputs = {"transposed": torch.randn(24, 3).t(), "sliced": torch.randn(12, 24)[::2],
              "broadcast": x[:1].expand(4, 24), "3d sliced": torch.randn(2, 6, 48)[:, ::2, ::2]}
    for (wn, w), (bn, b), (xn, xi) in itertools.product(weights.items(), biases.items(), inputs.items()):
        with torch.no_grad():
            got = linear(xi, w, b)
        torch.testing.assert_close(got, torch.nn.functional.linear(xi, w, b), rtol=1e-6, atol=1e-5,
                                   msg=lambda m: f"weight {wn}, bias {bn}, input {xn}: {m}")
    with torch.no_grad():
        assert linear(torch.randn(0, 24), weight_2).shape == (0, 50)


def test_linear_takes_the_onednn_path_only_for_inference_in_float32(monkeypatch):
    # The oneDNN product must be the one that runs for inference in float32, and never where it would change what
    # is computed or seen: autograd, float64, autocast (bf16 products), a FLOP counter, vmap. A spy stands in for
    # the kernel, so the choice is tested on machines without oneDNN too.
    from torch.utils.flop_counter import FlopCounterMode

    calls = []

    def spy(x, weight, bias, *attrs):
        calls.append(attrs)
        return torch.nn.functional.linear(x, weight, bias)

    monkeypatch.setattr(onednn, "KERNEL", spy)
    monkeypatch.setattr(onednn, "INFERENCE_MIN_WEIGHT", 0)  # the size rule has its own test
    module = Linear(16, 30)
    with torch.no_grad():
        module(torch.randn(1, 1, 16))
        assert calls == [("none", [], "")]
        module.double()(torch.randn(1, 1, 16, dtype=torch.float64))
        module.float()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert module(torch.randn(2, 16)).dtype == torch.bfloat16
        with FlopCounterMode(display=False) as counter:
            module(torch.randn(2, 16))
        assert counter.get_total_flops() == 2 * 2 * 16 * 30
        assert torch.func.vmap(module)(torch.randn(3, 2, 16)).shape == (3, 2, 30)  # vmap: plain F.linear
    assert len(calls) == 1
    with torch.inference_mode():
        module(torch.randn(300, 16))
    assert len(calls) == 2
    module(torch.randn(1, 1, 16)).sum().backward()  # autograd: the plain F.linear, gradients as usual
    assert len(calls) == 2 and module.weight.grad is not None
    with torch.no_grad(), fast.disabled("onednn"):  # switched off: F.linear
        assert module(torch.randn(4, 16)).shape == (4, 30)
    assert len(calls) == 2
    monkeypatch.setattr(onednn, "KERNEL", None)  # no oneDNN in this torch: F.linear
    with torch.no_grad():
        assert module(torch.randn(4, 16)).shape == (4, 30)
    assert len(calls) == 2


@pytest.mark.parametrize("with_bias", [True, False])
def test_training_through_a_frozen_weight_takes_onednn_both_ways_with_f_linear_gradients(monkeypatch, with_bias):
    # LoRA's base: the weight and bias are frozen, the input needs its gradient. The forward and the backward's
    # dL/dx = dL/dy W run on the kernel (a spy here, so machines without oneDNN test the choice too).
    calls = _spy_kernel(monkeypatch)
    module = Linear(16, 30, bias=with_bias).requires_grad_(False)
    torch.manual_seed(0)
    x = torch.randn(2, 5, 16, requires_grad=True)
    y = module(x)
    assert type(y.grad_fn).__name__.startswith("_FrozenLinear")
    grad_out = torch.randn(2, 5, 30)
    y.backward(grad_out)
    assert calls == [(30, 16), (16, 30)]  # the forward, then the backward's product with the transposed weight
    x_plain = x.detach().clone().requires_grad_()
    torch.nn.functional.linear(x_plain, module.weight, module.bias).backward(grad_out)
    torch.testing.assert_close(x.grad, x_plain.grad)
    torch.testing.assert_close(y, torch.nn.functional.linear(x, module.weight, module.bias))
    module.weight.requires_grad_(True)  # a trained weight: the plain F.linear and its weight gradient
    module(x).sum().backward()
    assert len(calls) == 2 and module.weight.grad is not None


@pytest.mark.skipif(not onednn.available(), reason="this torch has no oneDNN linear")
def test_the_frozen_route_on_the_real_kernel_gives_f_linear_gradients():
    torch.manual_seed(1)
    weight, bias = torch.randn(97, 40), torch.randn(97)
    for w in (weight, torch.randn(40, 97).t()):  # a plain weight and a transposed view
        x = torch.randn(3, 7, 40, requires_grad=True)
        grad_out = torch.randn(3, 7, 97)
        linear(x, w, bias).backward(grad_out)
        with fast.disabled("onednn"):
            x_plain = x.detach().clone().requires_grad_()
            linear(x_plain, w, bias).backward(grad_out)
        torch.testing.assert_close(x.grad, x_plain.grad, rtol=1e-5, atol=1e-5)


def test_onednn_kernel_is_used_only_where_it_checks_out(monkeypatch):
    # The kernel is private to torch: it is taken only on x86-64, and only if a small integer product (exact in any
    # summation order) comes out as F.linear's; a kernel that raises or computes something else is never used.
    monkeypatch.setattr(onednn.torch.backends.mkldnn, "is_available", lambda: True)
    monkeypatch.setattr(onednn.platform, "machine", lambda: "aarch64")
    assert onednn._find_onednn_linear() is None
    monkeypatch.setattr(onednn.platform, "machine", lambda: "x86_64")

    def wrong(x, weight, bias, *attrs):
        return torch.nn.functional.linear(x, weight) + 1.0

    def raises(*args):
        raise RuntimeError("no such kernel")

    def right(x, weight, bias, *attrs):
        return torch.nn.functional.linear(x, weight, bias)

    for kernel, usable in ((wrong, False), (raises, False), (right, True)):
        monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", kernel)
        assert (onednn._find_onednn_linear() is kernel) == usable


def _plain_grads(x, weight, bias, grad_out):
    """(dL/dx, dL/dW, dL/db) of autograd's own route for F.linear."""
    leaves = [t.detach().clone().requires_grad_(t.requires_grad) for t in (x, weight, bias) if t is not None]
    x_p, w_p, b_p = leaves[0], leaves[1], leaves[2] if bias is not None else None
    torch.nn.functional.linear(x_p, w_p, b_p).backward(grad_out)
    return x_p.grad, w_p.grad, None if b_p is None else b_p.grad


@pytest.mark.parametrize("with_bias", [True, False])
def test_the_trained_route_formulas_equal_autograd_in_float64(with_bias):
    # _TrainedLinear's three products, with F.linear as the product: the formulas alone, in float64 (1e-10).
    torch.manual_seed(2)
    x = torch.randn(3, 7, 24, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(40, 24, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(40, dtype=torch.float64, requires_grad=True) if with_bias else None
    grad_out = torch.randn(3, 7, 40, dtype=torch.float64)
    y = onednn._TrainedLinear.apply(x, weight, bias, torch.nn.functional.linear)
    y.backward(grad_out)
    expected = _plain_grads(x, weight, bias, grad_out)
    torch.testing.assert_close(y, torch.nn.functional.linear(x, weight, bias), rtol=0, atol=1e-10)
    for got, want in zip((x.grad, weight.grad, None if bias is None else bias.grad), expected):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-10)


@pytest.mark.skipif(not onednn.available(), reason="this torch has no oneDNN linear")
@pytest.mark.parametrize("with_bias", [True, False])
def test_the_trained_route_on_the_real_kernel_gives_f_linear_gradients(monkeypatch, with_bias):
    # float32 on oneDNN itself (the rule's size bound lowered so a small product takes the route): 1e-5.
    monkeypatch.setattr(onednn, "TRAINED_MIN_MACS", 0)
    torch.manual_seed(3)
    for w in (torch.randn(97, 40), torch.randn(40, 97).t()):  # a plain weight and a transposed view
        weight = w.requires_grad_()
        bias = torch.randn(97, requires_grad=True) if with_bias else None
        for x in (torch.randn(3, 7, 40, requires_grad=True), torch.randn(5, 40)):  # the input trains or not
            grad_out = torch.randn(*x.shape[:-1], 97)
            y = linear(x, weight, bias)
            assert type(y.grad_fn).__name__.startswith("_TrainedLinear")
            y.backward(grad_out)
            expected = _plain_grads(x, weight, bias, grad_out)
            got = (x.grad, weight.grad, None if bias is None else bias.grad)
            for name, g, want in zip(("x", "weight", "bias"), got, expected):
                if want is None:
                    assert g is None, name
                else:
                    torch.testing.assert_close(g, want, rtol=1e-5, atol=1e-5, msg=lambda m: f"dL/d{name}: {m}")
            weight.grad = None
            if bias is not None:
                bias.grad = None


def test_the_trained_route_is_taken_only_above_the_rule_and_when_switched_on(monkeypatch):
    calls = _spy_kernel(monkeypatch)
    module = Linear(16, 30)
    x = torch.randn(4, 16, requires_grad=True)
    module(x).sum().backward()  # 4 * 16 * 30 multiply-adds, below the rule: F.linear
    assert calls == []
    monkeypatch.setattr(onednn, "TRAINED_MIN_MACS", 4 * 16 * 30)
    module(x).sum().backward()  # at the rule: forward, dL/dx (transposed weight), dL/dW ([in, N] as the "weight")
    assert calls == [(30, 16), (16, 30), (16, 4)]
    for switch in (fast.disabled("train"), fast.disabled("onednn"), fast.disabled()):
        with switch:
            assert type(module(x).grad_fn).__name__ == "AddmmBackward0"
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert module(x).dtype == torch.bfloat16
    assert len(calls) == 3


def test_a_model_trained_on_the_route_gets_the_plain_gradients(monkeypatch):
    # Every linear of a small GPT on the route (the rule lowered to 0): the loss and every parameter's gradient
    # equal those of the plain model (``fast.disabled()``), float32 1e-5.
    from tinygpt import GPTModel, get_config

    monkeypatch.setattr(onednn, "TRAINED_MIN_MACS", 0)
    torch.manual_seed(4)
    model = GPTModel(get_config("tiny", vocab_size=50, emb_dim=32, n_layers=2))
    idx = torch.randint(0, 50, (2, 16))
    targets = torch.randint(0, 50, (2, 16))

    def grads():
        model.zero_grad(set_to_none=True)
        loss = model(idx, targets=targets)
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    loss, got = grads()
    with fast.disabled():
        loss_plain, want = grads()
    torch.testing.assert_close(loss, loss_plain, rtol=1e-5, atol=1e-5)
    assert got.keys() == want.keys()
    for name in got:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")


def test_inference_takes_onednn_only_from_the_weight_size_rule(monkeypatch):
    # A oneDNN call's fixed cost loses on small weights (``INFERENCE_MIN_WEIGHT``): those run on F.linear, at every
    # row count, and the result is F.linear's either way.
    calls = _spy_kernel(monkeypatch)
    monkeypatch.setattr(onednn, "INFERENCE_MIN_WEIGHT", 16 * 30)
    small, large = Linear(16, 29), Linear(16, 30)
    with torch.inference_mode():
        for rows in (1, 64):
            x = torch.randn(rows, 16)
            assert torch.equal(small(x), torch.nn.functional.linear(x, small.weight, small.bias))
            large(x)
    assert calls == [(30, 16), (30, 16)]
    with torch.inference_mode():  # the training loss's caller waives the rule
        assert onednn.applies(torch.randn(1, 16), small.weight, min_weight=0)
