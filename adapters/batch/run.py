"""``run_batch``: one batch job from INPUT to OUTPUT, on this machine (``local.py``) or on Ray Data (``ray.py``).

The steps, in order, each able to stop the run with a ``BatchError`` before any worker starts: check the job's
arguments and defaults; read INPUT (bad records become error lines, duplicate ids stop the run); read OUTPUT for
resumption (cut a partial last line; with ``retry_errors`` drop the error lines); check the model folder. Then
the pending records run, longest prompt first, and every line goes through one ``BatchOutput``.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import attrs

from ortspec.adapters.hosts import available_cores
from ortspec.backends.onnx.config import BackendConfig
from ortspec.batch_driver import check_prefill_budget
from ortspec.core.checks import check_int
from ortspec.core.speculative import speculative_value

from .job import BatchError, BatchJob, BatchSummary
from .local import plan_threads, run_embedded
from .output import BatchOutput, prepare_output
from .records import Task, check_options, option_fields, read_input, record_key
from .worker import WorkerSettings


@attrs.frozen
class _Pending:
    """What this run has to do: the valid records not yet in OUTPUT (longest prompt first), the error lines of
    bad records not yet there, and the counts for the summary."""

    tasks: list[Task]
    error_lines: list[dict[str, Any]]
    records: int
    skipped: int


def _defaults(job: BatchJob) -> dict[str, Any]:
    """The job's generation keywords as the Engine takes them; ``BatchError`` naming a bad one."""
    defaults = dict(job.options)
    unknown = [k for k in defaults if k not in option_fields()]
    if unknown:
        raise BatchError(f"options: unknown generation keyword(s) {', '.join(map(repr, unknown))}")
    defaults["speculative"] = speculative_value(defaults.get("speculative"))
    try:
        check_options(defaults)  # ``speculative``: a name of core.speculative's table, None or a proposer
    except ValueError as exc:
        raise BatchError(f"options: {exc}") from None
    return defaults


def _check_job(job: BatchJob) -> None:
    """The files and the backend; ``BatchError`` for a job that cannot start."""
    if not job.input_path.is_file():
        raise BatchError(f"INPUT {job.input_path} is not a file")
    if job.output_path.exists() and job.output_path.resolve() == job.input_path.resolve():
        raise BatchError("OUTPUT is INPUT: give another file for the results")
    if not isinstance(job.backend, BackendConfig):
        raise BatchError(f"backend must be a BackendConfig, got {type(job.backend).__name__}")
    if job.backend.threads is not None:
        raise BatchError("backend.threads: set the job's threads (each worker's), not the backend's")
    if job.max_batch is not None and (
        isinstance(job.max_batch, bool) or not isinstance(job.max_batch, int) or job.max_batch < 1
    ):
        raise BatchError(f"max_batch must be None or an int >= 1, got {job.max_batch!r}")
    try:
        check_prefill_budget(job.prefill_budget)
        check_int("tree_branches", job.tree_branches, 1)
    except ValueError as exc:
        raise BatchError(str(exc)) from None


def _pending(job: BatchJob, defaults: Mapping[str, Any], say: Callable[[str], object]) -> _Pending:
    """Read INPUT and OUTPUT: what is left to write (saying what OUTPUT already held)."""
    tasks, bad = read_input(job.input_path, defaults, option_fields())
    state = prepare_output(job.output_path, retry_errors=job.retry_errors)
    if state.repaired_bytes:
        say(f"OUTPUT ended with a partial line ({state.repaired_bytes} bytes, from an interrupted run): cut off")
    if job.retry_errors and state.errors:
        say(f"retrying {len(state.errors)} records whose earlier run ended in an error")
    total = len(tasks) + len(bad)
    todo = [t for t in tasks if t.key not in state.done]
    bad_todo = [e for e in bad if record_key(e["id"], e["line"]) not in state.done]
    skipped = total - len(todo) - len(bad_todo)
    if skipped:
        say(f"{skipped} of {total} records are already in {job.output_path}: skipped")
    todo.sort(key=lambda t: -t.size)  # longest prompt first (stable: input order among equals)
    return _Pending(tasks=todo, error_lines=bad_todo, records=total, skipped=skipped)


def _default_model() -> Path:
    from ortspec.adapters.tools.convert import convert_smollm2, default_model_dir, is_complete

    folder = default_model_dir("fp32")
    if not is_complete(folder):
        print(f"ortspec: converting the default model into {folder} (about a minute)", file=sys.stderr)
        convert_smollm2(folder, "fp32", progress=lambda m: print(m, file=sys.stderr))
    return folder


def _check_model(model_dir: Path) -> None:
    """``BatchError`` unless ``model_dir`` is a model folder ortspec can load (checked before any worker starts)."""
    from ortspec.backends.onnx import ModelFolder

    if not model_dir.is_dir():
        raise BatchError(f"model folder {model_dir} does not exist")
    try:
        ModelFolder.load(model_dir)
    except (ValueError, OSError) as exc:
        raise BatchError(str(exc)) from None


def run_batch(job: BatchJob, *, progress: bool = True, log: Callable[[str], object] | None = None) -> BatchSummary:
    """Generate for every record of ``job.input_path`` (JSONL) not yet in ``job.output_path``, appending one line
    per record (``BatchJob`` says how). ``progress``: a progress bar on stderr. ``log`` receives notes (repairs,
    skips; default: stderr). Returns a ``BatchSummary``; raises ``BatchError`` when the run cannot start or go on
    (a bad record is an error line, not an exception)."""
    t0 = time.perf_counter()
    say = log if log is not None else (lambda m: print(f"ortspec batch: {m}", file=sys.stderr))
    _check_job(job)
    defaults = _defaults(job)
    threads = job.threads
    if job.ray is None:
        threads = plan_threads(job.workers, job.threads, len(available_cores()))
    else:
        from .ray import import_ray_data

        import_ray_data()  # the extra is there, or a clear message before anything runs
    pending = _pending(job, defaults, say)
    model_dir = job.model if job.model is not None else _default_model()
    if pending.tasks and (job.ray in (None, "local") or job.ship_model or model_dir.is_dir()):
        _check_model(model_dir)  # unless Ray nodes have it at that path, the folder must be here

    summary = BatchSummary(mode=job.mode, workers=job.workers, threads=threads or 0)
    summary.records, summary.skipped = pending.records, pending.skipped
    total = len(pending.tasks) + len(pending.error_lines)
    output = BatchOutput(job.output_path, summary, total=total, progress=progress, t0=t0)
    try:
        for record in pending.error_lines:
            output.write(record)
        if pending.tasks and job.ray is None:
            assert threads is not None
            settings = WorkerSettings.of(job, threads, defaults, pending.tasks, model_dir)
            run_embedded(output, pending.tasks, model_dir, settings, workers=job.workers, pin=job.pin, say=say)
        elif pending.tasks:
            from .ray import run_ray

            run_ray(output, pending.tasks, model_dir, job, defaults, say)
    finally:
        output.close()
    summary.lost = total - summary.written
    return summary
