"""The package's import graph: no circle and no arrow back up, counting every import (module level, inside
functions, under ``TYPE_CHECKING``). Read from the source with ``ast``, so nothing is imported to check it.

Data flows one way (STYLE.md): config -> layers -> model -> ... -> inference -> generation -> (training | interop |
evaluation | serving ...) -> cli. The model files (``config``, ``layers``, ``model``, ``rope``) import nothing from
``inference/`` (the caches and their attention live there) and nothing from ``fast/`` beyond the kernels they name.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"

# The spine, bottom to top: a module may import from its own rank or below, never above. A subpackage is one node
# (``tinygpt.inference``); modules not listed are still held to the no-circle rule.
RANK = {
    "checks": 0, "fileio": 0, "devices": 0, "sampling": 0, "rope": 0, "fast": 0, "chat_template": 0, "figures": 0,
    "config": 1,
    "layers": 2,
    "model": 3, "params": 3, "tokenizer": 3, "quantize": 3,
    "checkpoint": 4,
    "lora": 5,
    "multi_lora": 6,
    "inference": 7, "kv_cache": 7,
    "generation": 8,
    "text_stream": 9,
    "training": 10, "interop": 10, "evaluation": 10, "experiments": 10, "verify": 10, "alignment": 10,
    "serving": 11,
    "cli": 12,
}
MODEL_FILES = {"config", "layers", "model", "rope"}
# fileio: the one JSON reader (GPTConfig.from_file), a standard-library leaf at rank 0
MODEL_MAY_IMPORT = {"tinygpt.config", "tinygpt.checks", "tinygpt.fileio", "tinygpt.rope", "tinygpt.layers",
                    "tinygpt.fast"}


def _modules(src: Path) -> dict[str, Path]:
    mods = {}
    for path in (src / "tinygpt").rglob("*.py"):
        parts = list(path.relative_to(src).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = path
    return mods


def import_graph(src: Path = SRC) -> dict[str, set[str]]:
    """module -> the tinygpt modules it imports anywhere in its source (``from .x import y`` names ``x.y`` when
    that is a module, else ``x``)."""
    mods = _modules(src)
    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = ".".join(package[:len(package) - node.level + 1] + ([node.module] if node.module else []))
                else:
                    base = node.module or ""
                if base.split(".")[0] != "tinygpt":
                    continue
                for alias in node.names:
                    full = f"{base}.{alias.name}"
                    found.add(full if full in mods else base)
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.split(".")[0] == "tinygpt":
                        found.add(alias.name)
        graph[name] = found - {name}
    return graph


def node_of(module: str) -> str:
    """The graph node a module belongs to: its first name under tinygpt (a subpackage is one node)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "tinygpt"


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_no_module_imports_itself_back_through_a_circle():
    assert _cycle(import_graph()) is None, " -> ".join(_cycle(import_graph()) or [])


def test_no_circle_between_packages():
    collapsed: dict[str, set[str]] = {}
    for module, imports in import_graph().items():
        if module in ("tinygpt", "tinygpt.__main__"):  # the package's own re-exports sit above everything
            continue
        collapsed.setdefault(node_of(module), set()).update(node_of(i) for i in imports if node_of(i) != node_of(module))
    cycle = _cycle(collapsed)
    assert cycle is None, " -> ".join(cycle or [])


def test_no_arrow_back_up():
    upward = sorted(f"{module} -> {imported}" for module, imports in import_graph().items() for imported in imports
                    if node_of(module) in RANK and node_of(imported) in RANK
                    and RANK[node_of(imported)] > RANK[node_of(module)])
    assert not upward, "\n".join(upward)


def test_the_model_files_import_no_engine():
    graph = import_graph()
    bad = sorted(f"{module} -> {imported}" for module in (f"tinygpt.{m}" for m in MODEL_FILES)
                 for imported in graph[module] if not any(imported == ok or imported.startswith(ok + ".")
                                                          for ok in MODEL_MAY_IMPORT))
    assert not bad, "\n".join(bad)


def test_the_graph_reader_sees_function_level_and_type_checking_imports(tmp_path):
    package = tmp_path / "tinygpt"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "low.py").write_text("def f():\n    from .sub import high\n")
    (package / "sub" / "__init__.py").write_text("")
    (package / "sub" / "high.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                             "    from .. import low\n")
    graph = import_graph(tmp_path)
    assert graph["tinygpt.low"] == {"tinygpt.sub.high"} and graph["tinygpt.sub.high"] == {"tinygpt.low"}
    assert _cycle(graph) is not None
