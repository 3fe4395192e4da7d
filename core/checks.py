"""Argument checks shared by the core's values: one idiom, one message shape (``ArgumentError`` naming the field).

``ArgumentError`` is the one error type for an argument a caller got wrong, here and in the Engine's own keyword
checks: a ``ValueError`` (the public contract: callers catch ``ValueError``) whose ``argument`` is the keyword's
name as the caller typed it (``"max_tokens"``, ``"stop"``, ``"temperature"``), so a front end can say which of its
own fields was wrong (the server maps ``argument`` to a request field) without reading the message.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np


class ArgumentError(ValueError):
    """A bad argument: ``str(exc)`` is the message (it names the argument first), ``exc.argument`` the keyword's
    name as the caller typed it (the whole keyword, e.g. ``"logit_bias"`` for a bad ``logit_bias[7]``)."""

    def __init__(self, argument: str, message: str) -> None:
        super().__init__(message)
        self.argument = argument

    def __reduce__(self) -> tuple[Any, ...]:
        # Exceptions pickle as type(exc)(*exc.args); args holds the message alone, so say how to rebuild this one
        # (batch workers and Ray send errors across processes).
        return type(self), (self.argument, str(self))


def is_int(value: object) -> bool:
    """An int (Python or numpy), not a bool."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, bool)


def check_int(name: str, value: object, minimum: int) -> int:
    """``value`` as an int; ``ArgumentError`` naming ``name`` unless it is an int >= ``minimum``."""
    if not is_int(value) or int(value) < minimum:  # type: ignore[call-overload]
        raise ArgumentError(name, f"{name} must be an int >= {minimum}, got {value!r}")
    return int(value)  # type: ignore[call-overload]


def int_at_least(minimum: int, name: str | None = None) -> Callable[[Any, Any, Any], None]:
    """An attrs validator: the field is an int >= ``minimum`` (the error names ``name`` or the field)."""

    def validate(instance: Any, attribute: Any, value: Any) -> None:
        check_int(name or attribute.name, value, minimum)

    return validate


def number_in(low: float, high: float, *, low_open: bool = False) -> Callable[[Any, Any, Any], None]:
    """An attrs validator: the field is a number (not a bool) in ``[low, high]`` (``(low, high]`` when
    ``low_open``); ``ArgumentError`` naming the field."""

    def validate(instance: Any, attribute: Any, value: Any) -> None:
        is_number = not isinstance(value, bool) and isinstance(value, (int, float))
        if not is_number or not (low < value if low_open else low <= value) or not value <= high:
            interval = f"{'(' if low_open else '['}{low}, {high}]"
            raise ArgumentError(attribute.name, f"{attribute.name} must be a number in {interval}, got {value!r}")

    return validate


def token_ids(name: str, values: Iterable[object]) -> tuple[int, ...]:
    """``values`` as a tuple of ints; ``ArgumentError`` naming ``name`` at the first one that is not an int >= 0."""
    out = []
    for v in values:
        if not is_int(v) or int(v) < 0:  # type: ignore[call-overload]
            raise ArgumentError(name, f"{name}: {v!r} is not a token id (a non-negative int)")
        out.append(int(v))  # type: ignore[call-overload]
    return tuple(out)


def ids_in_vocab(name: str, values: Iterable[object], vocab_size: int) -> tuple[int, ...]:
    """``token_ids`` that must also lie in ``[0, vocab_size)``."""
    ids = token_ids(name, values)
    for t in ids:
        if t >= vocab_size:
            raise ArgumentError(name, f"{name} holds token id {t}, outside the vocabulary [0, {vocab_size})")
    return ids


def check_number(name: str, value: object, *, argument: str | None = None) -> float:
    """``value`` as a float; ``ArgumentError`` naming ``name`` unless it is a finite int or float (not a bool).
    ``argument``: the keyword, when ``name`` is a part of it (``logit_bias[7]`` of ``logit_bias``)."""
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise ArgumentError(argument or name, f"{name} must be a finite number, got {value!r}")
    if not math.isfinite(float(value)):
        raise ArgumentError(argument or name, f"{name} must be a finite number, got {value!r}")
    return float(value)
