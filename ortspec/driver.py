"""One generation on a one-sequence backend: ``generate`` and ``Generation``, a batch of one.

There is one per-sequence loop, ``ortspec.batch_driver`` (``BatchSequence``, stepped by ``BatchDriver``'s passes);
a lone generation runs on it with the backend behind the batched protocol as ``OneSlot(backend)``:

    driver   = BatchDriver(OneSlot(backend), prefill_chunk=backend.max_length, prefill_budget=None)
    sequence = driver.submit(prompt, options, proposer, draft_width=...)
    the prompt pass (one row: the whole prompt after the cached prefix), then until the state finishes:
        context, draft = speculation.draft(state)         propose(DraftContext), core.draft_width / take_draft
        out   = backend pass over (pending, *draft)       decode, decode_verify, or verify_picks on a device;
                                                          a DraftTree: verify_tree where the backend runs tree
                                                          rows (TreeRows), else its first branch as a chain
        state, commits, rewind_to = core.step(...)        every decision is the core's
        backend.keep_path(...) for a tree's accepted path; backend.rewind(rewind_to); deliver; speculation learns

So a lone generation is decided, rewound and delivered exactly as each sequence of a batch is; this module only
keeps the one-sequence call shapes (``cached_prefix``, the prompt pass at construction, ``resident_tokens``).
The values it returns and raises live in ``ortspec.results``; ``Speculation`` in ``ortspec.speculation``.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from ortspec.backends.base import Backend, OneSlot
from ortspec.batch_driver import BatchDriver
from ortspec.core.prefix import reusing
from ortspec.core.proposers import Proposer
from ortspec.core.state import Commit, DecodeState, Detokenize, Options
from ortspec.core.width import WidthPolicy
from ortspec.results import (
    FinishCallback,
    GenerateResult,
    GenerationAborted,
    GenerationError,
    ProposerError,
    StreamCallback,
    Timings,
    decode_rate,
)
from ortspec.speculation import Speculation

__all__ = [
    "FinishCallback",
    "GenerateResult",
    "Generation",
    "GenerationAborted",
    "GenerationError",
    "ProposerError",
    "Speculation",
    "StreamCallback",
    "Timings",
    "decode_rate",
    "generate",
]


def generate(
    backend: Backend,
    prompt_tokens: Sequence[int],
    options: Options | None = None,
    proposer: Proposer | None = None,
    *,
    draft_width: int | WidthPolicy = 8,
    callback: StreamCallback | None = None,
    detokenize: Detokenize | None = None,
) -> GenerateResult:
    """Generate from ``prompt_tokens`` on ``backend``; with a ``proposer``, speculatively.

    The output is the same with or without a proposer (and whatever it proposes); only the number of target
    passes changes. ``draft_width`` is the most draft tokens per pass, or a ``WidthPolicy`` choosing it per step.
    ``callback(text, token_id, finish_reason)`` is called for each generated token in order (``StreamCallback``).
    The proposer's draft is cut to the step's width (longer proposals are truncated). Raises ``ValueError`` for
    bad input (before anything runs), ``GenerationAborted`` when the callback raises, and ``GenerationError`` (with
    the partial result) when the backend, the proposer (``ProposerError``) or the core fails once generation
    started.
    """
    run = Generation(backend, prompt_tokens, options, proposer, draft_width=draft_width, detokenize=detokenize)
    return run.run(callback)


class Generation:
    """One generation as an iterator of ``Commit``s, run one target pass at a time as it is consumed: a batch of
    one on ``OneSlot(backend)`` (the module docstring). The prompt pass runs at construction.

    ``result()`` describes what has been delivered so far (complete once the iterator is exhausted). Arguments
    and errors are those of ``generate``; the backend is this run's from construction until it ends.
    ``cached_prefix``: how many leading prompt tokens the backend already holds the KV of (the caller vouches, e.g.
    from ``resident_tokens()`` of the previous generation on the same backend); the prompt pass then rewinds to
    what the core reuses of them (``core.prefix.reusing``) and prefills only the rest. 0 resets the backend.
    ``on_finish``: called once with the finished state at the end of the pass that finished it (not when the
    generation fails; ``FinishCallback``).
    """

    def __init__(
        self,
        backend: Backend,
        prompt_tokens: Sequence[int],
        options: Options | None = None,
        proposer: Proposer | None = None,
        *,
        draft_width: int | WidthPolicy = 8,
        detokenize: Detokenize | None = None,
        cached_prefix: int = 0,
        on_finish: FinishCallback | None = None,
    ) -> None:
        slot = OneSlot(backend)
        self._backend = slot
        # the whole prompt in one row, as a lone prompt pass: the chunk is the context, the budget unbounded
        self._driver = BatchDriver(slot, prefill_chunk=max(1, backend.max_length), prefill_budget=None)
        if cached_prefix:
            self._driver.vouch(0, tuple(prompt_tokens)[:cached_prefix])
        self._sequence = self._driver.submit(
            prompt_tokens, options, proposer, draft_width=draft_width, detokenize=detokenize, on_finish=on_finish
        )
        if cached_prefix and self._sequence.done:  # the prompt fills the context: no pass, the vouched KV stands
            self._sequence.state = reusing(self._sequence.state, cached_prefix)
        self._pass()  # the prompt pass
        if self._sequence.error is not None:
            raise self._sequence.error

    def _pass(self) -> None:
        """One pass of the driver; what the driver raises itself (a sequence's own failures it records) fails the
        sequence."""
        try:
            self._driver.step()
        except Exception as exc:
            self._sequence._fail(exc)

    @property
    def state(self) -> DecodeState:
        """The core's state after the last pass."""
        return self._sequence.state

    def __iter__(self) -> Iterator[Commit]:
        sequence = self._sequence
        while True:
            while (commit := sequence.take_commit()) is not None:
                yield commit
            if sequence.error is not None:
                raise sequence.error
            if sequence.done:
                return
            self._pass()

    def resident_tokens(self) -> tuple[int, ...]:
        """The tokens whose KV the backend holds at its first positions, whatever happened to this generation
        (finished, stopped early, failed): the committed context up to the KV length, as far as the backend's
        cache reaches. What the next generation on this backend may pass as ``cached_prefix``."""
        return self._sequence.resident_tokens()

    @property
    def proposer(self) -> Proposer | None:
        """The proposer as it stands now: a learning proposer's latest value (``core.proposers.Learner``)."""
        return self._sequence.proposer

    @property
    def done(self) -> bool:
        """True once the state is finished and every commit has been delivered."""
        return self._sequence.done and not self._sequence.buffered

    def run(self, callback: StreamCallback | None = None) -> GenerateResult:
        """Consume the rest of the generation, calling ``callback(text, token_id, finish_reason)`` for each token;
        return ``result()``. If the callback raises, generation stops with ``GenerationAborted`` carrying what was
        delivered before."""
        for commit in self:
            if callback is not None:
                try:
                    callback(commit.text, commit.token_id, self.state.finish_reason if self.done else None)
                except Exception as exc:
                    raise GenerationAborted(self.result()) from exc
        return self.result()

    def result(self) -> GenerateResult:
        """What was delivered so far: the finished result, or a partial one (``finish_reason`` None)."""
        return self._sequence.delivered()
