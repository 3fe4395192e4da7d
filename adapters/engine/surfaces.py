"""The generation options as each front end shows them, all derived from their one declaration.

Every generation option is declared once, as a field of ``GenerationOptions`` (its own, or inherited from the
core's ``Limits`` and ``Sampling``; ``core/declare.py``): name, type, default, bounds and help. This module turns
that declaration into the command line's flags (``add_flags`` / ``flag_values``) and the server's request fields
(``request_fields``); batch records take the field names as their keys. A new option is one declaration; every
surface shows it.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterable, Mapping
from typing import Any

import attrs

from ortspec.adapters.engine.options import GenerationOptions
from ortspec.core import Sampling, options_of
from ortspec.core.declare import OptionSpec

SAMPLING_OPTIONS: tuple[str, ...] = tuple(f.name for f in attrs.fields(Sampling))


def flag(name: str) -> str:
    """The command-line flag of an option: ``top_p`` -> ``--top-p``."""
    return "--" + name.replace("_", "-")


def declared(names: Iterable[str]) -> tuple[tuple[attrs.Attribute, OptionSpec], ...]:
    """The declarations of ``names`` (options of ``GenerationOptions``), in the order given."""
    table = {f.name: (f, s) for f, s in options_of(GenerationOptions)}
    return tuple(table[name] for name in names)


def _logit_bias_entry(text: str) -> tuple[int, float]:
    token, sep, bias = text.partition("=")
    try:
        if not sep:
            raise ValueError
        return int(token), float(bias)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected ID=BIAS (e.g. 13=-100), got {text!r}") from None


def _argument_type(field: attrs.Attribute, spec: OptionSpec) -> Any:
    if spec.bounds is not None:
        return int if spec.bounds.kind == "int" else float
    return str


def add_flags(group: Any, names: Iterable[str]) -> None:
    """Add one flag per option in ``names`` to an argparse parser or group: the type and the help come from the
    declaration; every default is None (unset: the declaration's default applies). ``logit_bias`` is
    ``--logit-bias ID=BIAS``, repeatable."""
    for field, spec in declared(names):
        help_text = f"{spec.help} (default {field.default!r})" if field.default not in (None, ()) else spec.help
        if field.name == "logit_bias":
            group.add_argument(
                flag(field.name),
                type=_logit_bias_entry,
                action="append",
                metavar="ID=BIAS",
                help=f"{spec.help} (repeatable)",
            )
            continue
        kind = _argument_type(field, spec)
        metavar = {int: "N", float: "X"}.get(kind, "VALUE")
        group.add_argument(flag(field.name), type=kind, default=None, metavar=metavar, help=help_text)


def flag_values(args: argparse.Namespace, names: Iterable[str]) -> dict[str, Any]:
    """The keywords of ``GenerationOptions`` for the flags of ``names`` that were given (unset ones left out)."""
    out: dict[str, Any] = {}
    for name in names:
        value = getattr(args, name, None)
        if value is None:
            continue
        out[name] = dict(value) if name == "logit_bias" else value
    return out


def request_fields(names: Iterable[str]) -> dict[str, tuple[Any, Any]]:
    """Pydantic field definitions (``create_model`` style: name -> (annotation, FieldInfo)) for the options in
    ``names``, each optional (None: the declaration's default), documented with the declaration's help and bounds.
    The bounds are documented, not enforced here: the Engine checks every value and the server answers 400 naming
    the field, as for every other refused value."""
    from pydantic import Field

    out: dict[str, tuple[Any, Any]] = {}
    for field, spec in declared(names):
        extra: dict[str, Any] = {}
        annotation: Any = Any
        if spec.bounds is not None:
            b = spec.bounds
            annotation = int | None if b.kind == "int" else float | None
            if b.minimum is not None:
                extra["exclusiveMinimum" if b.low_open else "minimum"] = b.minimum
            if b.maximum is not None:
                extra["exclusiveMaximum" if b.high_open else "maximum"] = b.maximum
        elif field.name == "logit_bias":
            annotation = dict[str, float] | None
        out[field.name] = (annotation, Field(default=None, description=spec.help, json_schema_extra=extra or None))
    return out


def json_logit_bias(value: Mapping[str, Any]) -> dict[int, float]:
    """A JSON object's ``logit_bias`` (string keys) as ``{token id: bias}``; ``ValueError`` naming ``logit_bias``."""
    try:
        return {int(k): v for k, v in value.items()}
    except (TypeError, ValueError):
        raise ValueError(f"logit_bias: keys must be token ids, got {json.dumps(list(value))[:80]}") from None
