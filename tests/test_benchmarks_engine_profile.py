"""The engine profile runs end to end in quick mode; no timing is asserted."""

from __future__ import annotations

import json

import pytest

from benchmarks import engine_profile


def test_quick_engine_profile_accounts_for_every_token_and_the_forward(tmp_path, capsys):
    assert engine_profile.main(["--quick", "--rows", "2", "--threads", "1", "--json", str(tmp_path / "out.json")]) == 0
    result = json.loads((tmp_path / "out.json").read_text())
    (run,) = result["runs"]
    assert run["rows"] == 2 and run["tokens"] == 2 * 1 * 4  # rows x requests x new tokens, all greedy to length
    assert 0 < run["forward_share"] <= 1
    assert abs(sum(run["shares"].values()) - 1) < 1e-6
    assert run["shares"][engine_profile.LINEAR] > 0 and run["linear_gflops"] > 0
    assert "cache gathers and writes %" in capsys.readouterr().out


@pytest.mark.parametrize("argv", [["--rows", "0"], ["--rows", "a,b"]])
def test_bad_row_counts_are_usage_errors(argv):
    with pytest.raises(SystemExit):
        engine_profile.main(["--quick", *argv])
