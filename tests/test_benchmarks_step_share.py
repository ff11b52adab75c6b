"""benchmarks.step_share runs and its shares are shares (a smoke run: few steps, one thread)."""

from __future__ import annotations

import json

from benchmarks import step_share


def test_step_share_reports_the_shared_kernels_share_of_a_step(tmp_path, capsys):
    out = tmp_path / "share.json"
    assert step_share.main(["--steps", "3", "--threads", "1", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    (row,) = result["rows"]
    assert row["model"] == "tinygpt" and row["step_ms"] > 0
    assert 0 < row["shared_share"] < 1
    assert abs(row["shared_ms"] + row["rest_ms"] - row["step_ms"]) < 1e-6 * row["step_ms"] + 1e-9
    assert "shared kernels' share" in capsys.readouterr().out


def test_step_share_refuses_a_folder_without_nanogpts_model(tmp_path, capsys):
    import pytest

    with pytest.raises(SystemExit):
        step_share.main(["--nanogpt", str(tmp_path)])
    assert "no model.py there" in capsys.readouterr().err
