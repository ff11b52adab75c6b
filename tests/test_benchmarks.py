"""The benchmark suite's runner works (quick mode, tiny sizes). No timing is ever asserted."""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from benchmarks import faults, forward_profile, gpu, memory, runner
from benchmarks.common import format_table, parse_shapes, time_interleaved, write_json_atomic
from benchmarks.models import available, build_tinygpt, forward_flops, quick_config
from tinygpt import generate_greedy


def test_time_interleaved_alternates_after_warmup():
    calls = []
    stats = time_interleaved({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}, warmup=1, repeats=3)
    assert calls == ["a", "b"] * 4
    assert set(stats) == {"a", "b"} and stats["a"]["samples"] == 3
    assert stats["a"]["min_s"] <= stats["a"]["median_s"] <= stats["a"]["max_s"]
    with pytest.raises(ValueError, match="repeats=0"):
        time_interleaved({"a": lambda: None}, warmup=0, repeats=0)


def test_forward_flops_match_the_counted_matmuls_plus_causal_attention():
    config = quick_config()
    model = build_tinygpt(config)
    batch, tokens = 2, 16
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model(torch.randint(0, config.vocab_size, (batch, tokens)))
    linears = counter.get_total_flops()  # projections and head (the counter leaves CPU SDPA out)
    # Query i sees i + 1 keys: a D-wide dot product per key for the scores and again for the weighted sum.
    attention = sum(2 * 2 * config.emb_dim * (i + 1) for i in range(tokens)) * batch * config.n_layers
    assert forward_flops(config, batch, tokens) == linears + attention


def test_quick_suite_runs_and_writes_json(tmp_path):
    path = tmp_path / "out" / "bench.json"
    assert runner.main(["--quick", "--json", str(path), "--only", "forward,train,bf16,generation"]) == 0
    result = json.loads(path.read_text())
    assert result["quick"] is True and result["ceiling"]["gflops_median"] > 0
    impls = {row["impl"] for row in result["forward"]["rows"]}
    assert "tinygpt" in impls
    for row in result["forward"]["rows"]:
        # Same weights in every implementation: the logits agree to float32 rounding.
        assert row["max_abs_logit_diff"] < 1e-4
        assert row["tokens_per_s"] > 0 and row["median_s"] > 0
    losses = {row["impl"]: row["first_loss"] for row in result["train"]["rows"]}
    if available("hf"):
        assert set(impls) >= {"tinygpt", "hf"}
        assert losses["hf"] == pytest.approx(losses["tinygpt"], abs=1e-4)  # same weights, same batch, same loss
        assert any(t["target"].startswith("train") for t in result["targets"])
    assert result["bf16"]["max_abs_logit_deviation"] < 0.1 * result["bf16"]["max_abs_logit_fp32"]
    assert "generation" in result
    assert "memory" not in result


def test_unknown_case_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exc:
        runner.main(["--quick", "--only", "forward,nope"])
    assert exc.value.code == 2
    assert "nope" in capsys.readouterr().err
    with pytest.raises(ValueError, match="allowed"):
        runner.run_suite(True, ["nope"])


@pytest.mark.slow
def test_memory_case_measures_fresh_processes(one_thread):
    # One child (tinygpt's); HF's row is the same measurement, taken here in this process, which has transformers
    # imported already in most runs of the suite (a child would spend seconds importing it again).
    result = memory.run(quick=True, works=("forward",), impls=("tinygpt",))
    rows = result["rows"]
    assert [(row["impl"], row["work"]) for row in rows] == [("tinygpt", "forward")]
    assert all(row["peak_rss_mib"] > 10 for row in rows)
    if available("hf"):
        row = memory.measure("hf", "forward", quick=True)
        assert (row["impl"], row["work"]) == ("hf", "forward") and row["peak_rss_mib"] > 10


def test_gpu_script_runs_tiny_on_cpu(tmp_path, capsys):
    path = tmp_path / "gpu.json"
    assert gpu.main(["--tiny", "--device", "cpu", "--steps", "3", "--json", str(path)]) == 0
    result = json.loads(path.read_text())
    assert result["compile"] is False
    train = result["train"]
    assert train["last_loss"] < train["first_loss"]  # the same batch every step: AdamW must fit it
    assert result["generate"]["decode_tokens_per_s"] > 0
    assert "MFU" in capsys.readouterr().out


def test_gpu_cached_decode_matches_greedy_generation():
    config = quick_config()
    model = build_tinygpt(config)
    prompt = torch.randint(0, config.vocab_size, (2, 5), generator=torch.Generator().manual_seed(0))
    ids = gpu.decode_greedy(model, config, prompt, new_tokens=7, dtype=torch.float32, device=torch.device("cpu"))
    assert torch.equal(ids, generate_greedy(model, prompt, 7))


