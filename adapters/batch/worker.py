"""One batch worker: an Engine that turns tasks into their output lines and metrics, up to ``max_batch`` records at
once on its batch driver (``batched.py``), or one at a time with ``Engine.generate``. Both runners use it: each
embedded worker process holds one (``local.py``), and so does each Ray Data actor (``ray.py``)."""

from __future__ import annotations

import collections
import contextlib
import os
import queue
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import attrs

from ortspec.adapters.engine.options import GenerationOptions
from ortspec.backends.onnx.config import BackendConfig
from ortspec.batch_driver import DEFAULT_PREFILL_BUDGET, check_prefill_budget

from .batched import BatchedRecords, Finished
from .job import BatchJob
from .output import failure_lines, result_lines
from .records import Task


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
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


def take_waiting(inbox: Any, *, wait: bool, timeout: float | None = None) -> list[Any]:
    """Everything waiting in ``inbox`` (a ``queue.Queue`` or a multiprocessing queue), for a worker's next
    ``advance``; ``wait``: first wait up to ``timeout`` seconds for one item (a worker that holds no task), raising
    ``queue.Empty`` if none came. A worker that holds tasks never waits: its passes go on."""
    items = [inbox.get(timeout=timeout)] if wait else []
    with contextlib.suppress(queue.Empty):
        while True:
            items.append(inbox.get_nowait())
    return items


def _max_batch(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"max_batch must be an int >= 1, got {value!r}")
    return value


@attrs.frozen
class WorkerSettings:
    """How every worker of a run opens its Engine and what it generates with: ``threads`` intra-op threads,
    ``backend`` (the rest of how the model is opened: ``BackendConfig``), the job's ``defaults``
    (``GenerationOptions`` keywords; a record's own win), ``max_batch``, the records a worker decodes at once
    (1: one ``Engine.generate`` per record), ``prefill_budget``, the most prompt tokens one of its batched passes
    folds in (the Engine's), and ``drafter`` (``Engine.from_dir``'s). Pickled to each worker."""

    threads: int
    defaults: Mapping[str, Any] = attrs.field(factory=dict, converter=dict)
    backend: BackendConfig = attrs.field(factory=BackendConfig)
    max_batch: int = attrs.field(default=1, validator=lambda _i, _a, v: _max_batch(v))
    prefill_budget: int | None = attrs.field(
        default=DEFAULT_PREFILL_BUDGET, validator=lambda _i, _a, v: check_prefill_budget(v)
    )
    drafter: str | os.PathLike[str] | bool | None = None

    @classmethod
    def of(cls, job: BatchJob, threads: int, defaults: Mapping[str, Any]) -> WorkerSettings:
        """A run's settings for ``job``: each worker's ``threads`` and the job's generation ``defaults``."""
        return cls(threads, defaults, job.backend, job.max_batch, job.prefill_budget, job.drafter)


class BatchWorker:
    """One Engine and the job's defaults: turns tasks into their output records and metrics.

    ``submit`` and ``advance`` are how a runner feeds it: with ``max_batch`` > 1 the tasks run on the Engine's batch
    driver (``BatchedRecords``: ``slots`` = ``max_batch`` records decode together, a submitted task joins when a
    slot frees), else, or when the folder cannot be batched (``note`` says why), one at a time with ``run``
    (``Engine.generate``, ``slots`` = 1). Either way each record's line is what ``run`` gives it.

    Loading warms what the first speculative generation would otherwise measure (the verify drift, and the verify
    cost curve for ``draft_width="auto"``). The cost curve is cached per machine; workers measure it one at a time
    (a file lock), so all but the first read the same curve, and every worker picks the same draft widths.
    ``load_s``: seconds the load and warm-up took. One thread uses a worker at a time."""

    def __init__(self, model_dir: str | os.PathLike[str], settings: WorkerSettings, *, name: str = "worker") -> None:
        from ortspec.adapters.engine import Engine
        from ortspec.adapters.engine.cache import cache_root
        from ortspec.backends.base import BackendError
        from ortspec.backends.onnx import ModelFolderError

        t0 = time.perf_counter()
        self.name = name
        self.defaults = dict(settings.defaults)
        config = attrs.evolve(settings.backend, threads=settings.threads)
        self.note: str | None = None
        engine: Engine | None = None
        if settings.max_batch > 1:  # one session: the Engine's own backend is its batch backend's lone slot
            try:
                engine = Engine.from_dir(
                    model_dir,
                    config,
                    drafter=settings.drafter,
                    batch_slots=settings.max_batch,
                    prefill_budget=settings.prefill_budget,
                )
            except ModelFolderError:
                raise
            except (BackendError, ValueError) as exc:
                self.note = f"the model cannot run batched, so each worker runs one record at a time: {exc}"
        if engine is None:
            engine = Engine.from_dir(model_dir, config, drafter=settings.drafter)
        self.engine = engine
        if self.defaults.get("speculative") is not None:
            with file_lock(cache_root() / "measurements" / ".measure.lock"):
                if self.defaults.get("draft_width", "auto") == "auto":
                    self.engine.pass_costs()
                self.engine.verify_drift()
                self.engine.draft_cost()  # 0.0 without a drafter
        self.batched: BatchedRecords | None = None  # the batched path, or None (one at a time)
        if settings.max_batch > 1 and self.note is None:
            self.batched = BatchedRecords(self.engine, self.defaults, name)
        self._queue: collections.deque[Task] = collections.deque()  # the one-at-a-time path's tasks
        self.load_s = time.perf_counter() - t0

    @property
    def slots(self) -> int:
        """Records this worker decodes at once."""
        return self.batched.slots if self.batched is not None else 1

    @property
    def held(self) -> int:
        """Tasks submitted whose line ``advance`` has not returned yet."""
        return self.batched.held if self.batched is not None else len(self._queue)

    def submit(self, task: Task) -> None:
        """Take ``task``; its line comes back from a later ``advance``."""
        if self.batched is not None:
            self.batched.submit(task)
        else:
            self._queue.append(task)

    def advance(self) -> list[Finished]:
        """Work on the submitted tasks: one pass of the batch driver, or one whole record one at a time; returns
        the ``(task, output record, metrics)`` of the records that finished (none when nothing is held)."""
        if self.batched is not None:
            return self.batched.step()
        if not self._queue:
            return []
        task = self._queue.popleft()
        return [(task, *self.run(task))]

    def run(self, task: Task) -> tuple[dict[str, Any], dict[str, Any]]:
        """(output record, metrics) for ``task`` with ``Engine.generate``; every failure is an error record. The
        metrics are what ``BatchSummary.add`` counts (``output.result_lines``)."""
        options = {**self.defaults, **task.options}
        try:
            result = self.engine.generate(task.prompt, **options)
        except Exception as exc:  # a bad record never stops the run
            return failure_lines(task, exc, self.name)
        return result_lines(task, result, self.name, GenerationOptions(**options).tool_use())
