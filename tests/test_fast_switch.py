"""tinygpt.fast.disabled: the switch of the fast path, a context manager scoped to its thread."""

import threading

import pytest
import torch
import torch.nn.functional as F

from tinygpt import GPTConfig, GPTModel, fast

CONFIG = GPTConfig(vocab_size=97, context_length=16, emb_dim=32, n_heads=4, n_layers=2, tie_weights=True)


def test_disabled_switches_the_named_parts_off_and_restores_them():
    assert all(fast.is_enabled(p) for p in fast.PARTS)
    with fast.disabled("onednn"):
        assert not fast.is_enabled("onednn") and fast.is_enabled("head") and fast.is_enabled("loss")
        with fast.disabled("loss"):  # nested blocks add up
            assert not fast.is_enabled("onednn") and not fast.is_enabled("loss")
        assert fast.is_enabled("loss")
    with pytest.raises(RuntimeError), fast.disabled():
        assert not any(fast.is_enabled(p) for p in fast.PARTS)
        raise RuntimeError("restored on the way out all the same")
    assert all(fast.is_enabled(p) for p in fast.PARTS)


def test_an_unknown_part_is_refused_naming_the_parts():
    with pytest.raises(ValueError, match="unknown fast-path part 'cuda'.*'onednn', 'train', 'head', 'loss'"):
        with fast.disabled("cuda"):
            pass


def test_disabled_holds_only_in_the_thread_that_entered_it():
    seen = []
    with fast.disabled():
        thread = threading.Thread(target=lambda: seen.append(fast.is_enabled("onednn")))
        thread.start()
        thread.join()
    assert seen == [True]


def test_the_disabled_model_is_plain_pytorch_with_the_same_results():
    torch.manual_seed(0)
    model = GPTModel(CONFIG).eval()
    idx = torch.randint(0, CONFIG.vocab_size, (2, 16))
    with torch.inference_mode():
        fast_logits = model(idx)
        with fast.disabled():
            plain = model(idx)
            reference = F.linear(model.hidden_states(idx), model.out_head.weight)
    assert plain.is_contiguous()  # the head's padded rows are off: a plain [B, T, V] tensor
    torch.testing.assert_close(plain, reference, rtol=0, atol=0)
    torch.testing.assert_close(fast_logits, plain, rtol=0, atol=1e-5)
    targets = torch.randint(0, CONFIG.vocab_size, (2, 16))
    fused = model(idx, targets=targets)
    with fast.disabled("loss"):
        unfused = model(idx, targets=targets)
    assert "HeadCrossEntropy" in type(fused.grad_fn).__name__  # the fused loss, unless switched off
    assert unfused.grad_fn is not None and "HeadCrossEntropy" not in type(unfused.grad_fn).__name__
    torch.testing.assert_close(fused, unfused, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(unfused, F.cross_entropy(model(idx).flatten(0, 1), targets.flatten()), rtol=0, atol=0)
