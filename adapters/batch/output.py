"""The output records: one JSON line per record in OUTPUT, written so that a killed run can resume.

Each record is appended with one ``write`` and flushed to disk before the next (``OutputWriter``), so a killed run
loses only the records in flight, and a rerun with the same OUTPUT skips every record already there
(``prepare_output``: a partial last line left by the kill is cut off first). ``BatchOutput`` is the only way a
run writes a line: it also counts the line into the ``BatchSummary`` and the progress bar.
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

from ortspec.adapters.engine.tools import ToolUse

from .job import BatchError, BatchSummary
from .records import Task, error_record, record_key


def output_record(task: Task, result: Any, tools: ToolUse | None = None) -> dict[str, Any]:
    """The output line of a finished generation (``result`` is a ``GenerateResult``; ``tools``: the record's). An
    answer made of calls has ``tool_calls`` in the OpenAI shape, and ``finish_reason_openai`` ``tool_calls`` when
    they are complete."""
    stats = result.stats
    out: dict[str, Any] = {
        "id": task.id,
        "text": result.text,
        "token_ids": list(result.token_ids),
        "finish_reason": str(result.finish_reason),
        "finish_reason_openai": result.finish_reason.openai,
        "seed": result.seed,
        "stats": {"steps": stats.steps, "proposed": stats.proposed_tokens, "accepted": stats.accepted_tokens},
        "prompt_tokens": result.prompt_tokens,
    }
    if result.stop_matched is not None:
        matched = result.stop_matched
        out["stop_matched"] = matched if isinstance(matched, str) else list(matched)
    if result.logprobs is not None:
        out["logprobs"] = [
            {"token_id": lp.token_id, "logprob": lp.logprob, "top": [list(pair) for pair in lp.top]}
            for lp in result.logprobs
        ]
    reply = tools.read(result.text) if tools is not None else None
    if reply is not None and reply.content is None:
        out["tool_calls"] = [call.openai() for call in reply.calls]
        out["finish_reason_openai"] = reply.finish_reason(out["finish_reason_openai"])
    return out


def result_lines(
    task: Task, result: Any, worker: str, tools: ToolUse | None = None
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The output line and the metrics of ``task``'s finished generation (``result``: a ``GenerateResult``;
    ``tools`` as for ``output_record``) made by ``worker``. The metrics (``worker``, ``ok``, ``tokens``,
    ``prompt_tokens``, ``prefill_s``, ``decode_s``, ``total_s``, ``steps``, ``proposed``, ``accepted``) are what
    ``BatchSummary.add`` counts."""
    t = result.timings
    metrics = {
        "worker": worker,
        "ok": True,
        "tokens": len(result.token_ids),
        "prompt_tokens": result.prompt_tokens,
        "prefill_s": t.prefill_s,
        "decode_s": t.decode_s,
        "total_s": t.total_s,
        "steps": result.stats.steps,
        "proposed": result.stats.proposed_tokens,
        "accepted": result.stats.accepted_tokens,
    }
    return output_record(task, result, tools), metrics


def failure_lines(task: Task, exc: Exception, worker: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """The error line and the metrics (``worker``, ``ok`` False) of ``task`` when ``exc`` stopped it: a
    ``GenerationError`` (failed midway) carries its ``partial`` result; a ``ValueError`` is the message alone (it
    names the bad input), anything else is prefixed with its type."""
    from ortspec.driver import GenerationError

    metrics = {"worker": worker, "ok": False}
    if isinstance(exc, GenerationError):
        partial = {"text": exc.partial.text, "token_ids": list(exc.partial.token_ids)}
        return error_record(task.id, task.line, str(exc), partial=partial), metrics
    message = str(exc) if isinstance(exc, ValueError) else f"{type(exc).__name__}: {exc}"
    return error_record(task.id, task.line, message), metrics


def encode_line(record: Mapping[str, Any]) -> bytes:
    """One output line: the record as JSON (UTF-8, not escaped) and its newline."""
    return (json.dumps(record, ensure_ascii=False) + "\n").encode("utf-8")


@attrs.define
class OutputState:
    """What OUTPUT already holds: the keys of its records, which of them are errors, and whether a partial last
    line was cut off."""

    done: set[str] = attrs.field(factory=set)
    errors: set[str] = attrs.field(factory=set)
    repaired_bytes: int = 0


def _line_key(record: Any) -> str | None:
    if not isinstance(record, dict):
        return None
    if record.get("id") is not None:
        return record_key(record["id"], 0)
    if isinstance(record.get("line"), int):
        return record_key(None, record["line"])
    return None


def prepare_output(path: Path, *, retry_errors: bool = False) -> OutputState:
    """Read OUTPUT for resumption: cut off a partial last line (what a kill mid-write leaves), and with
    ``retry_errors`` drop the error lines (rewritten atomically) so their records run again. ``BatchError`` if a
    complete line is not an output record (not a file this command wrote)."""
    state = OutputState()
    if not path.exists():
        return state
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise BatchError(f"cannot read OUTPUT {path}: {exc.strerror or exc}") from None
    end = data.rfind(b"\n") + 1  # everything after the last newline is a partial line
    lines = data[:end].split(b"\n")[:-1]
    tail = data[end:]
    # The writer ends every record with its newline in the same write, so bytes after the last newline are a
    # record cut short (even if they parse): they are dropped, and that record runs again.
    state.repaired_bytes = len(tail)
    kept: list[bytes] = []
    for number, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        try:
            record = json.loads(raw)
        except ValueError:
            raise BatchError(
                f"OUTPUT {path} line {number} is not JSON (only a partial last line can come from an "
                "interrupted run): is it an output of 'ortspec batch'?"
            ) from None
        key = _line_key(record)
        if key is None:
            raise BatchError(f"OUTPUT {path} line {number} has neither an id nor a line number: not a batch output")
        if "error" in record:
            state.errors.add(key)
            if retry_errors:
                continue
        state.done.add(key)
        kept.append(raw + b"\n")
    if tail or (retry_errors and state.errors):
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "wb") as f:
            f.writelines(kept)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    return state


class OutputWriter:
    """Appends one record per ``write`` call to OUTPUT and flushes it to disk before returning."""

    def __init__(self, path: Path) -> None:
        try:
            self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        except OSError as exc:
            raise BatchError(f"cannot write OUTPUT {path}: {exc.strerror or exc}") from None

    def write(self, record: Mapping[str, Any] | bytes) -> None:
        data = memoryview(record if isinstance(record, bytes) else encode_line(record))
        while data:
            written = os.write(self._fd, data)
            data = data[written:]
        os.fsync(self._fd)

    def close(self) -> None:
        os.close(self._fd)


class BatchOutput:
    """A run's side of OUTPUT: every line goes through ``write``, which appends it (``OutputWriter``), counts it
    into ``summary`` and advances the progress bar (on stderr; ``progress=False``: none). ``t0``: when the run
    started (``time.perf_counter()``), for the summary's times. It owns the writer: ``close`` closes it and sets
    ``summary.wall_s``."""

    def __init__(self, output: Path, summary: BatchSummary, *, total: int, progress: bool, t0: float) -> None:
        self.summary = summary
        self.writer = OutputWriter(output)
        self.t0 = t0
        self.bar: Any = None
        if progress:
            from tqdm import tqdm

            self.bar = tqdm(total=total, unit="rec", desc="batch", file=sys.stderr, dynamic_ncols=True)

    def write(self, record: Mapping[str, Any] | bytes, metrics: Mapping[str, Any] | None = None) -> None:
        """Append one output line: an error record (``metrics`` None or not ``ok``) or a worker's result with
        its metrics."""
        self.writer.write(record)
        elapsed = time.perf_counter() - self.t0
        s = self.summary
        s.add(metrics, elapsed)
        if self.bar is not None:
            parts = [f"{s.tokens / elapsed:.1f} tok/s" if elapsed > 0 else "", f"errors {s.errors}"]
            if s.proposed:
                parts.insert(1, f"acceptance {s.acceptance_rate:.0%}")
            self.bar.set_postfix_str(", ".join(p for p in parts if p), refresh=False)
            self.bar.update(1)

    def close(self) -> None:
        self.summary.wall_s = time.perf_counter() - self.t0
        if self.bar is not None:
            self.bar.close()
        self.writer.close()
