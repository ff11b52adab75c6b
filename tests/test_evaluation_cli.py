"""`tinygpt eval`: perplexity figures as the library computes them, tasks through lm-eval, and bad input as one
line with exit code 2."""

from __future__ import annotations

import json
import math
import os

import pytest

from tinygpt import load_checkpoint_tokenizer, load_model
from tinygpt.cli import main
from tinygpt.evaluation import perplexity, text_tokens

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

TEXT = ("The river ran past the mill and under the old stone bridge, where the children fished on summer "
        "evenings and the miller's dog slept in the shade. ") * 6


@pytest.fixture(scope="module")
def one_task_index():
    """lm-eval's ``TaskManager`` indexes its thousands of task files (seconds) each time it is built: the commands
    of this module share one, built for real by the first command that asks, per set of arguments (the same task
    folders give the same index; lm-eval's own evaluator shares one manager between runs just so)."""
    lm_eval_tasks = pytest.importorskip("lm_eval.tasks")
    real, built = lm_eval_tasks.TaskManager, {}

    def shared(*args, **kwargs):
        key = repr((args, sorted(kwargs.items())))
        if key not in built:
            built[key] = real(*args, **kwargs)
        return built[key]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(lm_eval_tasks, "TaskManager", shared)  # resolve_tasks imports it at each call
        yield built


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(["eval", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def _one_line_error(capsys, *argv: str) -> str:
    code, out, err = _run(capsys, *argv)
    assert code == 2 and out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tinygpt eval: error: "), err
    return lines[0]


def test_perplexity_of_a_text_file_as_json(eval_model_dirs, tmp_path, capsys):
    path = tmp_path / "river.txt"
    path.write_text(TEXT, encoding="utf-8")
    code, out, _ = _run(capsys, "--model", str(eval_model_dirs[0]), "--text", str(path), "--stride", "20",
                        "--json", "--no-progress")
    assert code == 0
    figures = json.loads(out)["perplexity"]
    model, tokenizer = load_model(eval_model_dirs[0]), load_checkpoint_tokenizer(eval_model_dirs[0])
    ids, n_bytes = text_tokens(tokenizer, TEXT)
    expected = perplexity(model, ids, window=64, stride=20, n_bytes=n_bytes)
    assert figures["loss"] == pytest.approx(expected.loss, abs=1e-6)
    assert figures["tokens"] == len(ids) - 1 and figures["bytes"] == len(TEXT.encode("utf-8"))
    assert figures["bits_per_byte"] == pytest.approx(expected.loss * figures["tokens"] / (math.log(2) * n_bytes))
    assert figures["window"] == 64 and figures["stride"] == 20


def test_perplexity_of_a_prepared_corpus(eval_model_dirs, tmp_path, capsys, gpt2_vocab_dir, monkeypatch):
    from tinygpt.training.data import PreparedCorpus, prepare_corpus

    monkeypatch.setenv("TINYGPT_GPT2_VOCAB", str(gpt2_vocab_dir))
    (tmp_path / "a.txt").write_text(TEXT * 3, encoding="utf-8")
    prepare_corpus([tmp_path / "a.txt"], "gpt2", tmp_path / "prepared", val_fraction=0.3, progress=False)
    code, out, _ = _run(capsys, "--model", str(eval_model_dirs[0]), "--data", str(tmp_path / "prepared"),
                        "--no-progress")
    assert code == 0 and out.startswith(f"perplexity of {tmp_path / 'prepared'} (val): loss ")
    val = PreparedCorpus.open(tmp_path / "prepared").val
    assert f"({len(val) - 1:,} tokens scored" in out


def test_shipped_task_through_the_command(eval_model_dirs, capsys, one_task_index):
    pytest.importorskip("lm_eval")
    code, out, _ = _run(capsys, "--model", str(eval_model_dirs[0]), "--tasks", "tinygpt_choice", "--limit", "3",
                        "--json", "--no-progress")
    assert code == 0
    figures = json.loads(out)["tasks"]["tinygpt_choice"]  # stdout is the JSON alone: lm-eval's notes go to stderr
    assert figures["items"] == 3 and set(figures) == {"acc", "acc_norm", "items"}
    assert all(figures[k] * 3 == round(figures[k] * 3) for k in ("acc", "acc_norm"))


def test_unknown_task_name(eval_model_dirs, capsys, one_task_index):
    pytest.importorskip("lm_eval")
    line = _one_line_error(capsys, "--model", str(eval_model_dirs[0]), "--tasks", "tinygpt_choice,no_such_task")
    assert "unknown task 'no_such_task'" in line and "tinygpt_lastword" in line


@pytest.mark.slow  # lm-eval indexes its thousands of task files first
def test_a_task_whose_data_cannot_be_downloaded_is_a_one_line_error(eval_model_dirs, capsys, one_task_index):
    pytest.importorskip("lm_eval")
    line = _one_line_error(capsys, "--model", str(eval_model_dirs[0]), "--tasks", "hellaswag", "--limit", "2")
    assert "--tasks hellaswag: cannot download the task's data" in line and "tinygpt_choice" in line


def test_task_file_that_does_not_parse(eval_model_dirs, tmp_path, capsys):
    pytest.importorskip("lm_eval")
    (tmp_path / "broken.yaml").write_text("task: broken\ndoc_to_text: [unclosed\n", encoding="utf-8")
    line = _one_line_error(capsys, "--model", str(eval_model_dirs[0]), "--tasks", "broken",
                           "--include-path", str(tmp_path))
    assert f"task file {tmp_path / 'broken.yaml'} does not parse" in line


def test_model_directory_that_is_not_a_model(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("not a model", encoding="utf-8")
    (tmp_path / "t.txt").write_text(TEXT, encoding="utf-8")
    line = _one_line_error(capsys, "--model", str(tmp_path), "--text", str(tmp_path / "t.txt"))
    assert str(tmp_path) in line and "config.json is missing" in line


def test_text_shorter_than_one_window(eval_model_dirs, tmp_path, capsys):
    (tmp_path / "short.txt").write_text("Too short to fill a window.", encoding="utf-8")
    line = _one_line_error(capsys, "--model", str(eval_model_dirs[0]), "--text", str(tmp_path / "short.txt"))
    assert "shorter than one window of 64 tokens" in line


@pytest.mark.parametrize("argv, message", [
    ([], "nothing to evaluate"),
    (["--text", "x.txt", "--window", "1"], "--window 1 must be an integer >= 2"),
    (["--text", "x.txt", "--batch-size", "0"], "--batch-size 0 must be an integer >= 1"),
    (["--tasks", "tinygpt_choice", "--stride", "8"], "--window and --stride apply to perplexity"),
    (["--text", "missing.txt"], "cannot read --text missing.txt"),
    (["--data", "missing_dir"], "missing_dir is not a prepared corpus"),
])
def test_argument_errors_before_the_model_loads(tmp_path, capsys, argv, message, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "x.txt").write_text(TEXT, encoding="utf-8")
    line = _one_line_error(capsys, "--model", "not-loaded", *argv)
    assert message in line
