"""The lean decode step: plain greedy rows drawn together (one argmax, one read-back), and the optional compiled
decode forward (``GenerationConfig(compile=True)``), each giving exactly the tokens of offline generation."""

from __future__ import annotations

import pytest
import torch

from inference_support import variant_model
from tinygpt import GenerationConfig, generate, generate_greedy
from tinygpt.inference import engine as engine_module
from tinygpt.inference import runner as runner_module
from tinygpt.inference.engine import InferenceEngine
from tinygpt.inference.row import Row

PROMPTS = [[3, 1, 4, 1, 5], [9, 2], [6, 5, 3, 5, 8, 9, 7], [2, 7, 1, 8]]


def _offline(model, prompt: list[int], n: int) -> list[int]:
    """The chapter's uncached loop: a full forward per token."""
    return generate_greedy(model, torch.tensor([prompt]), n)[0, len(prompt):].tolist()


def test_plain_greedy_rows_draw_together_and_give_the_offline_tokens(monkeypatch):
    model = variant_model("gpt2")
    drawn_alone = []
    draw = engine_module.draw
    monkeypatch.setattr(engine_module, "draw", lambda row, logits: drawn_alone.append(row.id) or draw(row, logits))
    engine = InferenceEngine(model, max_rows=4, token_budget=6)  # prompts prefilled in chunks beside decodes
    greedy = [engine.add(Row(list(p), GenerationConfig(max_new_tokens=9))) for p in PROMPTS[:3]]
    penalised = engine.add(Row(list(PROMPTS[3]), GenerationConfig(max_new_tokens=9, repetition_penalty=1.3)))
    together = []
    draw_greedy = engine_module.draw_greedy
    monkeypatch.setattr(engine_module, "draw_greedy",
                        lambda rows, logits: together.append(len(rows)) or draw_greedy(rows, logits))
    engine.run_until_done()
    for row, prompt in zip(greedy, PROMPTS):
        assert row.tokens[len(prompt):] == _offline(model, prompt, 9)
    assert set(drawn_alone) == {penalised.id}  # the penalty changes the logits: that row still draws alone
    assert len(drawn_alone) == 9
    assert max(together) == 3 and sum(together) == 3 * 9  # each step's greedy rows: one draw for all of them


def _spy_compile(monkeypatch, fail: bool = False) -> list[int]:
    """``torch.compile`` as the runner sees it, replaced by a wrapper that counts the tokens of each forward it
    runs (or fails as a missing C++ compiler would)."""
    calls: list[int] = []

    def compile(model, **options):
        assert options == {"dynamic": True, "options": {"realize_acc_reads_threshold": 1, "size_asserts": False,
                                                        "scalar_asserts": False}}

        def compiled(idx, **kwargs):
            if fail:
                raise RuntimeError("InvalidCxxCompiler: No working C++ compiler found")
            calls.append(idx.shape[1])
            return model(idx, **kwargs)

        return compiled

    monkeypatch.setattr(runner_module.torch, "compile", compile)
    monkeypatch.setattr(runner_module, "AHEAD_OF_TIME", False)  # one-row steps too (``aot_step`` compiles for real)
    return calls


def test_compile_runs_only_the_decode_forwards_compiled(monkeypatch):
    model = variant_model("llama")
    calls = _spy_compile(monkeypatch)
    result = generate(model, PROMPTS[:2], max_new_tokens=6, compile=True)
    assert result.rows() == [_offline(model, p, 6) for p in PROMPTS[:2]]
    assert calls == [2] * 5  # the prefill ran eager; each later step decodes both rows, compiled
    calls.clear()
    generate(model, PROMPTS[:2], max_new_tokens=6)
    assert calls == []  # off by default


def test_compiling_moves_the_weights_into_huge_pages_first(monkeypatch):
    from tinygpt.fast import pages

    if not pages.supported():
        pytest.skip("madvise(MADV_HUGEPAGE) is Linux's")
    monkeypatch.setattr(pages, "MIN_BYTES", 0)  # the tiny model's tensors count too
    model = variant_model("gpt2")
    _spy_compile(monkeypatch)
    generate(model, PROMPTS[:1], max_new_tokens=2)
    assert not any(pages.in_huge_pages(p) for p in model.parameters())  # eager: left where they are
    generate(model, PROMPTS[:1], max_new_tokens=2, compile=True)
    assert all(pages.in_huge_pages(p) for p in model.parameters())


