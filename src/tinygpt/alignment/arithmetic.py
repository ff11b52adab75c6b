"""A generated task with exact answers: arithmetic word problems of graded difficulty, split train/test by construction.

Each problem is a short story with one, two or three operations (``level`` 1-3), its answer an integer, and a worked
solution in the calculator's call syntax (``tinygpt.tools``)::

    Mia has 23 pens. She buys 4 boxes with 12 pens in each. How many pens does Mia have now?
    <<4*12=48>> <<23+48=71>> Answer: 71

With the tool, the model writes ``<<4*12=`` and the calculator writes ``48>>`` (forced tokens); without it, the model
writes the whole line itself. The split is decided by the arithmetic alone (a hash of the template and the numbers,
never the names or items), so no test problem's computation is ever seen in training, whatever story carries it.

``write_task(out_dir)`` writes ``train.jsonl`` and ``test.jsonl`` (Alpaca entries: ``instruction``, ``output``,
plus ``answer`` and ``level`` for the verifiers) and ``corpus.txt`` (the training solutions as plain text, for a
tokenizer and a first model).
"""

from __future__ import annotations

import json
import random
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

from ..fileio import atomic_write_text
from .data import format_prompt

NAMES = (("Mia", "She"), ("Tom", "He"), ("Ana", "She"), ("Leo", "He"), ("Zoe", "She"), ("Sam", "He"))
ITEMS = ("apples", "pens", "cards", "books", "shells", "stamps")
TEST_SHARE = 5  # one arithmetic in TEST_SHARE goes to the test split


@dataclass(frozen=True)
class Problem:
    """One word problem: the question, its integer answer, the worked solution, its level (operations) and split."""

    instruction: str
    output: str
    answer: int
    level: int
    split: str

    @property
    def prompt(self) -> str:
        return format_prompt(self.instruction)


def _solution(steps: list[tuple[str, int]]) -> str:
    return " ".join(f"<<{expression}={value}>>" for expression, value in steps) + f" Answer: {steps[-1][1]}"


# A template draws its numbers from ``rng`` and returns (key numbers, question, [(expression, value), ...]).
Template = Callable[[random.Random, str, str, str], tuple[tuple[int, ...], str, list[tuple[str, int]]]]


def _add(rng: random.Random, name: str, pronoun: str, item: str):
    a, b = rng.randint(2, 60), rng.randint(2, 40)
    return (a, b), f"{name} has {a} {item}. {pronoun} gets {b} more. How many {item} does {name} have now?", [
        (f"{a}+{b}", a + b)]


def _sub(rng: random.Random, name: str, pronoun: str, item: str):
    a = rng.randint(10, 90)
    b = rng.randint(1, a - 1)
    return (a, b), f"{name} has {a} {item}. {pronoun} gives away {b}. How many {item} are left?", [(f"{a}-{b}", a - b)]


def _mul(rng: random.Random, name: str, pronoun: str, item: str):
    a, b = rng.randint(2, 9), rng.randint(2, 12)
    return (a, b), f"{name} buys {a} boxes with {b} {item} in each. How many {item} does {name} buy?", [
        (f"{a}*{b}", a * b)]


def _div(rng: random.Random, name: str, pronoun: str, item: str):
    a, b = rng.randint(2, 12), rng.randint(2, 9)
    return (a, b), f"{name} shares {a * b} {item} equally among {b} friends. How many {item} does each get?", [
        (f"{a * b}/{b}", a)]


def _add_mul(rng: random.Random, name: str, pronoun: str, item: str):
    a, b, c = rng.randint(2, 40), rng.randint(2, 9), rng.randint(2, 12)
    return (a, b, c), (f"{name} has {a} {item}. {pronoun} buys {b} boxes with {c} {item} in each. How many {item} "
                       f"does {name} have now?"), [(f"{b}*{c}", b * c), (f"{a}+{b * c}", a + b * c)]


