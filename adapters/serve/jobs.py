"""What the app's pools share (``batch_pool.BatchPool``, ``ray.pool.RayPool``): a request's job and its events, how
a job's outcome is recorded (metrics, the event the app reads), ``SubmittedJobs`` (the jobs from submission to
their end, the queue limit, ``Retry-After``, ``wait_until`` and the busy/waiting gauges), and what the app needs of a
pool (``ServePool``) and of the model's text (``Texts``).

A job's events, in order: ``Started`` (the generation has begun; sent before the first ``Commit``), each
``Commit`` when streaming, then ``Finished`` or ``Failed`` (a job refused or ended before it started sends only
``Failed``). The pool's thread (the Engine scheduler's pass thread, or the Ray pool's relay on the event loop)
emits them; the event loop reads them (``next``). ``cancel`` may be called from any thread: the generation stops
within one target pass.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import threading
from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

from ortspec.adapters.engine.options import Prompt
from ortspec.adapters.engine.tokenizer import Tokenizer
from ortspec.adapters.engine.tools import ToolUse
from ortspec.adapters.serve.errors import Cancelled, RequestTimeout
from ortspec.adapters.serve.metrics import Metrics
from ortspec.adapters.serve.models import Prepared
from ortspec.core.checks import check_int
from ortspec.core.state import Commit
from ortspec.driver import GenerateResult

Clock = Callable[[], float]


class Started(NamedTuple):
    """The generation has begun: the first ``Commit`` (or the end) follows."""


class Finished(NamedTuple):
    result: GenerateResult


class Failed(NamedTuple):
    error: BaseException


Event = Started | Commit | Finished | Failed


class Texts(Protocol):
    """Text and token ids of the model served: what the app needs to make a request ready and to spell its tokens
    (an ``Engine`` is one; so is a ``PromptReader``, which needs no model session)."""

    @property
    def tokenizer(self) -> Tokenizer: ...

    def prompt_ids(self, prompt: Prompt, *, tools: ToolUse | None = None) -> list[int]: ...


class RequestGeneration:
    """One request's generation in a pool. ``texts``: whose tokenizer reads its tokens (for logprob text);
    ``worker``: the index reported in the response's ``ortspec.worker`` (0 on the batched pool; the replica's rank
    on Ray). ``deadline``: on the pool's clock. ``on_cancel``: what else ``cancel`` does (the batched pool cancels the
    scheduled request there, the Ray pool its relay)."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        texts: Texts,
        worker: int,
        prepared: Prepared,
        *,
        stream: bool,
        deadline: float,
    ) -> None:
        self.loop, self.texts, self.worker, self.prepared = loop, texts, worker, prepared
        self.stream, self.deadline = stream, deadline
        self.cancelled = threading.Event()
        self.on_cancel: Callable[[], object] | None = None
        self._events: asyncio.Queue[Event] = asyncio.Queue()
        self._started = False

    def cancel(self) -> None:
        """From any thread; a no-op once the job has ended."""
        self.cancelled.set()
        if self.on_cancel is not None:
            self.on_cancel()

    def emit(self, event: Event) -> None:
        """From the pool's thread. ``Started`` goes once, before the first ``Commit`` or ``Finished``; a ``Failed``
        before any of them comes first (the app answers it as an error response, not as a stream)."""
        if isinstance(event, Started) and self._started:
            return
        if not self._started and isinstance(event, (Commit, Finished)):
            self.emit(Started())
        self._started = self._started or not isinstance(event, Failed)
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody is listening any more
            self.loop.call_soon_threadsafe(self._events.put_nowait, event)

    def deliver(self, commit: Commit) -> None:
        """From the pool's thread: a commit of the generation (an event when streaming; ``Started`` either way)."""
        self.emit(commit if self.stream else Started())

    async def next(self) -> Event:
        return await self._events.get()

    async def next_ready(self) -> list[Event]:
        """The next event and every one already queued behind it (what one message to a remote reader carries)."""
        events = [await self._events.get()]
        while not self._events.empty():
            events.append(self._events.get_nowait())
        return events

    # -- outcomes (from the pool's thread): the metrics and the last event -------------------------------------------
    def finish(self, result: GenerateResult, metrics: Metrics) -> None:
        metrics.record(result)
        metrics.generations.labels("finished").inc()
        self.emit(Finished(result))

    def end_cancelled(self, metrics: Metrics) -> None:
        metrics.generations.labels("cancelled").inc()
        self.emit(Failed(Cancelled()))

    def time_out(self, timeout_s: float, partial: GenerateResult | None, metrics: Metrics) -> None:
        """Past the deadline: ``partial`` is what it generated (None: it never started)."""
        metrics.generations.labels("timeout").inc()
        self.emit(Failed(RequestTimeout(timeout_s, partial)))

    def fail(self, exc: BaseException, metrics: Metrics) -> None:
        """A ``ValueError`` is the request's mistake (nothing ran, not counted); anything else an error."""
        if not isinstance(exc, ValueError):
            metrics.generations.labels("error").inc()
        self.emit(Failed(exc))


