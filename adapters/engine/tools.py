"""Tools (function calling) as the library's value: ``tools``, ``tool_choice`` and ``parallel_tool_calls`` as the
OpenAI chat completions API defines them, checked once here for every surface (the Engine's keywords, the server's
request fields, a batch record's keys).

- ``tools``: a list of ``{"type": "function", "function": {"name", "description", "parameters", "strict"}}``
  (``parameters``: a JSON Schema of an object; default: any object);
- ``tool_choice``: ``"none"`` (no call: the tools are not shown to the model and the output is text), ``"auto"``
  (text or calls, the model's choice; the default with tools), ``"required"`` (calls), or
  ``{"type": "function", "function": {"name": NAME}}`` (one call of that function);
- ``parallel_tool_calls``: several calls in one turn (default true; false: at most one).

``ToolUse`` holds the three checked (``ArgumentError`` naming ``tools``, ``tool_choice`` or ``parallel_tool_calls``);
its ``grammar_source`` is the constraint (``tool_format.grammar``: the call's text, the name, the arguments by the
function's schema), compiled by the Engine's ``GrammarCompiler`` like a ``response_format``, so the output obeys it
and speculation stays exact by the same rules. ``read`` turns an output back into content or ``ToolCall``s.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

from ortspec.adapters.engine import tool_format
from ortspec.core.checks import ArgumentError

CHOICES = ("none", "auto", "required")
_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")  # the OpenAI API's function names


def _refuse(argument: str, message: str) -> ArgumentError:
    return ArgumentError(argument, f"{argument}: {message}")


@attrs.frozen
class Function:
    """One tool: its ``name``, ``description`` and ``parameters`` (the arguments' JSON Schema, as JSON text)."""

    name: str
    description: str | None
    parameters: str

    def definition(self) -> dict[str, Any]:
        """``{"name", "description", "parameters"}``: how the prompt shows it."""
        out: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            out["description"] = self.description
        return out | {"parameters": json.loads(self.parameters)}


def _json_value(argument: str, value: object) -> object:
    """``value`` as given, or parsed when it is JSON text (a command line or a record may give text)."""
    if isinstance(value, str) and argument == "tools":
        try:
            return json.loads(value)
        except json.JSONDecodeError as exc:
            raise _refuse(argument, f"not valid JSON ({exc})") from None
    return value


def parse_tools(value: object) -> tuple[Function, ...] | None:
    """``tools`` as the Engine takes it: None, or a list of tool objects (or its JSON text). ``ArgumentError``
    naming ``tools`` (and the item, e.g. ``tools[1].function.name``) for anything else."""
    value = _json_value("tools", value)
    if value is None or isinstance(value, tuple) and all(isinstance(f, Function) for f in value):
        return value
    if not isinstance(value, Sequence) or isinstance(value, (str, bytes)) or not value:
        raise _refuse("tools", f"expected a non-empty list of tools, got {value!r:.80}")
    functions = [_function(i, tool) for i, tool in enumerate(value)]
    names = [f.name for f in functions]
    for i, name in enumerate(names):
        if name in names[:i]:
            raise _refuse("tools", f"tools[{i}].function.name: {name!r} is given twice")
    return tuple(functions)


def _function(i: int, tool: object) -> Function:
    where = f"tools[{i}]"
    if not isinstance(tool, Mapping) or tool.get("type") != "function" or not isinstance(tool.get("function"), Mapping):
        raise _refuse("tools", f'{where}: expected {{"type": "function", "function": {{"name": ...}}}}')
    extra = sorted(str(k) for k in tool if k not in ("type", "function"))
    if extra:
        raise _refuse("tools", f"{where}: unrecognized field {extra[0]!r}")
    spec = tool["function"]
    extra = sorted(str(k) for k in spec if k not in ("name", "description", "parameters", "strict"))
    if extra:
        raise _refuse("tools", f"{where}.function: unrecognized field {extra[0]!r}")
    name = spec.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise _refuse("tools", f"{where}.function.name: 1-64 letters, digits, _ or -, got {name!r:.80}")
    description = spec.get("description")
    if description is not None and not isinstance(description, str):
        raise _refuse("tools", f"{where}.function.description: expected a string")
    if not isinstance(spec.get("strict", False), (bool, type(None))):
        raise _refuse("tools", f"{where}.function.strict: expected true or false")
    parameters = spec.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(parameters, Mapping) or parameters.get("type", "object") != "object":
        raise _refuse("tools", f"{where}.function.parameters: expected a JSON Schema of an object (type object)")
    try:
        text = json.dumps({"type": "object", **parameters}, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise _refuse("tools", f"{where}.function.parameters: not JSON ({exc})") from None
    return Function(name, description, text)


@attrs.frozen
class Named:
    """``tool_choice`` naming the function to call."""

    name: str


def parse_tool_choice(value: object) -> str | Named | None:
    """``tool_choice`` as the Engine takes it: None (the default: ``auto`` with tools), one of ``CHOICES``, or
    ``{"type": "function", "function": {"name": NAME}}`` (or its JSON text), kept as ``Named(NAME)``.
    ``ArgumentError`` naming ``tool_choice`` for anything else."""
    if isinstance(value, str) and value.startswith("{"):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise _refuse("tool_choice", f"not valid JSON ({exc})") from None
    if value is None or value in CHOICES or isinstance(value, Named):
        return value
    if isinstance(value, Mapping) and value.get("type") == "function" and set(value) == {"type", "function"}:
        spec = value["function"]
        if isinstance(spec, Mapping) and set(spec) == {"name"} and isinstance(spec["name"], str):
            return Named(spec["name"])
    raise _refuse(
        "tool_choice",
        f'expected one of {", ".join(CHOICES)} or {{"type": "function", "function": {{"name": ...}}}}, '
        f"got {value!r:.80}",
    )


@attrs.frozen
class ToolUse:
    """A generation's tools, checked: the ``functions``, the ``choice`` (``none``, ``auto``, ``required`` or
    ``function``, then ``name`` is the function to call) and whether ``several`` calls may be made."""

    functions: tuple[Function, ...]
    choice: str
    name: str | None = None
    several: bool = True

    @classmethod
    def of(cls, tools: tuple[Function, ...] | None, tool_choice: str | Named | None, parallel: bool) -> ToolUse | None:
        """The value of the three checked keywords (``parse_tools``, ``parse_tool_choice``), or None without tools;
        ``ArgumentError`` naming ``tool_choice`` when it names no tool or comes without tools."""
        if not isinstance(parallel, bool):
            raise _refuse("parallel_tool_calls", f"expected true or false, got {parallel!r:.80}")
        if tools is None:
            if tool_choice is not None:
                raise _refuse("tool_choice", "needs tools (there are none to choose from)")
            return None
        if isinstance(tool_choice, Named):
            if tool_choice.name not in [f.name for f in tools]:
                raise _refuse("tool_choice", f"function {tool_choice.name!r} is not one of the tools")
            return cls(tools, "function", tool_choice.name, several=False)
        return cls(tools, tool_choice or "auto", None, several=parallel)

    @property
    def calls(self) -> bool:
        """Whether the output may be calls (every choice but ``none``)."""
        return self.choice != "none"

    def definitions(self) -> list[dict[str, Any]] | None:
        """The tools as the prompt shows them (None with ``none``: the model is not told of them)."""
        return [f.definition() for f in self.functions] if self.calls else None

    def grammar_source(self) -> str:
        """The output's Lark grammar (only with ``calls``): calls of the chosen functions, or text too with
        ``auto``."""
        chosen = [f for f in self.functions if self.name in (None, f.name)]
        pairs = [(f.name, f.parameters) for f in chosen]
        return tool_format.grammar(pairs, only_calls=self.choice != "auto", several=self.several)

    def read(self, text: str) -> tool_format.Reply:
        """An output of this generation as content or calls (``none``: always content)."""
        if not self.calls:
            return tool_format.Reply(text, (), False)
        return tool_format.read_reply(text)
