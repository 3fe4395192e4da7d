"""How tool calls are written: the one place that knows the text of a call, of the tools' description in the
prompt, and of a tool's result, for models whose chat template has no tools branch.

SmolLM2 (the default model) was trained on function calling in this format, and its chat template does not render
tools, so ortspec renders them itself (a chat template that takes ``tools`` gets them instead: ``tokenizer.py``):

- the tools, in a system turn: an instruction, then the function definitions as a JSON list between ``<tools>`` and
  ``</tools>`` (``system_prompt``); a system turn the caller gave follows it in the same turn;
- the model's calls: ``<tool_call>[`` newline, one ``{"name": NAME, "arguments": {...}}`` per call separated by
  ``,`` newline, newline ``]</tool_call>`` (``calls_text``); the arguments are JSON with ``", "`` and ``": "``
  between items (``JSON_STYLE``: how the trained data writes them); between the tags, the calls are one JSON list;
- a tool's result: a user turn ``<tool_response>`` newline, the content, newline ``</tool_response>``.

The grammar of a call (``grammar``, llguidance's Lark dialect) is this text with each function's arguments
constrained by its ``parameters`` schema; ``CallReader`` reads the text back, incrementally (a stream) or whole.
Changing the format is changing this module.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

import attrs

TAG = "<tool_call>"  # what starts a call: an output that starts with it is calls, any other is text
OPEN = TAG + "[\n"
SEPARATOR = ",\n"
CLOSE = "\n]</tool_call>"
RESPONSE_OPEN, RESPONSE_CLOSE = "<tool_response>\n", "\n</tool_response>"
FINISH_REASON = "tool_calls"  # the OpenAI API's finish reason of an answer made of complete calls
# The arguments' JSON as the trained data writes it (llguidance's JSON options, in a schema's "x-guidance").
JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}

_INSTRUCTION = (
    "You can call functions to answer. The functions are listed below as JSON between <tools> and </tools>.\n"
    "<tools>{tools}</tools>\n"
    "To call functions, answer with only this, a JSON list of calls between <tool_call> and </tool_call>:\n"
    '<tool_call>[\n{{"name": "function name", "arguments": {{"argument": "value"}}}}\n]</tool_call>\n'
    "Give each argument the type its schema asks for."
)


def system_prompt(definitions: Sequence[Mapping[str, Any]]) -> str:
    """The system turn's text that describes ``definitions`` (each ``{"name", "description", "parameters"}``)."""
    return _INSTRUCTION.format(tools=json.dumps(list(definitions), ensure_ascii=False))


def call_text(name: str, arguments: str) -> str:
    """One call, ``arguments`` being JSON text of an object (reformatted in ``JSON_STYLE``)."""
    args = json.dumps(json.loads(arguments), ensure_ascii=False, separators=(", ", ": "))
    return '{"name": ' + json.dumps(name) + ', "arguments": ' + args + "}"


def calls_text(calls: Sequence[tuple[str, str]]) -> str:
    """The text of an assistant turn made of ``calls`` (``(name, arguments JSON text)`` pairs)."""
    return OPEN + SEPARATOR.join(call_text(name, args) for name, args in calls) + CLOSE


def response_text(content: str) -> str:
    """A tool's result as the user turn that shows it to the model."""
    return RESPONSE_OPEN + content + RESPONSE_CLOSE


def in_format(
    messages: Sequence[Mapping[str, Any]], definitions: Sequence[Mapping[str, Any]] | None
) -> list[dict[str, Any]]:
    """``messages`` (OpenAI chat messages: assistant turns may carry ``tool_calls``, ``tool`` turns a result) with
    those turns as plain ``{"role", "content"}`` turns in this format (the others as they are), the tools' system
    turn first when ``definitions`` is given."""
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        role, content = str(m["role"]), m.get("content") or ""
        if role == "tool":
            out.append({"role": "user", "content": response_text(str(content))})
        elif role == "assistant" and m.get("tool_calls"):
            calls = [_called(f"messages[{i}].tool_calls[{j}]", c) for j, c in enumerate(m["tool_calls"])]
            out.append({"role": "assistant", "content": (content + "\n" if content else "") + calls_text(calls)})
        else:
            out.append(dict(m))
    if definitions is not None:
        tools = system_prompt(definitions)
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": tools + "\n\n" + out[0]["content"]}
        else:
            out.insert(0, {"role": "system", "content": tools})
    return out


