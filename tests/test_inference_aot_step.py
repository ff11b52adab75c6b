"""inference.aot_step: the one-row decode step compiled ahead of time gives the eager logits and writes the eager
keys and values into the engine's own cache, at any key count and pool size; its library holds no weights (a model
of the same shapes reuses it from the disk cache); what cannot be built or run falls back to torch.compile, said
once."""

from __future__ import annotations

import shutil

import pytest
import torch

from inference_support import variant_model
from tinygpt import generate, generate_greedy
from tinygpt.inference import aot_step
from tinygpt.inference import runner as runner_module
from tinygpt.inference.aot_step import AotStep
from tinygpt.inference.batch import RowSlice, build_batch
from tinygpt.inference.kv_cache import PagedKVCache

needs_compiler = pytest.mark.skipif(not (shutil.which("g++") or shutil.which("c++")),
                                    reason="AOTInductor needs a C++ compiler (g++ or c++ on PATH)")


def _kv(cache: PagedKVCache) -> list[torch.Tensor]:
    return [t.clone() for layer in cache.layers for t in (layer.keys, layer.values)]


def _restore(cache: PagedKVCache, saved: list[torch.Tensor]) -> None:
    for t, s in zip((t for layer in cache.layers for t in (layer.keys, layer.values)), saved):
        t.copy_(s)


def _prefilled(model, prompt: list[int], num_blocks: int, block_size: int = 4):
    """A paged cache holding the prompt's keys and values (eager), the row's block table."""
    cache = PagedKVCache(model.config, num_blocks, block_size, dtype=next(model.parameters()).dtype)
    table = list(range(1, num_blocks))
    with torch.no_grad():
        model(torch.tensor([prompt]), cache=cache, pos=build_batch([RowSlice(0, len(prompt), table, [])], block_size,
                                                                   "cpu"))
    return cache, table


def _check_step(step: AotStep, model, cache: PagedKVCache, table: list[int], position: int, token: int) -> None:
    """One decode step at ``position``: the step's logits and cache writes against eager's on the same cache."""
    batch = build_batch([RowSlice(position, 1, table, [0])], cache.block_size, "cpu")
    assert AotStep.fits(batch)
    idx = torch.tensor([[token]])
    before = _kv(cache)
    with torch.no_grad():
        got = step(idx, cache=cache, pos=batch)
        written = _kv(cache)
        _restore(cache, before)
        want = model(idx, cache=cache, pos=batch)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    slot = int(batch.write_slots[0])
    for w, e, b in zip(written, _kv(cache), before):
        torch.testing.assert_close(w[slot], e[slot], rtol=1e-5, atol=1e-5)
        w[slot], b[slot] = 0, 0
        torch.testing.assert_close(w, b, rtol=0, atol=0, equal_nan=True)  # no other slot touched


@pytest.mark.slow
@needs_compiler
@pytest.mark.parametrize("variant", ["gpt2", "llama"])
def test_the_step_gives_the_eager_logits_and_writes_at_any_key_count_and_pool_size(variant):
    model = variant_model(variant, torch.float32)
    prompt = [3, 1, 4, 1, 5]
    cache, table = _prefilled(model, prompt, num_blocks=6)
    step = AotStep(model, cache, runner_module.COMPILE_OPTIONS)
    _check_step(step, model, cache, table, len(prompt), 7)  # 6 keys
    _check_step(step, model, cache, table, 2, 9)  # 3 keys: the key count is an input, not a constant
    bigger, table = _prefilled(model, prompt, num_blocks=11)  # another engine's pool, the same library
    _check_step(AotStep(model, bigger, runner_module.COMPILE_OPTIONS), model, bigger, table, len(prompt), 7)


@pytest.mark.slow
@needs_compiler
def test_a_model_of_the_same_shapes_reuses_the_library_with_its_own_weights(monkeypatch):
    first = variant_model("gpt2", torch.float32, seed=0)
    cache, table = _prefilled(first, [3, 1, 4], num_blocks=4)
    AotStep(first, cache, runner_module.COMPILE_OPTIONS)  # built (or found on disk)
    monkeypatch.setattr(aot_step, "_LOADED", {})  # a new process, as far as loading goes

    def no_build(*args, **kwargs):
        raise AssertionError("the library was compiled again")

    monkeypatch.setattr(aot_step, "_build", no_build)
    second = variant_model("gpt2", torch.float32, seed=1)
    cache, table = _prefilled(second, [3, 1, 4], num_blocks=4)
    _check_step(AotStep(second, cache, runner_module.COMPILE_OPTIONS), second, cache, table, 3, 2)


