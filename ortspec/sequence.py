"""``BatchSequence``: one request in a ``BatchDriver``, the one per-sequence loop: its row of each pass (a prompt
chunk, or the pending token and a draft), the core's step on that row's logits or picks, the rewind, and the
delivery of its commits (a callback, or an iterator's buffer). ``Phase``: where a sequence is. The driver
(``ortspec/batch_driver.py``) decides which sequences run and when; a sequence decides nothing itself: every
decision is the core's.
"""

from __future__ import annotations

import collections
import enum
import time
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import numpy as np

from ortspec.backends.base import BatchBackend, BatchRow, RowPicks, runs_trees
from ortspec.core.prefix import common_prefix_length, resident_tokens, reusing
from ortspec.core.proposers import DraftContext, Proposer
from ortspec.core.state import Commit, DecodeState, StepOutcome, step, step_from_picks
from ortspec.core.tree import Draft, DraftTree
from ortspec.results import FinishCallback, GenerateResult, GenerationAborted, GenerationError, StreamCallback, Timings
from ortspec.speculation import Speculation

if TYPE_CHECKING:
    from ortspec.batch_driver import BatchDriver


class Phase(enum.Enum):
    """Where a sequence is: waiting for a slot, prefilling its prompt in chunks, decoding, or done (finished and
    released, failed, or cancelled)."""

    WAITING = "waiting"
    PREFILL = "prefill"
    DECODING = "decoding"
    DONE = "done"


