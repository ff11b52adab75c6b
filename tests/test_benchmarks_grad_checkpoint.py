"""benchmarks/grad_checkpoint.py on a tiny model: both modes run in their own process, the same loss, a table."""

import json

from benchmarks import grad_checkpoint


def test_tiny_comparison(tmp_path, capsys):
    path = tmp_path / "out.json"
    assert grad_checkpoint.main(["--config", "tiny", "--batch-size", "2", "--context", "32", "--steps", "1",
                                 "--json", str(path)]) == 0
    result = json.loads(path.read_text())
    plain, checkpointed = result["runs"]["plain"][0], result["runs"]["checkpointed"][0]
    assert plain["loss"] == checkpointed["loss"]  # the same forward: checkpointing changes only the backward
    assert set(result["ratio_checkpointed_over_plain"]) == {"step_seconds", "peak_mib_added"}
    assert "checkpointed / plain" in capsys.readouterr().out
