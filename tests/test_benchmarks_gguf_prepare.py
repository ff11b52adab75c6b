"""benchmarks/gguf.py and benchmarks/prepare.py at toy sizes: their checks hold and their tables print; no timing
asserted."""

import pytest

pytest.importorskip("gguf")

from benchmarks import gguf as gguf_bench  # noqa: E402
from benchmarks import prepare as prepare_bench  # noqa: E402


@pytest.mark.slow
def test_gguf_benchmark_on_a_tiny_checkpoint(tmp_path, one_thread):
    """Every GGUF type through the benchmark's ``--model DIR`` path: a tiny GPT-2-shaped checkpoint with a trained
    300-token BPE vocabulary. (With GPT-2's 50,257 tokens every read-back spends seconds in gguf-py parsing the
    vocabulary; its export and read-back are tested in tests/test_interop_gguf.py.)"""
    import torch

    from tinygpt import GPTModel, get_config
    from tinygpt.checkpoint import save_model
    from tinygpt.tokenizer import BPETokenizer

    tokenizer = BPETokenizer.train([gguf_bench.PROMPT * 3, "the quick brown fox jumps over the lazy dog " * 20], 300)
    config = get_config("tiny").replace(vocab_size=tokenizer.vocab_size, context_length=64, emb_dim=64,
                                        qkv_bias=True, tie_weights=True)
    torch.manual_seed(0)
    save_model(GPTModel(config).eval(), tmp_path / "model", tokenizer=tokenizer)
    result = gguf_bench.measure("tiny", new_tokens=4, model_dir=str(tmp_path / "model"))
    assert result["f32_round_trip_exact"] and [r["type"] for r in result["rows"]] == ["f32", "f16", "q8_0", "q4_0"]
    assert result["rows"][0]["max_abs_logit_error"] == 0 and result["rows"][0]["greedy_agree"] == 4
    errors = [r["max_abs_logit_error"] for r in result["rows"]]
    sizes = [r["file_mb"] for r in result["rows"]]
    assert errors == sorted(errors) and errors[1] > 0  # fewer bits a weight: a larger error, a smaller file
    assert sizes == sorted(sizes, reverse=True)
    if "transformers_max_abs_diff" in result:  # transformers' GGUF loader reads the f32 file to the same logits
        assert result["transformers_max_abs_diff"] < 1e-4 * result["max_abs_logit"]
    assert "f32 round trip exact: True" in gguf_bench.table(result)


@pytest.mark.slow
def test_prepare_benchmark_gives_the_same_tokens_at_each_worker_count(tmp_path, one_thread):
    corpus = tmp_path / "c.txt"
    corpus.write_text("to be, or not to be: that is the question.\n" * 3000, encoding="utf-8")
    result = prepare_bench.measure(1, [1, 2], 1, "char", str(corpus))
    assert [r["workers"] for r in result["rows"]] == [1, 2] and all(r["identical"] for r in result["rows"])
    assert result["tokens"] == len(corpus.read_text())  # char: one token per character, no end-of-text id
    assert "same tokens.bin" in prepare_bench.table(result)
