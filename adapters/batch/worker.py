"""One batch worker: an Engine whose one scheduler runs a job's records, up to ``max_batch`` at once, each record's
line made the pass it finishes. Both runners use it: the local runner holds one in this process (one worker) or
one in each worker process (``--workers N``; ``local.py``), and each Ray Data actor holds one (``ray.py``)."""

from __future__ import annotations

import contextlib
import os
import queue
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs

from ortspec.adapters.engine.options import GenerationOptions
from ortspec.adapters.engine.tools import ToolUse
from ortspec.adapters.hosts import file_lock
from ortspec.backends.onnx.config import BackendConfig
from ortspec.batch_driver import DEFAULT_PREFILL_BUDGET, check_prefill_budget
from ortspec.core.speculative import DRAFT_MODEL_NAMES, DRAFTER_NAMES

from .job import BatchJob
from .output import failure_lines, result_lines
from .records import Task

if TYPE_CHECKING:
    from ortspec.adapters.engine.scheduler import ScheduledRequest

# A finished record: its task, its output line and its metrics (``output.result_lines``, ``failure_lines``).
Finished = tuple[Task, dict[str, Any], dict[str, Any]]


# The most records a worker decodes at once when the job does not say (``max_batch`` None): chosen by measurement on
# the throughput dataset's tuning split (python -m bench.slots: docs/bench/slots-tuning.md), the size with the best
# median tokens/s (more slots hold more KV memory and did not go faster there).
AUTO_MAX_BATCH = 16
# A run's KV positions per slot, when the job does not say (``planned_length``): a multiple of KV_ROUND, at least
# KV_FLOOR (so the Engine's cached measurements, whose probes fit 512 positions, stay valid).
KV_ROUND = 256
KV_FLOOR = 512


def _max_batch(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"max_batch must be an int >= 1, got {value!r}")
    return value


