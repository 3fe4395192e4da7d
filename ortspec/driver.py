"""The decode loop: the one place that calls both the core and a backend.

    logits = prefill(prompt); state = core.step(state, logits, None, ())     the first token, greedily
    until the state finishes:
        draft  = proposer.propose(context, width)       width <= draft_budget(state), draft_width, KV room
        rows   = backend pass over (pending, *draft)     one pass; K = 0 is plain greedy
        state, commits, rewind_to = core.step(state, rows[0], rows[1:], draft)
        backend.rewind(rewind_to); stream the commits

Everything about what is accepted, committed, streamed or when to stop is decided by ``ortspec.core``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence

import attrs

from ortspec.backends.base import Backend
from ortspec.core.proposers import Proposer
from ortspec.core.state import (
    Commit,
    DecodeState,
    Detokenize,
    FinishReason,
    Options,
    Stats,
    TokenLogprob,
    check_draft,
    draft_budget,
    step,
    step_ids,
)
from ortspec.core.width import FixedWidth, WidthPolicy


@attrs.frozen
class Timings:
    """Wall-clock seconds: ``prefill_s`` for the prompt pass (which also picks the first token);
    ``first_token_s`` from the call to the first commit;
    ``decode_s`` for the steps; ``total_s`` for the whole call."""

    prefill_s: float = 0.0
    first_token_s: float = 0.0
    decode_s: float = 0.0
    total_s: float = 0.0


@attrs.frozen
class GenerateResult:
    """What a generation produced. ``token_ids`` are the generated tokens (EOS and stop tokens kept);
    ``text`` is their text, cut before a matched stop string; ``logprobs`` is None unless asked for."""

    token_ids: tuple[int, ...]
    text: str
    finish_reason: FinishReason
    stop_matched: str | tuple[int, ...] | None
    stats: Stats
    logprobs: tuple[TokenLogprob, ...] | None
    timings: Timings
    prompt_tokens: int = 0

    @property
    def tokens_per_second(self) -> float:
        """Generated tokens per second of the whole call (prefill included)."""
        return len(self.token_ids) / self.timings.total_s if self.timings.total_s > 0 else 0.0


class GenerationAborted(Exception):
    """The stream callback raised: generation stopped, ``partial`` holds what was committed (and streamed)
    before it, and the original exception is the ``__cause__``."""

    def __init__(self, partial: GenerateResult) -> None:
        super().__init__(f"the stream callback raised after {len(partial.token_ids)} tokens; generation stopped")
        self.partial = partial


def generate(
    backend: Backend,
    prompt_tokens: Sequence[int],
    options: Options | None = None,
    proposer: Proposer | None = None,
    *,
    draft_width: int | WidthPolicy = 8,
    callback: Callable[[Commit], object] | None = None,
    detokenize: Detokenize | None = None,
) -> GenerateResult:
    """Generate greedily from ``prompt_tokens`` on ``backend``; with a ``proposer``, speculatively.

    The output is the same with or without a proposer (and whatever it proposes); only the number of target
    passes changes. ``draft_width`` is the most draft tokens per pass, or a ``WidthPolicy`` choosing it per step.
    ``callback`` receives each ``Commit`` (token id and text delta) in order. Raises ``ValueError`` for bad
    input, ``BackendError`` when the backend refuses a call, ``GenerationAborted`` when the callback raises.
    """
    run = Generation(backend, prompt_tokens, options, proposer, draft_width=draft_width, detokenize=detokenize)
    for commit in run:
        if callback is not None:
            try:
                callback(commit)
            except Exception as exc:
                raise GenerationAborted(run.result()) from exc
    return run.result()


class Generation:
    """One generation as an iterator of ``Commit``s, run one target pass at a time as it is consumed.

    ``result()`` describes what has been delivered so far (complete once the iterator is exhausted). Arguments
    and errors are those of ``generate``; the backend is reset on construction and is this run's until it ends.
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
    ) -> None:
        self._t_start = time.perf_counter()
        options = options if options is not None else Options()
        self._policy = draft_width if isinstance(draft_width, WidthPolicy) else FixedWidth(draft_width)
        capacity = backend.max_length
        if options.max_context is None or options.max_context > capacity:
            options = attrs.evolve(options, max_context=capacity)
        self.state = DecodeState.start(prompt_tokens, options, detokenize)
        self._backend = backend
        self._proposer = proposer
        self._device_accept = bool(getattr(backend, "device_accept", False)) and not options.top_logprobs
        self._commits: tuple[Commit, ...] = ()
        self._delivered = 0  # of self._commits
        self._t_first: float | None = None

        # The prompt pass: its last row picks the first token, exactly as a plain step would. Afterwards the
        # KV holds the whole prompt and the first generated token is pending, as the core expects.
        backend.reset()
        if not self.state.finished:
            logits = backend.decode(self.state.prompt_tokens, 0)
            self.state, self._commits, rewind_to = step(self.state, logits, None, ())
            backend.rewind(rewind_to)
            self._t_first = time.perf_counter()
        self._t_prefill = time.perf_counter()

    def __iter__(self) -> Iterator[Commit]:
        while True:
            while self._delivered < len(self._commits):
                self._delivered += 1
                yield self._commits[self._delivered - 1]
            if self.state.finished:
                return
            self._step()

    @property
    def done(self) -> bool:
        """True once the state is finished and every commit has been delivered."""
        return self.state.finished and self._delivered == len(self._commits)

    def _step(self) -> None:
        """One target pass: propose, verify, decide (core), rewind."""
        backend, state = self._backend, self.state
        width = min(draft_budget(state), backend.max_length - state.context_len)
        draft: tuple[int, ...] = ()
        if self._proposer is not None and width > 0:
            width = min(width, self._policy.width())
            if width > 0:
                context = state.prompt_tokens + state.generated_tokens
                proposal = tuple(self._proposer.propose(context, width))[:width]
                draft = check_draft(state, proposal, backend.vocab_size)
        tokens = (state.pending_token, *draft)
        if self._device_accept:
            ids, margins = backend.verify_argmax(tokens, state.kv_len)
            new_state, commits, rewind_to = step_ids(state, ids, draft, margins=margins)
        elif draft:
            rows = backend.decode_verify(tokens, state.kv_len)
            new_state, commits, rewind_to = step(state, rows[0], rows[1:], draft)
        else:
            new_state, commits, rewind_to = step(state, backend.decode(tokens, state.kv_len), None, draft)
        backend.rewind(rewind_to)
        accepted = new_state.stats.accepted_tokens - state.stats.accepted_tokens
        self._policy = self._policy.observe(len(draft), accepted)
        self.state, self._commits, self._delivered = new_state, commits, 0
        if commits and self._t_first is None:
            self._t_first = time.perf_counter()

    def result(self) -> GenerateResult:
        """What was delivered so far: the finished result, or a partial one (``finish_reason`` None)."""
        s = self.state
        undelivered = self._commits[self._delivered :]
        if undelivered:  # the consumer stopped mid-step: report only what it received
            kept = len(s.generated_tokens) - len(undelivered)
            s = attrs.evolve(
                s,
                generated_tokens=s.generated_tokens[:kept],
                logprobs=s.logprobs[:kept],
                streamed_chars=s.streamed_chars - sum(len(c.text) for c in undelivered),
                finish_reason=None,
                stop_matched=None,
            )
        now = time.perf_counter()
        t_first = self._t_first if self._t_first is not None else now
        return GenerateResult(
            token_ids=s.generated_tokens,
            text=s.text if s.finished else s.streamed_text,
            finish_reason=s.finish_reason,
            stop_matched=s.stop_matched,
            stats=s.stats,
            logprobs=s.logprobs if s.options.top_logprobs else None,
            timings=Timings(
                prefill_s=self._t_prefill - self._t_start,
                first_token_s=t_first - self._t_start,
                decode_s=now - self._t_prefill,
                total_s=now - self._t_start,
            ),
            prompt_tokens=len(s.prompt_tokens),
        )
