import pytest
import torch

from tinygpt import GPTModel, generate_greedy


def naive_greedy(model, idx, steps, context):
    """The seeds' loop written out with softmax, as the main notebook does it."""
    for _ in range(steps):
        with torch.no_grad():
            probs = torch.softmax(model(idx[:, -context:])[:, -1], dim=-1)
        idx = torch.cat((idx, probs.argmax(-1, keepdim=True)), dim=1)
    return idx


def test_greedy_matches_the_seeds_loop_beyond_the_context(tiny_config):
    torch.manual_seed(5)
    model = GPTModel(tiny_config)
    idx = torch.randint(0, 16, (2, 4))
    out = generate_greedy(model, idx, max_new_tokens=20)
    assert out.shape == (2, 24)
    assert torch.equal(out[:, :4], idx)
    model.eval()
    assert torch.equal(out, naive_greedy(model, idx, 20, 16))
    assert torch.equal(generate_greedy(model, idx, 8, context_size=5), naive_greedy(model, idx, 8, 5))


def test_greedy_restores_mode_and_records_no_gradients(tiny_config):
    model = GPTModel(tiny_config.replace(drop_rate=0.5))
    model.train()
    idx = torch.randint(0, 16, (1, 3))
    a = generate_greedy(model, idx, 5)
    b = generate_greedy(model, idx, 5)
    assert torch.equal(a, b)  # dropout was off during generation
    assert model.training
    assert not a.requires_grad
    model.eval()
    generate_greedy(model, idx, 1)
    assert not model.training


@pytest.mark.parametrize("kwargs,match", [(dict(max_new_tokens=-1), "max_new_tokens"),
                                          (dict(max_new_tokens=2, context_size=0), "context_size"),
                                          (dict(max_new_tokens=2, context_size=17), "context_size")])
def test_greedy_bad_arguments(tiny_config, kwargs, match):
    with pytest.raises(ValueError, match=match):
        generate_greedy(GPTModel(tiny_config), torch.zeros(1, 2, dtype=torch.long), **kwargs)
