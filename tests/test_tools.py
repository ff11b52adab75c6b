"""The calculator: exact arithmetic through ``ast`` (never ``eval``), bounded in size and time; its row state machine
forces ``result>>`` after ``<<expression=`` and nothing else."""

from __future__ import annotations

import pytest

from tinygpt.tools import Calculator, CalculatorError, calculate, tool_output


@pytest.mark.parametrize("expression, value", [
    ("4*12", "48"), ("71-9", "62"), ("7/2", "3.5"), ("1/3", "0.333333"), ("2**10", "1024"), ("(3+4)*5", "35"),
    ("-3--4", "1"), ("0.1+0.2", "0.3"), ("17//5", "3"), ("17%5", "2"), (" 1,000 + 1 ", "1001"), ("6÷3×2", "4"),
])
def test_calculate_is_exact_arithmetic(expression, value):
    assert calculate(expression) == value


@pytest.mark.parametrize("expression, fragment", [
    ("__import__('os').system('true')", "Call is not allowed"), ("x+1", "Name is not allowed"),
    ("1/0", "division by zero"), ("5%0", "division by zero"), ("2**1000", "exponents"), ("9**9*9**9*9**9*9**9"
                                                                                       "*9**9*9**9*9**9", "digits"),
    ("{1: 2}", "Dict is not allowed"), ("1+", "not an arithmetic expression"), ("", "empty"),
    ("1" * 300, "at most 200"), ("[1][0]", "not allowed"), ("'a'*3", "Constant is not allowed"),
])
def test_calculate_refuses_everything_else_with_a_reason(expression, fragment):
    with pytest.raises(CalculatorError, match=fragment.replace("(", r"\(")):
        calculate(expression)
    assert tool_output(expression) == "error>>"


def test_calculate_has_a_time_bound():
    with pytest.raises(CalculatorError, match="too long"):
        calculate("+".join(["1"] * 60), time_limit=-1.0)  # a bound already passed: refused at the first node


class _CharTokenizer:
    """One token per character: decode/encode are exact, which makes the forced tokens easy to read."""

    def decode(self, ids):
        return "".join(chr(i) for i in ids)

    def encode(self, text):
        return [ord(c) for c in text]


def test_the_calculator_forces_the_result_after_each_complete_call():
    calc, tok = Calculator(_CharTokenizer()), _CharTokenizer()
    forced = {}
    for i, ch in enumerate("so <<4*12= then <<48+2="):
        out = calc.advance(ord(ch))
        if out:
            forced[i] = tok.decode(out)
    assert forced == {9: "48>>", 22: "50>>"}  # after each "=", once; the first call is never answered twice
    assert calc.calls == [("4*12", "48>>"), ("48+2", "50>>")]
    assert calc.text == "so <<4*12=48>> then <<48+2=50>>"
    assert calc.allowed() is None and not calc.is_done()
    calc = Calculator(_CharTokenizer(), max_calls=1)
    outs = [calc.advance(ord(ch)) for ch in "<<1+1= <<2+2= a = b"]
    assert [tok.decode(o) for o in outs if o] == ["2>>"]  # the call budget is spent; a bare "=" calls nothing
