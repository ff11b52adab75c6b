"""benchmarks.llamacpp (opt-in: a llama.cpp build): a short side-by-side runs, keeps the marginal and the
end-to-end decode rates, and refuses bad types."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from benchmarks import llamacpp

LLAMA_BIN = os.environ.get("TINYGPT_LLAMA_BIN")


@pytest.mark.llamacpp
@pytest.mark.slow
@pytest.mark.skipif(not LLAMA_BIN or not (Path(LLAMA_BIN or ".") / "llama-bench").is_file(),
                    reason="set TINYGPT_LLAMA_BIN to a llama.cpp build's bin folder (the recipe: benchmarks/llamacpp.py)")
def test_a_short_side_by_side_gives_both_decode_rates(tmp_path):
    path = tmp_path / "side.json"
    assert llamacpp.main(["--llama-bin", LLAMA_BIN, "--shape", "train-default", "--types", "f32", "--repeats", "1",
                          "--decode", "16", "--prompt", "16", "--json", str(path)]) == 0
    row, = json.loads(path.read_text())["rows"]
    assert row["gguf"] == "f32" and row["tinygpt"] == "float32"
    assert row["llama_decode"] > 0 and row["tinygpt_decode"] > 0 and row["tinygpt_decode_e2e"] > 0
    assert row["decode_ratio"] == pytest.approx(row["tinygpt_decode"] / row["llama_decode"])
    assert row["greedy_agreement"] == 1.0  # a float32 file: the same greedy tokens


def test_bad_types_are_refused(tmp_path, capsys):
    (tmp_path / "llama-bench").touch()
    (tmp_path / "llama-server").touch()
    with pytest.raises(SystemExit) as stop:
        llamacpp.main(["--llama-bin", str(tmp_path), "--types", "f32,q4_k"])
    assert stop.value.code == 2
    assert "--types q4_k: allowed f32, f16, q8_0" in capsys.readouterr().err
