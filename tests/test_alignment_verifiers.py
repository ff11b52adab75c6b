"""Verifiers: the shipped rewards on hand-written completions; user functions loaded by ``module:function``; every bad
function (raising, returning a non-number, too slow) a one-line ``RewardError`` naming the function and the example."""

from __future__ import annotations

import sys
import time

import pytest

from tinygpt.alignment.verifiers import (RewardError, RewardScorer, answer_format, exact_answer, extract_answer,
                                         load_reward_fn)


def test_exact_answer_reads_the_last_answer_numerically():
    example = {"answer": 71}
    assert exact_answer("", "<<4*12=48>> <<23+48=71>> Answer: 71", example) == 1.0
    assert exact_answer("", "Answer: 70 ... Answer: 71.0", example) == 1.0
    assert exact_answer("", "Answer: +71", example) == 1.0
    assert exact_answer("", "Answer: 17", example) == 0.0
    assert exact_answer("", "71", example) == 0.0  # no "Answer:": not an answer
    assert exact_answer("", "Answer: 71", {}) == 0.0
    assert extract_answer("Answer: -3.5") == -3.5 and extract_answer("nothing") is None


def test_answer_format_pays_for_the_task_format():
    assert answer_format("", "<<4*12=48>> <<23+48=71>> Answer: 71", {}) == 1.0
    assert answer_format("", "Answer: 3", {}) == 1.0
    assert answer_format("", "well <<4*12=48>> Answer: 71 and more", {}) == 0.5
    assert answer_format("", "<<4*12=48>>", {}) == 0.0


def _raises(prompt, completion, example):
    raise KeyError("answer")


def _text(prompt, completion, example):
    return "1.0"


def _nan(prompt, completion, example):
    return float("nan")


def _slow(prompt, completion, example):
    time.sleep(0.5)
    return 1.0


def test_user_functions_load_and_bad_ones_get_one_clear_line():
    name, fn = load_reward_fn("exact")
    assert fn is exact_answer and load_reward_fn("tinygpt.alignment.verifiers:answer_format")[1] is answer_format
    for spec, fragment in [("nocolon", "module:function"), ("no_such_module_xyz:f", "cannot import"),
                           ("tinygpt.alignment.verifiers:nothing", "has no function 'nothing'"), ("", "module:")]:
        with pytest.raises(RewardError, match=fragment):
            load_reward_fn(spec)
    module = sys.modules[__name__].__name__
    where = ["train.jsonl: line 3"]
    for fn, fragment in [(_raises, "raised KeyError on train.jsonl: line 3"), (_text, "returned '1.0'"),
                         (_nan, "returned nan"), (_slow, "took more than 0.1 s on train.jsonl: line 3")]:
        scorer = RewardScorer([(f"{module}:{fn.__name__}", fn)], time_limit=0.1)
        with pytest.raises(RewardError, match=fragment) as err:
            scorer(["p"], ["c"], [{}], where)
        assert "\n" not in str(err.value) and fn.__name__ in str(err.value)
    both = RewardScorer([load_reward_fn("exact"), load_reward_fn("format")])
    assert both(["p", "p"], ["Answer: 2", "x Answer: 3"], [{"answer": 2}, {"answer": 2}], ["a", "b"]) == [2.0, 0.5]
