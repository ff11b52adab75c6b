"""The lm-eval model class: the shipped tasks give the same figures through tinygpt's class as through lm-eval's own
Hugging Face class on the exported checkpoint (offline: the tasks' data ship with tinygpt)."""

from __future__ import annotations

import os

import pytest

pytest.importorskip("lm_eval")
pytest.importorskip("transformers")
pytest.importorskip("accelerate")  # lm-eval's HF class imports it

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import lm_eval  # noqa: E402
from lm_eval.api.instance import Instance  # noqa: E402
from lm_eval.api.registry import get_model  # noqa: E402

from tinygpt.evaluation.harness import TinyGPTLM  # noqa: E402
from tinygpt.evaluation.task_files import SHIPPED_TASKS, TASKS_DIR, resolve_tasks  # noqa: E402

from conftest import VERDICT  # noqa: E402

LIMIT = 8


@pytest.fixture(scope="module")
def manager():
    return resolve_tasks(list(SHIPPED_TASKS))[1]


@pytest.fixture(scope="module")
def hf_lm(eval_model_dirs):
    return get_model("hf")(pretrained=str(eval_model_dirs[1]), batch_size=4, device="cpu")


@pytest.fixture(scope="module")
def both_results(eval_model_dirs, manager, hf_lm):
    ours = lm_eval.simple_evaluate(model="tinygpt", model_args=f"path={eval_model_dirs[0]},batch_size=5",
                                   tasks=list(SHIPPED_TASKS), task_manager=manager, limit=LIMIT, log_samples=True,
                                   bootstrap_iters=0)
    theirs = lm_eval.simple_evaluate(model=hf_lm, tasks=list(SHIPPED_TASKS), task_manager=manager, limit=LIMIT,
                                     log_samples=True, bootstrap_iters=0)
    return ours, theirs


def test_the_class_is_registered_as_tinygpt():
    assert get_model("tinygpt") is TinyGPTLM


def test_shipped_tasks_are_found_offline(manager):
    assert set(SHIPPED_TASKS) <= set(manager.all_tasks)
    assert {p.name for p in TASKS_DIR.glob("*.yaml")} == {f"{name}.yaml" for name in SHIPPED_TASKS}


def test_same_metrics_as_lm_evals_hf_class(both_results):
    ours, theirs = both_results
    for task in SHIPPED_TASKS:
        mine, ref = ours["results"][task], theirs["results"][task]
        metrics = [k for k in ref if "," in k and "_stderr" not in k]
        assert metrics, task
        for key in metrics:
            if key.startswith("perplexity"):
                assert mine[key] == pytest.approx(ref[key], rel=1e-4), (task, key)
            else:
                assert mine[key] == ref[key], (task, key)  # accuracies: identical


def test_same_loglikelihoods_and_generations_per_request(both_results):
    ours, theirs = both_results
    compared = {"loglikelihood": 0, "generate_until": 0}
    for task in SHIPPED_TASKS:
        mine, ref = ours["samples"][task], theirs["samples"][task]
        assert len(mine) == len(ref) == LIMIT
        for a, b in zip(sorted(mine, key=lambda s: s["doc_id"]), sorted(ref, key=lambda s: s["doc_id"])):
            assert a["arguments"] == b["arguments"]
            for x, y in zip(a["resps"], b["resps"]):
                if isinstance(y[0], str):
                    assert x == y  # the same generated text, greedy
                    compared["generate_until"] += 1
                else:
                    assert x[0][0] == pytest.approx(y[0][0], abs=1e-4) and x[0][1] == y[0][1]
                    compared["loglikelihood"] += 1
    assert compared == {"loglikelihood": LIMIT + 4 * LIMIT, "generate_until": LIMIT}


def test_rolling_loglikelihood_over_several_windows_matches(eval_model_dirs, hf_lm):
    text = VERDICT.read_text(encoding="utf-8")
    docs = [text[:900], text[2000:2300], "A short one."]  # the first is ~200 tokens: four 64-token windows
    requests = [Instance(request_type="loglikelihood_rolling", doc={}, arguments=(d,), idx=i)
                for i, d in enumerate(docs)]
    ours = TinyGPTLM(path=str(eval_model_dirs[0]), batch_size=3, progress=False).loglikelihood_rolling(requests)
    theirs = hf_lm.loglikelihood_rolling(requests, disable_tqdm=True)
    assert ours == pytest.approx(theirs, abs=1e-4)


def test_constructor_errors_are_clear(eval_model_dirs, tmp_path):
    with pytest.raises(ValueError, match="exactly one of path"):
        TinyGPTLM()
    with pytest.raises(ValueError, match="batch_size='many'"):
        TinyGPTLM(path=str(eval_model_dirs[0]), batch_size="many")
    with pytest.raises(ValueError, match="config.json is missing"):
        TinyGPTLM(path=str(tmp_path))
