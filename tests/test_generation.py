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


# ------------------------------------------------------------------------------------ the cached engine


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    yield

import itertools  # noqa: E402

from tinygpt import GPTConfig, GenerationConfig, generate, stream  # noqa: E402
from tinygpt.generation import OVERFLOW_POLICIES  # noqa: E402

SMALL = GPTConfig(vocab_size=43, context_length=16, emb_dim=24, n_heads=3, n_layers=2)


def _model(config=SMALL, dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    return GPTModel(config).to(dtype)


@pytest.mark.parametrize("pre_ln,tie,dtype", list(itertools.product((True, False), (False, True),
                                                                      (torch.float32, torch.float64))))
def test_cached_greedy_equals_generate_greedy_beyond_the_context(pre_ln, tie, dtype):
    model = _model(SMALL.replace(pre_ln=pre_ln, tie_weights=tie, qkv_bias=True), dtype)
    idx = torch.randint(0, SMALL.vocab_size, (2, 5))
    expected = generate_greedy(model, idx, 24)[:, 5:]  # 5 + 24 > C = 16: the seeds' window slides
    cached = generate(model, idx, max_new_tokens=24)  # default: cache + overflow="slide"
    assert cached.tokens.dtype == torch.long and cached.lengths == [24, 24]
    assert torch.equal(cached.tokens, expected)
    assert torch.equal(generate(model, idx, max_new_tokens=24, use_cache=False).tokens, expected)


@pytest.mark.parametrize("config", [SMALL, SMALL.replace(norm="rmsnorm", ffn="swiglu", bias=False, pos_emb="rope",
                                                         n_kv_heads=1)], ids=["gpt2", "llama-style"])
def test_batch_of_different_lengths_equals_each_prompt_alone(config):
    model = _model(config)
    rows = [torch.randint(0, config.vocab_size, (n,)).tolist() for n in (1, 3, 6, 16, 19)]
    result = generate(model, rows, max_new_tokens=14)
    alone = [generate_greedy(model, torch.tensor([r]), 14)[0, len(r):].tolist() for r in rows]
    assert result.rows() == alone
    streamed = list(stream(model, rows, max_new_tokens=14, use_cache=False))
    assert [[step[i] for step in streamed] for i in range(len(rows))] == alone


def _shift_reference(model, row, n_new, keep):
    """The shift policy written out without a cache: when the window would exceed C, keep its last `keep`."""
    seq, start = list(row), max(0, len(row) - model.config.context_length)
    if start:
        start = len(row) - keep
    out = []
    for _ in range(n_new):
        if len(seq) - start > model.config.context_length:
            start = len(seq) - keep
        with torch.no_grad():
            out.append(int(model(torch.tensor([seq[start:]]))[0, -1].argmax()))
        seq.append(out[-1])
    return out


@pytest.mark.parametrize("keep", [None, 1, 5, 15])
def test_shift_never_exceeds_the_context_and_matches_its_definition(keep):
    model = _model()
    widest = []
    forward = model.forward

    def recording_forward(idx, **kwargs):
        batch = kwargs.get("pos")  # the engine's packed rows: each token's own position in its row
        widest.append(int(batch.positions.max()) + 1 if batch is not None else idx.shape[1])
        return forward(idx, **kwargs)

    model.forward = recording_forward
    rows = [torch.randint(0, SMALL.vocab_size, (n,)).tolist() for n in (2, 9, 20)]
    result = generate(model, rows, max_new_tokens=40, overflow="shift", shift_keep=keep)
    assert result.lengths == [40, 40, 40]
    assert max(widest) <= SMALL.context_length
    model.forward = forward
    model.eval()
    expected = [_shift_reference(model, r, 40, keep or SMALL.context_length // 2) for r in rows]
    assert result.rows() == expected
    uncached = generate(model, rows, max_new_tokens=40, overflow="shift", shift_keep=keep, use_cache=False)
    assert uncached.rows() == expected


def test_overflow_error_is_raised_before_any_work_and_says_what_fits():
    model = _model()
    calls = []
    model.register_forward_pre_hook(lambda *args: calls.append(1))
    idx = torch.randint(0, SMALL.vocab_size, (1, 10))
    with pytest.raises(ValueError, match="at most 7 new tokens fit"):
        generate(model, idx, max_new_tokens=8, overflow="error")
    with pytest.raises(ValueError, match="too long"):
        stream(model, torch.zeros(1, 17, dtype=torch.long), max_new_tokens=1, overflow="error")
    assert calls == []
    # The last new token is never fed back, so 10 + 7 - 1 = 16 = C positions are enough.
    assert generate(model, idx, max_new_tokens=7, overflow="error").lengths == [7]


def test_overflow_policies_are_the_documented_ones():
    assert OVERFLOW_POLICIES == ("slide", "shift", "error") and GenerationConfig().overflow == "slide"


def test_temperature_zero_is_greedy_and_a_seed_repeats_the_text():
    model = _model()
    idx = torch.randint(0, SMALL.vocab_size, (3, 4))
    greedy = generate(model, idx, max_new_tokens=10)
    assert torch.equal(generate(model, idx, max_new_tokens=10, temperature=0.0, top_k=3, top_p=0.5).tokens,
                       greedy.tokens)
    assert torch.equal(generate(model, idx, max_new_tokens=10, temperature=2.0, top_k=1).tokens, greedy.tokens)
    sampled = dict(max_new_tokens=20, temperature=1.5, top_p=0.95, seed=7)
    a, b = generate(model, idx, **sampled), generate(model, idx, **sampled)
    assert torch.equal(a.tokens, b.tokens)
    assert not torch.equal(a.tokens, generate(model, idx, **{**sampled, "seed": 8}).tokens)
    assert not torch.equal(a.tokens[:, :10], greedy.tokens)  # it sampled rather than took the argmax
    g1, g2 = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    c = generate(model, idx, max_new_tokens=20, temperature=1.0, generator=g1)
    assert torch.equal(c.tokens, generate(model, idx, max_new_tokens=20, temperature=1.0, generator=g2).tokens)


def test_strong_repetition_penalty_never_repeats_a_token_in_greedy():
    model = _model()
    prompt = [1, 2, 3]
    out = generate(model, prompt, max_new_tokens=20, repetition_penalty=1e6).rows()[0]
    assert len(set(prompt + out)) == len(prompt) + len(out)
    assert out != generate(model, prompt, max_new_tokens=20).rows()[0]


def test_eos_and_stop_sequences_finish_rows_independently():
    model = _model()
    idx = torch.randint(0, SMALL.vocab_size, (3, 4))
    free = generate(model, idx, max_new_tokens=12).rows()
    eos = free[0][3]
    stop = tuple(free[1][5:7])
    result = generate(model, idx, max_new_tokens=12, eos_id=eos, stop=[stop], pad_id=0)

    def expected_end(row):
        for n in range(1, len(row) + 1):
            if row[n - 1] == eos:
                return n, "eos"
            if n >= 2 and tuple(row[n - 2:n]) == stop:
                return n, "stop"
        return len(row), "length"

    ends = [expected_end(r) for r in free]
    assert result.lengths == [n for n, _ in ends]
    assert result.finish_reasons == [why for _, why in ends]
    assert result.rows() == [r[:n] for r, (n, _) in zip(free, ends)]
    assert result.tokens.shape == (3, max(n for n, _ in ends))
    for i, (n, _) in enumerate(ends):
        assert torch.all(result.tokens[i, n:] == 0)
    steps = list(stream(model, idx, max_new_tokens=12, eos_id=eos, stop=[stop]))
    assert len(steps) == max(n for n, _ in ends)  # the loop ends when every row has finished
    assert [step[i] is None for step in steps for i in range(3)] == [
        s >= ends[i][0] for s in range(len(steps)) for i in range(3)
    ]


def test_stream_yields_as_it_goes_and_restores_the_mode():
    model = _model()
    model.train()
    it = stream(model, [5, 6, 7], max_new_tokens=50)
    first = next(it)
    assert len(first) == 1 and isinstance(first[0], int)
    assert not model.training  # eval while generating
    it.close()
    assert model.training
    assert generate(model, [5, 6, 7], max_new_tokens=0).tokens.shape == (1, 0)


@pytest.mark.parametrize("kwargs,match", [
    (dict(temperature=-0.1), "temperature"), (dict(temperature=float("nan")), "temperature"),
    (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"), (dict(top_k=0), "top_k"),
    (dict(repetition_penalty=0.0), "repetition_penalty"), (dict(max_new_tokens=-1), "max_new_tokens"),
    (dict(overflow="wrap"), "overflow"), (dict(shift_keep=16, overflow="shift"), "shift_keep"),
    (dict(eos_id=43), "eos_id"), (dict(pad_id=-1), "pad_id"), (dict(stop=[[]]), "stop"),
    (dict(stop=[[1, 99]]), "stop"), (dict(seed=1.5), "seed"), (dict(colour="red"), "colour"),
])
def test_bad_settings_are_value_errors(kwargs, match):
    with pytest.raises(ValueError, match=match):
        generate(_model(), [1, 2], **kwargs)


@pytest.mark.parametrize("prompts,match", [
    ([], "non-empty"), ([[1, 2], []], "prompt 1 is empty"), ([1, 43], "43"), ([[0, -1]], "-1"),
    (torch.zeros(1, 0, dtype=torch.long), "empty"), (torch.zeros(2, 2, 2, dtype=torch.long), "shape"),
])
def test_bad_prompts_are_value_errors(prompts, match):
    with pytest.raises(ValueError, match=match):
        generate(_model(), prompts, max_new_tokens=1)


def test_bad_types_are_type_errors():
    with pytest.raises(TypeError, match="integer token ids"):
        generate(_model(), torch.zeros(1, 2), max_new_tokens=1)
    with pytest.raises(TypeError, match="GenerationConfig"):
        generate(_model(), [1], {"temperature": 1.0})
    with pytest.raises(TypeError, match="Generator"):
        generate(_model(), [1], generator=7)


def test_a_row_generator_is_seeded_with_seed_plus_row_and_greedy_rows_have_none():
    from tinygpt.inference.sampling_params import GenerationConfig as Leaf

    assert Leaf is GenerationConfig  # generation re-exports the engine's leaf
    assert GenerationConfig().greedy and GenerationConfig(seed=3).row_generator() is None
    sampled = GenerationConfig(temperature=0.7, seed=3)
    assert not sampled.greedy and sampled.replace(seed=None).row_generator() is None
    draws = [torch.rand(4, generator=sampled.row_generator("cpu", row)) for row in (0, 1, 1)]
    assert torch.equal(draws[0], torch.rand(4, generator=torch.Generator().manual_seed(3)))
    assert torch.equal(draws[1], draws[2]) and not torch.equal(draws[0], draws[1])
