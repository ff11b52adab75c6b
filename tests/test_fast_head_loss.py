import contextlib

import pytest
import torch
import torch.nn.functional as F

from tinygpt import GPTConfig, GPTModel, fast
from tinygpt.fast import head_loss
from tinygpt.fast.head_loss import head_cross_entropy


def _plain_and_fused(h, weight, targets):
    """(loss, dL/dh, dL/dW) by F.cross_entropy over materialised logits, and by head_cross_entropy."""
    results = []
    for fused in (False, True):
        hh, ww = h.clone().requires_grad_(), weight.clone().requires_grad_()
        if fused:
            loss = head_cross_entropy(hh, ww, targets)
        else:
            loss = F.cross_entropy((hh @ ww.t()).flatten(0, -2), targets.flatten())
        loss.backward()
        results.append((loss.detach(), hh.grad, ww.grad))
    return results


@pytest.mark.parametrize("dtype,tol,onednn", [(torch.float64, 1e-12, False), (torch.float32, 2e-6, False),
                                              (torch.float32, 2e-6, True)])  # float32 logits by torch.mm or oneDNN
@pytest.mark.parametrize("chunk_logits", [1 << 24, 3 * 53])  # one chunk; chunks of 3 rows (the last one short)
def test_fused_loss_and_gradients_equal_cross_entropy_over_logits(monkeypatch, dtype, tol, onednn, chunk_logits):
    if onednn and not fast.onednn.available():
        pytest.skip("this torch has no oneDNN linear")
    monkeypatch.setattr(head_loss, "_CHUNK_LOGITS", chunk_logits)
    torch.manual_seed(0)
    h = torch.randn(2, 7, 16, dtype=dtype)
    weight = torch.randn(53, 16, dtype=dtype)
    targets = torch.randint(0, 53, (2, 7))
    targets[0, :3] = -100  # ignored positions: no loss, no gradient
    with contextlib.nullcontext() if onednn else fast.disabled("onednn"):
        (plain, gh, gw), (fused, fh, fw) = _plain_and_fused(h, weight, targets)
    torch.testing.assert_close(fused, plain, rtol=tol, atol=tol)
    torch.testing.assert_close(fh, gh, rtol=tol, atol=tol)
    torch.testing.assert_close(fw, gw, rtol=tol, atol=tol)
    assert fh[0, :3].abs().max() == 0


