"""benchmarks/copy_model.py: the copy-task examples have the speculative workload's prompt format, rename whole
words only, and never hold the benchmark's own function. (Training itself is the training loop's, tested there.)"""

from __future__ import annotations

import ast
import io
import random
import tokenize

from benchmarks import copy_model
from benchmarks import serve_workloads as wl

SOURCE = '''
class Box:
    def put(self, item, count=1):
        """Put copies in the box."""
        items = [item] * count
        self.items.extend(items)
        return len(items)

def empty():
    return []
'''


def _tokens(code: str) -> list[str]:
    return [t.string for t in tokenize.generate_tokens(io.StringIO(code).readline)]


def test_functions_are_cut_and_dedented():
    found = list(copy_model._functions(SOURCE))
    assert sorted(code.splitlines()[0] for code in found) == ["def empty():", "def put(self, item, count=1):"]
    assert all(ast.parse(code) for code in found)
    assert list(copy_model._functions("def broken(:\n")) == []


def test_an_example_is_the_prompt_format_with_whole_words_renamed():
    put = next(code for code in copy_model._functions(SOURCE) if code.startswith("def put"))
    for seed in range(20):
        text = copy_model.rename_example(put, random.Random(seed))
        header, rest = text.split("\n\n", 1)
        original, renamed = rest.split("\n# Rewritten:\n\n")
        assert original == put
        renames = dict(pair.split("` renamed to `") for pair in
                       header.removeprefix("# Rewrite this function with `").removesuffix("`; change nothing else.")
                       .split("` and `"))
        assert set(renames) <= {"item", "count"} and renames  # never self, never a name the function has
        assert not set(renames.values()) & {"item", "items", "count", "self", "put", "box"}
        before, after = _tokens(put), _tokens(renamed)  # Python's own tokenizer, not the regex under test
        assert len(before) == len(after)
        assert all(b == a or (b in renames and a == renames[b]) for b, a in zip(before, after))
        assert {b for b, a in zip(before, after) if b != a} == set(renames)
        assert "self.items" in renamed  # `items` is not `item`: whole words only
        ast.parse(renamed)
    assert copy_model.rename_example("def empty():\n    return []\n", random.Random(0)) is None
    assert copy_model.rename_example("def m(self):\n    return self\n", random.Random(0)) is None
    assert wl.COPY_PROMPT.startswith("# Rewrite this function with `") and "\n# Rewritten:\n\n" in wl.COPY_PROMPT


def test_the_copy_task_text_is_seeded_and_never_holds_the_benchmarks_function():
    text = copy_model.copy_task_text(3, seed=1)
    assert text.count("# Rewritten:") == 3 and "top_p_filter" not in text
    assert copy_model.copy_task_text(3, seed=1) == text != copy_model.copy_task_text(3, seed=2)
