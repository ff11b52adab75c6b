"""The KV cache and the model's cached forward: exact agreement with the uncached forward, bounds."""

import itertools

import pytest
import torch

from tinygpt import GPTConfig, GPTModel, KVCache, generate_greedy

BASE = GPTConfig(vocab_size=41, context_length=24, emb_dim=24, n_heads=3, n_layers=2, qkv_bias=True)
VARIANTS = list(itertools.product((True, False), (False, True), (torch.float32, torch.float64)))
TOLERANCE = {torch.float32: 1e-5, torch.float64: 1e-10}


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    yield


def _model(config: GPTConfig, dtype: torch.dtype, seed: int = 0) -> GPTModel:
    torch.manual_seed(seed)
    return GPTModel(config).to(dtype).eval()


@pytest.mark.parametrize("pre_ln,tie,dtype", VARIANTS)
def test_cached_logits_match_uncached_at_every_step_up_to_full_context(pre_ln, tie, dtype):
    config = BASE.replace(pre_ln=pre_ln, tie_weights=tie)
    model = _model(config, dtype)
    c = config.context_length
    prompt = torch.randint(0, config.vocab_size, (2, 5))
    cache = KVCache(config, 2, dtype=dtype)
    worst = 0.0
    with torch.no_grad():
        logits = model(prompt, cache=cache)  # prefill: [2, 5, V]
        worst = max(worst, (logits - model(prompt)).abs().max().item())
        seq = prompt
        for pos in range(5, c):  # one decode step per position, the last one at position C - 1
            nxt = logits[:, -1].argmax(-1, keepdim=True)
            seq = torch.cat([seq, nxt], dim=1)
            logits = model(nxt, cache=cache, pos=pos, last_only=True)  # [2, 1, V]
            worst = max(worst, (logits - model(seq)[:, -1:]).abs().max().item())
    assert seq.shape[1] == c and cache.length == c
    assert worst <= TOLERANCE[dtype]
    # The cached greedy tokens are exactly the seeds' uncached loop's.
    final = torch.cat([seq, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(final, generate_greedy(model, prompt, c - 5 + 1))


def test_chunked_prefill_matches_one_prefill():
    model = _model(BASE, torch.float64)
    idx = torch.randint(0, BASE.vocab_size, (3, 20))
    cache = KVCache(BASE, 3, dtype=torch.float64)
    with torch.no_grad():
        first = model(idx[:, :7], cache=cache)
        rest = model(idx[:, 7:], cache=cache, pos=7)  # several queries at once after cached keys
        full = model(idx)
    assert (torch.cat([first, rest], dim=1) - full).abs().max().item() <= 1e-10


def test_pos_without_a_cache_stays_causal():
    # Shifting positions alone must not let a query see later keys (the mask is relative to this call's keys).
    model = _model(BASE, torch.float64)
    idx = torch.randint(0, BASE.vocab_size, (1, 6))
    with torch.no_grad():
        whole = model(idx, pos=4)
        prefix = model(idx[:, :3], pos=4)
    assert (whole[:, :3] - prefix).abs().max().item() <= 1e-12


def test_cache_shapes_and_bounds():
    cache = KVCache(BASE, 2, max_length=8)
    assert cache.batch_size == 2 and cache.keys[0].shape == (2, BASE.n_heads, 8, BASE.head_dim)
    k = torch.zeros(2, BASE.n_heads, 3, BASE.head_dim)
    keys, _ = cache.update(0, 5, k, k)
    assert keys.shape[2] == 8
    with pytest.raises(ValueError, match="max_length=8"):
        cache.update(0, 6, k, k)
    with pytest.raises(ValueError, match="batch_size=2"):
        cache.update(0, 0, k[:1], k[:1])


@pytest.mark.parametrize("kwargs,match", [(dict(batch_size=0), "batch_size"),
                                          (dict(batch_size=1, max_length=0), "max_length"),
                                          (dict(batch_size=1, max_length=25), "max_length")])
def test_cache_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        KVCache(BASE, **kwargs)


def test_model_refuses_positions_past_the_context():
    model = _model(BASE, torch.float32)
    cache = KVCache(BASE, 1)
    with pytest.raises(ValueError, match="context_length=24"):
        model(torch.zeros(1, 2, dtype=torch.long), cache=cache, pos=23)


def test_each_layer_writes_through_its_own_view_and_a_dropped_cache_frees_its_buffers_at_once():
    import gc
    import weakref

    cache = KVCache(BASE, 1, max_length=8)
    k = torch.ones(1, BASE.n_heads, 2, BASE.head_dim)
    keys, _ = cache.layers[1].update(3, k, 2 * k)
    assert keys.shape[2] == 5 and cache.length == 5 and torch.count_nonzero(cache.keys[0]) == 0
    assert torch.equal(cache.values[1][:, :, 3:5], 2 * k)
    cache.reset()
    assert cache.length == 0
    buffer = weakref.ref(cache.keys[0])
    gc.disable()  # no reference cycle: the buffers go with the last reference, not at some later collection
    try:
        del cache, keys
        assert buffer() is None
    finally:
        gc.enable()


def test_each_cache_refuses_the_other_cache_s_pos():
    from tinygpt.inference.batch import RowSlice, build_batch
    from tinygpt.inference.kv_cache import PagedKVCache

    model = _model(BASE, torch.float32)
    idx = torch.zeros(1, 2, dtype=torch.long)
    with pytest.raises(TypeError, match="pos must be the int position"):
        model(idx, cache=KVCache(BASE, 1), pos=build_batch([RowSlice(0, 2, [2], [1])], 4, "cpu"))
    with pytest.raises(TypeError, match="needs pos=Batch"):
        model(idx, cache=PagedKVCache(BASE, 4, 4), pos=3)
    with pytest.raises(ValueError, match=r"needs idx \[1, 3\]"):
        model(idx, cache=PagedKVCache(BASE, 4, 4), pos=build_batch([RowSlice(0, 3, [2], [2])], 4, "cpu"))
    with pytest.raises(TypeError, match="without a cache pos must be an int"):
        model(idx, pos=1.5)
