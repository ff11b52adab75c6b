"""A calculator the model calls while it writes: safe arithmetic, and the per-row state machine that forces its output.

The call syntax is GSM8K's calculator annotation: the model writes ``<<4*12=`` and the tool writes ``48>>``. So

- ``calculate("4*12")`` evaluates an arithmetic expression (numbers, ``+ - * / // % **``, parentheses, unary
  signs) by walking its ``ast`` -- never ``eval`` -- with bounds on the text's length, the exponents and the
  size of every intermediate result, and a wall-clock bound; anything else is a ``CalculatorError`` naming what
  was wrong, and the forced text is then ``error>>`` (the model sees the tool refuse, and the run goes on);
- ``Calculator`` is a generation row's constraint (``tinygpt.inference.constraint.RowConstraint``): it decodes the
  tokens the row draws, and when a call is complete (``<<`` ... ``=``) its ``advance`` returns the result's tokens,
  which the engine appends as *forced* tokens -- fed to the model, never sampled, flagged in ``Row.forced`` so a
  training loss can leave them out (a policy should not be credited or blamed for what the tool wrote).
"""

from __future__ import annotations

import ast
import math
import operator
import time
from fractions import Fraction
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    import torch

    from .tokenizer import Tokenizer

CALL_OPEN = "<<"  # the model opens a call ...
CALL_END = "="  # ... ends its expression ...
RESULT_END = ">>"  # ... and the tool's forced output is ``result>>``
MAX_EXPRESSION_CHARS = 200
MAX_DIGITS = 60  # no intermediate result beyond 10**60 (an exponent tower would otherwise take the CPU)
MAX_EXPONENT = 64
TIME_LIMIT_SECONDS = 0.05
ERROR_TEXT = "error"

_BINARY: dict[type, Callable[[Fraction, Fraction], Fraction]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
}
_UNARY: dict[type, Callable[[Fraction], Fraction]] = {ast.UAdd: operator.pos, ast.USub: operator.neg}


class CalculatorError(ValueError):
    """An expression the calculator refuses (not arithmetic, too long, too large, too slow, division by zero)."""


def calculate(expression: str, time_limit: float = TIME_LIMIT_SECONDS) -> str:
    """The value of an arithmetic ``expression`` as text: an integer when it is one ("48"), else a decimal rounded to
    6 places ("2.333333"). Exact (``Fraction``) throughout, so ``0.1+0.2`` is ``0.3``. ``CalculatorError`` names
    the problem for anything else."""
    if not isinstance(expression, str):
        raise CalculatorError(f"the expression must be text, got {type(expression).__name__}")
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"the expression is {len(expression)} characters; at most {MAX_EXPRESSION_CHARS}")
    text = expression.strip().replace("×", "*").replace("÷", "/").replace(",", "")
    if not text:
        raise CalculatorError("empty expression")
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError:
        raise CalculatorError(f"{expression!r} is not an arithmetic expression (numbers, + - * / // % **, "
                              f"parentheses)") from None
    deadline = time.perf_counter() + time_limit
    value = _evaluate(tree.body, deadline)
    return _format(value)


def _evaluate(node: ast.AST, deadline: float) -> Fraction:
    if time.perf_counter() > deadline:
        raise CalculatorError("the expression took too long")
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        if isinstance(node.value, float) and not math.isfinite(node.value):
            raise CalculatorError("numbers must be finite")
        return _bounded(Fraction(str(node.value)) if isinstance(node.value, float) else Fraction(node.value))
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_evaluate(node.operand, deadline))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY or isinstance(node, ast.BinOp) and isinstance(
            node.op, ast.Pow):
        left, right = _evaluate(node.left, deadline), _evaluate(node.right, deadline)
        if isinstance(node.op, ast.Pow):
            if right.denominator != 1 or abs(right) > MAX_EXPONENT:
                raise CalculatorError(f"exponents must be whole numbers of at most {MAX_EXPONENT}")
            if left == 0 and right < 0:
                raise CalculatorError("division by zero")
            return _bounded(left ** int(right))
        if type(node.op) in (ast.Div, ast.FloorDiv, ast.Mod) and right == 0:
            raise CalculatorError("division by zero")
        return _bounded(_BINARY[type(node.op)](left, right))
    raise CalculatorError(f"{type(node).__name__} is not allowed: only numbers, + - * / // % ** and parentheses")


def _bounded(value: Fraction) -> Fraction:
    if abs(value.numerator) >= 10 ** MAX_DIGITS or value.denominator >= 10 ** MAX_DIGITS:
        raise CalculatorError(f"a result has more than {MAX_DIGITS} digits")
    return Fraction(value)


def _format(value: Fraction) -> str:
    if value.denominator == 1:
        return str(value.numerator)
    text = f"{float(value):.6f}".rstrip("0").rstrip(".")
    return "0" if text in ("-0", "") else text


def tool_output(expression: str) -> str:
    """What the tool writes after ``<<expression=``: ``result>>``, or ``error>>`` when the calculator refuses."""
    try:
        return calculate(expression) + RESULT_END
    except CalculatorError:
        return ERROR_TEXT + RESULT_END


class Calculator:
    """One generation row's calculator (a ``RowConstraint``): it allows every token, and after the token that ends a
    call (``<<`` expression ``=``) it returns the result's tokens (``tool_output``) for the engine to force.

    It follows the row's text by decoding each drawn token (forced tokens are not passed to ``advance``; their text
    is added here when they are returned). ``calls``: the (expression, output) pairs made so far."""

    def __init__(self, tokenizer: Tokenizer, max_calls: int = 8) -> None:
        self.tokenizer = tokenizer
        self.max_calls = max_calls
        self.text = ""  # the row's new text so far (drawn and forced)
        self.searched = 0  # ``text`` before this holds no call opening still to be answered
        self.open_at: int | None = None  # where the expression of an open call starts in ``text``
        self.calls: list[tuple[str, str]] = []

    def allowed(self) -> torch.Tensor | None:
        return None

    def is_done(self) -> bool:
        return False

    def advance(self, token: int) -> list[int]:
        piece = self.tokenizer.decode([token])
        self.text += piece
        if self.open_at is None:
            if len(self.calls) >= self.max_calls:
                return []
            start = self.text.find(CALL_OPEN, self.searched)
            if start < 0:
                # "<" may be the first half of an opening split over two tokens: search it again next time
                self.searched = max(self.searched, len(self.text) - len(CALL_OPEN) + 1)
                return []
            self.open_at = start + len(CALL_OPEN)
        end = self.text.find(CALL_END, self.open_at)
        if end < 0:
            if len(self.text) - self.open_at > MAX_EXPRESSION_CHARS:  # never closed: stop watching this call
                self.open_at, self.searched = None, len(self.text)
            return []
        expression = self.text[self.open_at:end]
        output = tool_output(expression)
        self.calls.append((expression, output))
        self.text += output
        self.open_at, self.searched = None, len(self.text)
        return self.tokenizer.encode(output)
