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
    configs = ("full", "qlora-r8", "qlora-dq-r8", "peft-r8", "dpo-lora-r8")  # a process each: a few, not all
    result = lora.run(True, configs=configs, steps=2)
    rows = {r["config"]: r for r in result["rows"]}
    assert set(rows) == set(configs) - set(result["not_available"])
    # r (in + out) for QKV (64 -> 192) and the output projection (64 -> 64), two layers
    expected = 2 * 8 * ((64 + 192) + (64 + 64))
    assert rows["qlora-r8"]["trainable"] == rows["qlora-dq-r8"]["trainable"] == rows["dpo-lora-r8"]["trainable"]
    assert rows["qlora-r8"]["trainable"] == expected
    if "peft-r8" in rows:
        assert rows["peft-r8"]["trainable"] == rows["qlora-r8"]["trainable"]
        assert rows["qlora-r8"]["speed_x_peft"] > 0 and rows["qlora-r8"]["rss_x_full"] > 0
    assert rows["dpo-lora-r8"]["reference_copy"] is False
    assert all(r["peak_rss_mib"] > 0 and r["step_s"] > 0 for r in rows.values())
    assert "RSS / full" in lora.table(result)
    json.dumps(result)  # what --json writes
