"""Every ```python block of README.md and docs/**/*.md runs, so the documentation cannot drift from the code.

The blocks of one file run in order in one namespace (a page builds on its earlier blocks, as a notebook does), in
a fresh working directory. A ```python block followed (blank lines apart) by a ```text block must print exactly that
text; trailing whitespace on each line and trailing blank lines do not count, and a decimal number may differ by one
in its last printed digit (a page that trains a model prints sums whose last float32 bits depend on the CPU's BLAS
kernels, which differ between CPU makers; such a bit can move a rounding by one). A page that calls ``gpt2_tokenizer()``
reads GPT-2's vocabulary from the tests' offline copy (``$TINYGPT_GPT2_VOCAB``), as a reader's tiktoken cache would.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import GPT2_VOCAB_DIR

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").rglob("*.md")])
FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)


@dataclass
class Block:
    line: int  # 1-based line of the opening fence
    code: str
    expected: str | None  # the ```text block right after it, if any


def python_blocks(text: str) -> list[Block]:
    """The page's ```python blocks, each with the ```text block that follows it (blank lines apart) or None."""
    fences = list(FENCE.finditer(text))
    blocks = []
    for i, fence in enumerate(fences):
        if fence.group(1) != "python":
            continue
        expected = None
        if i + 1 < len(fences) and fences[i + 1].group(1) == "text":
            between = text[fence.end() : fences[i + 1].start()]
            if not between.strip():
                expected = fences[i + 1].group(2)
        blocks.append(Block(text.count("\n", 0, fence.start()) + 1, fence.group(2), expected))
    return blocks


DECIMAL = re.compile(r"-?\d+\.\d+")


def normalised(output: str) -> str:
    return "\n".join(line.rstrip() for line in output.rstrip().splitlines())


def prints_the_same(got: str, want: str) -> bool:
    """``got`` equals ``want`` but for decimals one unit apart in the last printed digit (with that many digits)."""
    got_lines, want_lines = normalised(got).splitlines(), normalised(want).splitlines()
    if len(got_lines) != len(want_lines):
        return False
    for g, w in zip(got_lines, want_lines):
        # Spaces collapsed: a value at zero may print as -0.01 in one place and 0.00 in the other, one wider.
        if re.sub(" +", " ", DECIMAL.sub("#", g)) != re.sub(" +", " ", DECIMAL.sub("#", w)):
            return False
        for a, b in zip(DECIMAL.findall(g), DECIMAL.findall(w)):
            places = len(b.split(".")[1])
            if len(a.split(".")[1]) != places or abs(int(a.replace(".", "")) - int(b.replace(".", ""))) > 1:
                return False
    return True


def test_python_blocks_are_found_with_their_outputs() -> None:
    page = "x\n```python\nprint(1)\n```\n\n```text\n1\n```\n```bash\nls\n```\n```python\npass\n```\n"
    blocks = python_blocks(page)
    assert [(b.line, b.code, b.expected) for b in blocks] == [(2, "print(1)\n", "1\n"), (12, "pass\n", None)]


@pytest.mark.parametrize(
    "got, want, same",
    [
        ("a 0.39 b\n", "a 0.40 b", True),  # one unit in the last digit
        ("a  -0.01\n", "a   0.00", True),  # across zero, one character narrower
        ("a 0.38", "a 0.40", False),  # two units
        ("a 0.395", "a 0.40", False),  # another number of digits
        ("loss 1.9", "loss 2.0", True),
        ("19,776 parameters", "19,777 parameters", False),  # integers stay exact
        ("a 0.40 b", "a 0.40 c", False),  # the words stay exact
        ("a 0.40\nb", "a 0.40", False),
    ],
)
def test_prints_the_same_allows_one_unit_in_the_last_decimal(got: str, want: str, same: bool) -> None:
    assert prints_the_same(got, want) is same


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_page_blocks_run(page: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, one_thread: None) -> None:
    text = page.read_text(encoding="utf-8")
    blocks = python_blocks(text)
    if not blocks:
        pytest.skip("no python blocks")
    monkeypatch.chdir(tmp_path)
    if (GPT2_VOCAB_DIR / "encoder.json").exists():
        monkeypatch.setenv("TINYGPT_GPT2_VOCAB", str(GPT2_VOCAB_DIR))
    elif "gpt2_tokenizer(" in text and not os.environ.get("TINYGPT_GPT2_VOCAB"):
        pytest.skip(f"the page reads GPT-2's vocabulary, which is not in {GPT2_VOCAB_DIR}")
    namespace: dict = {"__name__": "__doc_page__"}
    for block in blocks:
        where = f"{page.relative_to(ROOT)}:{block.line}"
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            exec(compile(block.code, where, "exec"), namespace)
        if block.expected is not None:
            if not prints_the_same(out.getvalue(), block.expected):
                assert normalised(out.getvalue()) == normalised(block.expected), f"{where} printed something else"
