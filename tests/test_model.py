import pytest
import torch

from tinygpt import DummyGPTModel, GPTConfig, GPTModel, get_config


def test_tiny_config_logits_shape(tiny_config):
    model = GPTModel(tiny_config)
    idx = torch.randint(0, 16, (2, 6))
    assert model(idx).shape == (2, 6, 16)
    assert isinstance(model.trf_blocks, torch.nn.ModuleList) and len(model.trf_blocks) == 2
    assert model.out_head.bias is None


def test_dummy_model_has_the_same_interface(tiny_config):
    dummy = DummyGPTModel(tiny_config)
    assert dummy(torch.randint(0, 16, (2, 6))).shape == (2, 6, 16)
    with pytest.raises(ValueError, match="vocab_size=16"):
        dummy(torch.tensor([[16]]))


def test_tied_weights_are_one_parameter_and_train_together(tiny_config):
    model = GPTModel(tiny_config.replace(tie_weights=True))
    assert model.out_head.weight is model.tok_emb.weight
    assert model.out_head.weight.data_ptr() == model.tok_emb.weight.data_ptr()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.randint(0, 16, (2, 6))).sum().backward()
    opt.step()
    assert torch.equal(model.out_head.weight, model.tok_emb.weight)
    untied = GPTModel(tiny_config)
    assert untied.out_head.weight is not untied.tok_emb.weight


def test_gpt2_init_scales_residual_projections():
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=500, context_length=64, emb_dim=256, n_heads=4, n_layers=8)
    model = GPTModel(config)
    assert model.tok_emb.weight.std().item() == pytest.approx(0.02, rel=0.05)
    assert model.trf_blocks[0].att.qkv.weight.std().item() == pytest.approx(0.02, rel=0.05)
    residual = 0.02 / (2 * 8) ** 0.5
    assert model.trf_blocks[0].att.out_proj.weight.std().item() == pytest.approx(residual, rel=0.05)
    assert model.trf_blocks[3].ff.layers[2].weight.std().item() == pytest.approx(residual, rel=0.05)
    assert torch.equal(model.trf_blocks[0].ff.layers[0].bias, torch.zeros(1024))


@pytest.mark.parametrize(
    "idx,error,match",
    [
        (torch.tensor([[1, 2, 16]]), ValueError, r"token id 16 .* 0 <= id < vocab_size=16"),
        (torch.tensor([[1, -1]]), ValueError, r"token id -1"),
        (torch.zeros(1, 17, dtype=torch.long), ValueError, r"context_length=16"),
        (torch.zeros(1, 0, dtype=torch.long), ValueError, r"0 tokens"),
        (torch.zeros(4, dtype=torch.long), ValueError, r"\[batch, tokens\]"),
        (torch.zeros(1, 3), TypeError, r"integer token ids.*float32"),
        ([[1, 2]], TypeError, r"torch.Tensor"),
    ],
)
def test_bad_input_is_a_clear_error(tiny_config, idx, error, match):
    with pytest.raises(error, match=match):
        GPTModel(tiny_config)(idx)


def test_all_integer_dtypes_accepted(tiny_config):
    model = GPTModel(tiny_config).eval()
    idx = torch.randint(0, 16, (1, 5))
    ref = model(idx)
    for dtype in (torch.int32, torch.int16, torch.uint8):
        torch.testing.assert_close(model(idx.to(dtype)), ref)


def test_last_only_matches_full_forward(tiny_config):
    model = GPTModel(tiny_config).eval()
    idx = torch.randint(0, 16, (3, 9))
    torch.testing.assert_close(model(idx, last_only=True), model(idx)[:, -1:])


def test_embedding_dropout_uses_its_own_rate():
    model = GPTModel(get_config("tiny", drop_rate_emb=0.3))
    assert model.drop_emb.p == 0.3
    assert all(b.drop_shortcut.p == 0.0 for b in model.trf_blocks)


def test_backward_reaches_every_parameter(tiny_config):
    model = GPTModel(tiny_config)
    idx = torch.randint(0, 16, (2, 6))
    loss = torch.nn.functional.cross_entropy(model(idx).flatten(0, 1), idx.flatten())
    loss.backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())


def test_tied_build_draws_the_same_weights_as_before():
    # Same seed: the tied model's shared weight is what the untied model draws for its head (both redraw in the
    # same module order), and every other tensor is equal -- so building the tied head without a weight of its own
    # must consume the RNG exactly as that weight's init did.
    config = GPTConfig(vocab_size=3001, context_length=8, emb_dim=40, n_heads=4, n_layers=2, qkv_bias=True)
    torch.manual_seed(7)
    tied = GPTModel(config.replace(tie_weights=True))
    rng_after_tied = torch.get_rng_state()
    torch.manual_seed(7)
    untied = GPTModel(config)
    assert torch.equal(rng_after_tied, torch.get_rng_state())
    assert tied.out_head.weight is tied.tok_emb.weight
    assert torch.equal(tied.tok_emb.weight, untied.out_head.weight)
    untied_sd = untied.state_dict()
    for name, tensor in tied.state_dict().items():
        if name != "tok_emb.weight":
            assert torch.equal(tensor, untied_sd[name]), name