class BatchSequence:
    """One request in a ``BatchDriver``: made by ``BatchDriver.submit``, advanced by the driver's passes.

    With a ``callback``, each commit is delivered at the end of the pass that made it, as
    ``callback(text, token_id, finish_reason)``; without one, commits also wait in a buffer that iterating the
    sequence reads (iterating drives the driver's passes while the buffer is empty). ``result()`` is what the
    sequence committed so far (after ``cancel``, what was delivered); ``wait()`` drives the passes until the
    sequence is done and returns its result or raises its error.
    Not thread-safe, except ``cancel``, which may be called from anywhere and takes effect before the next pass.
    """

    def __init__(
        self,
        driver: BatchDriver,
        state: DecodeState,
        speculation: Speculation,
        callback: StreamCallback | None,
        reads_target_state: bool = False,
        on_finish: FinishCallback | None = None,
    ) -> None:
        self._t_start = time.perf_counter()
        self._on_finish = on_finish
        self._t_prefill = self._t_start
        self._t_first: float | None = None
        self._driver = driver
        self.state = state
        self._speculation = speculation
        self._reads_target_state = reads_target_state  # its proposer reads its slot: its rows keep hidden states
        self._callback = callback
        self._undelivered: collections.deque[Commit] = collections.deque()
        self._error: GenerationError | None = None
        self._cancelled = False
        self._phase = Phase.DONE if state.finished else Phase.WAITING
        self._slot: int | None = None  # while it holds one
        self._prefilled = 0  # prompt tokens whose KV the slot holds (from the reused ones on), while prefilling
        self._context: DraftContext | None = None  # the draft context and draft of the row in flight
        self._draft: Draft = ()

    @property
    def phase(self) -> Phase:
        return self._phase

    @property
    def slot(self) -> int | None:
        """The slot it holds, or held last (None until it is admitted)."""
        return self._slot

    @property
    def done(self) -> bool:
        """True once the sequence has finished, failed or been cancelled (its buffer may still hold commits)."""
        return self._phase is Phase.DONE

    @property
    def error(self) -> GenerationError | None:
        """Why the sequence failed (``GenerationAborted`` when its callback raised), or None."""
        return self._error

    @property
    def cancelled(self) -> bool:
        return self._cancelled

    def cancel(self) -> None:
        """Stop the sequence: it is in no pass after the current one, its slot is freed, nothing more is delivered
        (by its callback or its iterator), and ``result()`` reports what was delivered (``finish_reason`` None).
        A sequence that is done (finished, failed or cancelled) ignores it."""
        if self._phase is not Phase.DONE:
            self._cancelled = True

    def result(self) -> GenerateResult:
        """What the sequence committed so far (the finished result, or a partial one with ``finish_reason`` None;
        after ``cancel``, only what was delivered); a failed sequence's ``error.partial``. Timings count from
        ``submit``."""
        if self._error is not None:
            return self._error.partial
        return self._described(tuple(self._undelivered) if self._cancelled else ())

    def delivered(self) -> GenerateResult:
        """``result()`` without the commits still waiting in the buffer: what a consumer of the iterator was given."""
        if self._error is not None:
            return self._error.partial
        return self._described(tuple(self._undelivered))

    @property
    def buffered(self) -> int:
        """Commits made and not yet delivered (by the callback or the iterator)."""
        return len(self._undelivered)

    @property
    def proposer(self) -> Proposer | None:
        """The proposer as it stands now (a learning proposer's latest value)."""
        return self._speculation.proposer

    def resident_tokens(self) -> tuple[int, ...]:
        """The tokens whose KV its slot holds at its first positions now (``_resident``); empty before it has a
        slot."""
        return self._resident(self._driver.backend) if self._slot is not None else ()

    def wait(self) -> GenerateResult:
        """Run the driver's passes until this sequence is done; return its result, or raise its error."""
        for _ in self:
            pass
        return self.result()

    def take_commits(self) -> tuple[Commit, ...]:
        """The buffered commits, oldest first, taken out of the buffer without running a pass: for a caller that
        runs the driver's passes itself (``BatchScheduler``'s pass thread) and delivers the commits its own way.
        Nothing once the sequence is cancelled. A sequence with a callback buffers nothing past its pass."""
        if self._cancelled:
            return ()
        commits = tuple(self._undelivered)
        self._undelivered.clear()
        return commits

    def take_commit(self) -> Commit | None:
        """The oldest buffered commit, taken out of the buffer without running a pass (None when none waits or the
        sequence is cancelled): for a caller that runs the passes itself (``ortspec.driver.Generation``)."""
        if self._cancelled or not self._undelivered:
            return None
        return self._undelivered.popleft()

    def __iter__(self) -> Iterator[Commit]:
        """The buffered commits, in order, running the driver's passes while none are waiting; raises the
        sequence's ``GenerationError`` after the commits released before the failure."""
        while True:
            while self._undelivered and not self._cancelled:
                yield self._undelivered.popleft()
            if self._error is not None:
                raise self._error
            if self._phase is Phase.DONE:
                return
            if not self._driver.step() and self._phase is not Phase.DONE:
                raise RuntimeError("the batch driver is idle but this sequence is not done")

    # -- the driver's side --------------------------------------------------------------------------------------

    def _enter(self, backend: BatchBackend, slot: int, resident: Sequence[int]) -> None:
        """Take ``slot``, which holds the KV of ``resident`` at its first positions, and start prefilling after
        the part of the shared prefix that the core reuses (the slot is rewound to it, or reset)."""
        state = reusing(self.state, common_prefix_length(resident, self.state.prompt_tokens))
        reused = state.cached_prefix
        if reused:
            backend.rewind(slot, reused)
        else:
            backend.reset(slot)
        self.state, self._slot, self._phase, self._prefilled = state, slot, Phase.PREFILL, reused

    def _resident(self, backend: BatchBackend) -> tuple[int, ...]:
        """The tokens whose KV its slot holds at its first positions, whatever happened to the sequence (finished,
        failed, cancelled; a failed pass leaves the slot as it was): ``core.prefix.resident_tokens`` of the slot's
        length (while prefilling, the slot holds exactly the prompt tokens prefilled so far)."""
        assert self._slot is not None
        return resident_tokens(self.state, backend.current_len(self._slot))

    def _drop(self) -> None:
        """End a cancelled sequence (before the pass it would have joined)."""
        self._phase = Phase.DONE

    @property
    def _prompt_left(self) -> int:
        """Prompt tokens still to prefill (0 once decoding)."""
        return len(self.state.prompt_tokens) - self._prefilled if self._phase is Phase.PREFILL else 0

    def _row(
        self,
        chunk: int,
        vocab_size: int,
        plain_cost: float,
        device_picks: bool = False,
        token_cost: float | None = None,
    ) -> BatchRow:
        """This sequence's row of the next pass (a proposer failure raises ``ProposerError``): while prefilling,
        its next ``chunk`` prompt tokens (1 <= chunk <= ``_prompt_left``, the driver's choice); decoding, its
        pending token and draft, ``plain_cost`` being the price of a plain step in this pass
        (``Speculation.draft``, with ``token_cost``), asking for picks instead of logits when the backend makes
        them (``device_picks``) and the options need nothing else; a ``DraftTree`` draft is a tree row
        (``BatchRow.parents``)."""
        assert self._slot is not None
        state = self.state
        reads_slot = self._reads_target_state  # its proposer reads the hidden state of the last row
        if self._phase is Phase.PREFILL:
            assert 1 <= chunk <= self._prompt_left
            end = self._prefilled + chunk
            # only the last chunk's last row is read; earlier chunks' rows not at all (one is the least to ask)
            tokens = state.prompt_tokens[self._prefilled : end]
            last = reads_slot and end == len(state.prompt_tokens)
            return BatchRow(self._slot, tokens, self._prefilled, last_logits=1, hidden_states=last)
        self._context, self._draft = self._speculation.draft(state, vocab_size, plain_cost, self._slot, token_cost)
        picks = device_picks and state.options.device_picks_suffice
        draft = self._draft
        if isinstance(draft, DraftTree):
            tokens, parents = (state.pending_token, *draft.tokens), draft.parents
            return BatchRow(self._slot, tokens, state.kv_len, hidden_states=reads_slot, picks=picks, parents=parents)
        tokens = (state.pending_token, *draft)
        return BatchRow(self._slot, tokens, state.kv_len, hidden_states=reads_slot, picks=picks)

    def _take(self, backend: BatchBackend, row: BatchRow, logits: np.ndarray | RowPicks) -> tuple[Commit, ...]:
        """Decide (core) with this row's logits ``[row.logits_rows, vocab]`` (or its ``RowPicks``), keep the
        accepted path of a tree row (``_keep_path``) and rewind the slot; return the commits the step released."""
        assert self._slot is not None
        state = self.state
        if self._phase is Phase.PREFILL:
            self._prefilled += len(row.tokens)
            if self._prefilled < len(state.prompt_tokens):
                return ()
            assert not isinstance(logits, RowPicks)
            outcome = step(state, logits[-1], None, ())
            self._phase, self._t_prefill = Phase.DECODING, time.perf_counter()
        elif isinstance(logits, RowPicks):
            vocab = backend.vocab_size
            outcome = step_from_picks(state, logits.ids, self._draft, vocab_size=vocab, margins=logits.margins)
            self._speculation = self._speculation.observe(
                self._context, self._draft, outcome.accepted, outcome.kept_nodes
            )
        else:
            outcome = step(state, logits[0], logits[1:], self._draft)
            self._speculation = self._speculation.observe(
                self._context, self._draft, outcome.accepted, outcome.kept_nodes
            )
        self._keep_path(backend, row, outcome)
        backend.rewind(self._slot, outcome.rewind_to)
        self.state = outcome.state
        if outcome.commits and self._t_first is None:
            self._t_first = time.perf_counter()
        if self.state.finished:
            self._phase = Phase.DONE
            if self._on_finish is not None:
                self._on_finish(self.state)
        return outcome.commits

    def _keep_path(self, backend: BatchBackend, row: BatchRow, outcome: StepOutcome) -> None:
        """Move the KV of the accepted path's nodes (``outcome.kept_nodes``) from where the tree row wrote them
        (``row.position + 1 + node``) to where plain decoding has them (``row.position + 1 + depth``), unless they
        are there already (always, for a chain)."""
        kept = outcome.kept_nodes
        if any(node != depth for depth, node in enumerate(kept)):
            assert self._slot is not None and runs_trees(backend)
            backend.keep_path(self._slot, row.position, kept)

    def _described(self, undelivered: tuple[Commit, ...]) -> GenerateResult:
        timings = Timings.since(self._t_start, self._t_prefill, self._t_first, time.perf_counter())
        return GenerateResult.of(self.state, undelivered, timings)

    def _fail(self, exc: Exception) -> None:
        """End the sequence with a ``GenerationError`` for ``exc``, carrying every commit made before it (the
        iterator yields the buffered ones before it raises)."""
        self._error = GenerationError.after(exc, self._described(()))
        self._error.__cause__ = exc
        self._phase = Phase.DONE

    def _buffer(self, commits: Sequence[Commit]) -> None:
        self._undelivered.extend(commits)

    def _deliver(self) -> None:
        """With a callback, call it for each buffered commit until the sequence is cancelled or the callback
        raises (which fails the sequence with ``GenerationAborted``)."""
        if self._callback is None:
            return
        while self._undelivered and not self._cancelled:
            commit = self._undelivered.popleft()
            last = self.state.finished and not self._undelivered
            try:
                self._callback(commit.text, commit.token_id, self.state.finish_reason if last else None)
            except Exception as exc:
                self._error = GenerationAborted(self._described(tuple(self._undelivered)))
                self._error.__cause__ = exc
                self._phase = Phase.DONE
                return
