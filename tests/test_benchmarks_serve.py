"""benchmarks/serve.py at tiny size: both servers start, every request is answered and counted; no timing
asserted."""

from __future__ import annotations

import importlib.util

import pytest

from benchmarks import serve


def test_phase_figures_come_from_the_records():
    records = [{"ttft_s": 0.1, "decode_s": 0.3, "tokens": 4}, {"ttft_s": 0.3, "decode_s": 0.0, "tokens": 1}]
    row = serve.phase_row("x", 2, 2.0, records)
    assert row["tokens"] == 5 and row["tokens_per_s"] == 2.5
    assert row["ttft_p50_ms"] == pytest.approx(200.0) and row["ttft_p95_ms"] == pytest.approx(290.0)
    assert row["per_token_p50_ms"] == pytest.approx(100.0)  # only requests with >= 2 tokens have one


def test_prompts_have_the_asked_lengths():
    tokenizer = serve._gpt2_tokenizer()
    prompts = serve.make_prompts(tokenizer, 12, 16, 64)
    lengths = [len(tokenizer.encode(p)) for p in prompts]
    assert len(set(lengths)) > 3 and min(lengths) >= 12 and max(lengths) <= 68  # re-encoding may merge a little


@pytest.mark.slow
def test_quick_run_serves_every_request_on_both_servers():
    hf = importlib.util.find_spec("transformers") is not None and importlib.util.find_spec("fastapi") is not None
    result = serve.run(quick=True, clients=(1, 2), new_tokens=4, requests=1, hf=hf)
    rows = {(r["impl"], r["clients"]): r for r in result["rows"]}
    impls = ["tinygpt serve"] + (["HF transformers serve"] if hf and "hf" not in result["not_available"] else [])
    for impl in impls:
        for c in (1, 2):
            row = rows[(impl, c)]
            assert row["requests"] == c and row["tokens"] >= c and row["tokens_per_s"] > 0
    offline = rows[("tinygpt offline generate", 1)]
    assert offline["tokens"] == 4
    assert rows[("tinygpt serve", 1)]["tokens"] == 4  # a random model does not stop early on these prompts
    assert "tinygpt serve/offline generate at 1 client" in result["ratios"]
    if len(impls) == 2:
        assert "tinygpt/hf at 2 clients" in result["ratios"]
        assert result["same_text"][1] == 1.0  # same weights, greedy: the same text
    assert "tokens/s" in serve.table(result)