@pytest.mark.slow
@needs_compiler
def test_generate_decodes_one_row_through_the_step_with_the_offline_tokens(monkeypatch):
    model = variant_model("gpt2", torch.float32)
    calls, call = [], AotStep.__call__
    monkeypatch.setattr(AotStep, "__call__", lambda self, idx, **kw: calls.append(1) or call(self, idx, **kw))
    prompt = [6, 5, 3, 5]
    rows = generate(model, [prompt], max_new_tokens=6, compile=True).rows()
    assert rows == [generate_greedy(model, torch.tensor([prompt]), 6)[0, len(prompt):].tolist()]
    assert len(calls) == 5  # every step after the prefill
    calls.clear()
    rows = generate(model, [[5]], max_new_tokens=4, compile=True).rows()  # a one-token prompt: one key, no prefill
    assert rows == [generate_greedy(model, torch.tensor([[5]]), 4)[0, 1:].tolist()]
    assert len(calls) == 4  # its first forward is already the one-row step
    assert model not in runner_module._AOT_FAILED


def test_only_a_single_unmasked_decode_row_fits():
    one = RowSlice(4, 1, [1, 2], [0])
    assert AotStep.fits(build_batch([one], 4, "cpu"))
    assert not AotStep.fits(build_batch([one, RowSlice(3, 1, [3], [0])], 4, "cpu"))  # two rows
    assert not AotStep.fits(build_batch([one, RowSlice(0, 3, [3], [2])], 4, "cpu"))  # a prompt beside it
    assert not AotStep.fits(build_batch([RowSlice(4, 1, [1, 2], [])], 4, "cpu"))  # no logits wanted


def _spy_compile(monkeypatch) -> list[int]:
    calls: list[int] = []

    def compile(model, **options):
        def compiled(idx, **kwargs):
            calls.append(idx.shape[1])
            return model(idx, **kwargs)
        return compiled

    monkeypatch.setattr(runner_module.torch, "compile", compile)
    return calls


@pytest.mark.parametrize("where", ["build", "call"])
def test_a_step_that_fails_says_so_once_and_decodes_through_torch_compile(where, monkeypatch, capsys):
    model = variant_model("gpt2")
    calls = _spy_compile(monkeypatch)

    def fail(*args, **kwargs):
        raise RuntimeError("no C++ compiler")

    if where == "build":
        monkeypatch.setattr(aot_step, "_load_or_build", fail)
    else:
        monkeypatch.setattr(aot_step, "_load_or_build", lambda *args: None)
        monkeypatch.setattr(AotStep, "__call__", fail)
    prompt = [9, 2, 7]
    rows = generate(model, [prompt], max_new_tokens=5, compile=True).rows()
    assert rows == [generate_greedy(model, torch.tensor([prompt]), 5)[0, len(prompt):].tolist()]
    assert calls == [1] * 4  # every decode step, through torch.compile
    err = capsys.readouterr().err
    what = "cannot be compiled ahead of time" if where == "build" else "failed"
    assert err.count(f"the one-row decode step {what}, it runs through torch.compile from now on: "
                     "RuntimeError: no C++ compiler") == 1
    generate(model, [prompt], max_new_tokens=3, compile=True)
    assert capsys.readouterr().err == ""  # that model is not tried again
    assert model in runner_module._AOT_FAILED


def test_the_library_key_counts_what_the_code_depends_on_and_not_the_weights_values(monkeypatch):
    model = variant_model("gpt2", torch.float32)
    cache = PagedKVCache(model.config, 4, 4)
    options = runner_module.COMPILE_OPTIONS

    def key(m=model, c=cache, opts=options):
        names, weights = aot_step.model_tensors(m)
        return aot_step.library_key(m, c, names, weights, opts)

    base = key()
    assert key(m=variant_model("gpt2", torch.float32, seed=5)) == base  # other values, the same library
    assert key(c=PagedKVCache(model.config, 9, 4)) == base  # another pool size: a dynamic dimension
    assert key(m=variant_model("gpt2", torch.float64)) != base
    assert key(m=variant_model("llama", torch.float32)) != base
    assert key(c=PagedKVCache(model.config, 4, 4, dtype=torch.bfloat16)) != base
    assert key(opts={**options, "size_asserts": True}) != base
    threads = torch.get_num_threads()
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads + 1)
    assert key() != base  # inductor writes the thread count into its loops
