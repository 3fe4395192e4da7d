"""``WorkerPool``: N workers, each its own ``Engine`` and thread, behind a bounded FIFO queue.

Each worker is its own ``Engine`` (own backend and KV, prefix reuse on) and its own thread (ONNX Runtime releases
the GIL, so workers run in parallel). A request waits for an idle worker in a bounded FIFO queue (full:
``QueueFull``, answered 429 with ``Retry-After``); a free worker goes to the head of the queue, and a request
finding several idle workers takes the one whose resident tokens (``Engine.resident_tokens()``) share the longest
prefix with its prompt, net of the resident KV it would drop (``WorkerPool._best_idle``), so the next turn of a
conversation prefills only its new tokens.

A worker thread iterates the Engine's ``Generation`` one commit at a time and checks the job's cancel flag and
deadline between commits: a client that disconnects, or a request past its timeout, stops its generation within
one target pass. The pool never gives one Engine two requests at once (a worker is leased to one job at a time).

Threads: every method runs on the event loop except ``measure``, ``wait_until`` (any other thread) and the worker
threads' ``_execute``. Times are read from ``clock`` (seconds; ``time.monotonic`` unless the caller passes one).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

from ortspec.adapters.engine import Engine
from ortspec.adapters.serve.errors import QueueFull, RequestTimeout
from ortspec.adapters.serve.jobs import Clock, PoolCore, RequestGeneration, Started
from ortspec.adapters.serve.metrics import Metrics
from ortspec.adapters.serve.models import Prepared
from ortspec.core.prefix import reuse_score


class Worker:
    """One Engine and the thread that runs it. ``resident`` mirrors ``engine.resident_tokens()`` as of the end of
    its last job (read by the router while the worker is idle)."""

    def __init__(self, index: int, engine: Engine) -> None:
        self.index, self.engine = index, engine
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"ortspec-worker-{index}")
        self.resident: tuple[int, ...] = ()
        self.busy = False
        self.last_used = 0.0


class WorkerPool(PoolCore):
    """N workers behind a bounded FIFO queue, routing by shared prefix (see the module docstring).

    ``max_queue``: requests that may wait for a worker (one more: ``QueueFull``). ``timeout_s``: the request
    timeout, for ``RequestTimeout``'s message (each job's deadline is its own). ``clock``: where deadlines and
    durations are read (seconds)."""

    def __init__(
        self,
        engines: Sequence[Engine],
        *,
        max_queue: int,
        timeout_s: float,
        metrics: Metrics,
        clock: Clock = time.monotonic,
    ) -> None:
        if not engines:
            raise ValueError("the pool needs at least one engine")
        super().__init__(parallel=len(engines), max_queue=max_queue, timeout_s=timeout_s, metrics=metrics, clock=clock)
        self.workers = [Worker(i, e) for i, e in enumerate(engines)]
        self._waiters: deque[tuple[list[int], asyncio.Future[Worker]]] = deque()
        self._jobs: dict[RequestGeneration, Worker] = {}  # the running jobs, oldest first
        metrics.workers.set(len(self.workers))

    @property
    def texts(self) -> Engine:
        """The Engine whose tokenizer and chat template make requests ready."""
        return self.workers[0].engine

    @property
    def jobs(self) -> tuple[RequestGeneration, ...]:
        """The running jobs, oldest first."""
        return tuple(self._jobs)

    def health(self) -> dict[str, int]:
        """What ``/health`` reports about the pool besides busy and waiting."""
        return {"workers": len(self.workers)}

    @property
    def context_length(self) -> int:
        return min(w.engine.backend.max_length for w in self.workers)

    @property
    def busy(self) -> int:
        return sum(w.busy for w in self.workers)

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    def measure(self) -> None:
        """Measure each worker's verify drift, verify cost curve and drafter's cost (with a drafter), one after
        another, so they do not disturb each other. A measurement drops an Engine's resident KV: call this before
        serving."""
        for w in self.workers:
            w.engine.verify_drift()
            w.engine.pass_costs()
            w.engine.draft_cost()
            w.resident = w.engine.resident_tokens()

    def close(self) -> None:
        for job in self.jobs:
            job.cancel()
        for w in self.workers:
            w.executor.shutdown(wait=True, cancel_futures=True)

    # -- routing ---------------------------------------------------------------------------------------------------
    def _best_idle(self, ids: Sequence[int]) -> Worker | None:
        """The idle worker whose resident tokens share the longest prefix with ``ids``, net of the resident KV the
        request would drop there (``shared - (resident - shared)``; least recently used on ties).

        The next turn of a conversation (or another question about the same document) shares most of a worker's
        resident tokens and goes there. A new conversation that shares only the chat template's opening (the
        system prompt) with every worker goes to the one with the least to lose (an empty one first) instead of
        dropping the KV of a conversation that may continue."""
        idle = [w for w in self.workers if not w.busy]
        if not idle:
            return None

        def score(w: Worker) -> tuple[int, float]:
            return reuse_score(w.resident, ids), -w.last_used

        return max(idle, key=score)

    def _take(self, worker: Worker) -> Worker:
        worker.busy = True
        self._publish()
        return worker

    def _release(self, worker: Worker) -> None:
        worker.busy, worker.last_used = False, self.clock()
        while self._waiters:
            ids, future = self._waiters[0]
            if future.done():  # its request gave up
                self._waiters.popleft()
                continue
            best = self._best_idle(ids)
            if best is None:
                break
            self._waiters.popleft()
            future.set_result(self._take(best))
        self._publish()

    async def _acquire(self, ids: list[int], deadline: float) -> Worker:
        if not self._waiters:
            best = self._best_idle(ids)
            if best is not None:
                return self._take(best)
        if len(self._waiters) >= self.max_queue:
            self.metrics.rejected.inc()
            raise QueueFull(self.retry_after())
        future: asyncio.Future[Worker] = asyncio.get_running_loop().create_future()
        entry = (ids, future)
        self._waiters.append(entry)
        self._publish()
        try:
            return await asyncio.wait_for(future, timeout=max(0.0, deadline - self.clock()))
        except BaseException as exc:
            with contextlib.suppress(ValueError):
                self._waiters.remove(entry)
            self._publish()
            if future.done() and not future.cancelled():  # a worker was handed over as the request gave up
                self._release(future.result())
            if isinstance(exc, TimeoutError):
                raise RequestTimeout(self.timeout_s) from None
            raise

    # -- running ---------------------------------------------------------------------------------------------------
    async def submit(self, prepared: Prepared, *, stream: bool, deadline: float) -> RequestGeneration:
        """Wait for a worker (``QueueFull`` when the queue is full, ``RequestTimeout`` past the deadline) and start
        the generation on it. The caller reads the job's events and cancels the job when it stops reading."""
        t0 = self.clock()
        worker = await self._acquire(prepared.ids, deadline)
        self.metrics.queue_wait.observe(self.clock() - t0)
        job = RequestGeneration(
            asyncio.get_running_loop(), worker.engine, worker.index, prepared, stream=stream, deadline=deadline
        )
        self._jobs[job] = worker
        try:
            future = worker.executor.submit(self._execute, job, worker)
        except BaseException:
            del self._jobs[job]
            self._release(worker)
            raise
        started = self.clock()
        loop = job.loop

        def done(_: Future[None]) -> None:
            def on_loop() -> None:
                self._jobs.pop(job, None)
                self._served(self.clock() - started)
                self._release(worker)

            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(on_loop)

        future.add_done_callback(done)
        return job

    def _execute(self, job: RequestGeneration, worker: Worker) -> None:
        """In the worker's thread: run the generation one commit at a time, checking the cancel flag and the
        deadline between commits (so a cancelled request stops within one target pass)."""
        t0 = self.clock()
        try:
            generation = worker.engine.start_with(job.prepared.ids, job.prepared.options)
            job.emit(Started())
            for commit in generation:
                job.deliver(commit)
                if job.cancelled.is_set():
                    job.end_cancelled(self.metrics)
                    return
                if self.clock() > job.deadline:
                    job.time_out(self.timeout_s, generation.result(), self.metrics)
                    return
            job.finish(generation.result(), self.metrics)
        except Exception as exc:  # ValueError: the Engine refused the prompt or options (nothing ran); otherwise
            job.fail(exc, self.metrics)  # a GenerationError, or a bug: reported as a server error
        finally:
            worker.resident = worker.engine.resident_tokens()
            self.metrics.duration.observe(self.clock() - t0)
