"""benchmarks/serve.py at tiny size: both servers start, every request is answered and counted; no timing
asserted."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

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


def _hf_serve_installed() -> bool:
    return importlib.util.find_spec("transformers") is not None and importlib.util.find_spec("fastapi") is not None


@pytest.fixture(scope="module")
def workloads_run():
    """One quick run of every workload, this checkout as both the server and its "before" (hf off): five server
    processes, started once for the tests that read it."""
    checkout = Path(__file__).resolve().parents[1]
    return serve.run(quick=True, clients=(1, 2), new_tokens=4, requests=1, hf=False, rounds=1,
                     workloads=serve.wl.WORKLOADS, before=checkout, phase_seconds=60)


@pytest.mark.slow
def test_quick_run_serves_every_request_on_both_servers(request):
    hf = _hf_serve_installed()
    # Without HF's server the run would hold tinygpt's rows only, which the every-workload run already has: its
    # throughput rows are checked here (same clients, requests and tokens) rather than starting a server again.
    result = (serve.run(quick=True, clients=(1, 2), new_tokens=4, requests=1, hf=True) if hf
              else request.getfixturevalue("workloads_run"))
    rows = {(r["impl"], r["clients"]): r for r in result["rows"]}
    hf_label = serve.LABELS["hf"]
    impls = ["tinygpt serve"] + ([hf_label] if hf and hf_label not in result["not_available"] else [])
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


def test_median_row_takes_the_median_of_each_figure_over_rounds():
    rows = [{"impl": "x", "tokens_per_s": v, "ttft_p50_ms": t, "cut_short": False} for v, t in
            ((3.0, 10.0), (1.0, 30.0), (2.0, 20.0))]
    row = serve.median_row(rows)
    assert (row["impl"], row["tokens_per_s"], row["ttft_p50_ms"], row["rounds"]) == ("x", 2.0, 20.0, 3)
    assert (row["tokens_per_s_min"], row["tokens_per_s_max"], row["cut_short"]) == (1.0, 3.0, False)
    assert serve.rotated(["a", "b", "c"], 1) == ["b", "c", "a"] and serve.rotated([], 2) == []


def test_workloads_measure_a_live_server():
    """Each workload of serve_workloads against an in-process server of a tiny model: every figure present."""
    import asyncio

    from benchmarks import serve_workloads as wl

    from serving_support import live_server, tiny_model

    sizes = wl.QUICK_SIZES

    def body(prompt, max_tokens):
        return {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}}

    words = "the quick brown fox jumps over the lazy dog every effort moves you forward".split()
    text = [" ".join(words[i:] + words[:i]) for i in range(len(words))]
    with live_server(tiny_model(context_length=256), max_batch=8) as server:
        long = asyncio.run(wl.long_arrival(server.url, body, text[:2], " ".join(text[:4]), sizes, timeout=60))
        prefix = asyncio.run(wl.shared_prefix(server.url, body, " ".join(text[:3]), text, sizes))
        chat = asyncio.run(wl.conversation(server.url, body, [text[:3], text[3:6]], sizes))
        one = asyncio.run(wl.one_stream(server.url, body, wl.COPY_PROMPT[:200], sizes))
    assert long["long_ttft_ms"] > 0 and set(long) == {"step_ms", "longest_gap_ms", "gap_over_step", "long_ttft_ms"}
    assert prefix["ttft_p95_ms"] >= prefix["ttft_p50_ms"] > 0
    assert [k for k in chat if k.startswith("turn")] == ["turn1_ttft_ms", "turn2_ttft_ms", "turn3_ttft_ms"]
    assert chat["last_over_first"] == pytest.approx(chat["turn3_ttft_ms"] / chat["turn1_ttft_ms"])
    assert one["tokens"] >= 1 and one["tokens_per_s"] > 0 and one["acceptance"] is None  # no drafts reported


def test_offline_speculative_rows_agree_with_plain_decoding():
    from benchmarks import serve_workloads as wl

    from serving_support import tiny_model

    rows = wl.offline_speculative(tiny_model(context_length=64), [5, 6, 7, 5, 6, 7, 5, 6], 12, rounds=2)
    assert set(rows) == {"lookup", "off"} and all(r["tokens"] >= 1 and r["tokens_per_s"] > 0 for r in rows.values())
    assert rows["lookup"]["same_tokens"] and rows["off"]["acceptance"] is None
    assert 0 <= rows["lookup"]["acceptance"] <= 1


@pytest.mark.slow
def test_quick_run_of_every_workload_against_this_checkout_as_before_and_after(workloads_run):
    result = workloads_run
    impls = {r["impl"] for r in result["rows"]}
    assert {"tinygpt serve", "tinygpt serve (before)", "tinygpt offline generate"} <= impls
    assert result["same_text_before"] == {1: 1.0, 2: 1.0}  # the same code, greedy: the same text
    for name in ("long-arrival", "shared-prefix", "conversation"):
        assert {"tinygpt serve", "tinygpt serve (before)"} <= {r["impl"] for r in result["tables"][name]}
    spec = {(r["task"], r["impl"]) for r in result["tables"]["speculative"]}
    assert ("copy", "offline engine lookup") in spec
    assert ("prose", "offline engine off") in spec
    assert "tinygpt/before at 2 clients" in result["ratios"]
    text = serve.table(result)
    assert "long-arrival" in text and "conversation" in text and "speculative" in text and "structured" in text
    structured = result["structured"]
    assert {(r["mode"], r["clients"]) for r in structured["rows"]} == {(m, c) for m in ("free", "json_schema")
                                                                       for c in (1, 2)}
    assert structured["valid_share_with_mask"] == 1.0 and structured["mask_us_median"] > 0
    assert "json_schema/unconstrained tokens/s at 2 clients" in result["ratios"]
    import json

    json.dumps(result)  # what --json writes


def test_prepare_serves_a_trained_model_with_its_own_tokenizer(tmp_path):
    """``--model``: the checkpoint's weights and tokenizer reach both servers' folders; a model without a Hugging
    Face form (a char tokenizer) gives the reason instead of a folder, and the HF servers are then skipped."""
    from tinygpt import GPTConfig, GPTModel, save_model
    from tinygpt.tokenizer import train_tokenizer

    text = "def f(x):\n    return x + 1\n" * 20
    for kind in ("bpe:300", "char"):
        tokenizer = train_tokenizer(kind, text)
        config = GPTConfig(vocab_size=tokenizer.vocab_size, context_length=32, emb_dim=16, n_heads=2, n_layers=1)
        trained = GPTModel(config)
        source = tmp_path / kind.replace(":", "-")
        save_model(trained, source, tokenizer=tokenizer)
        model, served_tokenizer, ours, theirs = serve.prepare(tmp_path / f"out-{source.name}", serve.gpt2_small(),
                                                              source)
        assert model.config == config and served_tokenizer.encode(text) == tokenizer.encode(text)
        for name, tensor in trained.state_dict().items():
            assert torch.equal(model.state_dict()[name], tensor), name
        assert (ours / "config.json").is_file()
        if kind == "char":
            assert isinstance(theirs, str) and "no Hugging Face form" in theirs and "char" in theirs
            servers = serve.Servers(tmp_path, ours, theirs, 2, lambda line: None)
            servers.add_hf("hf-cb", True)
            assert servers.running == {} and servers.not_available[serve.LABELS["hf-cb"]] == theirs
        else:
            assert (theirs / "model.safetensors").is_file() and (theirs / "tokenizer.json").is_file()


def test_bad_arguments(capsys):
    with pytest.raises(ValueError, match="workload 'x'"):
        serve.run(quick=True, workloads=["x"])
    with pytest.raises(ValueError, match="no src/tinygpt"):
        serve.run(quick=True, before="/nonexistent")
    with pytest.raises(SystemExit):
        serve.main(["--workloads", "throughput,nope"])
    assert "argument --workloads: nope is not allowed; allowed: throughput," in capsys.readouterr().err
    with pytest.raises(SystemExit):
        serve.main(["--model", "/nonexistent/model", "--workloads", "speculative", "--hf", "none"])
    assert "/nonexistent/model" in capsys.readouterr().err
