"""benchmarks/gguf.py and benchmarks/prepare.py at toy sizes: their checks hold and their tables print; no timing
asserted."""

import pytest

pytest.importorskip("gguf")

from benchmarks import gguf as gguf_bench  # noqa: E402
from benchmarks import prepare as prepare_bench  # noqa: E402


@pytest.mark.slow
def test_gguf_benchmark_at_the_tiny_preset(gpt2_vocab_dir, monkeypatch, one_thread):
    monkeypatch.setenv("TINYGPT_GPT2_VOCAB", str(gpt2_vocab_dir))
    result = gguf_bench.measure("tiny", new_tokens=4)
    assert result["f32_round_trip_exact"] and [r["type"] for r in result["rows"]] == ["f32", "f16", "q8_0", "q4_0"]
    assert result["rows"][0]["max_abs_logit_error"] == 0 and result["rows"][0]["greedy_agree"] == 4
    assert "f32 round trip exact: True" in gguf_bench.table(result)


@pytest.mark.slow
def test_prepare_benchmark_gives_the_same_tokens_at_each_worker_count(tmp_path, one_thread):
    corpus = tmp_path / "c.txt"
    corpus.write_text("to be, or not to be: that is the question.\n" * 3000, encoding="utf-8")
    result = prepare_bench.measure(1, [1, 2], 1, "char", str(corpus))
    assert [r["workers"] for r in result["rows"]] == [1, 2] and all(r["identical"] for r in result["rows"])
    assert result["tokens"] == len(corpus.read_text())  # char: one token per character, no end-of-text id
    assert "same tokens.bin" in prepare_bench.table(result)
