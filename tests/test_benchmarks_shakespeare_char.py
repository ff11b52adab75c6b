import json
import textwrap

import pytest
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
    # The run's time outside its steps (setup, eval, sample, plot, checkpoints) is what the wall adds to the steps.
    assert 0 < figures["step_seconds_total"] < figures["wall_seconds"]
    assert figures["seconds_outside_steps"] == pytest.approx(figures["wall_seconds"] - figures["step_seconds_total"])
    assert "val loss (tinygpt)" in capsys.readouterr().out


# A stand-in for a nanoGPT checkout with nanoGPT's interface: prepare.py turns the input.txt beside it into
# train.bin/val.bin/meta.pkl; train.py takes a config file and --key=value overrides, reads data/<dataset>/ relative
# to its working directory and prints nanoGPT's "step N: ..." and "iter N: ... time ...ms" lines. It refuses to run
# on anything but the recipe and the text the benchmark promises.
FAKE_PREPARE = """
    import os, pickle
    import numpy as np
    here = os.path.dirname(__file__)
    data = open(os.path.join(here, "input.txt")).read()
    chars = sorted(set(data))
    ids = np.array([chars.index(c) for c in data], dtype=np.uint16)
    n = int(len(ids) * 0.9)
    ids[:n].tofile(os.path.join(here, "train.bin"))
    ids[n:].tofile(os.path.join(here, "val.bin"))
    pickle.dump({"vocab_size": len(chars)}, open(os.path.join(here, "meta.pkl"), "wb"))
"""
FAKE_TRAIN = """
    import os, sys
    import numpy as np
    settings = {}
    exec(open(sys.argv[1]).read(), {}, settings)
    settings.update(arg[2:].split("=", 1) for arg in sys.argv[2:])
    expected = {"device": "cpu", "compile": "False", "eval_iters": "20", "log_interval": "1", "block_size": "64",
                "batch_size": "12", "n_layer": "4", "n_head": "4", "n_embd": "128", "dropout": "0.0",
                "max_iters": "7", "lr_decay_iters": "7"}
    wrong = {k: settings.get(k) for k, v in expected.items() if settings.get(k) != v}
    assert not wrong, wrong
    train = np.fromfile(os.path.join("data", settings["dataset"], "train.bin"), dtype=np.uint16)
    text = open(os.path.join("data", settings["dataset"], "input.txt")).read()
    assert len(train) == int(len(text) * 0.9), "not the benchmark's text"
    for it in range(int(settings["max_iters"]) + 1):
        if it % int(settings["eval_interval"]) == 0:
            print(f"step {it}: train loss {3 - 0.1 * it:.4f}, val loss {3.1 - 0.1 * it:.4f}")
        print(f"iter {it}: loss {3 - 0.1 * it:.4f}, time {50 if it % 5 else 400:.2f}ms, mfu -100.00%")
"""


def _fake_nanogpt(root):
    files = {"data/shakespeare_char/prepare.py": FAKE_PREPARE, "train.py": FAKE_TRAIN, "model.py": "",
             "configurator.py": "", "config/train_shakespeare_char.py": "dataset = 'shakespeare_char'\n"
                                                                       "eval_interval = 5\n"}
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(textwrap.dedent(text), encoding="utf-8")
    return {p.relative_to(root): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def test_nanogpt_side_by_side_runs_both_recipes_in_their_own_processes(tmp_path, training_text_file, capsys):
    checkout = tmp_path / "nanoGPT"
    before = _fake_nanogpt(checkout)
    out = tmp_path / "side.json"
    assert shakespeare_char.main(["--data", str(training_text_file), "--steps", "7", "--threads", "1",
                                  "--nanogpt", str(checkout), "--json", str(out)]) == 0
    figures = json.loads(out.read_text())
    nano, tiny = figures["runs"]["nanogpt"][0], figures["runs"]["tinygpt"][0]
    assert nano["command"].startswith("python train.py config/train_shakespeare_char.py --device=cpu")
    # nanoGPT's iterations 0..7; the eval iterations (0, 5: 400 ms) count at the median step (50 ms), their
    # remainder is outside the steps.
    assert nano["steps"] == 8 and nano["tokens_per_second_median"] == pytest.approx(12 * 64 / 0.05)
    assert nano["step_seconds_total"] == pytest.approx(8 * 0.05)
    assert nano["seconds_outside_steps"] == pytest.approx(nano["wall_seconds"] - 8 * 0.05)
    assert nano["val_loss"] == pytest.approx(2.6)
    assert tiny["steps"] == 7 and 0 < tiny["step_seconds_total"] < tiny["wall_seconds"]
    ratio = figures["ratio_tinygpt_over_nanogpt"]["wall_seconds"]
    assert ratio == pytest.approx(tiny["wall_seconds"] / nano["wall_seconds"])
    assert "tinygpt / nanoGPT" in capsys.readouterr().out
    after = {p.relative_to(checkout): p.read_bytes() for p in checkout.rglob("*") if p.is_file()}
    assert after == before  # the checkout is only read


def test_nanogpt_option_refuses_a_folder_that_is_not_a_checkout(tmp_path, training_text_file, capsys):
    (tmp_path / "train.py").write_text("")
    with pytest.raises(SystemExit) as exit_info:
        shakespeare_char.main(["--data", str(training_text_file), "--nanogpt", str(tmp_path)])
    assert exit_info.value.code == 2
    assert "not a nanoGPT checkout (missing model.py" in capsys.readouterr().err


def test_the_time_to_nanogpts_loss_counts_the_steps_before_the_first_eval_at_or_below_it():
    lines = []
    for it in range(9):
        if it % 4 == 0:
            lines.append(f"step {it}: train loss 2.0, val loss {2.2 - 0.1 * it:.4f}")  # 2.2, 1.8 (step 4), 1.4
        lines.append(f"iter {it}: loss 2.0, time {500 if it % 4 == 0 else 100:.2f}ms, mfu -100.00%")
    figures = shakespeare_char.nanogpt_figures("\n".join(lines), wall=5.0)
    # iterations 0..3 come before step 4's eval; iteration 0's line holds an eval, so it counts at the median
    assert figures["steps_to_target"] == 4 and figures["seconds_to_target"] == pytest.approx(4 * 0.1)
    assert shakespeare_char.nanogpt_figures(lines[0] + "\n" + lines[1], wall=1.0)["seconds_to_target"] is None


def test_tinygpt_side_reports_its_time_to_the_target_with_muon_and_the_modern_block(tmp_path, training_text_file):
    threads = torch.get_num_threads()
    try:
        assert shakespeare_char.main(["--data", str(training_text_file), "--steps", "3", "--threads", "1",
                                      "--optimizer", "muon", "--block", "modern", "--eval-every", "1",
                                      "--json", str(tmp_path / "out.json")]) == 0
    finally:
        torch.set_num_threads(threads)
    figures = json.loads((tmp_path / "out.json").read_text())
    assert figures["config"]["qk_norm"] is True and figures["optimizer"] == "muon"
    assert figures["steps_to_target"] is None and figures["seconds_to_target"] is None  # 3 steps: not reached
