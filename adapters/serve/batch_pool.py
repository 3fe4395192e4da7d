"""``BatchPool``: every request on one batched Engine (one ``BatchScheduler`` over the Engine's batch backend).

The Engine's batch backend has ``slots`` KV caches; the scheduler's pass thread runs one target pass for every
sequence holding a slot, and a request that finds every slot taken waits in the driver's queue, first come first.
More than ``max_queue`` requests waiting beyond the slots: ``QueueFull`` (answered 429 with ``Retry-After``).

Each request is made ready exactly as ``Engine.generate_many`` makes a prompt ready (``batch_request``: the same
core options, proposer and width as ``Engine.generate``), so its output is what it gives alone. A client that
disconnects cancels its request (``BatchSequence.cancel``): it is in no pass after the current one. The deadline
is checked by the scheduler between passes: past it, the request ends with ``RequestTimeout`` carrying what it
generated. A failed pass fails the requests in it (500); the others, and the pool, go on.

Threads: every method runs on the event loop except ``measure`` (any other thread, before the first request: it
measures the batch backend's decode costs, which empties its slots, and the scheduler starts after it), ``close``,
``wait_until`` (any other thread) and ``_ended`` and ``_passed`` (the scheduler's pass thread). ``busy`` and
``waiting`` are the pool's own count of its jobs (the oldest ``slots`` hold a slot, the rest wait), kept on the
event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import time

from ortspec.adapters.engine import Engine
from ortspec.adapters.engine.many import batch_request
from ortspec.adapters.engine.measurements import cached_batch_decode_costs
from ortspec.adapters.engine.scheduler import BatchScheduler, PassReport, ScheduledRequest
from ortspec.adapters.serve.errors import QueueFull
from ortspec.adapters.serve.jobs import Clock, RequestGeneration, SubmittedJobs
from ortspec.adapters.serve.metrics import Metrics
from ortspec.adapters.serve.models import Prepared
from ortspec.backends.base import BatchBackend


class BatchPool(SubmittedJobs):
    """One Engine and its batch backend ``backend`` (``engine.batch_backend(slots)``, or a test's stand-in), behind
    a ``BatchScheduler`` (see the module docstring). ``max_queue``, ``timeout_s``, ``metrics`` and ``clock`` as for
    ``WorkerPool``."""

    def __init__(
        self,
        engine: Engine,
        backend: BatchBackend,
        *,
        max_queue: int,
        timeout_s: float,
        metrics: Metrics,
        clock: Clock = time.monotonic,
    ) -> None:
        super().__init__(parallel=backend.slots, max_queue=max_queue, timeout_s=timeout_s, metrics=metrics, clock=clock)
        self.engine, self.backend = engine, backend
        engine.shared_passes.hand_over()  # the batch backend's slots are this pool's scheduler's
        self._decode_costs: tuple[float, ...] | None = None  # measured by ``measure``
        self._scheduler: BatchScheduler | None = None  # started on first use, after ``measure``
        metrics.workers.set(1)
        metrics.batch_slots.set(backend.slots)

    @property
    def texts(self) -> Engine:
        """The Engine, whose tokenizer and chat template make requests ready."""
        return self.engine

    @property
    def context_length(self) -> int:
        return min(self.engine.backend.max_length, self.backend.max_length)

    def health(self) -> dict[str, int]:
        """What ``/health`` reports about the pool besides busy and waiting."""
        return {"workers": 1, "max_batch": self.parallel}

    @property
    def scheduler(self) -> BatchScheduler:
        """The scheduler over ``backend`` (started on first use; with the Engine's ``prefill_budget`` and the decode
        costs ``measure`` took)."""
        if self._scheduler is None:
            self._scheduler = BatchScheduler(
                self.backend,
                prefill_budget=self.engine.prefill_budget,
                decode_costs=self._decode_costs,
                clock=self.clock,
                on_pass=self._passed,
                name="ortspec-batch",
            )
        return self._scheduler

    def measure(self) -> None:
        """Measure the Engine's verify drift, verify cost curve and drafter's cost (the width policies of
        speculative requests) and the batch backend's decode costs (how a plain step is priced in a pass:
        speculation fades as the batch fills). Before serving: measuring the decode costs empties the slots."""
        self.engine.verify_drift()
        self.engine.pass_costs()
        self.engine.draft_cost()
        if self._scheduler is None:
            self._decode_costs = cached_batch_decode_costs(self.backend, self.engine.measurement_file())

    def close(self) -> None:
        if self._scheduler is not None:
            self._scheduler.close()

    async def submit(self, prepared: Prepared, *, stream: bool, deadline: float) -> RequestGeneration:
        """Start the request's generation (``QueueFull`` when ``max_queue`` requests already wait beyond the
        slots). The caller reads the job's events and cancels the job when it stops reading."""
        loop = asyncio.get_running_loop()
        job = RequestGeneration(loop, self.engine, 0, prepared, stream=stream, deadline=deadline)
        try:  # off the loop: a speculative request may measure the verify cost curve the first time
            request = await loop.run_in_executor(None, batch_request, self.engine, prepared.ids, prepared.options)
        except ValueError as exc:  # the Engine refused the prompt or options: nothing ran
            job.fail(exc, self.metrics)
            return job
        if len(self._jobs) >= self.parallel + self.max_queue:
            self.metrics.rejected.inc()
            raise QueueFull(self.retry_after())
        self._jobs[job] = None
        self._publish()
        scheduled = self.scheduler.submit(
            request.ids,
            request.options,
            request.proposer,
            draft_width=request.draft_width,
            detokenize=self.engine.tokenizer.decode,
            on_commit=job.deliver,
            on_done=lambda done: self._ended(job, done),
            deadline=deadline,
            on_finish=request.on_finish,
        )
        job.on_cancel = scheduled.cancel
        return job

    # -- the pass thread -------------------------------------------------------------------------------------------
    def _passed(self, report: PassReport) -> None:
        self.metrics.record_pass(report.rows, report.decoding)

    def _ended(self, job: RequestGeneration, request: ScheduledRequest) -> None:
        """The request is done: record it, send its last event, and (on the loop) drop the job."""
        now, admitted = self.clock(), request.admitted_at
        self.metrics.queue_wait.observe((now if admitted is None else admitted) - request.submitted_at)
        if admitted is not None:
            self.metrics.duration.observe(now - admitted)
        error, result = request.error, request.result()
        if request.timed_out:
            job.time_out(self.timeout_s, result if admitted is not None else None, self.metrics)
        elif error is not None:
            job.fail(error, self.metrics)
        elif request.cancelled or result is None:
            job.end_cancelled(self.metrics)
        else:
            job.finish(result, self.metrics)

        def on_loop() -> None:
            del self._jobs[job]
            if admitted is not None:
                self._served(now - admitted)
            self._publish()

        with contextlib.suppress(RuntimeError):  # the loop is closed: the server has stopped
            job.loop.call_soon_threadsafe(on_loop)
