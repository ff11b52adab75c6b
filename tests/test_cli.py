import json
import subprocess
import sys

import pytest

from tinygpt.cli import main


def test_params_table(capsys):
    assert main(["params", "--config", "gpt2-small"]) == 0
    assert "163,009,536" in capsys.readouterr().out


def test_params_json_with_flags(capsys):
    assert main(["params", "--config", "gpt2-small", "--qkv-bias", "--tie-weights", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["parameters"]["total"] == 124_439_808


def test_params_from_a_config_file(tmp_path, capsys):
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"vocab_size": 16, "context_length": 16, "emb_dim": 16, "n_heads": 4, "n_layers": 2}))
    assert main(["params", "--config", str(path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["parameters"]["total"] == 7264


def test_unknown_preset_is_one_line_exit_2(capsys):
    assert main(["params", "--config", "gpt9"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unknown config 'gpt9'" in err and "Traceback" not in err


def test_bad_arguments_exit_2(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["verify", "nope"])
    assert exc.value.code == 2
    assert capsys.readouterr().err.count("\n") == 1


def test_verify_missing_reference_exits_2(monkeypatch, capsys):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "transformers" else real(name, *a))
    assert main(["verify", "hf"]) == 2
    assert "pip install" in capsys.readouterr().err


def test_python_dash_m_is_the_same_command():
    out = subprocess.run([sys.executable, "-m", "tinygpt", "params", "--config", "tiny", "--json"],
                         capture_output=True, text=True, check=True).stdout
    assert json.loads(out)["parameters"]["total"] == 7264


@pytest.mark.slow
def test_verify_upstream_command(capsys):
    pytest.importorskip("llms_from_scratch")
    assert main(["verify", "upstream", "--json"]) == 0
    results = json.loads(capsys.readouterr().out)
    assert results[0]["dtype"] == "float64" and results[0]["max_abs_diff"] <= 1e-7
    assert all(r["passed"] for r in results)


def test_a_crowded_cpu_gets_one_line_saying_how_to_run_with_one_thread(monkeypatch, capsys, tmp_path):
    import os

    import torch

    from tinygpt.devices import crowded_cpu_note

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert crowded_cpu_note("tinygpt train", load=0.3, cores=2, threads=2) is None  # a quiet machine
    note = crowded_cpu_note("tinygpt train", load=6.2, cores=2, threads=2)
    assert note.startswith("tinygpt train: note: the load average is 6.2 on 2 cores") and note.count("\n") == 0
    assert note.endswith("OMP_NUM_THREADS=1 tinygpt train ...")
    assert crowded_cpu_note("tinygpt train", load=6.2, cores=2, threads=1) is None  # one thread already
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert crowded_cpu_note("tinygpt train", load=6.2, cores=2, threads=2) is None  # the user chose
    monkeypatch.delenv("OMP_NUM_THREADS")
    # at start-up of a command that runs a model on the CPU, before anything else
    monkeypatch.setattr(os, "getloadavg", lambda: (50.0, 40.0, 30.0))
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert main(["generate", "--model", str(tmp_path / "nope"), "--prompt", "a", "--device", "cpu"]) == 2
        assert main(["params"]) == 0  # computes a table: no note
    finally:
        torch.set_num_threads(before)
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2 and err[0].startswith("tinygpt generate: note: the load average is 50.0")
    assert err[1].startswith("tinygpt generate: error: ") and "no such folder" in err[1]
