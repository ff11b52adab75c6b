"""The chapter's and the block lesson's demonstrations as reproducible experiments: each prints a table and
writes a PNG and a JSON.

``run_NAME(out=None, seed=123, ...)`` returns an ``ExperimentReport`` (the printed text, the JSON data, the files);
``tinygpt experiment NAME`` calls the same function.
"""

from __future__ import annotations

from typing import Callable

from .activations import run_activations
from .anatomy import run_anatomy
from .attention import run_attention
from .ladder import run_ladder
from .layernorm import run_layernorm
from .prepost import run_prepost
from .report import ExperimentReport
from .residual import run_residual

EXPERIMENTS: dict[str, Callable[..., ExperimentReport]] = {
    "residual": run_residual,
    "prepost": run_prepost,
    "activations": run_activations,
    "layernorm": run_layernorm,
    "attention": run_attention,
    "anatomy": run_anatomy,
    "ladder": run_ladder,
}

__all__ = [
    "EXPERIMENTS",
    "ExperimentReport",
    "run_activations",
    "run_anatomy",
    "run_attention",
    "run_ladder",
    "run_layernorm",
    "run_prepost",
    "run_residual",
]
