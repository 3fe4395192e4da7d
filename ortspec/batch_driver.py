"""Continuous batching: many sequences, one backend pass at a time. The scheduler; it decides nothing about tokens.

    every pass (``BatchDriver.step``):
        drop the cancelled sequences; admit waiting requests into free slots, first come first: each takes the free
            slot whose resident tokens serve its prompt best (core.prefix.reuse_score; least recently released,
            then lowest, on ties), the core decides how much of the shared prefix it reuses
            (core.prefix.reusing), and backend.rewind(slot, reused) keeps that much (backend.reset(slot) for none)
        for every running sequence, in the order they were admitted, at most one row:
            prefilling: the next chunk of its prompt at the chunk's position, from the reused length on, asking
                        for the logits of its last position only; a chunk is min(prefill_chunk, what is left of
                        its prompt, what is left of the pass's prefill_budget), so the pass folds in at most
                        prefill_budget prompt tokens, first come first; a prefilling sequence that gets no token
                        sits the pass out (no row), and the first one always gets >= 1 (progress)
            decoding:   every pass, budget or not:
                        (pending, *draft) at state.kv_len; context, draft = speculation.draft(state, vocab,
                        plain_cost, slot, token_cost): the proposer's propose(DraftContext), cut by
                        core.draft_width / take_draft (a DraftTree is a tree row, BatchRow.parents, on a backend
                        whose tree_rows is True; elsewhere its first branch is verified); plain_cost: a one-token
                        row's share of a pass with this many decoding sequences (core.width.mean_row_cost on the
                        backend's decode_costs); token_cost: what one more row costs in it
                        (core.width.marginal_row_cost), where the backend runs a draft row beside the others
                        (backends.base.batches_drafts), else None (it runs alone): core.width.pass_cost)
        outputs = backend.run_pass(rows)                             ONE pass for every row
        for every row, with its own [len(tokens), vocab] logits:
            a prompt chunk that is not the last: nothing to decide
            else: outcome = core.step(state, rows[0], rows[1:], draft); a tree row's accepted path is moved into
                  place (backend.keep_path(slot, position, outcome.kept_nodes)); backend.rewind(slot, outcome.rewind_to)
                  speculation = speculation.observe(context, draft, outcome.accepted)
        then deliver each sequence's commits (its callback, or its iterator's buffer); free the slots of the
        sequences that finished, failed or were cancelled, each slot remembering its resident tokens

Each sequence is stepped by ``ortspec.core`` with its own rows only, so its output (tokens, text, finish reason,
stop, streamed deltas, stats) is what ``Generation`` gives the same request alone on a backend whose rows are the
batch's rows. A prompt counts as one core step however many chunks it takes. A failure is a sequence's own: its
proposer, the core or its callback failing fails that sequence (``GenerationError`` with its partial result) and
the others go on; a failed backend pass fails the sequences that had a row in it.

Prefix reuse (``prefix_reuse=True``, the default). A freed slot keeps the KV of its last sequence, and the driver
remembers which tokens that is: the sequence's context up to its KV length, as far as the slot's ``current_len``
reaches (``core.prefix.resident_tokens``); a slot whose pass raised anything but a ``BackendError`` (which leaves
the slots as they were) is remembered as empty. So the next turn of a conversation goes to the slot holding its
first turn and prefills only its new tokens. The output is the same as without reuse (a token's KV depends only
on the tokens before it); only the prefill work changes (``cached_prompt_tokens`` of the result). Without it, a
request takes the lowest free slot, emptied. A new driver knows nothing of what its backend's slots hold: it
starts with every slot empty.

Proposers that read the target's own state (the shared-KV drafter: its sequence's KV and last hidden state) read it
in the slot the draft's context names (``DraftContext.slot``, the sequence's slot). A request whose proposer does so
is submitted with ``reads_target_state``: its rows ask the backend to keep their hidden states
(``BatchRow.hidden_states``: the last prompt chunk's, every decode row's), and the driver's promise to its proposer
is: when it is asked for a draft, the slot holds the KV of every context token but the last and its last row
computed the hidden state before that. The core never sees a slot.

Device picks. On a backend whose logits live on a device (``picks_on_device``: the CUDA path behind ``OneSlot``), a
decoding row whose options need nothing but the argmax (``Options.device_picks_suffice``) asks for picks
(``BatchRow.picks``) and the core steps from them (``core.step_from_picks``); every other row reads logits.

A lone generation is a batch of one on this loop (``ortspec.driver``): there is no other per-sequence loop.
"""

from __future__ import annotations

import collections
from collections.abc import Sequence

