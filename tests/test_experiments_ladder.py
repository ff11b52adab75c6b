"""experiment ladder: the rungs add one change each, every run goes through the product's loop with a CPU-time
budget, and ladder.json's table is what its runs say."""

from __future__ import annotations

import json

import pytest

from tinygpt.cli import main
from tinygpt.config import MODERN_BLOCK
from tinygpt.experiments.ladder import RUNG_NAMES, ladder_table, rung_configs, run_ladder


def test_each_rung_adds_one_change_and_the_last_is_the_modern_block():
    rungs = rung_configs(50)
    assert [name for name, _, _ in rungs] == list(RUNG_NAMES)
    first = rungs[0][1]
    assert (first.norm, first.ffn, first.pos_emb, first.bias, first.tie_weights) == ("layernorm", "gelu", "learned",
                                                                                      True, True)
    assert [opt for _, _, opt in rungs] == ["adamw"] + ["muon"] * (len(rungs) - 1)
    for (_, above, _), (name, config, _) in zip(rungs, rungs[1:]):
        changed = {k for k, v in config.to_dict().items() if getattr(above, k) != v}
        assert len(changed) <= 2 and (changed or name == "muon"), (name, changed)  # bias moves with qkv_bias
    last = rungs[-1][1]
    assert all(getattr(last, k) == v for k, v in MODERN_BLOCK.items())
    with pytest.raises(ValueError, match="unknown rung 'swiglu'"):
        rung_configs(50, ["gpt2", "swiglu"])


def test_the_table_verdicts_follow_the_per_seed_differences():
    runs = [{"rung": r, "seed": s, "val_bpb": v, "steps": 10} for r, s, v in [
        ("a", 1, 2.0), ("a", 2, 2.2), ("b", 1, 1.9), ("b", 2, 2.1), ("c", 1, 2.0), ("c", 2, 2.0)]]
    rows = ladder_table(runs, ["a", "b", "c"])
    assert "verdict" not in rows[0] and rows[0]["val_bpb_mean"] == pytest.approx(2.1)
    assert rows[1]["verdict"] == "helps" and rows[1]["delta_mean"] == pytest.approx(-0.1)
    assert rows[2]["verdict"] == "no clear change"  # +0.1 on one seed, -0.1 on the other
    assert ladder_table([{**r, "val_bpb": -r["val_bpb"]} for r in runs], ["a", "b"])[1]["verdict"] == "hurts"


@pytest.mark.slow
def test_a_small_ladder_runs_and_its_json_recomputes_its_table(tmp_path, capsys):
    assert main(["experiment", "ladder", "--out", str(tmp_path), "--budget", "0.3s", "--seeds", "2",
                 "--rungs", "gpt2,zero-init", "--max-chars", "20000"]) == 0
    printed = capsys.readouterr().out
    data = json.loads((tmp_path / "ladder.json").read_text())
    assert data["rungs"] == ["gpt2", "zero-init"] and len(data["runs"]) == 4
    assert data["table"] == ladder_table(data["runs"], data["rungs"])
    assert all(run["curve"] and run["curve"][-1][0] >= 0.3 for run in data["runs"])  # the budget was spent
    assert (tmp_path / "ladder.png").stat().st_size > 0 and "verdict" in printed
    assert data["configs"]["zero-init"]["qk_norm"] is True  # the top rung keeps every change below it
    with pytest.raises(ValueError, match="budget"):
        run_ladder(out=tmp_path / "bad", budget="soon")
