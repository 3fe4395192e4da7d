"""``BatchScheduler``: one ``BatchDriver`` owned by a thread of its own, for requests arriving from any thread.

Contract:

- ``submit`` may be called from any thread. It puts the request in an inbox (a deque under the scheduler's
  condition) and returns its ``ScheduledRequest`` at once; the pass thread hands the inbox to the driver before
  its next pass. Only the pass thread touches the driver (``BatchDriver`` is not thread-safe).
- The pass thread runs ``driver.step()`` while any sequence is running or waiting; with nothing to do it blocks on
  the condition (woken by ``submit``, ``cancel`` and ``close``; it never polls).
- After each pass, each request's new commits go to its ``on_commit``, in order; then each request that is done
  (finished, failed, cancelled or timed out) goes to its ``on_done``, once. Both run on the pass thread: keep them
  short, and do not call ``close`` from them. An ``on_commit`` that raises stops its request (``error`` is the
  exception); an ``on_done`` that raises is logged. Neither stops the scheduler.
- ``ScheduledRequest.cancel`` may be called from any thread: the request is in no pass after the current one.
- A request with a ``deadline`` (seconds on ``clock``) that is past it before a pass is cancelled and marked
  ``timed_out``; its ``result()`` is what it committed by then (None if it never got a slot).
- A failed backend pass fails the sequences that had a row in it (``error``: their ``GenerationError``, with the
  partial result); the others go on, and so does the scheduler.
- ``close`` cancels every request (each still gets its ``on_done``) and joins the pass thread; ``submit`` after it
  raises ``RuntimeError``.
- ``exclusive()`` (any thread but the pass thread) hands the backend's slots to its caller for a while (a
  measurement): admission stops, the running sequences finish, then no pass runs until the block ends, and the
  driver forgets what the slots held (the waiting requests are admitted after it, into emptied slots).

Observable for tests and metrics: ``passes`` (backend passes run), ``rows_per_pass`` (rows -> passes with that many
rows), ``submitted`` and ``ended`` (requests submitted, and done, so far), ``on_pass`` (called on the pass thread
after each pass with its ``PassReport``; ``observe`` adds more such observers) and ``wait_until`` (block until a
predicate on the scheduler holds; tested after every pass, whenever a request is submitted and whenever one ends).

Each sequence is stepped by the core with its own rows (``BatchDriver``), so a request's output is what the same
request gives alone, whatever else shares its passes.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import NamedTuple

import attrs

from ortspec.backends.base import BatchBackend
from ortspec.batch_driver import (
    DEFAULT_PREFILL_BUDGET,
    BatchDriver,
    BatchSequence,
    Phase,
    check_prefill_budget,
)
from ortspec.core.proposers import Proposer
from ortspec.core.state import Commit, Detokenize, Options
from ortspec.core.width import WidthPolicy
from ortspec.driver import FinishCallback, GenerateResult

log = logging.getLogger("ortspec.scheduler")

Clock = Callable[[], float]


@attrs.frozen
class Scheduling:
    """How an Engine's scheduler runs: ``prefix_reuse`` and ``prefill_budget`` (``BatchDriver``'s; the budget an int
    >= 1 or None) and ``clock``, the seconds a request's ``deadline`` is read on."""

    prefix_reuse: bool = False
    prefill_budget: int | None = attrs.field(
        default=DEFAULT_PREFILL_BUDGET, validator=lambda _i, _a, v: check_prefill_budget(v)
    )
    clock: Callable[[], float] = time.monotonic


class PassReport(NamedTuple):
    """One pass: ``rows`` sequences had a row in it, ``decoding`` of them past their prompt."""

    rows: int
    decoding: int


class Submission(NamedTuple):
    """What ``BatchDriver.submit`` takes for one request."""

    prompt_tokens: Sequence[int]
    options: Options
    proposer: Proposer | None = None
    draft_width: int | WidthPolicy = 8
    detokenize: Detokenize | None = None
    on_finish: FinishCallback | None = None
    reads_target_state: bool = False


class ScheduledRequest:
    """One request of a ``BatchScheduler``. ``done`` is set once its ``on_done`` ran (or would have). Read
    ``result()``, ``error``, ``cancelled`` and ``timed_out`` once it is done. ``submitted_at`` and ``admitted_at``
    (when it first held a slot, None until then) are on the scheduler's clock."""

    def __init__(
        self,
        scheduler: BatchScheduler,
        submission: Submission,
        on_commit: Callable[[Commit], object] | None,
        on_done: Callable[[ScheduledRequest], object] | None,
        deadline: float | None,
    ) -> None:
        self._scheduler, self.submission = scheduler, submission
        self._on_commit, self._on_done, self.deadline = on_commit, on_done, deadline
        self.sequence: BatchSequence | None = None  # set by the pass thread
        self.submitted_at = scheduler.clock()
        self.admitted_at: float | None = None
        self.done = threading.Event()
        self.timed_out = False
        self._cancelled = False
        self._error: BaseException | None = None

    def cancel(self) -> None:
        """From any thread: the request runs in no pass after the current one (a done request ignores it)."""
        self._cancelled = True
        sequence = self.sequence
        if sequence is not None:
            sequence.cancel()
        self._scheduler._wake()

    @property
    def cancelled(self) -> bool:
        """True once ``cancel`` was called (or the deadline passed, or the scheduler closed)."""
        return self._cancelled

    @property
    def error(self) -> BaseException | None:
        """Why it failed: the driver's ``ValueError`` for a bad submission, the sequence's ``GenerationError``,
        or what ``on_commit`` raised; None otherwise."""
        if self._error is not None:
            return self._error
        return self.sequence.error if self.sequence is not None else None

    def result(self) -> GenerateResult | None:
        """What it committed so far (after a cancel, what ``on_commit`` was given); None if it never reached the
        driver (cancelled in the inbox, refused at submission)."""
        return self.sequence.result() if self.sequence is not None else None


