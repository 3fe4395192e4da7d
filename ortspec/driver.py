"""The decode loop: the one place that calls both the core and a backend.

    state = DecodeState.start(prompt, options, capacity=backend.max_length, cached_prefix=cached)
    state = core.step(state, backend.decode(prompt[state.cached_prefix:], state.cached_prefix), None, ()).state
    proposer = core.coupling(proposer, options, len(prompt))   a draft model under seeded sampling: coupled picks
    until the state finishes:
        width  = core.draft_width(state, policy.width())
        draft  = core.take_draft(state, proposer.propose(context, width), width, vocab)
        rows   = backend pass over (pending, *draft)     one pass; K = 0 is a plain step
        state, commits, rewind_to, accepted = core.step(state, rows[0], rows[1:], draft)
        backend.rewind(rewind_to); deliver the commits; policy = policy.observe(K, accepted)
        proposer = proposer.observe(context, width, draft, accepted)   a learning proposer (``core.proposers.Learner``)

When ``options.device_picks_suffice`` and the backend makes picks where its logits live
(``backends.base.uses_device_picks``), the pass returns the K + 1 picks and margins instead of the rows, and the
loop calls ``core.step_from_picks``. Everything about what is accepted, committed, streamed or when to stop, how
wide a draft may be and how much of a cached prefix is reused is decided by ``ortspec.core``; this module only
moves data.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager

import attrs

from ortspec.backends.base import Backend, DevicePicks, uses_device_picks
from ortspec.core.prefix import resident_tokens
from ortspec.core.proposers import Learner, PricedProposer, Proposer, coupling
from ortspec.core.state import (
    Commit,
    DecodeState,
    Detokenize,
    FinishReason,
    Options,
    Stats,
    StepOutcome,
    TokenLogprob,
    delivered,
    draft_width,
    step,
    step_from_picks,
    take_draft,
)
from ortspec.core.width import FixedWidth, PricedWidth, WidthPolicy


def decode_rate(new_tokens: int, first_token_s: float, total_s: float) -> float | None:
    """Tokens per second after the first token: ``(new_tokens - 1) / (total_s - first_token_s)``; None when
    fewer than two tokens or no time passed after the first."""
    if new_tokens < 2 or total_s <= first_token_s:
        return None
    return (new_tokens - 1) / (total_s - first_token_s)


@attrs.frozen
class Timings:
    """Wall-clock seconds: ``prefill_s`` for the prompt pass (which also picks the first token);
    ``first_token_s`` from the call to the first commit; ``decode_s`` for the steps after the prompt pass;
    ``total_s`` for the whole call."""

    prefill_s: float = 0.0
    first_token_s: float = 0.0
    decode_s: float = 0.0
    total_s: float = 0.0

    @classmethod
    def since(cls, t_start: float, t_prefill: float, t_first: float | None, now: float) -> Timings:
        """The timings of a generation that started at ``t_start``, ended its prompt pass at ``t_prefill`` and
        committed its first token at ``t_first`` (None: not yet), as of ``now`` (``time.perf_counter`` seconds)."""
        return cls(
            prefill_s=t_prefill - t_start,
            first_token_s=(t_first if t_first is not None else now) - t_start,
            decode_s=now - t_prefill,
            total_s=now - t_start,
        )


@attrs.frozen
class GenerateResult:
    """What a generation produced. ``token_ids`` are the generated tokens (EOS and stop tokens kept);
    ``text`` is their text, cut before a matched stop string; ``logprobs`` is None unless asked for;
    ``finish_reason`` is None for a partial result (see ``Generation.result``). ``cached_prompt_tokens`` of the
    ``prompt_tokens`` were not prefilled: their KV was reused from the previous sequence. ``seed`` is the sampler's
    seed when sampling."""

    token_ids: tuple[int, ...]
    text: str
    finish_reason: FinishReason | None
    stop_matched: str | tuple[int, ...] | None
    stats: Stats
    logprobs: tuple[TokenLogprob, ...] | None
    timings: Timings
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    seed: int | None = None  # the sampler's seed (None when decoding greedily): rerun with it to replay

    @classmethod
    def of(cls, state: DecodeState, undelivered: Sequence[Commit], timings: Timings) -> GenerateResult:
        """What a consumer who has seen every commit of ``state`` but the trailing ``undelivered`` ones was given:
        the finished result, or a partial one (``finish_reason`` None; ``core.state.delivered``)."""
        s = delivered(state, undelivered)
        return cls(
            token_ids=tuple(s.generated_tokens),
            text=s.text,
            finish_reason=s.finish_reason,
            stop_matched=s.stop_matched,
            stats=s.stats,
            logprobs=tuple(s.logprobs) if s.options.top_logprobs else None,
            timings=timings,
            prompt_tokens=len(s.prompt_tokens),
            cached_prompt_tokens=s.cached_prefix,
            seed=s.options.replay_seed,
        )

    @property
    def tokens_per_second(self) -> float:
        """Generated tokens per second of the whole call (prefill included)."""
        return len(self.token_ids) / self.timings.total_s if self.timings.total_s > 0 else 0.0

    @property
    def decode_tokens_per_second(self) -> float:
        """Generated tokens per second after the first token (0.0 with fewer than two tokens)."""
        return decode_rate(len(self.token_ids), self.timings.first_token_s, self.timings.total_s) or 0.0


def _tokens(n: int) -> str:
    return f"{n} token" if n == 1 else f"{n} tokens"


class GenerationError(RuntimeError):
    """A generation failed after it started (the backend, the proposer or the core raised): ``partial`` is what
    was delivered before the failure, and the original exception is the ``__cause__``. Nothing delivered is
    taken back; the backend stays usable (the next generation resets it)."""

    def __init__(self, message: str, partial: GenerateResult) -> None:
        super().__init__(message)
        self.partial = partial

    @classmethod
    def after(cls, exc: Exception, partial: GenerateResult) -> GenerationError:
        """The error for ``exc`` raised once ``partial`` was delivered (raise it ``from exc``)."""
        return cls(f"generation failed after {_tokens(len(partial.token_ids))}: {type(exc).__name__}: {exc}", partial)


class GenerationAborted(GenerationError):
    """The stream callback raised: generation stopped, ``partial`` holds what was committed (and streamed)
    before it, and the original exception is the ``__cause__``."""

    def __init__(self, partial: GenerateResult) -> None:
        super().__init__(
            f"the stream callback raised after {_tokens(len(partial.token_ids))}; generation stopped", partial
        )


class ProposerError(ValueError):
    """The proposer raised, or proposed something that is not a draft (ids that are not ints in the
    vocabulary); the ``__cause__`` says which."""


@attrs.frozen
class Speculation:
    """One sequence's proposer and width policy as they stand (a learning proposer and a width policy are values
    that learn): the draft for its next step, and what they learn from that step's outcome. Without a proposer
    every step is plain."""

    proposer: Proposer | None
    policy: WidthPolicy

    @classmethod
    def of(cls, proposer: Proposer | None, draft_width: int | WidthPolicy, state: DecodeState) -> Speculation:
        """``proposer`` for the generation of ``state`` (``with_proposer``); ``draft_width``: the most draft tokens
        per pass, or a ``WidthPolicy`` choosing it per step."""
        policy = draft_width if isinstance(draft_width, WidthPolicy) else FixedWidth(draft_width)
        return cls(None, policy).with_proposer(proposer, state)

    def with_proposer(self, proposer: Proposer | None, state: DecodeState) -> Speculation:
        """This width policy with ``proposer`` as the generation of ``state`` uses it: a draft model coupled to its
        seeded sampling when it samples (``core.proposers.coupling``)."""
        return Speculation(coupling(proposer, state.options, len(state.prompt_tokens)), self.policy)

    def draft(self, state: DecodeState, vocab_size: int, plain_cost: float = 1.0) -> tuple[int, tuple[int, ...]]:
        """``(width, draft)`` for the next step from ``state``: the width asked for (``core.draft_width``; 0 without a
        proposer) and the proposer's answer cut to it (``core.take_draft``; ``()`` when the width is 0). Raises
        ``ProposerError`` when the proposer raises or proposes something that is not a draft. ``plain_cost``: what a
        plain step costs in the pass the step joins (1.0 alone; ``core.width.marginal_row_cost`` in a batch), asked
        of a ``PricedWidth`` policy and a ``PricedProposer``."""
        if self.proposer is None:
            return 0, ()
        policy = self.policy
        asked = policy.width_at(plain_cost) if isinstance(policy, PricedWidth) else policy.width()
        width = draft_width(state, asked)
        if width == 0:
            return 0, ()
        try:
            if isinstance(self.proposer, PricedProposer):
                proposal = self.proposer.propose_at(state.context_tokens, width, plain_cost)
            else:
                proposal = self.proposer.propose(state.context_tokens, width)
            return width, take_draft(state, proposal, width, vocab_size)
        except Exception as exc:
            raise ProposerError(f"the proposer {self.proposer!r} failed: {type(exc).__name__}: {exc}") from exc

    def observe(self, state: DecodeState, width: int, draft: tuple[int, ...], accepted: int) -> Speculation:
        """What both learn from the step from ``state`` over ``draft`` (asked at ``width``) that accepted
        ``accepted`` draft tokens: the policy always, a ``core.proposers.Learner`` when it was asked for a draft."""
        proposer = self.proposer
        if isinstance(proposer, Learner) and width > 0:
            proposer = proposer.observe(state.context_tokens, width, draft, accepted)
        return Speculation(proposer, self.policy.observe(len(draft), accepted))


FinishCallback = Callable[[DecodeState], object]
"""``on_finish(state)``: what a generation calls once with its finished state (its ``context_tokens`` are the prompt
and every committed token), e.g. to record the output; it must not raise."""

StreamCallback = Callable[[str, int, "FinishReason | None"], object]
"""``callback(text, token_id, finish_reason)``, called for every generated token in order: the text it releases
(often '' while text is held back), its id, and the finish reason on the last token (None before). The one
callback shape of ``generate``, ``Generation.run`` and ``Engine.generate_stream`` (onnx_genai's)."""


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


@attrs.frozen
class PassGuard:
    """How every pass of a generation (the prompt pass and each step) is guarded: ``lease``, a context manager
    entered around the pass (e.g. the lock of a backend shared by several generations), and ``before_pass``, called
    inside it before the pass (e.g. to check that the backend is still this generation's). What either raises ends
    the generation with a ``GenerationError``."""

    lease: AbstractContextManager[object] | None = None
    before_pass: Callable[[], None] | None = None


class Generation:
    """One generation as an iterator of ``Commit``s, run one target pass at a time as it is consumed.

    ``result()`` describes what has been delivered so far (complete once the iterator is exhausted). Arguments
    and errors are those of ``generate``; the backend is this run's from construction until it ends.

    ``cached_prefix``: how many leading prompt tokens the backend already holds the KV of (the caller vouches, e.g.
    from ``resident_tokens()`` of the previous generation on the same backend); the prompt pass then rewinds to
    what the core reuses of them (``DecodeState.cached_prefix``) and prefills only the rest. 0 resets the backend.
    ``guard``: how every pass is guarded (``PassGuard``). Pass a lock itself as the lease (not a Python class whose
    ``__enter__`` acquires it): a KeyboardInterrupt can land just after a Python-level ``acquire()`` returns, before
    ``__exit__`` is armed, and leave the lock held; a lock's own ``with`` cannot be split that way.
    ``on_finish``: called once with the finished state when the iterator has delivered the last commit (not when
    the generation fails or is abandoned before; ``FinishCallback``).
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
        guard: PassGuard | None = None,
        on_finish: FinishCallback | None = None,
    ) -> None:
        self._t_start = time.perf_counter()
        self._on_finish = on_finish
        options = options if options is not None else Options()
        self.state = DecodeState.start(
            prompt_tokens,
            options,
            detokenize,
            capacity=backend.max_length,
            vocab_size=backend.vocab_size,
            cached_prefix=cached_prefix,
        )
        self._speculation = Speculation.of(proposer, draft_width, self.state)
        self._backend = backend
        self._picker: DevicePicks | None = (
            backend if uses_device_picks(backend) and options.device_picks_suffice else None
        )
        self._commits: tuple[Commit, ...] = ()
        self._delivered = 0  # of self._commits
        self._t_first: float | None = None
        guard = guard if guard is not None else PassGuard()
        self._lease = guard.lease if guard.lease is not None else contextlib.nullcontext()
        self._before_pass = guard.before_pass
        self._t_prefill = self._t_start
        self._guarded(self._prompt_pass)

    def _prompt_pass(self) -> None:
        """Its last row picks the first token, exactly as a plain step would. Afterwards the KV holds the whole
        prompt and the first generated token is pending, as the core expects."""
        backend, cached = self._backend, self.state.cached_prefix
        if cached:
            backend.rewind(cached)
        else:
            backend.reset()
        if not self.state.finished:
            logits = backend.decode(self.state.prompt_tokens[cached:], cached)
            self.state, self._commits, rewind_to, _ = step(self.state, logits, None, ())
            backend.rewind(rewind_to)
            self._t_first = time.perf_counter()
        self._t_prefill = time.perf_counter()

    def _guarded(self, action: Callable[[], None]) -> None:
        """Run one pass (inside the lease); a failure becomes a ``GenerationError`` carrying what was delivered
        before it."""
        try:
            with self._lease:
                if self._before_pass is not None:
                    self._before_pass()
                action()
        except Exception as exc:
            raise GenerationError.after(exc, self.result()) from exc

    def __iter__(self) -> Iterator[Commit]:
        while True:
            while self._delivered < len(self._commits):
                self._delivered += 1
                yield self._commits[self._delivered - 1]
            if self.state.finished:
                if self._on_finish is not None:
                    on_finish, self._on_finish = self._on_finish, None
                    on_finish(self.state)
                return
            self._guarded(self._step)

    def resident_tokens(self) -> tuple[int, ...]:
        """The tokens whose KV the backend holds at its first positions, whatever happened to this generation
        (finished, stopped early, failed): the committed context up to the KV length, as far as the backend's
        cache reaches. What the next generation on this backend may pass as ``cached_prefix``."""
        return resident_tokens(self.state, self._backend.current_len())

    @property
    def proposer(self) -> Proposer | None:
        """The proposer as it stands now: a learning proposer's latest value (``core.proposers.Learner``)."""
        return self._speculation.proposer

    @property
    def done(self) -> bool:
        """True once the state is finished and every commit has been delivered."""
        return self.state.finished and self._delivered == len(self._commits)

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

    def _step(self) -> None:
        """One target pass: propose, verify, decide (core), rewind."""
        backend, state = self._backend, self.state
        width, draft = self._speculation.draft(state, backend.vocab_size)
        tokens = (state.pending_token, *draft)
        outcome: StepOutcome
        if self._picker is not None:
            picks, margins = self._picker.verify_picks(tokens, state.kv_len)
            outcome = step_from_picks(state, picks, draft, vocab_size=backend.vocab_size, margins=margins)
        elif draft:
            rows = backend.decode_verify(tokens, state.kv_len)
            outcome = step(state, rows[0], rows[1:], draft)
        else:
            outcome = step(state, backend.decode(tokens, state.kv_len), None, draft)
        backend.rewind(outcome.rewind_to)
        self._speculation = self._speculation.observe(state, width, draft, outcome.accepted)
        self.state, self._commits, self._delivered = outcome.state, outcome.commits, 0
        if outcome.commits and self._t_first is None:
            self._t_first = time.perf_counter()

    def result(self) -> GenerateResult:
        """What was delivered so far: the finished result, or a partial one (``finish_reason`` None)."""
        timings = Timings.since(self._t_start, self._t_prefill, self._t_first, time.perf_counter())
        return GenerateResult.of(self.state, self._commits[self._delivered :], timings)
