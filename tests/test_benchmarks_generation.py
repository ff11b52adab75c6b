"""benchmarks/generation.py in quick mode: every implementation runs and agrees with tinygpt; no timing asserted."""

import pytest

from benchmarks import generation
from benchmarks.models import available, build_tinygpt, quick_config


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    yield


def test_quick_run_compares_every_implementation_on_the_same_tokens():
    result = generation.run(quick=True, repeats=1)
    impls = {(r["shape"], r["impl"]) for r in result["rows"]}
    expected = {"tinygpt", "tinygpt-no-cache"} | {n for n, ref in (("hf", "hf"), ("upstream-kv-cache", "upstream"))
                                                  if available(ref)}
    assert {impl for shape, impl in impls if shape.startswith("1x")} == expected
    assert ("8x8+24", "tinygpt-no-cache") not in impls  # the uncached loop is timed at batch 1 only
    for row in result["rows"]:
        assert row["tokens_match"], row  # same weights, greedy: the same tokens everywhere
        assert row["tokens_per_s"] > 0 and row["samples"] >= 1
    assert result["copy_bandwidth"]["gbps_median"] > 0
    assert abs(sum(result["profile"]["shares"].values()) - 1.0) < 1e-6
    text = generation.table(result)
    assert "tinygpt-no-cache" in text and "copy bandwidth" in text


def test_weight_bytes_count_the_head_once_and_skip_the_embedding_rows():
    config = quick_config()  # tied head
    model = build_tinygpt(config)
    d, c = config.emb_dim, config.context_length
    total = sum(p.numel() for p in model.parameters())  # the tied matrix counted once
    assert generation.weight_bytes_per_step(model) == 4 * (total - c * d)
    untied = build_tinygpt(config.replace(tie_weights=False))
    assert generation.weight_bytes_per_step(untied) == 4 * (total - c * d)  # + head V x D - token table V x D
