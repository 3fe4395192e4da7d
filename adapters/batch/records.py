"""The input records: one JSON object per line of INPUT, checked into a ``Task`` or turned into an error line.

A record has ``id`` (a string or an integer, unique in the file), ``prompt`` (text or token ids) or ``messages``
(chat turns), and any of the Engine's generation keywords: the fields of ``GenerationOptions``, read from the
declaration itself (``option_fields``), so a keyword added there is a record key here. Every rule about what a
record may hold lives in this module; a record that breaks one gets ``{"id", "line", "error"}`` and never stops
the run. Duplicate ids stop it before anything runs (``BatchError``): ids are what output lines and resumption
match on.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

from ortspec.adapters.engine.options import GenerationOptions
from ortspec.core.speculative import SPECULATIVE_CHOICES, check_speculative, speculative_value

from .job import BatchError

RECORD_KEYS = ("id", "prompt", "messages")
_MESSAGE_KEYS = frozenset({"role", "content", "tool_calls", "tool_call_id"})  # a chat turn's keys


def option_fields() -> tuple[str, ...]:
    """The generation keywords a record (or the job's defaults) may set: ``GenerationOptions``' fields."""
    return tuple(f.name for f in attrs.fields(GenerationOptions))


def record_key(record_id: str | int | None, line: int) -> str:
    """What output lines and resumption match on: the id as JSON (so ``1`` and ``"1"`` differ), or the line
    number for a record without a usable id."""
    return f"#line {line}" if record_id is None else json.dumps(record_id, ensure_ascii=False)


@attrs.frozen
class Task:
    """One valid record, ready for a worker: its ``prompt`` (text, token ids or chat messages) and its own
    generation keywords (``options``, JSON values converted: ``logit_bias`` keys as ints). ``size`` orders the
    queue (longest prompt first): characters of text, or 4 per token id."""

    id: str | int
    line: int
    prompt: Any
    options: Mapping[str, Any]
    size: int

    @property
    def key(self) -> str:
        return record_key(self.id, self.line)


def error_record(record_id: str | int | None, line: int, message: str, **extra: Any) -> dict[str, Any]:
    """The output line of a record that cannot run (``extra``: e.g. the ``partial`` result of a failed one)."""
    return {"id": record_id, "line": line, "error": message, **extra}


def record_options(raw: Mapping[str, Any], fields: Sequence[str]) -> dict[str, Any]:
    """A record's generation keywords (JSON values) as the Engine takes them; ``ValueError`` naming the problem."""
    unknown = [k for k in raw if k not in fields and k not in RECORD_KEYS]
    if unknown:
        raise ValueError(
            f"unknown field{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))} (a record has id, "
            f"prompt or messages, and generation fields: {', '.join(fields)})"
        )
    options = {k: v for k, v in raw.items() if k in fields}
    if "speculative" in options:
        options["speculative"] = speculative_value(options["speculative"])
        try:  # in JSON, a name of core.speculative's table or null
            if not isinstance(options["speculative"], (str, type(None))):
                raise TypeError
            check_speculative(options["speculative"])
        except (TypeError, ValueError):
            names = ", ".join(repr(name) for name in SPECULATIVE_CHOICES)
            raise ValueError(f"speculative={raw['speculative']!r}: expected null, 'none' or one of {names}") from None
    if options.get("logit_bias") is not None:
        bias = options["logit_bias"]
        if not isinstance(bias, Mapping):
            raise ValueError(f"logit_bias: expected an object {{token id: bias}}, got {bias!r}")
        converted = {}
        for token, value in bias.items():
            try:
                converted[int(token)] = value
            except ValueError:
                raise ValueError(f"logit_bias: key {token!r} is not a token id") from None
        options["logit_bias"] = converted
    return options


def _prompt_of(raw: Mapping[str, Any]) -> tuple[Any, int]:
    """The record's prompt and its size; ``ValueError`` naming the problem."""
    has_prompt, has_messages = "prompt" in raw, "messages" in raw
    if has_prompt == has_messages:
        raise ValueError("give exactly one of 'prompt' (text or token ids) and 'messages' (chat turns)")
    if has_prompt:
        prompt = raw["prompt"]
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("'prompt' is empty")
            return prompt, len(prompt)
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            if min(prompt) < 0:
                raise ValueError("'prompt': token ids must be >= 0")
            return prompt, 4 * len(prompt)
        raise ValueError(f"'prompt' must be a non-empty string or a non-empty list of token ids, got {prompt!r:.80}")
    messages = raw["messages"]
    if not isinstance(messages, list) or not messages:
        raise ValueError("'messages' must be a non-empty list of {'role': ..., 'content': ...} objects")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or set(m) - _MESSAGE_KEYS:
            raise ValueError(
                f"messages[{i}] must be an object with a string 'role' and 'content' (and, for a tool call's turns, "
                "an assistant's 'tool_calls' or a tool's 'tool_call_id')"
            )
        calls = m.get("tool_calls")
        if calls is not None and (m["role"] != "assistant" or not isinstance(calls, list) or not calls):
            raise ValueError(f"messages[{i}].tool_calls: a non-empty list, in an assistant turn only")
        if not isinstance(m.get("content"), str) and not (calls and m.get("content") is None):
            raise ValueError(f"messages[{i}].content must be a string (null only beside tool_calls)")
    return messages, sum(len(m.get("content") or "") for m in messages)


def check_options(options: Mapping[str, Any]) -> None:
    """``GenerationOptions(**options)``: ``ValueError`` naming the keyword (a wrong type included)."""
    try:
        GenerationOptions(**options)
    except TypeError as exc:
        raise ValueError(str(exc).replace("GenerationOptions.__init__()", "generation options:")) from None


def parse_record(text: str, line: int, defaults: Mapping[str, Any], fields: Sequence[str]) -> Task | dict[str, Any]:
    """A ``Task``, or the error record for this input line."""
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as exc:
        return error_record(None, line, f"line {line} is not valid JSON: {exc}")
    if not isinstance(raw, dict):
        return error_record(None, line, f"line {line} is not a JSON object")
    record_id = raw.get("id")
    if "id" not in raw:
        return error_record(None, line, f"line {line} has no 'id'")
    if isinstance(record_id, bool) or not isinstance(record_id, (str, int)) or record_id == "":
        return error_record(
            None, line, f"line {line}: 'id' must be a non-empty string or an integer, got {record_id!r}"
        )
    try:
        prompt, size = _prompt_of(raw)
        options = record_options(raw, fields)
        check_options({**defaults, **options})
    except ValueError as exc:
        return error_record(record_id, line, str(exc))
    return Task(id=record_id, line=line, prompt=prompt, options=options, size=size)


def read_input(
    path: Path, defaults: Mapping[str, Any], fields: Sequence[str]
) -> tuple[list[Task], list[dict[str, Any]]]:
    """Every non-blank line of ``path``: the valid tasks and the error records of the bad lines. ``BatchError``
    for duplicate ids (nothing has run yet)."""
    tasks: list[Task] = []
    errors: list[dict[str, Any]] = []
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise BatchError(f"cannot read INPUT {path}: {exc.strerror or exc}") from None
    seen: dict[str, int] = {}
    duplicates: list[str] = []
    for number, raw_line in enumerate(data.split(b"\n"), start=1):
        if not raw_line.strip():
            continue
        try:
            text = raw_line.decode("utf-8")
        except UnicodeDecodeError as exc:
            errors.append(error_record(None, number, f"line {number} is not UTF-8: {exc}"))
            continue
        parsed = parse_record(text, number, defaults, fields)
        record_id = parsed.id if isinstance(parsed, Task) else parsed["id"]
        if record_id is not None:
            key = record_key(record_id, number)
            if key in seen:
                duplicates.append(f"{key} (lines {seen[key]} and {number})")
            seen.setdefault(key, number)
        (tasks if isinstance(parsed, Task) else errors).append(parsed)  # type: ignore[arg-type]
    if duplicates:
        shown = "; ".join(duplicates[:5]) + (f"; and {len(duplicates) - 5} more" if len(duplicates) > 5 else "")
        raise BatchError(
            f"INPUT {path} has {len(duplicates)} duplicate id{'s' if len(duplicates) > 1 else ''}: {shown}. "
            "Ids match output lines to records and drive resumption, so they must be unique; nothing was run"
        )
    return tasks, errors


def task_message(task: Task) -> str:
    """A task as one JSON string (how it travels to Ray workers; ``task_from_message`` reads it back)."""
    options = {
        k: ({str(t): b for t, b in v.items()} if k == "logit_bias" and v else v) for k, v in task.options.items()
    }
    return json.dumps({"id": task.id, "line": task.line, "prompt": task.prompt, "options": options}, ensure_ascii=False)


def task_from_message(text: str) -> Task:
    """The task ``task_message`` wrote (``size`` 0: the queue is already ordered)."""
    data = json.loads(text)
    options = dict(data["options"])
    if options.get("logit_bias") is not None:
        options["logit_bias"] = {int(k): v for k, v in options["logit_bias"].items()}
    return Task(id=data["id"], line=data["line"], prompt=data["prompt"], options=options, size=0)
