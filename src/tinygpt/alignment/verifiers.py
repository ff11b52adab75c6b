"""Verifiers: rewards a program computes (the answer is right or it is not), for GRPO.

A reward function is any Python function ``fn(prompt: str, completion: str, example: dict) -> float`` (``example``:
every field of the data entry, ``answer`` included); ``--reward-fn module:function`` names one (several are summed).
Shipped here:

- ``exact_answer``: 1.0 when the number after the completion's last ``Answer:`` equals the example's ``answer``
  (numerically: ``71``, ``71.0`` and ``+71`` all match 71), else 0.0;
- ``answer_format``: 1.0 for a completion that is calculator calls then ``Answer: <number>`` and nothing else
  (the shipped task's format, ``alignment.arithmetic``), 0.5 when it only contains an ``Answer: <number>``, else 0.

``RewardScorer`` calls them with a time bound and turns every failure (an exception, a value that is not a finite
number, a call slower than the bound) into a ``RewardError`` that names the function, the example and what was
wrong -- a one-line error for the command, never a traceback in the middle of a run.
"""

from __future__ import annotations

import concurrent.futures
import importlib
import math
import numbers
import re
from typing import Any, Callable, Mapping, Sequence

RewardFunction = Callable[[str, str, Mapping[str, Any]], float]
SHIPPED = {"exact": "tinygpt.alignment.verifiers:exact_answer", "format": "tinygpt.alignment.verifiers:answer_format"}
DEFAULT_TIME_LIMIT = 5.0  # seconds per call

_NUMBER = r"[-+]?\d+(?:\.\d+)?"
_ANSWER = re.compile(rf"Answer:\s*({_NUMBER})")
_FORMAT = re.compile(rf"\s*(?:<<[^<>]*>>\s*)*Answer:\s*{_NUMBER}\s*")


class RewardError(ValueError):
    """A reward function failed, or a ``--reward-fn`` cannot be loaded."""


def extract_answer(completion: str) -> float | None:
    """The number after the last ``Answer:`` of ``completion``, or None."""
    found = _ANSWER.findall(completion)
    return float(found[-1]) if found else None


def exact_answer(prompt: str, completion: str, example: Mapping[str, Any]) -> float:
    """1.0 when the completion's answer equals ``example["answer"]`` (numerically), else 0.0."""
    got = extract_answer(completion)
    want = example.get("answer")
    if got is None or want is None:
        return 0.0
    try:
        return float(math.isclose(got, float(want), rel_tol=0.0, abs_tol=1e-9))
    except (TypeError, ValueError):
        return 0.0


def answer_format(prompt: str, completion: str, example: Mapping[str, Any]) -> float:
    """1.0 for ``<<...>> ... Answer: N`` and nothing else, 0.5 for any text holding ``Answer: N``, else 0.0."""
    if _FORMAT.fullmatch(completion):
        return 1.0
    return 0.5 if _ANSWER.search(completion) else 0.0


def load_reward_fn(spec: str) -> tuple[str, RewardFunction]:
    """(name, function) for ``module:function`` or a shipped name (``exact``, ``format``); ``RewardError`` saying what
    is wrong otherwise."""
    if not isinstance(spec, str) or not spec:
        raise RewardError(f"--reward-fn {spec!r}: give module:function or one of {', '.join(SHIPPED)}")
    target = SHIPPED.get(spec, spec)
    module_name, sep, attribute = target.partition(":")
    if not sep or not module_name or not attribute:
        raise RewardError(f"--reward-fn {spec!r}: give module:function (a function in an importable module) or one "
                          f"of the shipped {', '.join(SHIPPED)}")
    try:
        module = importlib.import_module(module_name)
    except Exception as err:  # noqa: BLE001 -- any import failure is the user's module's: say so in one line
        raise RewardError(f"--reward-fn {spec!r}: cannot import {module_name!r} ({type(err).__name__}: {err})"
                          ) from None
    fn = getattr(module, attribute, None)
    if not callable(fn):
        raise RewardError(f"--reward-fn {spec!r}: {module_name!r} has no function {attribute!r}")
    return spec, fn


class RewardScorer:
    """The summed reward of the named functions for each (prompt, completion, example), each call time-bounded."""

    def __init__(self, functions: Sequence[tuple[str, RewardFunction]], time_limit: float = DEFAULT_TIME_LIMIT
                 ) -> None:
        if not functions:
            raise RewardError("at least one reward function is needed")
        self.functions = list(functions)
        self.time_limit = time_limit
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None

    def _call(self, name: str, fn: RewardFunction, prompt: str, completion: str, example: Mapping[str, Any],
              where: str) -> float:
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="reward")
        future = self._pool.submit(fn, prompt, completion, dict(example))
        try:
            value = future.result(timeout=self.time_limit)
        except concurrent.futures.TimeoutError:
            self._pool.shutdown(wait=False)  # the stuck call keeps its thread; the next scorer call gets a new one
            self._pool = None
            raise RewardError(f"reward function {name} took more than {self.time_limit:g} s on {where}") from None
        except Exception as err:  # noqa: BLE001 -- the user's function: report, never a traceback
            raise RewardError(f"reward function {name} raised {type(err).__name__} on {where}: {err}") from None
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(float(value)):
            raise RewardError(f"reward function {name} returned {value!r} on {where}; a reward must be a finite "
                              f"number (int or float)")
        return float(value)

    def __call__(self, prompts: Sequence[str], completions: Sequence[str], examples: Sequence[Mapping[str, Any]],
                 where: Sequence[str]) -> list[float]:
        """One reward per completion; ``where[i]`` names example i in errors ("train.jsonl: line 12")."""
        return [sum(self._call(name, fn, p, c, e, w) for name, fn in self.functions)
                for p, c, e, w in zip(prompts, completions, examples, where)]
