"""``BatchPool``: every request of the server on one Engine's one scheduler (``Engine.scheduler``).

The Engine's batch backend has ``slots`` KV caches; its scheduler's pass thread runs one target pass for every
sequence holding a slot, and a request that finds every slot taken waits in the driver's queue, first come first.
More than ``max_queue`` of the pool's requests waiting beyond the slots: ``QueueFull`` (answered 429 with
``Retry-After``). The pool submits to the scheduler and nothing else: it owns no backend and no scheduler, so the
Engine's other callers (``generate`` on another thread, say) share the same passes and slots; ``busy`` and
``waiting`` count the pool's own requests.

Each request is made ready by ``Engine.request`` (the one path every surface takes: the same core options,
proposer and width as ``Engine.generate``), so its output is what it gives alone. A client that disconnects cancels
its request (``ScheduledRequest.cancel``): it is in no pass after the current one. The deadline is on the Engine's
clock (``Engine.clock``, which is this pool's ``clock``) and checked by the scheduler between passes: past it, the
request ends with ``RequestTimeout`` carrying what it generated. A failed pass fails the requests in it (500); the
others, and the pool, go on.

Threads: every method runs on the event loop except ``measure`` and ``close`` (a thread of the server's, before the
first request and after the last), ``wait_until`` (any other thread), ``_ready`` (the loop's executor: making a
request ready may measure) and ``_ended`` and ``_passed`` (the scheduler's pass thread). ``busy`` and ``waiting``
are the pool's own count of its jobs (the oldest ``slots`` hold a slot, the rest wait), kept on the event loop.

The pool does not close the Engine: whoever opened it does (``ortspec serve`` when the server stops; a test's
fixture), so one Engine may serve several apps one after another, or an app and in-process calls at once.
"""

from __future__ import annotations

import asyncio
import contextlib

from ortspec.adapters.engine import Engine
from ortspec.adapters.engine.requests import Request
from ortspec.adapters.engine.scheduler import PassReport, ScheduledRequest
from ortspec.adapters.serve.errors import QueueFull
from ortspec.adapters.serve.jobs import RequestGeneration, SubmittedJobs
from ortspec.adapters.serve.metrics import Metrics
from ortspec.adapters.serve.models import Prepared


class BatchPool(SubmittedJobs):
    """The server's requests on ``engine``'s scheduler (see the module docstring). ``max_queue``: requests that may
    wait beyond the slots (one more: ``QueueFull``). ``timeout_s``: the request timeout, for ``RequestTimeout``'s
    message (each job's deadline is its own). ``metrics``: where the pool records (its passes are the scheduler's,
    observed from now on). The clock is the Engine's (``Engine(clock=...)``): the scheduler reads the deadlines on
    it."""

    def __init__(self, engine: Engine, *, max_queue: int, timeout_s: float, metrics: Metrics) -> None:
        slots = engine.batch.slots
        super().__init__(parallel=slots, max_queue=max_queue, timeout_s=timeout_s, metrics=metrics, clock=engine.clock)
        self.engine = engine
        self._closed = False
        # starts the scheduler (EngineClosed if the Engine is closed)
        self._stop_observing = engine.scheduler.observe(self._passed)
        metrics.workers.set(1)
        metrics.batch_slots.set(slots)

    @property
    def texts(self) -> Engine:
        """The Engine, whose tokenizer and chat template make requests ready."""
        return self.engine

    @property
    def context_length(self) -> int:
        return self.engine.batch.max_length

    def health(self) -> dict[str, int]:
        """What ``/health`` reports about the pool besides busy and waiting."""
        return {"workers": 1, "max_batch": self.parallel}

    def measure(self) -> None:
        """``Engine.warm``: the verify drift, the verify cost curve and the drafter's cost (the width policies of
        speculative requests) and the batch backend's decode costs (how a plain step is priced in a pass:
        speculation fades as the batch fills), each kept on disk once measured. Before serving: a measurement holds
        the slots."""
        self.engine.warm()

    def close(self) -> None:
        """Cancel the pool's requests (each is in no pass after the current one) and stop recording passes. The
        Engine stays open (the module docstring)."""
        self._closed = True
        self._stop_observing()
        for job in self.jobs:
            job.cancel()

    async def submit(self, prepared: Prepared, *, stream: bool, deadline: float) -> RequestGeneration:
        """Start the request's generation (``QueueFull`` when ``max_queue`` requests already wait beyond the
        slots). The caller reads the job's events and cancels the job when it stops reading."""
        loop = asyncio.get_running_loop()
        job = RequestGeneration(loop, self.engine, 0, prepared, stream=stream, deadline=deadline)
        try:  # off the loop: a speculative request may measure the first time
            request = await loop.run_in_executor(None, self._ready, prepared)
        except ValueError as exc:  # the Engine refused the prompt or options: nothing ran
            job.fail(exc, self.metrics)
            return job
        if self.full:
            self.metrics.rejected.inc()
            raise QueueFull(self.retry_after())
        self._jobs[job] = None
        self._publish()
        try:
            scheduled = self.engine.submit(
                request, on_commit=job.deliver, on_done=lambda done: self._ended(job, done), deadline=deadline
            )
        except BaseException:  # the Engine is closed
            del self._jobs[job]
            self._publish()
            raise
        job.on_cancel = scheduled.cancel
        if job.cancelled.is_set():  # cancelled before it was scheduled
            scheduled.cancel()
        return job

    def _ready(self, prepared: Prepared) -> Request:
        """(The loop's executor.) ``Engine.request``; for a request that reads the price of a plain step in its pass,
        the measurements ``Engine.submit`` would otherwise take on the event loop (``warm``: each once per model)."""
        request = self.engine.request(prepared.ids, prepared.options)
        if request.reads_pass_price:
            self.engine.warm()
        return request

    # -- the pass thread -------------------------------------------------------------------------------------------
    def _passed(self, report: PassReport) -> None:
        if not self._closed:
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