def _called(where: str, call: object) -> tuple[str, str]:
    """A history turn's call as ``(name, arguments JSON text)``; ``ValueError`` naming ``where`` for another shape."""
    function = call.get("function") if isinstance(call, Mapping) else None
    name = function.get("name") if isinstance(function, Mapping) else None
    arguments = function.get("arguments") if isinstance(function, Mapping) else None
    if not isinstance(name, str) or not isinstance(arguments, str):
        raise ValueError(f"{where}: expected {{'function': {{'name': str, 'arguments': JSON text}}}}")
    try:
        json.loads(arguments)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{where}.function.arguments: not JSON ({exc})") from None
    return name, arguments


def _literal(text: str) -> str:
    return json.dumps(text)  # a Lark string literal is a JSON string


def grammar(functions: Sequence[tuple[str, str]], *, only_calls: bool, several: bool) -> str:
    """The Lark grammar (llguidance's dialect) of this format's output: calls of ``functions`` (``(name, parameters
    schema as JSON text)``; each call's arguments match its function's schema), one or, with ``several``, one or more;
    with ``only_calls`` False, any text not starting with ``TAG`` (the empty text too) is allowed instead
    (``tool_choice`` ``auto``)."""
    rules = []
    names = []
    for i, (name, schema) in enumerate(functions):
        styled = {**json.loads(schema), "x-guidance": JSON_STYLE}
        head = '{"name": ' + json.dumps(name) + ', "arguments": '
        rules.append(f"call_{i}: {_literal(head)} args_{i} {_literal('}')}")
        rules.append(f"args_{i}: %json {json.dumps(styled)}")
        names.append(f"call_{i}")
    repeat = f" ({_literal(SEPARATOR)} call)*" if several else ""
    calls = f"calls: {_literal(OPEN)} call{repeat} {_literal(CLOSE)}"
    start = "start: calls" if only_calls else "start: (calls | TEXT)?"  # text may be empty (EOS at once), as without
    text = [] if only_calls else [f"TEXT: /(?s:.+)/ & ~/(?s:{re.escape(TAG)}.*)/"]
    return "\n".join([start, calls, "call: " + " | ".join(names), *rules, *text]) + "\n"