from ortspec.backends.base import BackendError, BatchBackend, BatchRow, batches_drafts, runs_trees
from ortspec.core.checks import check_int
from ortspec.core.prefix import reuse_score
from ortspec.core.proposers import Proposer
from ortspec.core.state import Commit, DecodeState, Detokenize, Options
from ortspec.core.width import WidthPolicy, marginal_row_cost, mean_row_cost
from ortspec.results import FinishCallback, StreamCallback
from ortspec.sequence import BatchSequence, Phase
from ortspec.speculation import Speculation

__all__ = ["DEFAULT_PREFILL_BUDGET", "BatchDriver", "BatchSequence", "Phase", "check_prefill_budget"]


# The default prompt-token budget of one pass (BatchDriver's prefill_budget; chosen by measurement:
# docs/serve/prefill-budget/in-process.md).
DEFAULT_PREFILL_BUDGET = 512


def check_prefill_budget(prefill_budget: object) -> int | None:
    """``prefill_budget`` as given: an int >= 1, or None (unbounded); ``ArgumentError`` naming it otherwise."""
    return None if prefill_budget is None else check_int("prefill_budget", prefill_budget, 1)


class _PromptBudget:
    """What is left of one pass's prompt-token budget (``None``: unbounded), granted first come first."""

    def __init__(self, tokens: int | None) -> None:
        self._left = tokens

    def take(self, wanted: int) -> int:
        """Grant up to ``wanted`` tokens (>= 0) out of what is left, and spend them."""
        if self._left is None:
            return wanted
        granted = min(wanted, self._left)
        self._left -= granted
        return granted


