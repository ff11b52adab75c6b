"""Plots tell the truth: every panel of every figure tinygpt writes names its axes, step and index axes tick at
whole numbers, and PPO's KL is labelled as the sample estimate it is. Checked on the Figure objects themselves."""

from __future__ import annotations

import pytest

from tinygpt.alignment.ppo_trainer import reward_kl_figure
from tinygpt.experiments import report, run_activations, run_anatomy, run_attention, run_layernorm, run_residual
from tinygpt.figures import integer_ticks, new_figure, save_png
from tinygpt.training.metrics import loss_figure


def _panels(fig):
    """(axes, is_colorbar) for every visible panel of ``fig``, drawn so that ticks are final."""
    fig.canvas.draw()
    return [(ax, hasattr(ax, "_colorbar")) for ax in fig.axes if ax.get_visible() and ax.axison]


def _unlabelled(fig) -> list[str]:
    """Titles (or indices) of panels lacking an axis label; a colorbar needs only its own (long-axis) label."""
    missing = []
    for i, (ax, is_colorbar) in enumerate(_panels(fig)):
        labelled = (ax.get_xlabel() or ax.get_ylabel()) if is_colorbar else (ax.get_xlabel() and ax.get_ylabel())
        if not labelled:
            missing.append(ax.get_title() or f"axes {i}")
    return missing


def _shown_ticks(axis) -> list[float]:
    low, high = sorted(axis.get_view_interval())
    return [t for t in axis.get_majorticklocs() if low - 1e-9 <= t <= high + 1e-9]


def _all_whole(ticks: list[float]) -> bool:
    return bool(ticks) and all(float(t).is_integer() for t in ticks)


def test_integer_ticks_only_at_whole_numbers(tmp_path):
    figs = [new_figure(7, 4), new_figure(7, 4)]  # the loss plot's size
    plain, fixed = (fig.add_subplot() for fig in figs)
    for ax in (plain, fixed):
        ax.plot([1, 2, 3], [0.5, 0.4, 0.3])
    integer_ticks(fixed.xaxis)
    for fig in figs:
        fig.canvas.draw()
    assert not _all_whole(_shown_ticks(plain.xaxis))  # matplotlib's default: 1.25, 1.5, ... for three steps
    assert _all_whole(_shown_ticks(fixed.xaxis))
    assert save_png(figs[1], tmp_path / "f.png").read_bytes()[:4] == b"\x89PNG"


def test_loss_figure_labels_both_axes_and_ticks_whole_steps():
    records = [{"step": s, "loss": 3.0 - 0.1 * s} for s in (1, 2, 3)]
    records[-1].update(train_loss=2.7, val_loss=2.8)
    fig = loss_figure(records, baseline=3.3)
    (ax, _), = _panels(fig)
    assert ax.get_xlabel() == "step" and "loss" in ax.get_ylabel()
    assert _all_whole(_shown_ticks(ax.xaxis))
    assert _unlabelled(fig) == []


def test_ppo_figure_calls_its_kl_a_sample_estimate():
    records = [{"step": s, "reward": 0.1 * s, "kl": (-0.01, 0.02, 0.05)[s - 1]} for s in (1, 2, 3)]
    records[-1]["val_reward"] = 0.4
    fig = reward_kl_figure(records)
    (top, _), (bottom, _) = _panels(fig)
    assert "sample estimate" in bottom.get_ylabel() and "KL" in bottom.get_ylabel()
    assert "log pi_old - log pi_ref" in bottom.get_legend().get_texts()[0].get_text()
    assert any(list(line.get_ydata()) == [0.0, 0.0] for line in bottom.get_lines())  # the estimate can dip below 0
    assert _unlabelled(fig) == []
    for ax in (top, bottom):
        assert _all_whole(_shown_ticks(ax.xaxis))
        assert any(label.get_visible() and label.get_text() for label in ax.get_xticklabels())


@pytest.fixture
def drawn_figures(monkeypatch):
    """Every figure the experiments hand to ``save_png``, by file stem."""
    figures: dict = {}
    real = report.save_png

    def capture(fig, path):
        figures[path.stem] = fig
        return real(fig, path)

    monkeypatch.setattr(report, "save_png", capture)
    return figures


def test_every_experiment_panel_names_its_axes(tmp_path, drawn_figures):
    run_residual(tmp_path / "residual", seed=1)
    run_activations(tmp_path / "activations")
    run_layernorm(tmp_path / "layernorm")
    run_anatomy(tmp_path / "anatomy", configs=["tiny", "gpt2-small"])
    run_attention(tmp_path / "attention", seed=1, config="tiny", prompt="hello world", layer=1)
    assert set(drawn_figures) == {"residual", "activations", "layernorm", "anatomy", "attention"}
    for stem, fig in drawn_figures.items():
        assert _unlabelled(fig) == [], stem


def test_long_attention_maps_tick_whole_positions(tmp_path, drawn_figures):
    from tinygpt import get_config

    config = get_config("tiny").replace(context_length=64, vocab_size=256)
    run_attention(tmp_path, seed=1, config=config, prompt="a prompt longer than forty characters, in bytes")
    for ax, is_colorbar in _panels(drawn_figures["attention"]):
        if not is_colorbar:
            assert _all_whole(_shown_ticks(ax.xaxis)) and _all_whole(_shown_ticks(ax.yaxis))
