"""Every ```python block of README.md and docs/**/*.md runs, so the documentation cannot drift from the code.

The blocks of one file run in order in one namespace (a page builds on its earlier blocks, as a notebook does), in
a fresh working directory. A ```python block followed (blank lines apart) by a ```text block must print exactly that
text; trailing whitespace on each line and trailing blank lines do not count. A page that calls ``gpt2_tokenizer()``
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


def normalised(output: str) -> str:
    return "\n".join(line.rstrip() for line in output.rstrip().splitlines())


def test_python_blocks_are_found_with_their_outputs() -> None:
    page = "x\n```python\nprint(1)\n```\n\n```text\n1\n```\n```bash\nls\n```\n```python\npass\n```\n"
    blocks = python_blocks(page)
    assert [(b.line, b.code, b.expected) for b in blocks] == [(2, "print(1)\n", "1\n"), (12, "pass\n", None)]


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
            assert normalised(out.getvalue()) == normalised(block.expected), f"{where} printed something else"
