"""benchmarks/gguf_load.py --products: the two exact q8_0 products it times are exact (float32 rounding against the
float64 product of the q8_0 values) and Int8Linear's per-row requantisation is not; the JSON is written."""

import json

import pytest

from benchmarks import gguf_load


def test_products_table_and_the_exact_routes(tmp_path, capsys):
    pytest.importorskip("gguf")
    assert gguf_load.main(["--products", "--preset", "gpt2-small", "--repeats", "1",
                           "--json", str(tmp_path / "p.json")]) == 0
    rows = {row["way"]: row for row in json.loads((tmp_path / "p.json").read_text())["rows"]}
    assert rows["q8_0 exact: blocks dequantised"]["max_err_vs_q8_0"] < 1e-4
    assert rows["q8_0 exact: two int4 kernels"]["max_err_vs_q8_0"] < 1e-4
    assert rows["Int8Linear (per row)"]["max_err_vs_q8_0"] > 1e-3  # bf16 input and per-row scales
    assert rows["Int8Linear (per row)"]["of_int8"] == 1.0
    assert "x Int8Linear" in capsys.readouterr().out
