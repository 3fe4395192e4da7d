"""Shared passes: concurrent ``generate``, ``stream`` and ``generate_stream`` calls on an Engine opened with
``batch_slots`` run as requests of ONE ``BatchScheduler`` over the Engine's batch backend, so calls from many threads
share one target pass per step (up to ``batch_slots`` sequences at once; the rest wait for a slot, first come first).

Contract:

- Which calls share passes: ``shares_passes`` (the one rule). An Engine opened without ``batch_slots`` never does
  (every call runs on its own backend, as ``Engine`` says). On one opened with it, every call does, whatever its
  proposer (a shared-KV drafter is bound to the slot the call takes: ``many.bound_to_slots``); only ``Engine.start``
  (the step-by-step ``Generation``) runs on the lone slot.
- Each call is made ready by ``many.batch_request`` (the one path that builds a batched request: the same core
  options, proposer and width as ``Engine.generate`` would use), so bad options raise the same ``ValueError`` before
  anything is queued, and the output (tokens, text, finish reason, stop, logprobs, stats) is what the call gives
  alone, whatever else shares its passes (``BatchDriver``).
- The scheduler (``SharedPasses``) is one per Engine, started by the first shared call after measuring the batch
  backend's decode costs (``Engine.batch_decode_costs``: it needs the slots empty; once per model, kept on disk),
  and closed by ``Engine.close``. Its pass thread only queues commits; everything a caller sees (its commits, its
  callback, its errors) happens on the caller's own thread (``SharedCall``), so a slow or failing callback holds up
  no other request.
- ``stream`` is lazy: its request is queued on the first ``next``; an iterator closed or dropped (garbage) cancels
  its request, which is in no pass after the current one. A ``generate_stream`` callback that raises stops only its
  own request: ``GenerationAborted`` carries what was delivered up to and including that commit. A call that an
  ``Engine.close`` cuts short raises ``GenerationError`` (its ``partial``: everything it delivered) caused by
  ``EngineClosed``; a call after ``close`` raises ``EngineClosed``.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

from ortspec.adapters.engine.many import BatchRequest, batch_request
from ortspec.adapters.engine.options import GenerationOptions, Prompt
from ortspec.adapters.engine.scheduler import BatchScheduler, ScheduledRequest
from ortspec.core import FinishReason
from ortspec.core.state import Commit, DecodeState, Detokenize
from ortspec.driver import GenerateResult, GenerationAborted, GenerationError, StreamCallback

if TYPE_CHECKING:
    from ortspec.adapters.engine.engine import Engine


class EngineClosed(RuntimeError):
    """The Engine was closed (``Engine.close``): no generation starts on it, and the shared-pass calls it cut short
    raise ``GenerationError`` caused by this."""


def shares_passes(engine: Engine) -> bool:
    """Whether a ``generate`` / ``stream`` / ``generate_stream`` call (with any options) runs on ``engine``'s shared
    passes (the module docstring): the Engine was opened with ``batch_slots`` (and did not hand its slots over), so
    the batch driver serves every proposer. The one place this rule lives."""
    return engine.shared_passes.available


class SharedCall:
    """One call's request on the shared passes, consumed on the caller's thread. Iterate it for ``(commit,
    finish_reason)`` pairs in order (``finish_reason`` is None except on the last commit of a finished request); the
    iteration then raises the request's error, if any. Closing (or dropping) the iterator cancels the request."""

    def __init__(self, scheduler: BatchScheduler, request: BatchRequest, detokenize: Detokenize) -> None:
        # (commit, the sequence's state after the pass that made it), then None once the request is done
        self._items: queue.SimpleQueue[tuple[Commit, DecodeState] | None] = queue.SimpleQueue()
        self._taken = 0  # commits the caller has taken
        self._state: DecodeState | None = None  # the state that came with the last commit taken
        self._stopped = False  # the caller cancelled it (``stop`` or an abandoned iterator)
        self._submitting = threading.Lock()  # held until ``request`` is set: the pass thread reads it
        with self._submitting:
            self.request: ScheduledRequest = scheduler.submit(
                request.ids,
                request.options,
                request.proposer,
                draft_width=request.draft_width,
                detokenize=detokenize,
                on_commit=self._took,
                on_done=lambda _: self._items.put(None),
            )

    def _took(self, commit: Commit) -> None:
        """On the pass thread, after the pass that made ``commit``."""
        with self._submitting:
            sequence = self.request.sequence
        assert sequence is not None
        self._items.put((commit, sequence.state))

    def __iter__(self) -> Iterator[tuple[Commit, FinishReason | None]]:
        try:
            while (item := self._items.get()) is not None:
                commit, state = item
                self._taken, self._state = self._taken + 1, state
                yield commit, state.finish_reason if self._taken == len(state.generated_tokens) else None
            self._raise_error()
        finally:
            self.stop()

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
        the ``GenerationAborted`` to raise, carrying what was delivered up to and including that commit (as
        ``Generation.run`` reports it)."""
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
        if request.cancelled and not self._stopped:  # only ``close`` cancels a request of the shared passes
            partial = self.result()
            closed = EngineClosed("the Engine was closed while this generation ran")
            raise GenerationError.after(closed, partial) from closed


class SharedPasses:
    """An Engine's shared passes: its ``BatchScheduler`` over ``engine.batch_backend()``, started on first use and
    ended by ``close`` (see the module docstring). ``available``: the Engine was opened with ``batch_slots``.
    ``scheduler``: the running scheduler (None until the first shared call), for observers (``passes``,
    ``rows_per_pass``, ``wait_until``). Thread-safe. One owner drives a batch backend's slots: these passes, or the one
    ``hand_over`` names."""

    def __init__(self, engine: Engine, *, available: bool) -> None:
        self._engine = engine
        self.available = available
        self.scheduler: BatchScheduler | None = None
        self.closed = False
        self._lock = threading.Lock()

    def call(self, request: BatchRequest) -> SharedCall:
        """Queue ``request`` (``many.batch_request``) on the passes; ``EngineClosed`` after ``close``."""
        with self._lock:
            if self.closed:
                raise EngineClosed("this Engine is closed")
            if self.scheduler is None:
                engine = self._engine
                costs = engine.batch_decode_costs()  # before the slots are in use: measuring empties them
                self.scheduler = BatchScheduler(
                    engine.batch_backend(),
                    decode_costs=costs,
                    prefix_reuse=engine.prefix_reuse,
                    prefill_budget=engine.prefill_budget,
                    name="ortspec-engine-passes",
                )
            try:
                return SharedCall(self.scheduler, request, self._engine.tokenizer.decode)
            except RuntimeError as exc:  # the scheduler closed (it does only when the Engine closes)
                raise EngineClosed("this Engine is closed") from exc

    def hand_over(self) -> None:
        """Another owner drives the batch backend's slots from now on (the server's ``BatchPool``, a batch worker's
        ``BatchedRecords``), so the Engine's calls keep off them: ``generate`` and the rest run on the lone slot and
        ``generate_many`` on a driver of its own, as before the shared passes. ``RuntimeError`` once they started."""
        with self._lock:
            if self.scheduler is not None:
                raise RuntimeError("this Engine's shared passes already drive its batch backend")
            self.available = False

    def close(self) -> None:
        """End the passes: every request in flight is cancelled (its call raises ``GenerationError`` caused by
        ``EngineClosed``) and the pass thread is joined. Idempotent."""
        with self._lock:
            self.closed = True
            scheduler = self.scheduler
        if scheduler is not None:
            scheduler.close()


def generate(engine: Engine, prompt: Prompt, options: GenerationOptions) -> GenerateResult:
    """``Engine.generate`` on the shared passes."""
    call = engine.shared_passes.call(_ready(engine, prompt, options))
    try:
        for _ in call:
            pass
    finally:  # interrupted (KeyboardInterrupt): in no pass after the current one
        call.stop()
    return call.result()


def generate_stream(
    engine: Engine, prompt: Prompt, callback: StreamCallback, options: GenerationOptions
) -> GenerateResult:
    """``Engine.generate_stream`` on the shared passes: ``callback`` runs on the caller's thread."""
    call = engine.shared_passes.call(_ready(engine, prompt, options))
    try:
        for commit, finish_reason in call:
            try:
                callback(commit.text, commit.token_id, finish_reason)
            except Exception as exc:
                raise call.aborted() from exc
    finally:  # interrupted (KeyboardInterrupt): in no pass after the current one
        call.stop()
    return call.result()


