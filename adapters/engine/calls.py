"""A call on an Engine's one scheduler, consumed on the caller's thread: ``Call``, and the Engine's ``generate``,
``generate_stream``, ``stream`` and ``generate_many`` on it.

Contract:

- Every generation of an Engine is a request of its one ``BatchScheduler`` (``Engine.scheduler``), whatever thread
  makes it: calls from many threads share passes (up to the Engine's slots at once; the rest wait, first come
  first), and a lone call is a batch of one. The output (tokens, text, finish reason, stop, logprobs, stats) is what
  the call gives alone, whatever else shares its passes.
- The pass thread only queues commits; everything a caller sees (its commits, its callback, its errors) happens on
  the caller's own thread, so a slow or failing callback holds up no other request.
- ``stream`` is lazy: its request is queued on the first ``next``; an iterator closed or dropped (garbage) cancels
  its request, which is in no pass after the current one. A ``generate_stream`` callback that raises stops only its
  own request: ``GenerationAborted`` carries what was delivered up to and including that commit. A call that
  ``Engine.close`` cuts short raises ``GenerationError`` (its ``partial``: everything it delivered) caused by
  ``EngineClosed``; a call after ``close`` raises ``EngineClosed``.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

from ortspec.adapters.engine.requests import Request
from ortspec.adapters.engine.scheduler import ScheduledRequest
from ortspec.core import FinishReason
from ortspec.core.state import Commit, DecodeState
from ortspec.results import GenerateResult, GenerationAborted, GenerationError, StreamCallback

if TYPE_CHECKING:
    from ortspec.adapters.engine.engine import Engine


class EngineClosed(RuntimeError):
    """The Engine was closed (``Engine.close``): no generation starts on it, and the calls it cut short raise
    ``GenerationError`` caused by this."""


class Call:
    """One request on an Engine's scheduler, consumed on the caller's thread: iterate it for its ``Commit``s in
    order (``pairs`` for ``(commit, finish_reason)``, the finish reason on the last commit of a finished request);
    the iteration then raises the request's error, if any. Closing (or dropping) an iterator cancels the request;
    so does ``stop``. ``run`` consumes the rest, ``result`` is what it delivered."""

    def __init__(self, engine: Engine, request: Request) -> None:
        # (commit, the sequence's state after the pass that made it), then None once the request is done
        self._items: queue.SimpleQueue[tuple[Commit, DecodeState] | None] = queue.SimpleQueue()
        self._taken = 0  # commits the caller has taken
        self._state: DecodeState | None = None  # the state that came with the last commit taken
        self._stopped = False  # the caller cancelled it (``stop`` or an abandoned iterator)
        self._submitting = threading.Lock()  # held until ``request`` is set: the pass thread reads it
        with self._submitting:
            self.request: ScheduledRequest = engine.submit(
                request, on_commit=self._took, on_done=lambda _: self._items.put(None)
            )

    def _took(self, commit: Commit) -> None:
        """On the pass thread, after the pass that made ``commit``."""
        with self._submitting:
            sequence = self.request.sequence
        assert sequence is not None
        self._items.put((commit, sequence.state))

    def pairs(self) -> Iterator[tuple[Commit, FinishReason | None]]:
        """``(commit, finish_reason)`` in order; then the request's error, if any, is raised."""
        try:
            while (item := self._items.get()) is not None:
                commit, state = item
                self._taken, self._state = self._taken + 1, state
                yield commit, state.finish_reason if self._taken == len(state.generated_tokens) else None
            self._raise_error()
        finally:
            self.stop()

    def __iter__(self) -> Iterator[Commit]:
        return (commit for commit, _ in self.pairs())

    def run(self, callback: StreamCallback | None = None) -> GenerateResult:
        """Consume the rest, calling ``callback(text, token_id, finish_reason)`` for each commit on this thread;
        return ``result()``. A callback that raises stops the request: ``GenerationAborted`` (with what was
        delivered up to and including that commit) is raised from its exception."""
        for commit, finish_reason in self.pairs():
            if callback is not None:
                try:
                    callback(commit.text, commit.token_id, finish_reason)
                except Exception as exc:
                    raise self.aborted() from exc
        return self.result()

    @property
    def state(self) -> DecodeState | None:
        """The core's state that came with the last commit taken (None before the first)."""
        return self._state

    def stop(self) -> None:
        """Cancel the request (from the caller's thread): it is in no pass after the current one. A done request
        ignores it."""
        if not self.request.done.is_set():
            self._stopped = True
            self.request.cancel()

    def result(self) -> GenerateResult:
        """The request's result, once iterating it has ended without an error."""
        result = self.request.result()
        assert result is not None
        return result

    def aborted(self) -> GenerationAborted:
        """Stop the request because the caller's handling of the last commit it took raised (a stream callback):
        the ``GenerationAborted`` to raise, carrying what was delivered up to and including that commit."""
        self.stop()
        self.request.done.wait()  # every commit handed over is queued by now, the last pass's included
        state = self._state
        assert state is not None
        undelivered: list[Commit] = []  # what the taken commit's pass made after it
        while len(undelivered) < len(state.generated_tokens) - self._taken:
            try:
                item = self._items.get_nowait()
            except queue.Empty:
                break
            if item is None:
                break
            undelivered.append(item[0])
        return GenerationAborted(GenerateResult.of(state, undelivered, self.result().timings))

    def _raise_error(self) -> None:
        request = self.request
        if request.error is not None:
            raise request.error
        if request.cancelled and not self._stopped:  # only ``close`` cancels a request behind its caller's back
            partial = self.result()
            closed = EngineClosed("the Engine was closed while this generation ran")
            raise GenerationError.after(closed, partial) from closed


def generate(engine: Engine, request: Request, callback: StreamCallback | None = None) -> GenerateResult:
    """``Engine.generate`` and ``generate_stream``: ``callback`` runs on the caller's thread."""
    call = engine.call(request)
    try:
        return call.run(callback)
    finally:  # interrupted (KeyboardInterrupt): in no pass after the current one
        call.stop()


def texts(engine: Engine, request: Request) -> Iterator[str]:
    """``Engine.stream``: the request is queued on the first ``next``; empty texts are skipped."""
    call = engine.call(request)
    try:
        for commit in call:
            if commit.text:
                yield commit.text
    finally:
        call.stop()


def generate_all(engine: Engine, requests: Sequence[Request]) -> list[GenerateResult]:
    """Every request at once; their results in order once all are done; the first failure raises. An interrupted
    caller cancels those still running."""
    calls: list[Call] = []
    try:
        calls = [engine.call(request) for request in requests]
        failures = []
        for call in calls:
            try:
                for _ in call.pairs():
                    pass
            except Exception as exc:
                failures.append(exc)
        if failures:
            raise failures[0]
        return [call.result() for call in calls]
    finally:
        for call in calls:
            call.stop()