class BatchScheduler:
    """A ``BatchDriver`` on ``backend`` run by a thread of its own (see the module docstring). ``prefill_chunk``,
    ``prefill_budget``, ``decode_costs`` and ``prefix_reuse``: as for ``BatchDriver``. ``clock``: where deadlines
    are read (seconds). ``on_pass``: called on the pass thread after every pass with its ``PassReport``."""

    def __init__(
        self,
        backend: BatchBackend,
        *,
        prefill_chunk: int = 512,
        prefill_budget: int | None = DEFAULT_PREFILL_BUDGET,
        decode_costs: Sequence[float] | None = None,
        prefix_reuse: bool = True,
        clock: Clock = time.monotonic,
        on_pass: Callable[[PassReport], object] | None = None,
        name: str = "ortspec-batch",
    ) -> None:
        self._driver = BatchDriver(
            backend,
            prefill_chunk=prefill_chunk,
            prefill_budget=prefill_budget,
            decode_costs=decode_costs,
            prefix_reuse=prefix_reuse,
        )
        self.slots = backend.slots
        self.clock = clock
        self._observers: list[Callable[[PassReport], object]] = [on_pass] if on_pass is not None else []
        self.passes = 0
        self.submitted = 0  # requests submitted so far
        self.ended = 0  # requests done so far (their on_done ran)
        self.rows_per_pass: collections.Counter[int] = collections.Counter()
        self._changed = threading.Condition()
        self._inbox: collections.deque[ScheduledRequest] = collections.deque()
        self._live: list[ScheduledRequest] = []  # the pass thread's: handed to the driver, not done yet
        self._closed = False
        self._paused = 0  # callers in ``exclusive`` (or waiting to be)
        self._parked = False  # the pass thread is waiting for them: the slots are theirs
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    @property
    def closed(self) -> bool:
        """True once ``close`` was called (the pass thread ends after the pass it is in)."""
        return self._closed

    @property
    def decode_costs(self) -> tuple[float, ...] | None:
        """The driver's ``decode_costs`` (None: a plain step is priced as alone). Settable from any thread: the
        passes after the assignment price by the new curve."""
        return self._driver.decode_costs

    @decode_costs.setter
    def decode_costs(self, costs: Sequence[float] | None) -> None:
        self._driver.decode_costs = tuple(costs) if costs is not None else None

    def submit(
        self,
        submission: Submission,
        *,
        on_commit: Callable[[Commit], object] | None = None,
        on_done: Callable[[ScheduledRequest], object] | None = None,
        deadline: float | None = None,
    ) -> ScheduledRequest:
        """A new request (``submission``: what ``BatchDriver.submit`` takes; check it first, as ``Engine.prepare``
        does: a submission the driver refuses ends with ``error`` its ``ValueError``). From any thread."""
        request = ScheduledRequest(self, submission, on_commit, on_done, deadline)
        with self._changed:
            if self._closed:
                raise RuntimeError("the batch scheduler is closed")
            self._inbox.append(request)
            self.submitted += 1
            self._changed.notify_all()
        return request

    def observe(self, on_pass: Callable[[PassReport], object]) -> Callable[[], None]:
        """Call ``on_pass(report)`` on the pass thread after every pass from now on (metrics); it must not raise.
        Returns what stops it (idempotent)."""
        with self._changed:
            self._observers = [*self._observers, on_pass]

        def stop() -> None:
            with self._changed:
                self._observers = [o for o in self._observers if o is not on_pass]

        return stop

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[BatchDriver]:
        """The backend's slots for the caller until the block ends (the module docstring): yields the driver, whose
        settings (``decode_costs``) the caller may change meanwhile. ``RuntimeError`` once closed, or from the pass
        thread."""
        if threading.current_thread() is self._thread:
            raise RuntimeError("BatchScheduler.exclusive was called from its own pass thread")
        with self._changed:
            if self._closed:
                raise RuntimeError("the batch scheduler is closed")
            self._paused += 1
            self._changed.notify_all()
            try:
                self._changed.wait_for(lambda: self._parked or self._closed)
                if self._closed:
                    raise RuntimeError("the batch scheduler closed")
            except BaseException:
                self._paused -= 1
                self._changed.notify_all()
                raise
        try:
            yield self._driver
        finally:
            with self._changed:
                self._paused -= 1
                self._changed.notify_all()

    def close(self) -> None:
        """Cancel every request (each gets its ``on_done``) and join the pass thread. Idempotent."""
        with self._changed:
            self._closed = True
            self._changed.notify_all()
        if threading.current_thread() is not self._thread:
            self._thread.join()

    def wait_until(self, predicate: Callable[[BatchScheduler], bool], timeout_s: float) -> bool:
        """Block until ``predicate(self)`` holds (tested after every pass and whenever a request ends); False after
        ``timeout_s``."""
        with self._changed:
            return self._changed.wait_for(lambda: predicate(self), timeout=timeout_s)

    def _wake(self) -> None:
        with self._changed:
            self._changed.notify_all()

    # -- the pass thread -------------------------------------------------------------------------------------------
    def _busy(self) -> bool:
        return bool(self._inbox or self._driver.running or self._driver.waiting)

    def _run(self) -> None:
        while True:
            with self._changed:
                self._changed.wait_for(lambda: self._closed or self._busy() or self._paused > 0)
                if self._closed:
                    break
                if self._paused and not self._driver.running:
                    self._park()
                    continue
                self._driver.admitting = not self._paused
                arrived = list(self._inbox)
                self._inbox.clear()
            for request in arrived:
                self._hand_over(request)
            self._expire()
            self._deliver()  # the cancelled end before the pass that drops them
            report = self._next_pass()
            try:
                ran = self._driver.step()
            except BaseException as exc:  # a bug in the driver, or an interrupt raised in a pass: fail what it holds
                # and keep serving (the pass thread never dies with requests waiting on it)
                log.exception("a batch pass raised")
                self._fail_all(exc)
                ran = False
            self._deliver()
            if ran:
                with self._changed:
                    self.passes += 1
                    self.rows_per_pass[report.rows] += 1
                    self._changed.notify_all()
                for observer in self._observers:
                    observer(report)
        self._shut_down()

    def _park(self) -> None:
        """(Under the condition.) Leave the slots to the callers of ``exclusive`` until they are done; then forget
        what the slots held."""
        self._parked = True
        self._changed.notify_all()
        self._changed.wait_for(lambda: self._closed or not self._paused)
        self._parked = False
        self._driver.forget()

    def _hand_over(self, request: ScheduledRequest) -> None:
        """Give the request to the driver (unless it was cancelled in the inbox)."""
        if not request.cancelled:
            s = request.submission
            try:
                request.sequence = self._driver.submit(
                    s.prompt_tokens,
                    s.options,
                    s.proposer,
                    draft_width=s.draft_width,
                    detokenize=s.detokenize,
                    on_finish=s.on_finish,
                    reads_target_state=s.reads_target_state,
                )
            except ValueError as exc:
                request._error = exc
            else:
                if request.cancelled:  # cancelled while being handed over
                    request.sequence.cancel()
        self._live.append(request)

    def _expire(self) -> None:
        """Cancel the requests past their deadline (before the pass)."""
        now = self.clock()
        for request in self._live:
            if request.deadline is not None and now > request.deadline and not request.cancelled:
                request.timed_out = True
                request.cancel()

    def _next_pass(self) -> PassReport:
        """The rows the next ``step`` will run: the running sequences not cancelled, and the waiting ones that
        will take the free slots."""
        running = [s for s in self._driver.running if not s.cancelled]
        waiting = sum(not s.cancelled for s in self._driver.waiting)
        admitted = min(waiting, self.slots - len(running))
        return PassReport(len(running) + admitted, sum(s.phase is Phase.DECODING for s in running))

    def _deliver(self) -> None:
        """Each live request's new commits to its ``on_commit``; the done and the cancelled ones (no pass after
        this one runs them, so their result stands) to their ``on_done``."""
        for request in list(self._live):
            sequence = request.sequence
            if sequence is not None:
                if request.admitted_at is None and sequence.slot is not None:
                    request.admitted_at = self.clock()
                if request._on_commit is not None:
                    try:
                        for commit in sequence.take_commits():
                            request._on_commit(commit)
                    except Exception as exc:
                        request._error = exc
                        request.cancel()
                if not (sequence.done or sequence.cancelled):
                    continue
            self._live.remove(request)
            self._end(request)

    def _end(self, request: ScheduledRequest) -> None:
        try:
            if request._on_done is not None:
                request._on_done(request)
        except Exception:
            log.exception("a request's on_done raised")
        finally:
            request.done.set()
            with self._changed:
                self.ended += 1
                self._changed.notify_all()

    def _fail_all(self, exc: BaseException) -> None:
        """The driver itself raised (a bug, or an interrupt from inside a pass): end every live request with ``exc``
        and go on with a fresh driver on the same backend (every slot is reset when next taken)."""
        for request in self._live:
            request._error = exc
            request.cancel()
        self._driver = self._driver.fresh()

    def _shut_down(self) -> None:
        with self._changed:
            arrived = list(self._inbox)
            self._inbox.clear()
        for request in [*self._live, *arrived]:
            request.cancel()
            self._end(request)
        self._live.clear()
