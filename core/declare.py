"""How a generation option is declared: once, as an attrs field carrying its bounds and its help.

An option is a field of a frozen attrs value (``Sampling``, ``Limits``, the Engine's ``GenerationOptions``) made by
``option(...)``. The field's name, annotation and default are attrs'; ``option`` adds the bounds (checked by the
field's validator, with one message shape) and the help text, and keeps both in the field's metadata, so every
surface that exposes the option is built from this one declaration: the Engine's keywords, the command line's
flags, the server's request fields and the batch records' keys read ``attrs.fields(...)`` and ``spec(field)``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs

from .checks import ArgumentError, check_number, is_int

_SPEC = "ortspec.option"


@attrs.frozen
class Bounds:
    """The values an option accepts: ``kind`` "int" or "number" (a finite int or float, not a bool), within
    ``[minimum, maximum]`` (``low_open`` / ``high_open`` exclude the end); ``None`` leaves that side open. ``none_ok``:
    ``None`` is also accepted (it means "unset")."""

    kind: str = "number"
    minimum: float | None = None
    maximum: float | None = None
    low_open: bool = False
    high_open: bool = False
    none_ok: bool = False

    def describe(self) -> str:
        """The accepted range in words, e.g. "a finite number in (0, 1]" or "an int >= 1"."""
        what = "an int" if self.kind == "int" else "a finite number"
        lo, hi = self.minimum, self.maximum
        if lo is not None and hi is not None:
            return f"{what} in {'(' if self.low_open else '['}{lo:g}, {hi:g}{')' if self.high_open else ']'}"
        if lo is not None:
            return f"{what} {'>' if self.low_open else '>='} {lo:g}"
        if hi is not None:
            return f"{what} {'<' if self.high_open else '<='} {hi:g}"
        return what

    def check(self, name: str, value: object) -> None:
        """``ArgumentError`` naming ``name`` unless ``value`` lies within these bounds."""
        if value is None and self.none_ok:
            return
        if self.kind == "int" and not is_int(value):
            raise ArgumentError(name, f"{name} must be {self.describe()}, got {value!r}")
        number: float = int(value) if self.kind == "int" else check_number(name, value)  # type: ignore[call-overload]
        lo, hi = self.minimum, self.maximum
        below = lo is not None and (number <= lo if self.low_open else number < lo)
        above = hi is not None and (number >= hi if self.high_open else number > hi)
        if below or above:
            raise ArgumentError(name, f"{name} must be {self.describe()}, got {value!r}")


@attrs.frozen
class OptionSpec:
    """What a declaration says beyond attrs: ``help`` (one sentence, the user's words) and ``bounds`` (None for
    options that are not plain numbers: their own converter or validator checks them)."""

    help: str
    bounds: Bounds | None = None


def option(
    default: Any,
    help: str,
    *,
    bounds: Bounds | None = None,
    converter: Callable[[Any], Any] | None = None,
    validator: Callable[[Any, Any, Any], None] | None = None,
    none_is_a_value: bool = False,
) -> Any:
    """An attrs field declaring one generation option: its default, help and bounds (see the module docstring).

    ``None`` (a JSON null, an unset flag) given for an option whose default is not None means the default, unless
    ``none_is_a_value`` (None is then one of the option's values, e.g. ``speculative=None``: plain decoding). The
    value is converted (``converter``), then checked (``bounds``, then ``validator(instance, field, value)``) as the
    field is set, so a value with several bad options names the first declared one."""

    def convert(value: Any, instance: Any, field: attrs.Attribute) -> Any:
        if value is None and default is not None and not none_is_a_value:
            value = default
        elif converter is not None:
            value = converter(value)
        if bounds is not None:
            bounds.check(field.name, value)
        if validator is not None:
            validator(instance, field, value)
        return value

    return attrs.field(
        default=default,
        converter=attrs.Converter(convert, takes_self=True, takes_field=True),
        metadata={_SPEC: OptionSpec(help=help, bounds=bounds)},
    )


def spec(field: attrs.Attribute) -> OptionSpec | None:
    """The declaration of an option field (None for a field that is not an option)."""
    return field.metadata.get(_SPEC)


def options_of(cls: type) -> tuple[tuple[attrs.Attribute, OptionSpec], ...]:
    """Every option field of an attrs class, in declaration order, with its spec."""
    return tuple((f, s) for f in attrs.fields(cls) if (s := spec(f)) is not None)
