"""benchmarks.decode_split: the layers' exclusive times add up to the whole, the timers come off afterwards, and bad
arguments are refused."""

from __future__ import annotations

import json

import pytest

from benchmarks import decode_split
from tinygpt.inference.engine import InferenceEngine
from tinygpt.inference.runner import ModelRunner


def test_quick_run_splits_each_token_into_the_layers(tmp_path, capsys):
    before = (ModelRunner._run_model, ModelRunner.forward, InferenceEngine.step)
    path = tmp_path / "split.json"
    assert decode_split.main(["--quick", "--weights", "float32,int8", "--new-tokens", "6", "--llama-tok-s", "500",
                              "--json", str(path)]) == 0
    rows = json.loads(path.read_text())["rows"]
    assert [r["weights"] for r in rows] == ["float32", "int8"]
    for r in rows:
        parts = r["model"] + r["runner"] + r["engine"] + r["generate"]
        assert all(r[k] > 0 for k in ("model", "runner", "engine", "generate"))
        assert parts == pytest.approx(r["total"], rel=1e-9) and r["llama_us"] == pytest.approx(2000)
    assert (ModelRunner._run_model, ModelRunner.forward, InferenceEngine.step) == before
    assert "llama.cpp us/token" in capsys.readouterr().out


@pytest.mark.parametrize("args, message", [(["--weights", "fp8"], "allowed float32, bfloat16, int8"),
                                           (["--new-tokens", "0"], "must be >= 1")])
def test_bad_arguments_are_refused(args, message, capsys):
    with pytest.raises(SystemExit) as stop:
        decode_split.main(["--quick", *args])
    assert stop.value.code == 2
    assert message in capsys.readouterr().err