def _mul_sub(rng: random.Random, name: str, pronoun: str, item: str):
    a, b = rng.randint(2, 9), rng.randint(2, 12)
    c = rng.randint(1, a * b - 1)
    return (a, b, c), (f"{name} buys {a} boxes with {b} {item} in each. {pronoun} gives away {c}. How many {item} "
                       f"are left?"), [(f"{a}*{b}", a * b), (f"{a * b}-{c}", a * b - c)]


def _mul_add_mul(rng: random.Random, name: str, pronoun: str, item: str):
    a, b, c, d = rng.randint(2, 9), rng.randint(2, 12), rng.randint(2, 9), rng.randint(2, 12)
    return (a, b, c, d), (f"{name} buys {a} boxes with {b} {item} in each and {c} bags with {d} {item} in each. "
                          f"How many {item} does {name} buy?"), [
        (f"{a}*{b}", a * b), (f"{c}*{d}", c * d), (f"{a * b}+{c * d}", a * b + c * d)]


TEMPLATES: dict[int, tuple[Template, ...]] = {1: (_add, _sub, _mul, _div), 2: (_add_mul, _mul_sub), 3: (_mul_add_mul,)}


def split_of(template: str, numbers: tuple[int, ...]) -> str:
    """``"test"`` for one arithmetic (template + numbers) in ``TEST_SHARE``, else ``"train"``: a stable hash."""
    key = f"{template}:{','.join(map(str, numbers))}".encode()
    return "test" if zlib.crc32(key) % TEST_SHARE == 0 else "train"


def make_problems(n: int, *, levels: tuple[int, ...] = (1, 2), seed: int = 0, split: str | None = None,
                  direct_share: float = 0.0) -> list[Problem]:
    """``n`` distinct problems (levels drawn uniformly from ``levels``), only of ``split`` when given. A
    ``direct_share`` of them have the bare ``Answer: N`` as their solution, without the calculator calls: an SFT
    model trained on them answers some problems by heart, which GRPO can teach it not to do."""
    if not 0.0 <= direct_share <= 1.0:
        raise ValueError(f"direct_share={direct_share!r} must be in [0, 1]")
    for level in levels:
        if level not in TEMPLATES:
            raise ValueError(f"level {level!r} is not one of {sorted(TEMPLATES)}")
    if split not in (None, "train", "test"):
        raise ValueError(f"split={split!r} must be 'train', 'test' or None")
    rng = random.Random(seed)
    problems: list[Problem] = []
    seen: set[str] = set()
    for _ in range(200 * n):
        if len(problems) == n:
            return problems
        level = rng.choice(levels)
        template = rng.choice(TEMPLATES[level])
        name, pronoun = rng.choice(NAMES)
        numbers, question, steps = template(rng, name, pronoun, rng.choice(ITEMS))
        where = split_of(template.__name__, numbers)
        if question in seen or (split is not None and where != split):
            continue
        seen.add(question)
        direct = rng.random() < direct_share
        output = f"Answer: {steps[-1][1]}" if direct else _solution(steps)
        problems.append(Problem(question, output, steps[-1][1], level, where))
    raise ValueError(f"only {len(problems)} distinct problems of levels {levels} found; asked for {n}")


def write_task(out_dir: str | Path, *, train: int = 2000, test: int = 200, levels: tuple[int, ...] = (1, 2),
               seed: int = 0, direct_share: float = 0.0) -> dict[str, Path]:
    """Write ``train.jsonl``, ``test.jsonl`` and ``corpus.txt`` (each atomically) into ``out_dir``; their paths.
    ``direct_share``: of the training solutions (``make_problems``); the test solutions are all worked."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {}
    for split, n in (("train", train), ("test", test)):
        problems = make_problems(n, levels=levels, seed=seed + (split == "test"), split=split,
                                 direct_share=direct_share if split == "train" else 0.0)
        lines = [json.dumps({k: v for k, v in asdict(p).items() if k != "split"}) for p in problems]
        paths[split] = out / f"{split}.jsonl"
        atomic_write_text(paths[split], "\n".join(lines) + "\n")
        if split == "train":
            paths["corpus"] = out / "corpus.txt"
            atomic_write_text(paths["corpus"], "\n\n".join(p.prompt + p.output for p in problems) + "\n")
    return paths