@pytest.mark.parametrize("name,peak", [("NVIDIA H100 80GB HBM3", 989.0), ("NVIDIA H100 PCIe", 756.0),
                                       ("NVIDIA H200", 989.0), ("NVIDIA A100-SXM4-80GB", 312.0),
                                       ("Some Future GPU", None)])
def test_peak_table_by_device_name(name, peak):
    assert gpu.peak_tflops(name) == peak


def test_table_and_atomic_json(tmp_path):
    text = format_table([{"a": "x", "b": 1234.5}, {"a": "yy", "b": 0.5}], [("a", "A"), ("b", "B")])
    assert text.splitlines()[0].split() == ["A", "B"] and "1,234" in text and "0.5" in text
    path = tmp_path / "r.json"
    write_json_atomic(path, {"k": [1, 2]})
    assert json.loads(path.read_text()) == {"k": [1, 2]}
    assert [p.name for p in tmp_path.iterdir()] == ["r.json"]


def test_the_installed_package_never_imports_the_suite(capsys):
    # The suite's one entry point is `python -m benchmarks`, from a checkout; no `tinygpt bench` that would reach
    # into the source tree for it, and importing the package and its CLI loads no module of benchmarks/.
    from tinygpt.cli import main

    with pytest.raises(SystemExit) as exited:
        main(["bench", "--quick"])
    assert exited.value.code == 2 and "invalid choice: 'bench'" in capsys.readouterr().err
    code = ("import sys, tinygpt, tinygpt.cli, tinygpt.fast; tinygpt.cli.build_parser(); "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'benchmarks'))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


@pytest.mark.slow
@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the tunables are glibc's")
def test_faults_case_compares_malloc_settings_in_children():
    # 512 x 64 positions of the quick model's 320 logits are 40 MiB: above glibc's largest mmap threshold, so with
    # its defaults every forward's logits arrive as fresh pages; with mmap off and no trimming they are reused.
    # The median of 5 forwards: a heap that still grows in B's first two (seen once in CI, with the other test
    # worker busy: 4,096 faults in the median of 3) does not make the test flaky. Only the two variants compared
    # here, a child each (C differs from A only in an environment variable of torch's).
    variants = ["A (glibc defaults)", "B (keep freed memory)"]
    result = faults.run([(512, 64)], rounds=1, repeats=5, quick=True, variants=variants)
    by_variant = {row["variant"]: row for row in result["rows"]}
    assert list(by_variant) == variants and list(result["variants"]) == variants
    default, kept = by_variant["A (glibc defaults)"], by_variant["B (keep freed memory)"]
    assert default["speedup"] == 1.0  # the first variant named is the baseline
    assert default["faults"] >= 512 * 64 * 320 * 4 / 4096
    assert kept["faults"] < default["faults"] / 10
    assert "page faults" in faults.table(result)
    with pytest.raises(ValueError, match="rounds"):
        faults.run([(1, 8)], rounds=0, repeats=1, quick=True)


def test_parse_shapes():
    assert parse_shapes("1x128,8x256") == [(1, 128), (8, 256)]
    for bad in ("", "1x", "0x8", "1x2x3", "ax8"):
        with pytest.raises(argparse.ArgumentTypeError, match="batch x tokens"):
            parse_shapes(bad)


def test_forward_profile_groups_the_self_cpu_time(capsys):
    result = forward_profile.run([(2, 16), (1, 8)], repeats=2, quick=True)
    for prof in result["shapes"].values():
        assert abs(sum(prof["shares"].values()) - 1.0) < 1e-6
        assert prof["shares"]["matmul (linear layers, head)"] > 0 and prof["self_cpu_s"] > 0
    assert "2x16 %" in forward_profile.table(result)
    with pytest.raises(ValueError, match="context_length"):
        forward_profile.run([(1, 65)], repeats=1, quick=True)
    with pytest.raises(SystemExit):
        forward_profile.main(["--quick", "--shapes", "1x0"])
    assert "batch x tokens" in capsys.readouterr().err


def test_threads_benchmark_times_both_settings(tmp_path, capsys):
    from benchmarks import threads

    path = tmp_path / "threads.json"
    assert threads.main(["--repeats", "1", "--tokens", "2", "--json", str(path)]) == 0
    data = json.loads(path.read_text(encoding="utf-8"))
    assert data["tokens"] == 2 and set(data["stats"]) == {f"{data['cores']} threads (torch's default)", "1 thread"}
    assert all(s["samples"] == 1 and s["median_s"] > 0 for s in data["stats"].values())
    assert "default / one thread:" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        threads.main(["--repeats", "0"])