class ServePool(Protocol):
    """What the app serves requests with (``BatchPool`` on one Engine, or ``ortspec serve --ray``'s ``RayPool``):
    ``submit`` starts a request's job (``QueueFull`` when the queue is full); the rest is what the routes and
    ``/health`` read. ``clock``: where the app reads request deadlines and durations (seconds). Every method runs on
    the event loop except ``measure`` and ``close`` (a thread of the server's, before the first request and after
    the last)."""

    metrics: Metrics
    clock: Clock

    @property
    def texts(self) -> Texts: ...

    @property
    def context_length(self) -> int: ...

    @property
    def busy(self) -> int: ...

    @property
    def waiting(self) -> int: ...

    def health(self) -> dict[str, int]: ...

    def measure(self) -> None: ...

    def close(self) -> None: ...

    async def submit(self, prepared: Prepared, *, stream: bool, deadline: float) -> RequestGeneration: ...


class SubmittedJobs:
    """The jobs a pool submitted and that have not ended (``_jobs``, oldest first; the value per job is the pool's
    own: the Ray pool keeps the replica serving it), the queue limit, ``Retry-After``, the gauges and
    ``wait_until``. ``parallel``: how many requests run at once (slots); the oldest ``parallel`` jobs are busy (they
    hold a slot), the rest wait. Every method runs on the event loop except ``wait_until``."""

    def __init__(self, *, parallel: int, max_queue: int, timeout_s: float, metrics: Metrics, clock: Clock) -> None:
        self.parallel = parallel
        self.max_queue = check_int("max_queue", max_queue, 0)
        self.timeout_s, self.metrics, self.clock = timeout_s, metrics, clock
        self._jobs: dict[RequestGeneration, Any] = {}  # submitted and not ended, oldest first
        self._service_s = 1.0  # moving average of a job's time running, for Retry-After
        self._changed = threading.Condition()  # notified whenever busy or waiting changes

    @property
    def jobs(self) -> tuple[RequestGeneration, ...]:
        """The jobs submitted and not ended, oldest first."""
        return tuple(self._jobs)

    @property
    def busy(self) -> int:
        """Requests holding a slot."""
        return min(len(self._jobs), self.parallel)

    @property
    def waiting(self) -> int:
        """Requests waiting for a slot."""
        return max(0, len(self._jobs) - self.parallel)

    @property
    def full(self) -> bool:
        """Whether ``max_queue`` jobs already wait beyond the slots (the next one is refused: ``QueueFull``)."""
        return len(self._jobs) >= self.parallel + self.max_queue

    def wait_until(self, predicate: Callable[[Any], bool], timeout_s: float) -> bool:
        """From a thread other than the event loop's: block until ``predicate(pool)`` holds (it is tested whenever
        busy or waiting changes); False after ``timeout_s``."""
        with self._changed:
            return self._changed.wait_for(lambda: predicate(self), timeout=timeout_s)

    def _publish(self) -> None:
        """After busy or waiting changed: the gauges, and anyone in ``wait_until``."""
        self.metrics.busy.set(self.busy)
        self.metrics.waiting.set(self.waiting)
        with self._changed:
            self._changed.notify_all()

    def _served(self, seconds: float) -> None:
        """A job ran for ``seconds``: the service time behind ``retry_after``."""
        self._service_s = 0.8 * self._service_s + 0.2 * seconds

    def retry_after(self) -> int:
        """Seconds until a queue slot is likely free: the waiting requests' share of the mean service time."""
        return max(1, math.ceil(self._service_s * (self.waiting + 1) / self.parallel))
