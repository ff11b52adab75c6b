"""tinygpt.checks: one rule per kind of setting, one wording, bool never taken for a number."""

import math

import pytest

from tinygpt import checks
from tinygpt.checks import OptionError


@pytest.mark.parametrize("check,good,bad,rule", [
    (checks.positive_int, [1, 7], [0, -1, 1.0, True, "3", None], "must be an integer >= 1"),
    (checks.non_negative_int, [0, 5], [-1, 0.5, False, None], "must be an integer >= 0"),
    (checks.positive_number, [1e-9, 3, math.inf], [0, -1.0, math.nan, True, "1"], "must be a number > 0"),
    (checks.non_negative_number, [0, 0.0, 2.5], [-1e-9, math.nan, None], "must be a number >= 0"),
    (checks.fraction, [0, 0.5, 0.999], [1, 1.0, -0.1, math.nan, True], "must be a number in [0, 1)"),
])
def test_each_rule_accepts_and_refuses_with_the_field_and_the_rule(check, good, bad, rule):
    for value in good:
        check("x", value)
    for value in bad:
        with pytest.raises(OptionError) as info:
            check("x", value)
        assert str(info.value) == f"x={value!r} {rule}"
        assert (info.value.field, info.value.value, info.value.rule) == ("x", value, rule)
        assert isinstance(info.value, ValueError)  # callers that catch ValueError keep working


def test_optional_takes_none_and_says_so():
    checks.positive_int("top_k", None, optional=True)
    with pytest.raises(OptionError, match=r"^top_k=0 must be an integer >= 1 \(or unset\)$"):
        checks.positive_int("top_k", 0, optional=True)
    with pytest.raises(OptionError, match=r"^top_k=0 must be an integer >= 1 \(unset: no filter\)$"):
        checks.positive_int("top_k", 0, optional=True, note="(unset: no filter)")


def test_ranges_name_their_bounds():
    checks.int_in_range("layer", 3, 0, 3)
    with pytest.raises(OptionError, match=r"layer=4 must be an integer in \[0, 3\]"):
        checks.int_in_range("layer", 4, 0, 3)
    checks.number_in_range("top_p", 1.0, 0, 1, low_open=True)
    with pytest.raises(OptionError, match=r"top_p=0 must be a number in \(0, 1\]"):
        checks.number_in_range("top_p", 0, 0, 1, low_open=True)
    with pytest.raises(OptionError, match=r"min_lr=0.5 must be a number in \[0, 0.1\]"):
        checks.number_in_range("min_lr", 0.5, 0, 0.1)


def test_choice_and_boolean():
    checks.choice("dtype", "float32", ("auto", "float32"))
    with pytest.raises(OptionError, match="dtype='fp8' is not allowed; allowed: auto, float32"):
        checks.choice("dtype", "fp8", ("auto", "float32"))
    checks.boolean("flag", False)
    for value in (0, 1, "true", None):
        with pytest.raises(OptionError, match="must be true or false"):
            checks.boolean("flag", value)


def test_every_settings_dataclass_uses_them():
    from tinygpt import GPTConfig
    from tinygpt.alignment import FinetuneOptions, PPOConfig
    from tinygpt.generation import GenerationConfig
    from tinygpt.training import TrainingOptions

    cases = [
        (lambda: TrainingOptions(batch_size=True).check(), "batch_size=True must be an integer >= 1"),
        (lambda: TrainingOptions(n_layers=0).check(), "n_layers=0 must be an integer >= 1 (or unset)"),
        (lambda: FinetuneOptions(warmup_steps=-1).check(), "warmup_steps=-1 must be an integer >= 0"),
        (lambda: FinetuneOptions(val_fraction=1.0).check(), "val_fraction=1.0 must be a number in [0, 1)"),
        (lambda: PPOConfig(gamma=1.5), "gamma=1.5 must be a number in [0, 1]"),
        (lambda: GenerationConfig(top_k=0), "top_k=0 must be an integer >= 1"),
        (lambda: GPTConfig(n_layers=0), "n_layers=0 must be an integer >= 1"),
        (lambda: GPTConfig(drop_rate=1.0), "drop_rate=1.0 must be a number in [0, 1)"),
    ]
    for make, message in cases:
        with pytest.raises(OptionError) as info:
            make()
        assert str(info.value).startswith(message), str(info.value)
