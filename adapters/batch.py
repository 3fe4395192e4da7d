"""Batch generation over a JSONL dataset, on this machine (worker processes) or on a Ray cluster (Ray Data).

    ortspec batch prompts.jsonl results.jsonl --workers 2 --threads 1
    ortspec batch prompts.jsonl results.jsonl --ray                 # a local Ray instance
    ortspec batch prompts.jsonl results.jsonl --ray auto --workers 8 --threads 4

    from ortspec.adapters.batch import run_batch
    summary = run_batch("prompts.jsonl", "results.jsonl", model=folder, workers=2, threads=1)

Input: one JSON object per line: ``id`` (a string or an integer, unique in the file), ``prompt`` (text or token
ids) or ``messages`` (chat turns), and any of the Engine's generation keywords (``GenerationOptions``: max_tokens,
stop, temperature, seed, ...), which override the job's defaults for that record. Blank lines are skipped.

Output: one JSON object per line, in completion order: ``id``, ``text``, ``token_ids``, ``finish_reason`` and
``finish_reason_openai``, ``stop_matched`` (when a stop matched), ``seed`` (the sampler's seed when sampling,
drawn and reported when the record gave none; null when greedy), ``stats`` (``steps`` = target passes,
``proposed`` and ``accepted`` draft tokens), ``prompt_tokens``, ``logprobs`` (when asked for). A record that
cannot run gets ``{"id", "line", "error"}`` instead (``partial`` too when generation failed midway); it never
stops the run. A line whose id is missing or unusable gets ``"id": null`` and its line number.

Each record is appended with one ``write`` and flushed to disk before the next, so a killed run loses only the
records in flight, and a rerun with the same OUTPUT skips every record already there (a partial last line left
by the kill is cut off first). Duplicate ids in INPUT are refused before anything runs: ids are what output lines
and resumption match on, so two records with one id would be ambiguous.

Embedded (default): N worker processes (spawn), each with its own Engine and T intra-op threads pinned to its
own cores (N x T <= the cores this process may use), fed one record at a time from one queue, longest prompt
first. ``--ray``: the same records on Ray Data (``adapters/batch_ray.py``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing as mp
import multiprocessing.connection as mp_connection
import os
import queue
import signal
import sys
import time
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

RECORD_KEYS = ("id", "prompt", "messages")
# How the parent waits for worker messages before checking that its workers are alive (seconds).
_POLL_S = 0.5


class BatchError(Exception):
    """The run as a whole cannot start or go on (a bad argument, an unreadable file, duplicate ids, a worker that
    cannot load the model). A bad record is not one: it gets an error line and the run goes on."""


def option_fields() -> tuple[str, ...]:
    """The generation keywords a record (or the job's defaults) may set: ``GenerationOptions``' fields."""
    from ortspec.adapters.engine import GenerationOptions

    return tuple(f.name for f in attrs.fields(GenerationOptions))


# -- records ---------------------------------------------------------------------------------------------------


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
    return {"id": record_id, "line": line, "error": message, **extra}


def _json_options(raw: Mapping[str, Any], fields: Sequence[str]) -> dict[str, Any]:
    """A record's generation keywords as the Engine takes them; ``ValueError`` naming the problem."""
    unknown = [k for k in raw if k not in fields and k not in RECORD_KEYS]
    if unknown:
        raise ValueError(
            f"unknown field{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))} (a record has id, "
            f"prompt or messages, and generation fields: {', '.join(fields)})"
        )
    options = {k: v for k, v in raw.items() if k in fields}
    if "speculative" in options:
        value = options["speculative"]
        if value in (None, "none"):
            options["speculative"] = None
        elif value != "prompt-lookup":
            raise ValueError(f"speculative={value!r}: expected null, 'none' or 'prompt-lookup'")
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
        if (
            not isinstance(m, dict)
            or not isinstance(m.get("role"), str)
            or not isinstance(m.get("content"), str)
            or set(m) - {"role", "content"}
        ):
            raise ValueError(f"messages[{i}] must be an object with a string 'role' and a string 'content' only")
    return messages, sum(len(m["content"]) for m in messages)


def check_options(options: Mapping[str, Any]) -> None:
    """``GenerationOptions(**options)``: ``ValueError`` naming the keyword (a wrong type included)."""
    from ortspec.adapters.engine import GenerationOptions

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
        options = _json_options(raw, fields)
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
    """A task as one JSON string (how it travels to Ray workers)."""
    return json.dumps(
        {"id": task.id, "line": task.line, "prompt": task.prompt, "options": _jsonable(task.options)},
        ensure_ascii=False,
    )


def task_from_message(text: str) -> Task:
    data = json.loads(text)
    options = dict(data["options"])
    if options.get("logit_bias") is not None:
        options["logit_bias"] = {int(k): v for k, v in options["logit_bias"].items()}
    return Task(id=data["id"], line=data["line"], prompt=data["prompt"], options=options, size=0)


def _jsonable(options: Mapping[str, Any]) -> dict[str, Any]:
    return {k: ({str(t): b for t, b in v.items()} if k == "logit_bias" and v else v) for k, v in options.items()}


# -- output ----------------------------------------------------------------------------------------------------


def output_record(task: Task, result: Any) -> dict[str, Any]:
    """The output line of a finished generation (``result`` is a ``GenerateResult``)."""
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
    return out


def encode_line(record: Mapping[str, Any]) -> bytes:
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


# -- the worker (one Engine) -----------------------------------------------------------------------------------


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    """An exclusive lock on ``path`` across processes (none where ``fcntl`` is missing)."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - Windows
        yield
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def job_proposer(speculative: Any) -> Any:
    """The job-level ``speculative`` default as the Engine takes it."""
    return None if speculative in (None, "none") else speculative


class BatchWorker:
    """One Engine and the job's defaults: turns a task into its output record and its metrics.

    Loading warms what the first speculative generation would otherwise measure (the verify drift, and the verify
    cost curve for ``draft_width="auto"``). The cost curve is cached per machine; workers measure it one at a time
    (a file lock), so all but the first read the same curve, and every worker picks the same draft widths."""

    def __init__(
        self,
        model_dir: str | os.PathLike[str],
        *,
        threads: int,
        defaults: Mapping[str, Any],
        provider: str = "cpu",
        max_length: int | None = None,
        name: str = "worker",
    ) -> None:
        from ortspec.adapters.cache import cache_root
        from ortspec.adapters.engine import Engine
        from ortspec.backends.onnx import BackendConfig

        t0 = time.perf_counter()
        self.name = name
        self.defaults = dict(defaults)
        self.engine = Engine.from_dir(
            model_dir, BackendConfig(provider=provider, threads=threads, max_length=max_length), drafter=False
        )  # prompt lookup only: batch workers open no shared-KV drafter (docs/drafter.md)
        if self.defaults.get("speculative") is not None:
            with _file_lock(cache_root() / "measurements" / ".measure.lock"):
                if self.defaults.get("draft_width", "auto") == "auto":
                    self.engine.pass_costs()
                self.engine.verify_drift()
        self.load_s = time.perf_counter() - t0

    def run(self, task: Task) -> tuple[dict[str, Any], dict[str, Any]]:
        """(output record, metrics) for ``task``; every failure is an error record."""
        from ortspec.driver import GenerationError

        metrics: dict[str, Any] = {"worker": self.name, "ok": False}
        options = {**self.defaults, **task.options}
        try:
            result = self.engine.generate(task.prompt, **options)
        except GenerationError as exc:
            partial = exc.partial
            record = error_record(
                task.id,
                task.line,
                str(exc),
                partial={"text": partial.text, "token_ids": list(partial.token_ids)},
            )
            return record, metrics
        except Exception as exc:  # a bad record never stops the run
            message = str(exc) if isinstance(exc, ValueError) else f"{type(exc).__name__}: {exc}"
            return error_record(task.id, task.line, message), metrics
        t = result.timings
        metrics.update(
            ok=True,
            tokens=len(result.token_ids),
            prompt_tokens=result.prompt_tokens,
            prefill_s=t.prefill_s,
            decode_s=t.decode_s,
            total_s=t.total_s,
            steps=result.stats.steps,
            proposed=result.stats.proposed_tokens,
            accepted=result.stats.accepted_tokens,
        )
        return output_record(task, result), metrics


# -- the job: what both runners share ---------------------------------------------------------------------------


@attrs.define
class BatchSummary:
    """What a run did. ``records`` in INPUT (non-blank lines), ``skipped`` (already in OUTPUT), ``written``
    this run (``errors`` of them error lines), ``lost`` (sent to a worker, no line written: a rerun retries
    them). ``tokens`` generated and ``prompt_tokens`` read by the successful records; ``wall_s`` from the start
    of the run (reading INPUT) to the last line; ``first_line_s`` to the first generated line (startup: worker
    start and model load); ``load_s`` per worker (Engine load and warm-up); ``ray_init_s``: starting or joining
    Ray; ``prefill_s``/``decode_s``/``generate_s``: sums over records of the Engine's timings (prompt pass, the
    steps after it, whole call); ``steps``/``proposed``/``accepted``: summed ``stats``."""

    mode: str
    workers: int
    threads: int
    records: int = 0
    skipped: int = 0
    written: int = 0
    errors: int = 0
    lost: int = 0
    tokens: int = 0
    prompt_tokens: int = 0
    wall_s: float = 0.0
    first_line_s: float | None = None
    load_s: list[float] = attrs.field(factory=list)
    ray_init_s: float | None = None
    prefill_s: float = 0.0
    decode_s: float = 0.0
    generate_s: float = 0.0
    steps: int = 0
    proposed: int = 0
    accepted: int = 0

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def records_per_second(self) -> float:
        return (self.written - self.errors) / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    def line(self) -> str:
        acc = f", acceptance {self.accepted}/{self.proposed} = {self.acceptance_rate:.0%}" if self.proposed else ""
        lost = f", {self.lost} lost (rerun to retry them)" if self.lost else ""
        return (
            f"{self.written} records written ({self.errors} errors), {self.skipped} already done{lost}; "
            f"{self.tokens} tokens in {self.wall_s:.1f} s: {self.records_per_second:.2f} records/s, "
            f"{self.tokens_per_second:.1f} tok/s{acc} ({self.mode}, {self.workers} x {self.threads} threads)"
        )


class Job:
    """OUTPUT, the progress bar and the summary: every line goes through ``write``."""

    def __init__(self, output: Path, summary: BatchSummary, total: int, progress: bool, t0: float) -> None:
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
        s = self.summary
        s.written += 1
        if metrics and metrics.get("ok"):
            if s.first_line_s is None:
                s.first_line_s = time.perf_counter() - self.t0
            s.tokens += metrics["tokens"]
            s.prompt_tokens += metrics["prompt_tokens"]
            s.prefill_s += metrics["prefill_s"]
            s.decode_s += metrics["decode_s"]
            s.generate_s += metrics["total_s"]
            s.steps += metrics["steps"]
            s.proposed += metrics["proposed"]
            s.accepted += metrics["accepted"]
        else:
            s.errors += 1
        if self.bar is not None:
            elapsed = time.perf_counter() - self.t0
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


# -- embedded: worker processes on this machine ------------------------------------------------------------------


def available_cores() -> list[int]:
    """The CPU ids this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def plan_threads(workers: int, threads: int | None, cores: int, *, where: str = "here") -> int:
    """Intra-op threads per worker: ``threads``, or the cores shared out. ``BatchError`` when workers x threads
    would exceed ``cores``."""
    if isinstance(workers, bool) or not isinstance(workers, int) or workers < 1:
        raise BatchError(f"workers must be an int >= 1, got {workers!r}")
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
        raise BatchError(f"threads must be an int >= 1, got {threads!r}")
    if workers > cores:
        raise BatchError(f"{workers} workers need at least {workers} cores; {cores} available {where}")
    if threads is None:
        return max(1, cores // workers)
    if workers * threads > cores:
        raise BatchError(
            f"{workers} workers x {threads} threads = {workers * threads} intra-op threads, more than the {cores} "
            f"cores available {where}: choose workers x threads <= {cores} (e.g. --workers {workers} --threads "
            f"{max(1, cores // workers)})"
        )
    return threads


def _worker_main(
    index: int,
    cpus: list[int] | None,
    model_dir: str,
    threads: int,
    defaults: dict[str, Any],
    provider: str,
    max_length: int | None,
    tasks: Any,
    results: Any,
) -> None:
    """A worker process: pin, load, then run tasks from its queue until ``None`` or its parent is gone. Ctrl-C
    is the parent's to handle (it stops the workers)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    parent = os.getppid()
    if cpus is not None and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, cpus)
    try:
        worker = BatchWorker(
            model_dir,
            threads=threads,
            defaults=defaults,
            provider=provider,
            max_length=max_length,
            name=f"worker-{index}",
        )
    except Exception as exc:
        results.send(("failed", index, f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=3)}"))
        return
    results.send(("ready", index, worker.load_s))
    while True:
        try:
            task = tasks.get(timeout=1.0)
        except queue.Empty:
            if os.getppid() != parent:
                return
            continue
        if task is None:
            return
        record, metrics = worker.run(task)
        results.send(("done", index, task.key, encode_line(record), metrics))


def run_embedded(
    job: Job,
    tasks: Sequence[Task],
    model_dir: Path,
    *,
    workers: int,
    threads: int,
    defaults: Mapping[str, Any],
    provider: str,
    max_length: int | None,
    pin: bool,
) -> None:
    """Run ``tasks`` (in this order) on ``workers`` processes, writing each record as it completes."""
    ctx = mp.get_context("spawn")
    cores = available_cores()
    procs: dict[int, Any] = {}
    inboxes: dict[int, Any] = {}
    # Each worker answers on its own pipe (one writer, no lock): a worker killed in the middle of a write (a
    # crash, the OOM killer) can then only break its own channel, never block the others' answers, as it could
    # while holding the write lock of a queue shared by all workers.
    outboxes: dict[int, Any] = {}
    closed: set[int] = set()  # outboxes at end of file (their worker is gone)
    holding: dict[int, Task | None] = {}
    ready: set[int] = set()
    outstanding = 0  # tasks handed to a worker, not yet written

    def start(index: int) -> None:
        cpus = cores[index * threads : (index + 1) * threads] if pin else None
        inboxes[index] = ctx.Queue()
        outboxes[index], writer = ctx.Pipe(duplex=False)
        closed.discard(index)
        args = (index, cpus, str(model_dir), threads, dict(defaults), provider, max_length, inboxes[index], writer)
        procs[index] = ctx.Process(target=_worker_main, args=args, name=f"ortspec-batch-{index}", daemon=True)
        procs[index].start()
        writer.close()  # the worker's copy stays open; when it exits, the parent's reader sees end of file
        holding[index] = None

    def receive(index: int) -> None:
        """Handle one message from worker ``index`` (or note that its pipe is at end of file)."""
        nonlocal outstanding
        try:
            message = outboxes[index].recv()
        except (EOFError, OSError):
            closed.add(index)
            return
        kind = message[0]
        if kind == "failed":
            raise BatchError(f"worker {index} could not load the model: {message[2]}")
        if kind == "ready":
            ready.add(index)
            job.summary.load_s.append(float(message[2]))
        elif (held := holding[index]) is not None and held.key == message[2]:
            holding[index] = None
            outstanding -= 1
            job.write(message[3], message[4])

    def check_workers() -> None:
        """A worker that exited: before it was ready, the run cannot go on; after, the record it held (the
        likely cause) gets an error line and a new worker takes its place."""
        nonlocal outstanding
        for i, proc in list(procs.items()):
            if proc.exitcode is None:
                continue
            while i not in closed and outboxes[i].poll():  # what it sent before it died
                receive(i)
            if i not in ready:
                raise BatchError(f"worker {i} exited (code {proc.exitcode}) before it was ready (its error is above)")
            task = holding[i]
            if task is not None:
                message = f"the worker process died (exit code {proc.exitcode}) while generating this record"
                job.write(error_record(task.id, task.line, message))
                outstanding -= 1
            ready.discard(i)
            start(i)

    pending = list(reversed(tasks))  # pop() takes the next one
    try:
        for i in range(min(workers, len(tasks))):
            start(i)
        while pending or outstanding:
            for i in sorted(ready):
                if holding[i] is None and pending:
                    holding[i] = pending.pop()
                    inboxes[i].put(holding[i])
                    outstanding += 1
            open_ = {outboxes[i]: i for i in procs if i not in closed}
            for conn in mp_connection.wait(list(open_), timeout=_POLL_S):
                receive(open_[conn])
            if not open_:
                time.sleep(_POLL_S)
            check_workers()
    finally:
        for i, proc in procs.items():
            if proc.is_alive():
                with contextlib.suppress(Exception):
                    inboxes[i].put(None)
        deadline = time.monotonic() + 5.0
        for proc in procs.values():
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.terminate()
                proc.join(1.0)


# -- the API ----------------------------------------------------------------------------------------------------


def _default_model() -> Path:
    from ortspec.adapters.convert import convert_smollm2, default_model_dir, is_complete

    folder = default_model_dir("fp32")
    if not is_complete(folder):
        print(f"ortspec: converting the default model into {folder} (about a minute)", file=sys.stderr)
        convert_smollm2(folder, "fp32", progress=lambda m: print(m, file=sys.stderr))
    return folder


def run_batch(
    input_path: str | os.PathLike[str],
    output_path: str | os.PathLike[str],
    *,
    model: str | os.PathLike[str] | None = None,
    workers: int = 1,
    threads: int | None = None,
    ray: str | None = None,
    options: Mapping[str, Any] | None = None,
    provider: str = "cpu",
    max_length: int | None = None,
    retry_errors: bool = False,
    progress: bool = True,
    pin: bool = True,
    ship_model: bool = False,
    log: Callable[[str], object] | None = None,
) -> BatchSummary:
    """Generate for every record of INPUT (JSONL) not yet in OUTPUT, appending one line per record.

    ``model``: the model folder (default: SmolLM2-135M-Instruct fp32, converted on first use). ``workers`` x
    ``threads``: Engines and intra-op threads each (``threads`` default: the cores shared out); embedded, the
    product may not exceed this process's cores, and each worker is pinned to its own cores (``pin``).
    ``options``: ``GenerationOptions`` keywords for every record (a record's own fields win; ``speculative`` may
    be a proposer object, e.g. ``PromptLookup(...)``). ``ray``: run on Ray Data instead: ``"local"`` starts a
    local Ray instance, any other value is the address for ``ray.init`` (``"auto"``, ``"ray://host:10001"``);
    ``ship_model`` then puts the model folder into Ray's object store for nodes that do not have it.
    ``retry_errors``: drop OUTPUT's error lines first and run those records again. ``log`` receives notes
    (repairs, skips; default: stderr). Returns a ``BatchSummary``; raises ``BatchError`` when the run cannot
    start or go on (a bad record is an error line, not an exception)."""
    t0 = time.perf_counter()
    say = log if log is not None else (lambda m: print(f"ortspec batch: {m}", file=sys.stderr))
    input_path, output_path = Path(input_path), Path(output_path)
    if not input_path.is_file():
        raise BatchError(f"INPUT {input_path} is not a file")
    if output_path.exists() and output_path.resolve() == input_path.resolve():
        raise BatchError("OUTPUT is INPUT: give another file for the results")
    if provider not in ("cpu", "cuda"):
        raise BatchError(f"provider={provider!r}: expected 'cpu' or 'cuda'")
    defaults = dict(options or {})
    fields = option_fields()
    unknown = [k for k in defaults if k not in fields]
    if unknown:
        raise BatchError(f"options: unknown generation keyword(s) {', '.join(map(repr, unknown))}")
    defaults["speculative"] = job_proposer(defaults.get("speculative"))
    try:
        check_options(defaults)
        if defaults["speculative"] is not None:
            from ortspec.adapters.engine import make_proposer

            make_proposer(defaults["speculative"])
    except ValueError as exc:
        raise BatchError(f"options: {exc}") from None

    if ray is None:
        threads = plan_threads(workers, threads, len(available_cores()))
    else:
        from ortspec.adapters.batch_ray import import_ray

        import_ray()  # the extra is there, or a clear message before anything runs
    tasks, bad = read_input(input_path, defaults, fields)
    state = prepare_output(output_path, retry_errors=retry_errors)
    if state.repaired_bytes:
        say(f"OUTPUT ended with a partial line ({state.repaired_bytes} bytes, from an interrupted run): cut off")
    if retry_errors and state.errors:
        say(f"retrying {len(state.errors)} records whose earlier run ended in an error")
    total = len(tasks) + len(bad)
    todo = [t for t in tasks if t.key not in state.done]
    bad_todo = [e for e in bad if record_key(e["id"], e["line"]) not in state.done]
    skipped = total - len(todo) - len(bad_todo)
    if skipped:
        say(f"{skipped} of {total} records are already in {output_path}: skipped")
    todo.sort(key=lambda t: -t.size)  # longest prompt first (stable: input order among equals)
    model_dir = Path(model).expanduser() if model is not None else _default_model()
    if todo and (ray in (None, "local") or ship_model or model_dir.is_dir()):
        # The folder must be here (unless Ray nodes have it at that path): check it before any worker starts.
        from ortspec.backends.onnx import ModelFolder

        if not model_dir.is_dir():
            raise BatchError(f"model folder {model_dir} does not exist")
        try:
            ModelFolder.load(model_dir)
        except (ValueError, OSError) as exc:
            raise BatchError(str(exc)) from None

    summary = BatchSummary(mode="embedded" if ray is None else "ray", workers=workers, threads=threads or 0)
    summary.records, summary.skipped = total, skipped
    job = Job(output_path, summary, len(todo) + len(bad_todo), progress, t0)
    try:
        for record in bad_todo:
            job.write(record)
        if todo and ray is None:
            assert threads is not None
            run_embedded(
                job,
                todo,
                model_dir,
                workers=workers,
                threads=threads,
                defaults=defaults,
                provider=provider,
                max_length=max_length,
                pin=pin,
            )
        elif todo and ray is not None:
            from ortspec.adapters.batch_ray import run_ray

            run_ray(
                job,
                todo,
                model_dir,
                address=ray,
                workers=workers,
                threads=threads,
                defaults=defaults,
                provider=provider,
                max_length=max_length,
                ship_model=ship_model,
                say=say,
            )
    finally:
        job.close()
    summary.lost = len(todo) + len(bad_todo) - summary.written
    return summary


# -- the command ------------------------------------------------------------------------------------------------


def defaults_json(text: str) -> dict[str, Any]:
    """``--defaults``: a JSON object of generation fields (argparse type)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("expected a JSON object of generation fields")
    return value


def cmd_batch(args: argparse.Namespace) -> int:
    """``ortspec batch`` (its options are declared with the other commands' in ``adapters/cli.py``)."""
    from ortspec.core import PromptLookup

    if args.output is None:
        if args.ray is not None and (Path(args.ray).suffix in (".jsonl", ".json") or Path(args.ray).is_file()):
            message = f"--ray took {args.ray!r} as the cluster address: put --ray after INPUT OUTPUT, or give one"
        else:
            message = "give OUTPUT, the JSONL file for the results"
        print(f"ortspec batch: {message}", file=sys.stderr)
        return 2
    speculative = None
    try:
        if args.speculative != "none":
            speculative = PromptLookup(ngram=args.ngram, max_draft=args.max_draft, min_ngram=args.min_ngram)
        if set(args.defaults) & set(RECORD_KEYS):
            raise ValueError("--defaults takes generation fields only (not id, prompt or messages)")
        record_defaults = _json_options(args.defaults, option_fields())
    except ValueError as exc:
        print(f"ortspec batch: {exc}", file=sys.stderr)
        return 2
    options = {
        "max_tokens": args.max_tokens,
        "chat": args.chat,
        "draft_width": args.draft_width,
        "speculative": speculative,
        **record_defaults,
    }
    try:
        summary = run_batch(
            args.input,
            args.output,
            model=args.model,
            workers=args.workers,
            threads=args.threads,
            ray=args.ray,
            options=options,
            provider=args.provider,
            max_length=args.max_length,
            retry_errors=args.retry_errors,
            progress=args.progress,
            pin=args.pin,
            ship_model=args.ship_model,
        )
    except BatchError as exc:
        print(f"ortspec batch: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"\nortspec batch: interrupted; rerun the same command to resume ({args.output})", file=sys.stderr)
        return 130
    print(f"ortspec batch: {summary.line()}", file=sys.stderr)
    return 0 if not summary.lost else 1


__all__ = [
    "BatchError",
    "BatchSummary",
    "BatchWorker",
    "Task",
    "cmd_batch",
    "defaults_json",
    "parse_record",
    "prepare_output",
    "read_input",
    "run_batch",
]
