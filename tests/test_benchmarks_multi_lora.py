"""The multi-adapter benchmark runs end to end in quick mode; no timing is asserted."""

from __future__ import annotations

import json

import pytest

from benchmarks import multi_lora


def test_quick_multi_lora_benchmark_times_every_case(tmp_path, capsys):
    assert multi_lora.main(["--quick", "--repeat", "1", "--rows", "4", "--adapters", "2",
                            "--json", str(tmp_path / "out.json")]) == 0
    result = json.loads((tmp_path / "out.json").read_text())
    cases = [r["case"] for r in result["table"]]
    assert cases == ["base", "attached, base rows", "one adapter", "mixed", "merged, one forward each"]
    assert all(r["step_ms"] > 0 for r in result["table"]) and result["table"][0]["x_base"] == 1.0
    assert "mixed / merged" in capsys.readouterr().out


def test_more_adapters_than_rows_is_a_usage_error():
    with pytest.raises(SystemExit):
        multi_lora.main(["--quick", "--rows", "2", "--adapters", "3"])