def test_a_compile_that_fails_says_so_once_and_decodes_eager(monkeypatch, capsys):
    model = variant_model("gpt2")
    _spy_compile(monkeypatch, fail=True)
    engine = InferenceEngine(model, max_rows=2, compile=True)
    rows = [engine.add(Row(list(p), GenerationConfig(max_new_tokens=5))) for p in PROMPTS[:2]]
    engine.run_until_done()
    assert [r.tokens[len(p):] for r, p in zip(rows, PROMPTS)] == [_offline(model, p, 5) for p in PROMPTS[:2]]
    assert all(r.finish_reason == "length" for r in rows)
    err = capsys.readouterr().err
    assert err.count("torch.compile failed, decoding eager from now on: RuntimeError: InvalidCxxCompiler") == 1
    assert engine.runner.compiled is None
    assert generate(model, PROMPTS[:1], max_new_tokens=3, compile=True).rows() == [_offline(model, PROMPTS[0], 3)]
    assert capsys.readouterr().err == ""  # that model is not compiled again


def test_compile_is_a_checked_setting():
    with pytest.raises(ValueError, match="compile"):
        GenerationConfig(compile="yes")


@pytest.mark.slow
def test_the_compiled_decode_step_gives_the_eager_tokens():
    # The real inductor (it needs a C++ compiler): float32, greedy, one row; the step's sums may be ordered
    # differently from eager's, so the claim is the tokens, which a tiny model's logits keep apart.
    import shutil

    from tinygpt.inference import runner

    if not (shutil.which("g++") or shutil.which("c++")):
        pytest.skip("inductor's CPU backend needs a C++ compiler (g++ or c++ on PATH)")
    torch.manual_seed(0)
    model = variant_model("gpt2", dtype=torch.float32)
    prompt = PROMPTS[0]
    eager = generate(model, [prompt], max_new_tokens=6).rows()
    assert generate(model, [prompt], max_new_tokens=6, compile=True).rows() == eager == [_offline(model, prompt, 6)]
    assert model not in runner._COMPILE_FAILED  # the compiled step really ran: no fallback to eager


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["gpt2", "gqa"])
def test_compiled_rows_of_different_lengths_give_the_offline_tokens(variant, monkeypatch):
    # Rows of 2-7 tokens decode together: one decode group whose keys are padded to the longest row, so the
    # compiled step's attention (``one_query_attention``, sums in place of sdpa) runs under a padding mask; the
    # gqa variant shares its key/value heads between query heads.
    import shutil

    from tinygpt.inference import runner

    if not (shutil.which("g++") or shutil.which("c++")):
        pytest.skip("inductor's CPU backend needs a C++ compiler (g++ or c++ on PATH)")
    torch.manual_seed(0)
    model = variant_model(variant, dtype=torch.float32)
    picked, model_for = [], runner.ModelRunner._model_for

    def spy(self, slices, batch):
        chosen = model_for(self, slices, batch)
        picked.append((chosen is self.compiled, batch.decode_groups[0].mask is not None if batch.decode_groups
                       else None))
        return chosen

    monkeypatch.setattr(runner.ModelRunner, "_model_for", spy)
    rows = generate(model, PROMPTS, max_new_tokens=5, compile=True).rows()
    assert rows == [_offline(model, p, 5) for p in PROMPTS]
    assert model not in runner._COMPILE_FAILED
    assert (True, True) in picked  # a compiled step ran rows padded under a mask


def test_serve_compile_reaches_the_engine_and_its_rows_decode_the_offline_tokens(monkeypatch, one_thread):
    from serving_support import Collector, offline, tiny_model, tokenizer
    from tinygpt.serving.engine import EngineRequest, EngineThread
    from tinygpt.serving.options import ServeOptions

    assert ServeOptions(compile=True).compile and not ServeOptions().compile
    calls = _spy_compile(monkeypatch)
    model = tiny_model()
    engine = EngineThread(model, tokenizer(), max_batch=2, compile=True)
    try:
        prompt = tokenizer().encode("Every effort")
        sink = Collector()
        settings = GenerationConfig(max_new_tokens=5, eos_id=tokenizer().eot_id, overflow="error")
        engine.submit([EngineRequest(list(prompt), settings, sink)])
        sink.wait()
        assert sink.tokens == offline(model, prompt, 5)
        assert calls  # the decode steps ran through the compiled model
    finally:
        engine.shutdown()
