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
import re
from collections.abc import Iterable, Mapping
from typing import Any

import attrs

from ortspec.adapters.engine.options import GenerationOptions
from ortspec.core import Sampling, options_of
from ortspec.core.declare import Bounds, OptionSpec
from ortspec.core.sampling import F32_TINY

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


def bounds_schema(bounds: Bounds) -> dict[str, Any]:
    """``bounds`` as JSON Schema keywords (beside the value's type): the one translation of a declaration's bounds,
    so a request field states exactly the values the option's check accepts."""
    out: dict[str, Any] = {}
    if bounds.minimum is not None:
        out["exclusiveMinimum" if bounds.low_open else "minimum"] = bounds.minimum
    if bounds.maximum is not None:
        out["exclusiveMaximum" if bounds.high_open else "maximum"] = bounds.maximum
    return out


# What an option's own validator refuses within its bounds, as JSON Schema (the validator is the rule; this says it
# to a client): temperature is 0 or at least float32's smallest normal (``core/sampling.py``).
_WITHIN_BOUNDS: dict[str, dict[str, Any]] = {
    "temperature": {"not": {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": F32_TINY}},
}
# The JSON key of a ``logit_bias`` entry: a token id in decimal, one spelling per id (no sign, no leading zero).
TOKEN_ID_KEY = re.compile(r"^(0|[1-9][0-9]*)$")


def option_schema(name: str) -> dict[str, Any]:
    """The JSON Schema keywords of option ``name`` as a request states it (beside the value's type): its help and
    bounds from its declaration, and what its validator refuses within them."""
    field, spec = declared([name])[0]
    out: dict[str, Any] = {"description": spec.help}
    if spec.bounds is not None:
        out |= bounds_schema(spec.bounds)
    if field.name == "logit_bias":
        out["propertyNames"] = {"pattern": TOKEN_ID_KEY.pattern}
    return out | _WITHIN_BOUNDS.get(name, {})


def check_bounds(name: str, value: object) -> None:
    """``ArgumentError`` naming ``name`` unless ``value`` lies within option ``name``'s declared bounds (what the
    option's field checks as it is set; for a value given but not used, e.g. ``max_tokens`` beside a chat request's
    ``max_completion_tokens``)."""
    bounds = declared([name])[0][1].bounds
    if bounds is not None:
        bounds.check(name, value)


def request_fields(names: Iterable[str], *, integer: Any = int, number: Any = float) -> dict[str, tuple[Any, Any]]:
    """Pydantic field definitions (``create_model`` style: name -> (annotation, FieldInfo)) for the options in
    ``names``, each optional (None: the declaration's default), documented by ``option_schema`` (help, bounds).
    ``integer`` and ``number``: the annotations of a JSON integer and a JSON number (the server's wire types).
    The bounds are stated, not enforced here: the Engine checks every value against the same declaration and the
    server answers 400 naming the field, as for every other refused value."""
    from pydantic import Field

    out: dict[str, tuple[Any, Any]] = {}
    for field, spec in declared(names):
        annotation: Any = Any
        if spec.bounds is not None:
            annotation = (integer if spec.bounds.kind == "int" else number) | None
        elif field.name == "logit_bias":
            annotation = dict[str, number] | None
        extra = option_schema(field.name)
        description = extra.pop("description")
        out[field.name] = (annotation, Field(default=None, description=description, json_schema_extra=extra or None))
    return out


def json_logit_bias(value: Mapping[str, Any]) -> dict[int, float]:
    """A JSON object's ``logit_bias`` (string keys) as ``{token id: bias}``; ``ValueError`` naming ``logit_bias``."""
    bad = [k for k in value if not (isinstance(k, str) and TOKEN_ID_KEY.fullmatch(k))]
    if bad:
        raise ValueError(f'logit_bias: keys must be token ids in decimal (e.g. "13"), got {json.dumps(bad)[:80]}')
    return {int(k): v for k, v in value.items()}
