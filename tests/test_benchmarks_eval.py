"""benchmarks/eval.py in quick mode: both classes score the same requests to the same values; no timing asserted."""

import pytest

pytest.importorskip("lm_eval")
pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from benchmarks import eval as eval_bench  # noqa: E402


@pytest.mark.slow
def test_quick_run_scores_the_shipped_tasks_with_both_classes(one_thread):
    result = eval_bench.run(quick=True, repeats=1, batch_size=4)
    assert result["requests"] == 8 + 8 * 4  # 8 last-word items, 8 four-way choices
    assert {r["impl"] for r in result["rows"]} == {"tinygpt", "hf"}
    assert all(r["tokens_per_s"] > 0 and r["samples"] == 1 for r in result["rows"])
    assert result["max_abs_loglikelihood_diff"] < 1e-4 and result["same_greedy"]
    text = eval_bench.table(result)
    assert "tinygpt vs lm-eval's HF class" in text and "batch size 4 for both" in text
