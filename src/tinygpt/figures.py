"""The PNG figures tinygpt writes (loss curves, PPO's reward and KL, the experiments), drawn one way.

A figure is a bare ``matplotlib.figure.Figure`` with the Agg canvas attached explicitly: no GUI backend is touched,
pyplot's global state (and a user's ``matplotlib.use``) is left alone, and ``import matplotlib.pyplot`` is never
paid. PNGs are written atomically. Modules that draw only now and then (the training loops) import this module
inside their plotting function, so matplotlib stays out of their start-up.
"""

from __future__ import annotations

from pathlib import Path

from matplotlib.axis import Axis
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from .fileio import atomic_write_with


def new_figure(width: float, height: float, layout: str | None = None) -> Figure:
    """A figure bound to the Agg canvas (PNG output without any GUI backend); ``layout`` as for ``Figure``
    (``save_png`` applies ``tight_layout`` when none is set)."""
    fig = Figure(figsize=(width, height), dpi=100, layout=layout)
    FigureCanvasAgg(fig)
    return fig


def save_png(fig: Figure, path: Path) -> Path:
    if fig.get_layout_engine() is None:
        fig.tight_layout()
    # No "Software" metadata: the same seed gives the same bytes across matplotlib patch versions more often.
    atomic_write_with(path, lambda tmp: fig.savefig(tmp, format="png", metadata={"Software": None}))
    return path


def integer_ticks(axis: Axis) -> None:
    """Ticks only at whole numbers on ``axis`` (steps, layer and block indices): a run of 3 steps is not labelled
    1.25, 1.5, ..."""
    axis.set_major_locator(MaxNLocator(integer=True))