def test_only_the_rows_with_a_target_reach_the_head(monkeypatch):
    # SFT ignores every prompt token: those rows must cost no head product (the loss and gradients stay the plain ones).
    seen = []
    apply = head_loss._HeadCrossEntropy.apply
    monkeypatch.setattr(head_loss._HeadCrossEntropy, "apply",
                        lambda h, *rest: seen.append(h.shape[0]) or apply(h, *rest))
    torch.manual_seed(2)
    h, weight = torch.randn(3, 8, 16, dtype=torch.float64), torch.randn(29, 16, dtype=torch.float64)
    targets = torch.randint(0, 29, (3, 8))
    targets[:, :5] = -100  # a prompt of 5 tokens in each row
    targets[2, 6] = -100
    (plain, gh, gw), (fused, fh, fw) = _plain_and_fused(h, weight, targets)
    assert seen == [8]  # 3 x 3 answer tokens, one of them ignored too
    torch.testing.assert_close(fused, plain, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(fh, gh, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(fw, gw, rtol=1e-12, atol=1e-12)
    assert fh[:, :5].abs().max() == 0 and fh[2, 6].abs().max() == 0
    seen.clear()
    head_cross_entropy(h, weight, torch.randint(0, 29, (3, 8)))  # nothing ignored: no copy, every row
    assert seen == [24]


def test_a_target_with_underflowing_probability_keeps_an_exact_finite_loss():
    # Logits ~ +-1000: softmax gives exactly 0 to most targets in float32, so -log(p) alone would be inf.
    torch.manual_seed(1)
    h = torch.randn(5, 8) * 100
    weight = torch.randn(11, 8) * 10
    targets = torch.arange(5)
    (plain, gh, gw), (fused, fh, fw) = _plain_and_fused(h, weight, targets)
    assert torch.isfinite(fused) and plain > 100
    torch.testing.assert_close(fused, plain, rtol=1e-6, atol=1e-3)
    torch.testing.assert_close(fh, gh)
    torch.testing.assert_close(fw, gw)


def test_all_ignored_is_nan_like_cross_entropy_and_no_grad_computes_the_loss_only():
    h, weight = torch.randn(4, 6), torch.randn(9, 6)
    ignored = torch.full((4,), -100)
    assert torch.isnan(head_cross_entropy(h, weight, ignored)) and torch.isnan(F.cross_entropy(h @ weight.t(), ignored))
    targets = torch.tensor([1, 2, 3, 4])
    with torch.no_grad():
        torch.testing.assert_close(head_cross_entropy(h, weight, targets), F.cross_entropy(h @ weight.t(), targets))


def test_bad_targets_are_clear_errors():
    h, weight = torch.randn(2, 3, 6), torch.randn(9, 6)
    with pytest.raises(ValueError, match="0 <= id < vocab_size=9"):
        head_cross_entropy(h, weight, torch.full((2, 3), 9))
    with pytest.raises(ValueError, match="out of range"):
        head_cross_entropy(h, weight, torch.full((2, 3), -1))
    with pytest.raises(ValueError, match="shape"):
        head_cross_entropy(h, weight, torch.zeros(3, 2, dtype=torch.long))
    with pytest.raises(TypeError, match="integer"):
        head_cross_entropy(h, weight, torch.zeros(2, 3))


@pytest.mark.parametrize("tie", [True, False])
def test_model_forward_with_targets_is_the_loss_over_its_logits(tie):
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=97, context_length=12, emb_dim=32, n_heads=4, n_layers=2, tie_weights=tie)
    model = GPTModel(config)
    idx, targets = torch.randint(0, 97, (3, 12)), torch.randint(0, 97, (3, 12))
    loss = model(idx, targets=targets)
    loss.backward()
    fused_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    plain = F.cross_entropy(model(idx).flatten(0, 1), targets.flatten())
    plain.backward()
    torch.testing.assert_close(loss, plain)
    for name, p in model.named_parameters():
        torch.testing.assert_close(fused_grads[name], p.grad, rtol=1e-5, atol=1e-7, msg=name)
    with pytest.raises(ValueError, match="last_only"):
        model(idx, targets=targets, last_only=True)
    with pytest.raises(ValueError, match=r"targets must have shape \[3, 12\]"):
        model(idx, targets=targets[:, :5])
    with pytest.raises(TypeError, match="torch.Tensor"):
        model(idx, targets=targets.tolist())


def test_under_autocast_it_is_the_plain_expression():
    torch.manual_seed(0)
    h, weight, targets = torch.randn(4, 16), torch.randn(33, 16), torch.randint(0, 33, (4,))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fused = head_cross_entropy(h, weight, targets)
        plain = F.cross_entropy(F.linear(h, weight).float(), targets)
    assert fused.dtype == torch.float32
    torch.testing.assert_close(fused, plain)


def test_under_torch_compile_it_is_the_plain_expression():
    # Traced by dynamo (the "eager" backend: no C++ compiler needed), the loss is the plain logits expression.
    torch.manual_seed(0)
    h, weight, targets = torch.randn(2, 3, 8), torch.randn(17, 8), torch.randint(0, 17, (2, 3))
    targets[0, 0] = -100
    compiled = torch.compile(head_cross_entropy, backend="eager", fullgraph=True)
    torch.testing.assert_close(compiled(h, weight, targets),
                               F.cross_entropy((h @ weight.t()).flatten(0, 1), targets.flatten()))


@pytest.mark.parametrize("frozen", ["weight", "hidden"])
def test_a_frozen_input_gets_no_gradient_and_the_other_the_plain_one(monkeypatch, frozen):
    # A LoRA run freezes the head: its [V, D] gradient is then neither computed nor held.
    torch.manual_seed(0)
    h, weight, targets = torch.randn(2, 5, 16, dtype=torch.float64), torch.randn(41, 16, dtype=torch.float64), \
        torch.randint(0, 41, (2, 5))
    (_, gh, gw), _ = _plain_and_fused(h, weight, targets)
    hh, ww = h.clone().requires_grad_(frozen != "hidden"), weight.clone().requires_grad_(frozen != "weight")
    big = []
    real_zeros_like = torch.zeros_like
    monkeypatch.setattr(head_loss.torch, "zeros_like", lambda t, **k: big.append(t.shape) or real_zeros_like(t, **k))
    head_cross_entropy(hh, ww, targets).backward()
    if frozen == "weight":
        assert ww.grad is None and big == [] and torch.allclose(hh.grad, gh, atol=1e-12)
    else:
        assert hh.grad is None and torch.allclose(ww.grad, gw, atol=1e-12)
