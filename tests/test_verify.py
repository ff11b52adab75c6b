import pytest
import torch

from tinygpt import GPTConfig, get_config
from tinygpt import verify

pytest.importorskip("transformers")
pytest.importorskip("llms_from_scratch")


def test_upstream_tiny_float64_within_seed_bound():
    result = verify.check_upstream(get_config("tiny"), torch.float64, 1e-7)
    assert result.passed and result.tokens_match
    assert result.max_abs_diff <= 1e-7


def test_upstream_with_qkv_bias_float32():
    config = GPTConfig(vocab_size=300, context_length=32, emb_dim=64, n_heads=4, n_layers=2, qkv_bias=True)
    result = verify.check_upstream(config, torch.float32, 1e-5)
    assert result.passed, result


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 1e-5)])
def test_hf_gpt2_and_openai_gpt(dtype, tol):
    config = GPTConfig(vocab_size=50, context_length=16, emb_dim=32, n_heads=4, n_layers=2,
                       qkv_bias=True, tie_weights=True)
    gpt2 = verify.check_hf_gpt2(config, dtype, tol)
    gpt1 = verify.check_hf_openai_gpt(config.replace(pre_ln=False, tie_weights=False), dtype, tol)
    assert gpt2.passed and gpt2.tokens_match
    assert gpt1.passed


def test_a_wrong_weight_is_detected(monkeypatch):
    """The check can fail: break one mapping (swap LayerNorm scale and shift) and the diff explodes."""
    from tinygpt.interop import hf

    monkeypatch.setitem(hf._NORMS, "ln_1", "norm2")
    config = GPTConfig(vocab_size=50, context_length=16, emb_dim=32, n_heads=4, n_layers=2,
                       qkv_bias=True, tie_weights=True)
    assert not verify.check_hf_gpt2(config, torch.float64, 1e-10).passed


def test_check_refuses_mismatched_architecture():
    with pytest.raises(ValueError, match="pre-LN"):
        verify.check_hf_gpt2(get_config("tiny"), torch.float64, 1e-10)
