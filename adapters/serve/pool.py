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
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import NamedTuple

from ortspec.adapters.engine import Engine
from ortspec.adapters.serve.errors import Cancelled, QueueFull, RequestTimeout
from ortspec.adapters.serve.metrics import Metrics
from ortspec.adapters.serve.models import Prepared
from ortspec.core.checks import check_int
from ortspec.core.prefix import reuse_score
from ortspec.core.state import Commit
from ortspec.driver import GenerateResult

Clock = Callable[[], float]


class Started(NamedTuple):
    """The prompt pass is done: the first token is decided (the first ``Commit`` follows)."""


class Finished(NamedTuple):
    result: GenerateResult


class Failed(NamedTuple):
    error: BaseException


Event = Started | Commit | Finished | Failed


class Worker:
    """One Engine and the thread that runs it. ``resident`` mirrors ``engine.resident_tokens()`` as of the end of
    its last job (read by the router while the worker is idle); ``job``: the job it runs (None when idle)."""

    def __init__(self, index: int, engine: Engine) -> None:
        self.index, self.engine = index, engine
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"ortspec-worker-{index}")
        self.resident: tuple[int, ...] = ()
        self.busy = False
        self.job: RequestGeneration | None = None
        self.last_used = 0.0


class RequestGeneration:
    """One request's generation on a worker. The worker thread puts events (``Started``, each ``Commit`` when
    streaming, then ``Finished`` or ``Failed``) on a queue the event loop reads; ``cancel()`` asks the thread to
    stop before its next target pass (``cancelled`` is set from then on). ``deadline``: on the pool's clock."""

    def __init__(
        self, loop: asyncio.AbstractEventLoop, worker: Worker, prepared: Prepared, *, stream: bool, deadline: float
    ) -> None:
        self.loop, self.worker, self.prepared = loop, worker, prepared
        self.stream, self.deadline = stream, deadline
        self.cancelled = threading.Event()
        self._events: asyncio.Queue[Event] = asyncio.Queue()

    def cancel(self) -> None:
        self.cancelled.set()

    def emit(self, event: Event) -> None:
        """From the worker thread."""
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is listening any more
            self.loop.call_soon_threadsafe(self._events.put_nowait, event)

    async def next(self) -> Event:
        return await self._events.get()


class WorkerPool:
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
        self.workers = [Worker(i, e) for i, e in enumerate(engines)]
        self.max_queue = check_int("max_queue", max_queue, 0)
        self.timeout_s, self.metrics, self.clock = timeout_s, metrics, clock
        self._waiters: deque[tuple[list[int], asyncio.Future[Worker]]] = deque()
        self._jobs: set[RequestGeneration] = set()
        self._service_s = 1.0  # moving average of a job's time on a worker, for Retry-After
        self._changed = threading.Condition()  # notified whenever busy or waiting changes
        metrics.workers.set(len(self.workers))

    @property
    def context_length(self) -> int:
        return min(w.engine.backend.max_length for w in self.workers)

    @property
    def busy(self) -> int:
        return sum(w.busy for w in self.workers)

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    def wait_until(self, predicate: Callable[[WorkerPool], bool], timeout_s: float) -> bool:
        """From a thread other than the event loop's: block until ``predicate(pool)`` holds (it is tested whenever a
        worker is taken or released and whenever a request joins or leaves the queue); False after ``timeout_s``."""
        with self._changed:
            return self._changed.wait_for(lambda: predicate(self), timeout=timeout_s)

    def _publish(self) -> None:
        """After busy or waiting changed: the gauges, and anyone in ``wait_until``."""
        self.metrics.busy.set(self.busy)
        self.metrics.waiting.set(len(self._waiters))
        with self._changed:
            self._changed.notify_all()

    def measure(self) -> None:
        """Measure each worker's verify drift and verify cost curve (one after another, so they do not disturb
        each other). A measurement drops an Engine's resident KV: call this before serving."""
        for w in self.workers:
            w.engine.verify_drift()
            w.engine.pass_costs()
            w.resident = w.engine.resident_tokens()

    def close(self) -> None:
        for job in list(self._jobs):
            job.cancel()
        for w in self.workers:
            w.executor.shutdown(wait=True, cancel_futures=True)

    def retry_after(self) -> int:
        """Seconds until a queue slot is likely free: the waiting requests' share of the mean service time."""
        return max(1, math.ceil(self._service_s * (len(self._waiters) + 1) / len(self.workers)))

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
        worker.busy, worker.job, worker.last_used = False, None, self.clock()
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
        loop = asyncio.get_running_loop()
        job = worker.job = RequestGeneration(loop, worker, prepared, stream=stream, deadline=deadline)
        self._jobs.add(job)
        try:
            future = worker.executor.submit(self._execute, job)
        except BaseException:
            self._jobs.discard(job)
            self._release(worker)
            raise
        started = self.clock()

        def done(_: Future[None]) -> None:
            def on_loop() -> None:
                self._jobs.discard(job)
                self._service_s = 0.8 * self._service_s + 0.2 * (self.clock() - started)
                self._release(worker)

            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(on_loop)

        future.add_done_callback(done)
        return job

    def _execute(self, job: RequestGeneration) -> None:
        """In the worker's thread: run the generation one commit at a time, checking the cancel flag and the
        deadline between commits (so a cancelled request stops within one target pass)."""
        worker, t0 = job.worker, self.clock()
        try:
            generation = worker.engine.start_with(job.prepared.ids, job.prepared.options)
            job.emit(Started())
            for commit in generation:
                if job.stream:
                    job.emit(commit)
                if job.cancelled.is_set():
                    self.metrics.generations.labels("cancelled").inc()
                    job.emit(Failed(Cancelled()))
                    return
                if self.clock() > job.deadline:
                    self.metrics.generations.labels("timeout").inc()
                    job.emit(Failed(RequestTimeout(self.timeout_s, generation.result())))
                    return
            result = generation.result()
            self.metrics.record(result)
            self.metrics.generations.labels("finished").inc()
            job.emit(Finished(result))
        except ValueError as exc:  # the Engine refused the prompt or options: nothing ran
            job.emit(Failed(exc))
        except Exception as exc:  # GenerationError, or a bug: reported as a server error
            self.metrics.generations.labels("error").inc()
            job.emit(Failed(exc))
        finally:
            worker.resident = worker.engine.resident_tokens()
            self.metrics.duration.observe(self.clock() - t0)
