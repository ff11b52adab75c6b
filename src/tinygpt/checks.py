"""Argument checks shared by every settings dataclass: one rule per kind of value, one wording per rule.

Each check returns nothing and raises ``OptionError`` (a ``ValueError``) naming the field, the value given and what
is allowed -- ``batch_size=0 must be an integer >= 1``. The error keeps the three parts apart so that the command
line can say the same with its flag name (``--batch-size 0 must be an integer >= 1``). ``bool`` is not accepted
where a number is asked for: ``True`` is an ``int`` to Python, never a batch size to a user.
"""

from __future__ import annotations

import math
from typing import Any, Iterable


class OptionError(ValueError):
    """A setting that breaks its rule; ``str()`` is ``"field=value rule"``."""

    def __init__(self, field: str, value: Any, rule: str) -> None:
        self.field, self.value, self.rule = field, value, rule
        super().__init__(f"{field}={value!r} {rule}")


def is_int(value: object) -> bool:
    """An ``int`` that is not a ``bool``."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: object) -> bool:
    """An ``int`` or ``float`` that is not a ``bool`` (NaN passes here; range checks reject it)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _unset(optional: bool) -> str:
    return " (or unset)" if optional else ""


def positive_int(name: str, value: Any, *, optional: bool = False, note: str = "") -> None:
    """An integer >= 1 (``optional``: or None)."""
    int_in_range(name, value, 1, None, optional=optional, note=note)


def non_negative_int(name: str, value: Any, *, optional: bool = False, note: str = "") -> None:
    """An integer >= 0 (``optional``: or None)."""
    int_in_range(name, value, 0, None, optional=optional, note=note)


def _wanted(kind: str, low: float | None, high: float | None, low_open: bool = False, high_open: bool = False
            ) -> str:
    """ "an integer in [1, 8]", "a number > 0", ...: what a range check allows, in words."""
    if low is not None and high is not None:
        return f"{kind} in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
    if low is not None:
        return f"{kind} {'>' if low_open else '>='} {low:g}"
    if high is not None:
        return f"{kind} {'<' if high_open else '<='} {high:g}"
    return kind


def _refuse(name: str, value: Any, wanted: str, optional: bool, note: str) -> None:
    # A note of an optional setting says what unset means, so it replaces the bare "(or unset)".
    raise OptionError(name, value, f"must be {wanted}{' ' + note if note else _unset(optional)}")


def int_in_range(name: str, value: Any, low: int | None, high: int | None, *, optional: bool = False,
                 note: str = "") -> None:
    """An integer in [low, high] (either bound may be None = unbounded)."""
    if optional and value is None:
        return
    if not (is_int(value) and (low is None or value >= low) and (high is None or value <= high)):
        _refuse(name, value, _wanted("an integer", low, high), optional, note)


def number_in_range(name: str, value: Any, low: float | None = None, high: float | None = None, *,
                    low_open: bool = False, high_open: bool = False, optional: bool = False,
                    note: str = "") -> None:
    """A finite-or-infinite number (not NaN) within the bounds; ``low_open`` / ``high_open`` exclude a bound."""
    if optional and value is None:
        return
    ok = is_number(value) and not math.isnan(value)
    if ok and low is not None:
        ok = value > low if low_open else value >= low
    if ok and high is not None:
        ok = value < high if high_open else value <= high
    if not ok:
        _refuse(name, value, _wanted("a number", low, high, low_open, high_open), optional, note)


def positive_number(name: str, value: Any, *, optional: bool = False, note: str = "") -> None:
    """A number > 0."""
    number_in_range(name, value, 0, None, low_open=True, optional=optional, note=note)


def non_negative_number(name: str, value: Any, *, optional: bool = False, note: str = "") -> None:
    """A number >= 0."""
    number_in_range(name, value, 0, None, optional=optional, note=note)


def fraction(name: str, value: Any, *, note: str = "") -> None:
    """A number in [0, 1): a share held out, a dropout rate."""
    number_in_range(name, value, 0, 1, high_open=True, note=note)


def choice(name: str, value: Any, allowed: Iterable[Any]) -> None:
    """One of ``allowed``."""
    allowed = list(allowed)
    if value not in allowed:
        raise OptionError(name, value, f"is not allowed; allowed: {', '.join(str(a) for a in allowed)}")


def boolean(name: str, value: Any) -> None:
    """``True`` or ``False`` (not 0/1, not a string)."""
    if not isinstance(value, bool):
        raise OptionError(name, value, "must be true or false")


def option(default: Any = None, help: str | None = None, **cli: Any) -> Any:
    """A dataclass field with its command-line description in ``metadata`` (read by ``tinygpt.cli.common``).

    ``help`` None keeps the field off the command line. ``cli`` may hold ``flag`` (default ``--field-name``),
    ``metavar``, ``choices``, ``nargs``, ``default_help`` (what the help says the default is, when it is computed)
    and ``group`` (fields of one group are mutually exclusive flags).
    """
    from dataclasses import field

    return field(default=default, metadata={"help": help, **cli})


def restated(owner: type, name: str, default: Any, **changes: Any) -> Any:
    """The field ``name`` of the dataclass ``owner`` with another ``default`` (and ``changes`` to its command-line
    metadata): how a subclass gives a setting its own default without writing its help again."""
    from dataclasses import field, fields

    inherited = next(f for f in fields(owner) if f.name == name)
    return field(default=default, metadata={**inherited.metadata, **changes})