class BatchDriver:
    """Runs many generations on one ``BatchBackend``, one pass for all of them at a time (see the module
    docstring). Requests join with ``submit`` at any time (a callback may submit too) and start when a slot is
    free; ``step`` runs one pass, ``run`` passes until every sequence is done. Not thread-safe.

    ``prefill_chunk``: the most prompt tokens one sequence folds in per pass, so a long prompt is prefilled over
    several passes while the others decode. ``prefill_budget``: the most prompt tokens one pass folds in, summed
    over every prefilling sequence (first come first; ``None``: unbounded, every prefilling sequence gets its
    chunk). A prompt pass is compute-bound, so folding many prompts into one pass buys no throughput; it only holds
    every decoding sequence, and every newcomer's first token, until the whole pass ends. The default,
    ``DEFAULT_PREFILL_BUDGET``, equals the default chunk, so a request alone is prefilled exactly as without a
    budget (chosen by measurement: docs/serve/prefill-budget/in-process.md).
    ``decode_costs``: the backend's measured cost of a pass of ``n`` one-token rows ÷ one alone, for ``n = 0 ..
    slots`` (``core.width.mean_row_cost``, ``marginal_row_cost``; ``Engine.batch_decode_costs`` measures it);
    without it a plain step is priced as alone (1.0), so a ``PricedWidth`` policy speculates as it would alone.
    ``prefix_reuse``: a request takes the free slot holding its longest prefix and prefills only the rest (module
    docstring); off, it takes the lowest free slot, emptied.
    The driver must be the only user of the backend's slots: what it remembers of them is what its own passes left
    there. ``passes`` counts the backend passes run."""

    def __init__(
        self,
        backend: BatchBackend,
        *,
        prefill_chunk: int = 512,
        prefill_budget: int | None = DEFAULT_PREFILL_BUDGET,
        decode_costs: Sequence[float] | None = None,
        prefix_reuse: bool = True,
    ) -> None:
        check_int("prefill_chunk", prefill_chunk, 1)
        check_prefill_budget(prefill_budget)
        if decode_costs is not None and (len(decode_costs) < 2 or any(not c >= 0 for c in decode_costs)):
            raise ValueError(f"decode_costs must hold >= 2 costs >= 0 (index = rows in the pass), got {decode_costs!r}")
        if not isinstance(prefix_reuse, bool):
            raise ValueError(f"prefix_reuse must be True or False, got {prefix_reuse!r}")
        self._backend = backend
        self.prefill_chunk = prefill_chunk
        self.prefill_budget = prefill_budget
        self.decode_costs = tuple(decode_costs) if decode_costs is not None else None
        self.prefix_reuse = prefix_reuse
        self._waiting: collections.deque[BatchSequence] = collections.deque()
        self._running: list[BatchSequence] = []
        self._free = list(range(backend.slots))
        # Per slot: the tokens whose KV it holds (as of its last release) and the release count at that release.
        self._resident: list[tuple[int, ...]] = [()] * backend.slots
        self._released_at = [0] * backend.slots
        self._releases = 0
        self._in_pass = False
        self.passes = 0
        self.device_picks = bool(getattr(backend, "picks_on_device", False))  # rows may ask for picks
        self.batched_drafts = batches_drafts(backend)  # a draft row joins the pass's run: priced by its tokens
        self.tree_rows = runs_trees(backend)  # a proposer's DraftTree is verified whole (else its first branch)
        self.admitting = True  # False: waiting requests stay waiting (the running ones go on)

    @property
    def backend(self) -> BatchBackend:
        """The backend whose slots this driver owns."""
        return self._backend

    def vouch(self, slot: int, tokens: Sequence[int]) -> None:
        """The caller vouches that free ``slot`` holds the KV of ``tokens`` at its first positions (a one-sequence
        backend's previous generation: ``ortspec.driver.Generation``'s ``cached_prefix``), so the next request
        taking it may reuse them as it would its own resident tokens. ``ValueError`` for a slot in use."""
        if slot not in self._free:
            raise ValueError(f"slot {slot!r} is not a free slot of this driver")
        self._resident[slot] = tuple(tokens)
        self.prefix_reuse = True

    def forget(self) -> None:
        """Forget what every free slot holds (each is emptied when next taken): after someone else used the
        backend's slots (a measurement)."""
        self._resident = [()] * len(self._resident)

    @property
    def running(self) -> tuple[BatchSequence, ...]:
        """The sequences holding a slot, in the order they were admitted."""
        return tuple(self._running)

    @property
    def waiting(self) -> tuple[BatchSequence, ...]:
        """The sequences waiting for a slot, first come first."""
        return tuple(self._waiting)

    def resident_tokens(self, slot: int) -> tuple[int, ...]:
        """The tokens whose KV free ``slot`` holds at its first positions, as of its last sequence's end (what a
        request taking it may reuse; empty for a slot never used, or in use now). ``ValueError`` for a slot that
        is not one of the backend's."""
        if isinstance(slot, bool) or not isinstance(slot, int) or not 0 <= slot < len(self._resident):
            raise ValueError(f"slot must be an int in [0, {len(self._resident)}), got {slot!r}")
        return self._resident[slot] if slot in self._free else ()

    def submit(
        self,
        prompt_tokens: Sequence[int],
        options: Options | None = None,
        proposer: Proposer | None = None,
        *,
        draft_width: int | WidthPolicy = 8,
        detokenize: Detokenize | None = None,
        callback: StreamCallback | None = None,
        on_finish: FinishCallback | None = None,
        reads_target_state: bool = False,
    ) -> BatchSequence:
        """A new request, with the arguments of ``ortspec.generate``; it waits for a free slot and joins at the next
        pass. ``reads_target_state``: its proposer reads the target's state in its slot (module docstring).
        ``on_finish``: called once with the finished state, at the end of the pass that finished it (not for a
        sequence that fails or is cancelled; ``driver.FinishCallback``). Raises ``ValueError`` for bad input (before
        anything runs). A prompt that fills the context is done at
        once (``context_full``, no token, no pass)."""
        options = options if options is not None else Options()
        backend = self._backend
        state = DecodeState.start(
            prompt_tokens, options, detokenize, capacity=backend.max_length, vocab_size=backend.vocab_size
        )
        speculation = Speculation.of(proposer, draft_width, state, trees=self.tree_rows)
        sequence = BatchSequence(self, state, speculation, callback, reads_target_state, on_finish)
        if sequence.phase is Phase.WAITING:
            self._waiting.append(sequence)
        return sequence

    def run(self) -> None:
        """Run passes until no sequence is running or waiting."""
        while self.step():
            pass

    def step(self) -> bool:
        """One pass over every running sequence (after dropping the cancelled and admitting the waiting); False
        when there was nothing to run."""
        if self._in_pass:
            raise RuntimeError("BatchDriver.step was called from inside a pass (from a stream callback?)")
        self._in_pass = True
        try:
            self._drop_cancelled()
            self._admit()
            budget = _PromptBudget(self.prefill_budget)
            batch = self._gather(list(self._running), budget)
            batch += self._gather(self._admit(), budget)  # into the slots of sequences whose proposer just failed
            if not batch:
                return False
            self._run_pass(batch)
            return True
        finally:
            self._in_pass = False

    def _drop_cancelled(self) -> None:
        for sequence in [s for s in self._waiting if s.cancelled]:
            sequence._drop()
            self._waiting.remove(sequence)
        for sequence in [s for s in self._running if s.cancelled]:
            sequence._drop()
            self._release(sequence)

    def _admit(self) -> list[BatchSequence]:
        """Waiting requests take the free slots, first come first, each the one that serves its prompt best
        (``_best_free``). Returns the admitted (a sequence whose slot cannot be rewound or reset fails instead)."""
        admitted: list[BatchSequence] = []
        while self._waiting and self._free and self.admitting:
            sequence = self._waiting.popleft()
            slot = self._best_free(sequence.state.prompt_tokens)
            self._free.remove(slot)
            resident, self._resident[slot] = self._resident[slot] if self.prefix_reuse else (), ()
            try:
                sequence._enter(self._backend, slot, resident)
            except Exception as exc:  # the slot is remembered empty
                sequence._fail(exc)
                self._free.append(slot)
                continue
            self._running.append(sequence)
            admitted.append(sequence)
        return admitted

    def plain_cost(self) -> float:
        """What a plain step costs in the next pass, given the sequences decoding now: its share of the pass
        (``core.width.mean_row_cost``; 1.0 without ``decode_costs``)."""
        if self.decode_costs is None:
            return 1.0
        return mean_row_cost(self.decode_costs, sum(s.phase is Phase.DECODING for s in self._running))

    def token_cost(self) -> float | None:
        """What a draft token costs in the next pass where the backend runs draft rows beside the others (one more
        row: ``core.width.marginal_row_cost``); None where a draft row runs as a pass of its own."""
        if not self.batched_drafts or self.decode_costs is None:
            return None
        return marginal_row_cost(self.decode_costs, sum(s.phase is Phase.DECODING for s in self._running))

    def _best_free(self, prompt: Sequence[int]) -> int:
        """The free slot for ``prompt``: with prefix reuse, the best ``reuse_score`` of its resident tokens, then
        the least recently released, then the lowest; without, the lowest."""
        if not self.prefix_reuse:
            return min(self._free)
        return max(self._free, key=lambda s: (reuse_score(self._resident[s], prompt), -self._released_at[s], -s))

    def _gather(self, sequences: list[BatchSequence], budget: _PromptBudget) -> list[tuple[BatchSequence, BatchRow]]:
        """The ``sequences``' rows for the next pass, in their order: every decoding one's, and each prefilling
        one's next chunk as far as ``budget`` goes (one granted no token has no row); a sequence whose proposer
        fails is failed and freed."""
        batch = []
        plain_cost, token_cost = self.plain_cost(), self.token_cost()
        for sequence in sequences:
            chunk = budget.take(min(self.prefill_chunk, sequence._prompt_left))
            if sequence.phase is Phase.PREFILL and chunk == 0:
                continue  # the budget is spent: it sits this pass out
            try:
                vocab = self._backend.vocab_size
                row = sequence._row(chunk, vocab, plain_cost, self.device_picks, token_cost)
                batch.append((sequence, row))
            except Exception as exc:
                sequence._fail(exc)
                self._release(sequence)
        return batch

    def fresh(self) -> BatchDriver:
        """A new driver on the same backend with the same settings, knowing nothing of what the slots hold (each is
        emptied when next taken): what a caller goes on with after this one failed."""
        return BatchDriver(
            self._backend,
            prefill_chunk=self.prefill_chunk,
            prefill_budget=self.prefill_budget,
            decode_costs=self.decode_costs,
            prefix_reuse=self.prefix_reuse,
        )

    def _run_pass(self, batch: list[tuple[BatchSequence, BatchRow]]) -> None:
        """The one backend pass; then each sequence decides with its own rows, its commits are buffered and the
        slots of the finished are freed; only then do the callbacks run (so a callback that raises, even a
        ``KeyboardInterrupt``, finds every slot rewound and every commit buffered)."""
        self.passes += 1
        try:
            outputs = self._backend.run_pass([row for _, row in batch])
            if len(outputs) != len(batch):
                raise ValueError(f"the backend returned {len(outputs)} results for a pass of {len(batch)} rows")
        except Exception as exc:
            # A BackendError leaves every slot as it was; after anything else, what they hold is unknown.
            for sequence, _ in batch:
                sequence._fail(exc)
                self._release(sequence, known=isinstance(exc, BackendError))
            return
        released: list[tuple[BatchSequence, tuple[Commit, ...]]] = []
        for (sequence, row), logits in zip(batch, outputs, strict=True):
            try:
                released.append((sequence, sequence._take(self._backend, row, logits)))
            except Exception as exc:
                sequence._fail(exc)
        for sequence, commits in released:
            sequence._buffer(commits)
        self._release_done(batch)
        for sequence, _ in released:
            sequence._deliver()
        self._release_done(batch)  # a callback raised

    def _release_done(self, batch: list[tuple[BatchSequence, BatchRow]]) -> None:
        for sequence, _ in batch:
            if sequence.phase is Phase.DONE:
                self._release(sequence)

    def _release(self, sequence: BatchSequence, *, known: bool = True) -> None:
        """Give the sequence's slot back, remembering the tokens whose KV it holds (none unless ``known``)."""
        slot = sequence.slot
        if slot is not None and sequence in self._running:
            self._running.remove(sequence)
            self._resident[slot] = self._held_by(sequence) if known else ()
            self._releases += 1
            self._released_at[slot] = self._releases
            self._free.append(slot)

    def _held_by(self, sequence: BatchSequence) -> tuple[int, ...]:
        """What ``sequence``'s slot holds as it leaves (nothing, if the backend cannot say)."""
        try:
            return sequence._resident(self._backend)
        except Exception:
            return ()
