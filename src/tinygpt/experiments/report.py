"""What every experiment hands back and writes: a printed table, a JSON of the raw figures and a PNG.

Figures are drawn as ``tinygpt.figures`` draws every figure (a bare ``Figure`` on the Agg canvas, no pyplot).
JSON and PNG files are written atomically.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from matplotlib.figure import Figure

from .. import checks
from ..figures import new_figure, save_png
from ..fileio import atomic_write_with, check_output_dir

__all__ = ["DEFAULT_ROOT", "ExperimentReport", "check_seed", "finish", "format_table", "new_figure", "output_dir",
           "save_png", "write_json"]

DEFAULT_ROOT = Path("runs") / "experiments"


@dataclass
class ExperimentReport:
    """The outcome of one experiment: ``text`` is what the CLI prints, ``data`` is what the JSON holds."""

    name: str
    text: str
    data: dict[str, Any]
    files: dict[str, Path] = field(default_factory=dict)
    findings: list[str] = field(default_factory=list)


def output_dir(name: str, out: str | Path | None) -> Path:
    """``out`` or ``runs/experiments/NAME`` (relative to the working directory), created if missing."""
    path = DEFAULT_ROOT / name if out is None else Path(out)
    check_output_dir(path)  # not a file, writable, room on its disk: before the experiment runs
    path.mkdir(parents=True, exist_ok=True)
    return path


def _jsonable(value: Any) -> Any:
    """Floats that JSON cannot hold (inf, nan) become strings; tuples become lists; Paths become strings."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, Path):
        return str(value)
    return value


def write_json(path: Path, data: dict[str, Any]) -> Path:
    text = json.dumps(_jsonable(data), indent=2, sort_keys=False, allow_nan=False) + "\n"
    atomic_write_with(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))
    return path


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A plain aligned table: the first (label) column left-aligned, the others right-aligned."""
    cells = [[_cell(v) for v in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]

    def line(values: Sequence[str]) -> str:
        parts = [v.ljust(w) if i == 0 else v.rjust(w) for i, (v, w) in enumerate(zip(values, widths))]
        return "  ".join(parts).rstrip()

    return "\n".join([line(headers), line(["-" * w for w in widths]), *(line(r) for r in cells)])


def _cell(value: Any) -> str:
    if not checks.is_number(value):
        return str(value)
    if isinstance(value, int):
        return f"{value:,}"
    if value == 0 or 1e-3 <= abs(value) < 1e5:
        return f"{value:.4f}"
    return f"{value:.3e}"


def finish(name: str, directory: Path, title: str, tables: Sequence[str], data: dict[str, Any],
           findings: Sequence[str], figures: dict[str, Figure]) -> ExperimentReport:
    """Write the PNGs and ``NAME.json`` into ``directory`` and assemble the printed text."""
    files: dict[str, Path] = {}
    for stem, fig in figures.items():
        files[stem] = save_png(fig, directory / f"{stem}.png")
    files["json"] = directory / f"{name}.json"
    payload = {"experiment": name, **data, "findings": list(findings),
               "files": {k: v.name for k, v in files.items()}}
    write_json(files["json"], payload)
    lines = [title, ""]
    for table in tables:
        lines += [table, ""]
    lines += [f"- {f}" for f in findings]
    lines += [""] + [f"wrote {path}" for path in files.values()]
    return ExperimentReport(name=name, text="\n".join(lines), data=payload, files=files, findings=list(findings))


def check_seed(seed: int) -> int:
    checks.non_negative_int("seed", seed)
    return seed
