"""The alignment benchmark runs end to end in quick mode (tiny sizes). No timing is asserted."""

from __future__ import annotations

import json

import pytest

from benchmarks import alignment

pytestmark = pytest.mark.usefixtures("one_thread")


def test_quick_alignment_benchmark_has_a_row_per_stage(tmp_path):
    if not (alignment.SHARED_DATA / "instruction-data.json").exists():
        pytest.skip("instruction data not found")
    result = alignment.run(True, repeats=1, max_new_tokens=4)  # run(), not main(): main pins threads to all cores
    assert [r["stage"] for r in result["rows"]] == ["sft", "reward", "dpo", "ppo", "ppo rollout"]
    assert result["rows"][0]["x_sft"] == 1.0 and all(r["median_s"] > 0 for r in result["rows"])
    assert "x SFT step" in alignment.table(result)
    json.dumps(result)  # what --json writes