@attrs.frozen
class ToolCall:
    """One call the model made: ``id`` (``call_`` and 24 hex digits), the function's ``name``, its ``arguments``
    (JSON text of an object; cut short when the generation was)."""

    id: str
    name: str
    arguments: str

    def openai(self) -> dict[str, Any]:
        """As ``message.tool_calls[i]`` in the OpenAI API."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@attrs.frozen
class ContentPiece:
    """Text the model wrote instead of calls."""

    text: str


@attrs.frozen
class CallPiece:
    """A piece of call ``index``: its start (``id`` and ``name`` set, ``arguments`` empty) or a piece of its
    arguments."""

    index: int
    id: str | None
    name: str | None
    arguments: str


Piece = ContentPiece | CallPiece
_HEAD = re.compile(r'\{"name": "([^"\\]*)", "arguments": ')


class CallReader:
    """Reads an output in this format as it grows (``feed`` each new text, ``finish`` at the end): content pieces
    when it is text, call pieces when it is calls. Whether it is calls is known once its first ``len(TAG)``
    characters are (until then nothing is released). The output follows the grammar, so the reader only follows
    the format's fixed text; what comes after the last complete piece waits for more."""

    def __init__(self) -> None:
        self._buffer = ""
        self._mode = "undecided"  # then "text" or "calls"
        self._state = "open"  # in calls: "open", "head", "arguments", "tail", "closed"
        self._depth, self._in_string, self._escaped = 0, False, False
        self.calls: list[ToolCall] = []

    @property
    def is_calls(self) -> bool:
        return self._mode == "calls"

    @property
    def complete(self) -> bool:
        """True once the calls' closing text has been read."""
        return self._state == "closed"

    def finish_reason(self, otherwise: str) -> str:
        """``FINISH_REASON`` for complete calls, else ``otherwise`` (the generation's own)."""
        return FINISH_REASON if self.is_calls and self.complete else otherwise

    def feed(self, text: str) -> list[Piece]:
        self._buffer += text
        if self._mode == "undecided":
            if self._buffer.startswith(TAG):
                self._mode = "calls"
            elif not TAG.startswith(self._buffer):
                self._mode = "text"
            else:
                return []
        if self._mode == "text":
            out, self._buffer = [ContentPiece(self._buffer)] if self._buffer else [], ""
            return out  # type: ignore[return-value]
        return self._read_calls()

    def finish(self) -> list[Piece]:
        """What is left at the end: text that looked like the start of a call but ended."""
        if self._mode == "undecided" and self._buffer:
            self._mode = "text"
            return self.feed("")
        return []

    def _read_calls(self) -> list[Piece]:
        out: list[Piece] = []
        while True:
            b = self._buffer
            if self._state == "open":
                if len(b) < len(OPEN):
                    return out
                self._buffer, self._state = b[len(OPEN) :], "head"
            elif self._state == "head":
                match = _HEAD.match(b)
                if match is None:
                    return out
                call = ToolCall("call_" + uuid.uuid4().hex[:24], match.group(1), "")
                self.calls.append(call)
                out.append(CallPiece(len(self.calls) - 1, call.id, call.name, ""))
                self._buffer, self._state = b[match.end() :], "arguments"
            elif self._state == "arguments":
                taken = self._take_arguments(b)
                if taken:
                    last = self.calls[-1]
                    self.calls[-1] = attrs.evolve(last, arguments=last.arguments + taken)
                    out.append(CallPiece(len(self.calls) - 1, None, None, taken))
                self._buffer = b[len(taken) :]
                if self._state == "arguments":
                    return out
            elif self._state == "tail":
                if b.startswith("}" + SEPARATOR):
                    self._buffer, self._state = b[1 + len(SEPARATOR) :], "head"
                elif b.startswith("}" + CLOSE):
                    self._buffer, self._state = b[1 + len(CLOSE) :], "closed"
                else:
                    return out
            else:
                return out

    def _take_arguments(self, text: str) -> str:
        """The leading characters of ``text`` that belong to the arguments' JSON object (all of them, or up to its
        closing brace, after which the state is ``tail``)."""
        for i, ch in enumerate(text):
            if self._in_string:
                if self._escaped:
                    self._escaped = False
                elif ch == "\\":
                    self._escaped = True
                elif ch == '"':
                    self._in_string = False
            elif ch == '"':
                self._in_string = True
            elif ch in "{[":
                self._depth += 1
            elif ch in "}]":
                self._depth -= 1
                if self._depth == 0:
                    self._state = "tail"
                    return text[: i + 1]
        return text


@attrs.frozen
class Reply:
    """A whole output read: its ``content`` (None when it is calls), its ``calls`` and whether they are
    ``complete`` (the closing text was written; False when the generation was cut short in a call)."""

    content: str | None
    calls: tuple[ToolCall, ...]
    complete: bool

    def finish_reason(self, otherwise: str) -> str:
        """``FINISH_REASON`` for complete calls, else ``otherwise`` (the generation's own)."""
        return FINISH_REASON if self.content is None and self.complete else otherwise


def read_reply(text: str) -> Reply:
    """``text`` (a whole output in this format) as content or calls."""
    reader = CallReader()
    pieces = reader.feed(text) + reader.finish()
    if reader.is_calls:
        return Reply(None, tuple(reader.calls), reader.complete)
    return Reply("".join(p.text for p in pieces if isinstance(p, ContentPiece)), (), False)
