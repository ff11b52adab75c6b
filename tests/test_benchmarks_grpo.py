"""The GRPO demo benchmark runs end to end in quick mode (every command of the demo, tiny sizes), writes its JSON
and draws its figure. No timing or accuracy is asserted."""

from __future__ import annotations

import json

import pytest

from benchmarks import grpo_arithmetic

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.slow]


def test_quick_grpo_benchmark_runs_the_demo_commands(tmp_path, capsys):
    code = grpo_arithmetic.main(["--quick", "--out", str(tmp_path / "runs"), "--seeds", "0", "1", "--repeats", "1",
                                 "--json", str(tmp_path / "result.json"), "--figure", str(tmp_path / "acc.png")])
    assert code == 0 and (tmp_path / "acc.png").stat().st_size > 0
    result = json.loads((tmp_path / "result.json").read_text())
    assert [r["seed"] for r in result["grpo_runs"]] == [0, 1]
    assert result["throughput"]["same_completions"] is True  # together == one by one, on the trained model
    assert set(result["commands"]) == {"task", "pretrain", "sft"}
    assert all(0 <= r["accuracy_tool"] <= 1 and r["curve"] for r in result["grpo_runs"])
    assert "accuracy, tool" in capsys.readouterr().out
