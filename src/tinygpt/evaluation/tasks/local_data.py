"""Loads a shipped task's JSON Lines file from this folder (lm-eval's ``custom_dataset`` hook).

A task YAML names its data as ``dataset_kwargs: {data_files: {test: NAME.jsonl}}``; lm-eval would hand that to
``datasets.load_dataset("json", ...)``, which resolves a relative name against the working directory. Resolving it
here, against this folder, lets the tasks run from anywhere and offline.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent


def load(data_files: dict[str, str], **_: Any):
    """``datasets.DatasetDict`` of the named splits (paths relative to this folder); other keywords (the task's
    metadata, which lm-eval passes along) are ignored."""
    import datasets

    files = {split: str(HERE / name) for split, name in data_files.items()}
    return datasets.load_dataset("json", data_files=files)
