import json

import torch

from benchmarks import shakespeare_char


def test_shakespeare_char_benchmark_runs_through_the_training_api(tmp_path, training_text_file, capsys):
    threads = torch.get_num_threads()
    try:
        assert shakespeare_char.main(["--data", str(training_text_file), "--steps", "3", "--threads", "1",
                                      "--json", str(tmp_path / "out.json")]) == 0
    finally:
        torch.set_num_threads(threads)
    figures = json.loads((tmp_path / "out.json").read_text())
    assert figures["steps"] == 3 and figures["config"]["n_layers"] == 4 and figures["config"]["emb_dim"] == 128
    assert figures["val_loss"] > 0 and figures["tokens_per_second_median"] > 0
    assert "val loss (tinygpt)" in capsys.readouterr().out
