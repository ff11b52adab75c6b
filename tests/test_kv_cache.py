"""The KV cache and the model's cached forward: exact agreement with the uncached forward, padding, bounds."""

import itertools
import math

import pytest
import torch
import torch.nn.functional as F

from tinygpt import GPTConfig, GPTModel, KVCache, generate_greedy
from tinygpt.layers import Positions

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
            logits = model(nxt, cache=cache, start_pos=pos, last_only=True)  # [2, 1, V]
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
        rest = model(idx[:, 7:], cache=cache, start_pos=7)  # several queries at once after cached keys
        full = model(idx)
    assert (torch.cat([first, rest], dim=1) - full).abs().max().item() <= 1e-10


def test_start_pos_without_a_cache_stays_causal():
    # Shifting positions alone must not let a query see later keys (the mask is relative to this call's keys).
    model = _model(BASE, torch.float64)
    idx = torch.randint(0, BASE.vocab_size, (1, 6))
    with torch.no_grad():
        whole = model(idx, start_pos=4)
        prefix = model(idx[:, :3], start_pos=4)
    assert (whole[:, :3] - prefix).abs().max().item() <= 1e-12


def _math_sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, enable_gqa=False):
    """scaled_dot_product_attention as its formula: a fully masked row is softmax over nothing = NaN."""
    if enable_gqa:
        k, v = (t.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for t in (k, v))
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if is_causal:
        attn_mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).tril()
    if attn_mask is not None:
        scores = scores.masked_fill(~attn_mask, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


@pytest.mark.parametrize("sdpa", ["torch", "formula"])
def test_left_padding_rows_match_unpadded_and_stay_finite(monkeypatch, sdpa):
    # Some SDPA kernels return NaN for a query with no allowed key (a left-padding position); the formula does.
    # Padding queries must stay finite, or NaN keys/values leak into the real rows through 0 * NaN.
    if sdpa == "formula":
        monkeypatch.setattr(F, "scaled_dot_product_attention", _math_sdpa)
    model = _model(BASE, torch.float64)
    lengths = [7, 2, 4]
    rows = [torch.randint(0, BASE.vocab_size, (n,)) for n in lengths]
    width = max(lengths)
    pads = torch.tensor([width - n for n in lengths])[:, None]
    idx = torch.stack([torch.cat([torch.zeros(width - len(r), dtype=torch.long), r]) for r in rows])
    positions = (torch.arange(width) - pads).clamp(min=0)
    key_mask = torch.arange(width + 3) >= pads  # [B, width + 3]
    cache = KVCache(BASE, 3, dtype=torch.float64)
    with torch.no_grad():
        logits = model(idx, cache=cache, positions=positions, key_mask=key_mask[:, :width])
        assert torch.isfinite(logits).all() and all(torch.isfinite(k).all() for k in cache.keys + cache.values)
        for i, r in enumerate(rows):
            alone = model(r[None])
            assert (logits[i, pads[i, 0]:] - alone[0]).abs().max().item() <= 1e-10
        nxt = logits[:, -1].argmax(-1, keepdim=True)
        step = model(nxt, cache=cache, start_pos=width, positions=width - pads, key_mask=key_mask[:, : width + 1])
        for i, r in enumerate(rows):
            alone = model(torch.cat([r, nxt[i]])[None])[:, -1]
            assert (step[i, -1] - alone[0]).abs().max().item() <= 1e-10


def test_return_weights_path_has_no_nan_with_padding():
    att = GPTModel(BASE).trf_blocks[0].att.eval()
    x = torch.randn(2, 5, BASE.emb_dim)
    key_mask = torch.tensor([[True] * 5, [False, False, False, True, True]])
    out, weights = att(x, Positions(key_mask=key_mask), return_weights=True)
    assert torch.isfinite(out).all() and torch.isfinite(weights).all()
    assert torch.all(weights[1, :, 3:, :3] == 0)  # real queries give padding keys no weight
    assert torch.allclose(weights.sum(-1), torch.ones(2, BASE.n_heads, 5))


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
        model(torch.zeros(1, 2, dtype=torch.long), cache=cache, start_pos=23)


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