def planned_slots(max_batch: int | None, tasks: int, workers: int) -> int:
    """The records each worker decodes at once: ``max_batch`` when the job gives it; else sized from the work, each
    worker's share of the ``tasks`` (rounded up) up to ``AUTO_MAX_BATCH``, and at least 1."""
    if max_batch is not None:
        return max_batch
    share = -(-tasks // max(workers, 1))
    return max(1, min(share, AUTO_MAX_BATCH))


def task_options(defaults: Mapping[str, Any], task: Task) -> GenerationOptions:
    """``task``'s generation options: the job's ``defaults``, its own fields winning (``ValueError`` naming a bad
    one)."""
    return GenerationOptions(**{**defaults, **task.options})


def planned_length(model_dir: Path, defaults: Mapping[str, Any], tasks: Iterable[Task]) -> int | None:
    """The KV positions each slot of a run over ``tasks`` holds, when the job does not say: the most any record
    needs (its prompt's tokens, as its Engine will read them, plus its ``max_tokens``), rounded up to ``KV_ROUND``,
    at least ``KV_FLOOR``, and never more than the batched backend's default capacity (``BackendConfig.capacity``),
    so a record refused there is refused here alike. None (that default) when no record can be read (a bad record
    gets its error line from its worker). Every record fits, so no output changes: only memory does."""
    from ortspec.adapters.engine.tokenizer import PromptReader, Tokenizer
    from ortspec.backends.onnx import ModelFolder

    folder = ModelFolder.load(model_dir)
    reader = PromptReader(Tokenizer.from_folder(model_dir), folder.vocab_size)
    needs = []
    for task in tasks:
        try:
            options = task_options(defaults, task)
            ids = reader.prompt_ids(task.prompt, chat=options.chat, system=options.system, tools=options.tool_use())
        except Exception:  # noqa: BLE001 - the record's own error line says why
            continue
        needs.append(len(ids) + options.max_tokens)
    if not needs:
        return None
    default = BackendConfig().capacity(folder.context_length, batched=True)
    return min(max(-(-max(needs) // KV_ROUND) * KV_ROUND, KV_FLOOR), default)


def speculative_of(task: Task, defaults: Mapping[str, Any]) -> Any:
    """The ``speculative`` value ``task`` runs with: its own, else the job's default (None: plain decoding)."""
    return task.options["speculative"] if "speculative" in task.options else defaults.get("speculative")


def needs_drafter(defaults: Mapping[str, Any], tasks: Iterable[Task]) -> bool:
    """Whether any of ``tasks`` drafts with the Engine's drafter (``DRAFTER_NAMES``), its own ``speculative`` or the
    job's default."""
    return any(isinstance(s, str) and s in DRAFTER_NAMES for s in (speculative_of(t, defaults) for t in tasks))


def needs_draft_model(defaults: Mapping[str, Any], tasks: Iterable[Task]) -> bool:
    """Whether any of ``tasks`` drafts with the Engine's draft model (``DRAFT_MODEL_NAMES``), its own
    ``speculative`` or the job's default."""
    return any(isinstance(s, str) and s in DRAFT_MODEL_NAMES for s in (speculative_of(t, defaults) for t in tasks))


def speculates(defaults: Mapping[str, Any], tasks: Iterable[Task]) -> bool:
    """Whether any of ``tasks`` speculates (its ``speculative`` is not None)."""
    return any(speculative_of(t, defaults) is not None for t in tasks)


@attrs.frozen
class WorkerSettings:
    """How every worker of a run opens its Engine and what it generates with: ``threads`` intra-op threads,
    ``backend`` (the rest of how the model is opened: ``BackendConfig``), the job's ``defaults``
    (``GenerationOptions`` keywords; a record's own win), ``max_batch``, the records a worker decodes at once (its
    Engine's ``batch_slots``), ``prefill_budget``, the most prompt tokens one of its passes folds in (the
    Engine's), ``drafter`` (``Engine.from_dir``'s; ``False``: none is opened), ``warm``: measure what
    speculation needs before the first record (``Engine.warm``), ``draft_model`` (``Engine.from_dir``'s; None:
    none is opened) and ``tree_branches`` (``Engine.from_dir``'s). Pickled to each worker."""

    threads: int
    defaults: Mapping[str, Any] = attrs.field(factory=dict, converter=dict)
    backend: BackendConfig = attrs.field(factory=BackendConfig)
    max_batch: int = attrs.field(default=1, validator=lambda _i, _a, v: _max_batch(v))
    prefill_budget: int | None = attrs.field(
        default=DEFAULT_PREFILL_BUDGET, validator=lambda _i, _a, v: check_prefill_budget(v)
    )
    drafter: str | os.PathLike[str] | bool | None = None
    warm: bool = True
    draft_model: str | os.PathLike[str] | None = None
    tree_branches: int = 1

    @classmethod
    def of(
        cls,
        job: BatchJob,
        threads: int,
        defaults: Mapping[str, Any],
        tasks: Iterable[Task],
        model_dir: Path | None = None,
    ) -> WorkerSettings:
        """A run's settings for ``job``: each worker's ``threads`` and the job's generation ``defaults``, for the
        ``tasks`` the run has to do. The drafter is opened only when one of them drafts with it (``needs_drafter``:
        its own ``speculative`` or the job's default is ``"shared-kv"`` or ``"auto"``), as ``job.drafter`` says;
        otherwise not at all (``False``), whatever ``job.drafter`` says; likewise ``job.draft_model``, only when one
        of them drafts with it (``needs_draft_model``). The workers warm up only when one of them
        speculates. Each worker's slots are ``planned_slots`` (the job's ``max_batch``, or sized from the work), and
        hold ``planned_length`` positions each unless ``job.backend.max_length`` says, when ``model_dir`` (the
        folder, here) is given."""
        tasks = list(tasks)
        drafter = job.drafter if needs_drafter(defaults, tasks) else False
        backend = job.backend
        if model_dir is not None and backend.max_length is None and tasks:
            backend = attrs.evolve(backend, max_length=planned_length(model_dir, defaults, tasks))
        return cls(
            threads,
            defaults,
            backend,
            planned_slots(job.max_batch, len(tasks), job.workers),
            job.prefill_budget,
            drafter,
            speculates(defaults, tasks),
            draft_model=job.draft_model if needs_draft_model(defaults, tasks) else None,
            tree_branches=job.tree_branches,
        )


class BatchWorker:
    """One Engine (``Engine.from_dir(..., batch_slots=max_batch)``) and the job's defaults: turns tasks into their
    output lines and metrics.

    ``submit`` makes a task's request (``Engine.request``) and submits it to the Engine's one scheduler
    (``Engine.submit``): up to ``slots`` records decode together, and one submitted while every slot is taken joins
    at the first pass after one frees (first come first). When a record finishes, the scheduler's pass thread makes
    its line and puts it in the worker's queue, which ``advance`` empties; or hands it to the ``on_done`` given to
    ``submit``. A record that cannot start (a bad prompt or option) gets its error line at once; one that fails
    midway gets its error line with its ``partial`` result, and the others go on. Each record's line is what the
    record gives alone (``run``), whatever shares its passes, except its ``stats``: speculation is priced by the
    pass a record joins. A folder that cannot run batched runs one record at a time (one slot; ``note`` says why
    when ``max_batch`` asked for more).

    Loading warms what the first speculative record would otherwise measure (``Engine.warm``: the verify drift, the
    verify cost curve, the drafter's step, the batch decode costs; each kept on disk per machine) unless
    ``settings.warm`` is False. Workers warm one at a time (a file lock), so all but the first read what the first
    measured, and every worker picks the same draft widths. ``load_s``: seconds the load and warm-up took.

    ``submit`` (with ``on_done``) and ``run`` may be called from any thread; ``submit`` without it and ``advance``
    from one thread at a time. ``close`` (or ``with``) ends the Engine."""

    def __init__(self, model_dir: str | os.PathLike[str], settings: WorkerSettings, *, name: str = "worker") -> None:
        from ortspec.adapters.engine import Engine
        from ortspec.adapters.engine.cache import cache_root

        t0 = time.perf_counter()
        self.name = name
        self.defaults = dict(settings.defaults)
        self.engine = Engine.from_dir(
            model_dir,
            attrs.evolve(settings.backend, threads=settings.threads),
            drafter=settings.drafter,
            draft_model=settings.draft_model,
            batch_slots=settings.max_batch,
            prefill_budget=settings.prefill_budget,
            tree_branches=settings.tree_branches,
        )
        # Why the folder runs one record at a time (only news when more were asked for).
        self.note: str | None = self.engine.note if settings.max_batch > 1 else None
        try:
            if settings.warm:
                with file_lock(cache_root() / "measurements" / ".measure.lock"):
                    self.engine.warm()
        except BaseException:
            self.engine.close()
            raise
        self._finished: queue.SimpleQueue[Finished] = queue.SimpleQueue()
        self._held = 0  # submitted without ``on_done``, not yet returned by ``advance``
        self.load_s = time.perf_counter() - t0

    @property
    def slots(self) -> int:
        """Records this worker decodes at once."""
        return self.engine.batch.slots

    @property
    def held(self) -> int:
        """Tasks submitted (without ``on_done``) whose line ``advance`` has not returned yet."""
        return self._held

    def options(self, task: Task) -> GenerationOptions:
        """``task``'s generation options (``task_options``)."""
        return task_options(self.defaults, task)

    def submit(self, task: Task, on_done: Callable[[Finished], object] | None = None) -> None:
        """Take ``task``: its ``(task, output line, metrics)`` goes to ``on_done`` (on the scheduler's pass thread,
        or on this one for a record that cannot start), or, without one, comes back from a later ``advance``."""
        if on_done is None:
            self._held += 1
        deliver = on_done if on_done is not None else self._finished.put
        try:
            options = self.options(task)
            request = self.engine.request(task.prompt, options)
            tools = options.tool_use()
            self.engine.submit(request, on_done=lambda scheduled: deliver(self._finish(task, scheduled, tools)))
        except Exception as exc:  # a bad record never stops the run
            deliver((task, *failure_lines(task, exc, self.name)))

    def _finish(self, task: Task, scheduled: ScheduledRequest, tools: ToolUse | None) -> Finished:
        """(On the pass thread.) The line and metrics of ``task``'s request, now done."""
        try:
            result = scheduled.result()
            if scheduled.error is not None:
                return (task, *failure_lines(task, scheduled.error, self.name))  # type: ignore[arg-type]
            if scheduled.cancelled or result is None:
                raise RuntimeError("the batch worker closed before this record finished")
            return (task, *result_lines(task, result, self.name, tools))
        except Exception as exc:  # never leave a record without its line
            return (task, *failure_lines(task, exc, self.name))

    def advance(self, timeout: float | None = None) -> list[Finished]:
        """The records finished since the last call (submitted without ``on_done``). While tasks are held and none
        is finished, blocks until one is, at most ``timeout`` seconds (None: no limit); returns at once, empty,
        when nothing is held."""
        if not self._held:
            return []
        try:
            done = [self._finished.get(timeout=timeout)]
        except queue.Empty:
            return []
        with contextlib.suppress(queue.Empty):
            while True:
                done.append(self._finished.get_nowait())
        self._held -= len(done)
        return done

    def run(self, task: Task) -> tuple[dict[str, Any], dict[str, Any]]:
        """(output line, metrics) for ``task``, waiting for it: what the record gives alone when the worker holds
        nothing else. The metrics are what ``BatchSummary.add`` counts (``output.result_lines``)."""
        box: queue.SimpleQueue[Finished] = queue.SimpleQueue()
        self.submit(task, on_done=box.put)
        _, record, metrics = box.get()
        return record, metrics

    def close(self) -> None:
        """End the Engine (records still running are cancelled: their lines are not written). Idempotent."""
        self.engine.close()

    def __enter__(self) -> BatchWorker:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