def stream(engine: Engine, prompt: Prompt, options: GenerationOptions) -> Iterator[str]:
    """``Engine.stream`` on the shared passes: the request is checked now and queued on the first ``next``."""
    return _texts(engine, _ready(engine, prompt, options))


def _ready(engine: Engine, prompt: Prompt, options: GenerationOptions) -> BatchRequest:
    """The call made ready (``many.batch_request``); a speculative one warns, as ``Engine.start_with`` does, when
    speculative output may differ from plain output on this model."""
    request = batch_request(engine, prompt, options)
    if request.proposer is not None:
        with engine._lock:
            engine._warn_if_inexact()
    return request


def _texts(engine: Engine, request: BatchRequest) -> Iterator[str]:
    call = engine.shared_passes.call(request)
    try:
        for commit, _ in call:
            if commit.text:
                yield commit.text
    finally:
        call.stop()


def generate_all(engine: Engine, requests: Sequence[BatchRequest]) -> list[GenerateResult]:
    """Every request on the shared passes at once; their results in order once all are done; the first failure
    raises (as ``many.generate_requests`` does). An interrupted caller cancels those still running."""
    calls: list[SharedCall] = []
    try:
        calls = [engine.shared_passes.call(request) for request in requests]
        failures = []
        for call in calls:
            try:
                for _ in call:
                    pass
            except Exception as exc:
                failures.append(exc)
        if failures:
            raise failures[0]
        return [call.result() for call in calls]
    finally:
        for call in calls:
            call.stop()
