"""The shipped task: the split follows the arithmetic alone, every worked solution is right (by the verifier and by
the calculator), and a share of solutions can give the bare answer instead."""

from __future__ import annotations

import re

import pytest

from tinygpt.alignment.arithmetic import make_problems, split_of
from tinygpt.alignment.verifiers import answer_format, exact_answer
from tinygpt.tools import calculate


def test_the_task_splits_by_its_arithmetic_and_solves_itself():
    train = make_problems(300, levels=(1, 2, 3), seed=1, split="train")
    test = make_problems(100, levels=(1, 2, 3), seed=2, split="test")
    assert {p.split for p in train} == {"train"} and {p.split for p in test} == {"test"}
    assert not {p.instruction for p in train} & {p.instruction for p in test}
    assert {p.level for p in train} == {1, 2, 3}
    for p in train + test:  # every worked solution is right, and right by the verifier
        assert exact_answer("", p.output, {"answer": p.answer}) == 1.0 and answer_format("", p.output, {}) == 1.0
    assert split_of("_add", (3, 4)) == split_of("_add", (3, 4)) and make_problems(5, seed=1) == make_problems(5, seed=1)
    with pytest.raises(ValueError, match="level 4"):
        make_problems(3, levels=(4,))


def test_a_direct_share_of_solutions_answers_by_heart():
    problems = make_problems(200, levels=(1, 2), seed=3, direct_share=0.5)
    direct = [p for p in problems if not p.output.startswith("<<")]
    assert 60 < len(direct) < 140 and all(p.output == f"Answer: {p.answer}" for p in direct)
    for p in problems:
        for expression, value in re.findall(r"<<([^=]*)=([^>]*)>>", p.output):
            assert calculate(expression) == value  # what the tool would force is what the solution says
    with pytest.raises(ValueError, match="direct_share"):
        make_problems(3, direct_share=1.5)
