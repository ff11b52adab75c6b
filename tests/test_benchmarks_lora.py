"""The LoRA benchmark runs end to end in quick mode (tiny sizes, a subprocess per configuration). No timing is
asserted; the trainable counts are exact."""

from __future__ import annotations

import json

import pytest

from benchmarks import lora

pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.slow]


def test_quick_lora_benchmark_has_a_row_per_configuration(tmp_path, monkeypatch):
    if not (lora.SHARED_DATA / "instruction-data.json").exists():
        pytest.skip("instruction data not found")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    # Every process costs seconds of imports: `run` spawns one each for the rows its ratios need (full, QLoRA,
    # peft); the other kinds (double-quantised QLoRA, DPO with LoRA) are measured here by the same function a child
    # runs, and their trainable counts checked against the children's.
    configs = ("full", "qlora-r8", "peft-r8")
    result = lora.run(True, configs=configs, steps=2)
    rows = {r["config"]: r for r in result["rows"]}
    assert set(rows) == set(configs) - set(result["not_available"])
    start = lora.save_start("gpt2-small", True, tmp_path / "start")
    for name in ("qlora-dq-r8", "dpo-lora-r8"):
        rows[name] = lora.measure(name, "gpt2-small", steps=2, batch=1, tokens=128, quick=True, start=start)
        assert rows[name]["config"] == name and rows[name]["size"] == "tiny" and rows[name]["steps"] == 2
    # r (in + out) for QKV (64 -> 192) and the output projection (64 -> 64), two layers
    expected = 2 * 8 * ((64 + 192) + (64 + 64))
    assert rows["qlora-r8"]["trainable"] == rows["qlora-dq-r8"]["trainable"] == rows["dpo-lora-r8"]["trainable"]
    assert rows["qlora-r8"]["trainable"] == expected
    assert rows["full"]["trainable"] > 10 * expected  # every weight
    if "peft-r8" in rows:
        assert rows["peft-r8"]["trainable"] == rows["qlora-r8"]["trainable"]
        assert rows["qlora-r8"]["speed_x_peft"] > 0 and rows["qlora-r8"]["rss_x_full"] > 0
    assert rows["dpo-lora-r8"]["reference_copy"] is False
    assert all(r["peak_rss_mib"] > 0 and r["step_s"] > 0 for r in rows.values())
    assert "RSS / full" in lora.table(result)
    json.dumps(result)  # what --json writes


def test_quick_lora_speed_benchmark_interleaves_both_sides():
    pytest.importorskip("peft")
    if not (lora.SHARED_DATA / "instruction-data.json").exists():
        pytest.skip("instruction data not found")
    from benchmarks import lora_speed

    result = lora_speed.run(True, ranks=(4,), steps=2)
    (row,) = result["rows"]
    assert row["size"] == "tiny" and row["r"] == 4 and row["steps"] == 2 and len(row["tokens"]) == 2
    assert row["tinygpt_step_s"] > 0 and row["peft_step_s"] > 0 and 0 < row["answer_share"] < 1
    assert row["speed_x_peft"] == pytest.approx(row["peft_step_s"] / row["tinygpt_step_s"])
    assert "speed / peft" in lora_speed.table(result)
    json.dumps(result)
