"""The shipped lm-eval tasks and the checks done before a model is loaded: every named task exists, every task file
in an extra folder parses.

``TASKS_DIR`` holds the shipped tasks (lm-eval custom task YAMLs with their JSON Lines data, offline): a
LAMBADA-style last word (``tinygpt_lastword``), a HellaSwag-style four-way choice (``tinygpt_choice``) and a short
generated answer (``tinygpt_until``). Pass it to lm-eval as ``--include_path``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

TASKS_DIR = Path(__file__).resolve().parent / "tasks"
SHIPPED_TASKS = ("tinygpt_lastword", "tinygpt_choice", "tinygpt_until")


def _import_lm_eval() -> Any:
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        raise ValueError("lm-eval is not installed; install the extra: pip install 'tinygpt[eval]'") from None
    return lm_eval


def check_task_files(folder: str | Path) -> list[Path]:
    """Parse every ``*.yaml`` under ``folder`` as lm-eval reads it; a file that does not parse is a ``ValueError``
    naming it (lm-eval itself skips such a file silently, and its tasks then look unknown)."""
    _import_lm_eval()
    from lm_eval.tasks._yaml_loader import load_yaml

    folder = Path(folder)
    if not folder.is_dir():
        raise ValueError(f"task folder {folder} does not exist")
    files = sorted(folder.rglob("*.yaml"))
    for path in files:
        try:
            config = load_yaml(path, resolve_func=False)
        except Exception as err:  # yaml.YAMLError, ValueError (not a mapping), OSError, a bad include
            detail = " ".join(str(err).split())
            raise ValueError(f"task file {path} does not parse: {detail}") from None
        if "task" not in config and "group" not in config and "include" not in config:
            raise ValueError(f"task file {path} names no task: it needs a 'task:' (or 'group:') key")
    return files


def resolve_tasks(names: str | list[str], include_path: str | Path | None = None) -> tuple[list[str], Any]:
    """(task names, an lm-eval ``TaskManager`` that knows the shipped tasks, ``include_path``'s and lm-eval's own).

    ``names``: a list or comma-separated string. An unknown name is a ``ValueError`` listing the shipped tasks.
    """
    _import_lm_eval()
    from lm_eval.tasks import TaskManager

    wanted = [n.strip() for n in (names.split(",") if isinstance(names, str) else names)]
    if not wanted or any(not n for n in wanted):
        raise ValueError(f"--tasks {names!r} has an empty name; give comma-separated task names")
    paths = [TASKS_DIR]
    if include_path is not None:
        check_task_files(include_path)
        paths.append(Path(include_path))
    if include_path is None and set(wanted) <= set(SHIPPED_TASKS):
        # only tinygpt's own tasks: index just their folder, not lm-eval's few thousand task files (seconds saved)
        return wanted, TaskManager(include_path=[str(TASKS_DIR)], include_defaults=False)
    manager = TaskManager(include_path=[str(p) for p in paths])
    known = set(manager.all_tasks)
    unknown = [n for n in wanted if n not in known]
    if unknown:
        raise ValueError(f"unknown task {', '.join(map(repr, unknown))}; shipped (offline): "
                         f"{', '.join(SHIPPED_TASKS)}; lm-eval's own are listed by `lm-eval ls tasks`")
    return wanted, manager
