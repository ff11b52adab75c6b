"""benchmarks.ab's refactor case: two checkouts timed in child processes. No timing is asserted."""

from pathlib import Path

import pytest

from benchmarks import ab, ab_refactor

CHECKOUT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_refactor_case_compares_two_checkouts_and_finds_this_one_identical_to_itself(tmp_path):
    result = ab_refactor.run(CHECKOUT, CHECKOUT, [(1, 8)], rounds=1, repeats=1, quick=True)
    assert [r["case"] for r in result["rows"]] == ["forward 1x8", "cached decode 1x16+8", "train step 2x32"]
    assert all(r["identical"] and r["ratio"] > 0 for r in result["rows"])
    assert result["before"] == result["after"] == str(CHECKOUT / "src")
    assert "speed after/before" in ab_refactor.table(result)


def test_refactor_case_refuses_a_folder_that_is_no_checkout(tmp_path, capsys):
    with pytest.raises(ValueError, match="is not a tinygpt checkout"):
        ab_refactor.run(tmp_path, CHECKOUT, [(1, 8)], rounds=1, repeats=1, quick=True)
    with pytest.raises(SystemExit):
        ab.main(["refactor"])
    assert "refactor needs --before DIR" in capsys.readouterr().err


def test_trained_case_times_both_routes_and_compares_their_gradients():
    from benchmarks.ab import parse_products, run_trained
    from tinygpt.fast import onednn

    if not onednn.available():
        pytest.skip("this torch has no oneDNN linear")
    result = run_trained(1, parse_products("8x16x24"))
    assert [r["variant"] for r in result["rows"]] == ["A (F.linear)", "B (oneDNN)"]
    assert all(r["rule"] == "F.linear" and r["max_abs_diff"].startswith("grads within") for r in result["rows"])
    assert float(result["rows"][0]["max_abs_diff"].split()[-1]) < 1e-4
    with pytest.raises(Exception, match="ROWSxINxOUT"):
        parse_products("8x16")


def test_decode_case_times_the_step_before_and_after_with_the_same_tokens():
    from benchmarks.ab import run_decode
    from tinygpt.fast import onednn
    from tinygpt.inference import engine

    rule, draws = onednn.INFERENCE_MIN_WEIGHT, engine._draws_greedy
    result = run_decode(1, ["char"], ["float32", "bfloat16"], [1, 2], 4, quick=True)
    assert [r["variant"] for r in result["rows"]] == ["A (before)", "B (lean step)"] * 4
    assert all(r["max_abs_diff"] == "tokens equal" and r["speedup"] > 0 for r in result["rows"])
    assert (onednn.INFERENCE_MIN_WEIGHT, engine._draws_greedy) == (rule, draws)  # A's swap is undone
