"""The decode loop: the one place that calls both the core and a backend.

    prefill prompt[:-1]                      (the last prompt token is the first pending token)
    until the state finishes:
        draft  = proposer.propose(context, width)       width <= draft_budget(state), draft_width, KV room
        rows   = backend pass over (pending, *draft)     one pass; K = 0 is plain greedy
        state, commits, rewind_to = core.step(state, rows[0], rows[1:], draft)
        backend.rewind(rewind_to); stream the commits

Everything about what is accepted, committed, streamed or when to stop is decided by ``ortspec.core``.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

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
    """Wall-clock seconds: ``prefill_s`` for prompt[:-1]; ``first_token_s`` from the call to the first commit;
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
    t_start = time.perf_counter()
    options = options if options is not None else Options()
    policy = FixedWidth(draft_width) if not isinstance(draft_width, WidthPolicy) else draft_width
    capacity = backend.max_length
    if options.max_context is None or options.max_context > capacity:
        options = attrs.evolve(options, max_context=capacity)
    state = DecodeState.start(prompt_tokens, options, detokenize)
    vocab = backend.vocab_size
    device_accept = getattr(backend, "device_accept", False) and not options.top_logprobs

    backend.reset()
    prefill_passes = 0
    prompt = state.prompt_tokens
    if len(prompt) > 1 and not state.finished:
        backend.decode(prompt[:-1], 0)
        prefill_passes = 1
    t_prefill = time.perf_counter()
    t_first = None

    def result(s: DecodeState) -> GenerateResult:
        now = time.perf_counter()
        return GenerateResult(
            token_ids=s.generated_tokens,
            text=s.text if s.finished else s.streamed_text,
            finish_reason=s.finish_reason,
            stop_matched=s.stop_matched,
            stats=attrs.evolve(s.stats, target_forward_passes=s.stats.target_forward_passes + prefill_passes),
            logprobs=s.logprobs if options.top_logprobs else None,
            timings=Timings(
                prefill_s=t_prefill - t_start,
                first_token_s=(t_first if t_first is not None else now) - t_start,
                decode_s=now - t_prefill,
                total_s=now - t_start,
            ),
            prompt_tokens=len(prompt),
        )

    while not state.finished:
        width = min(draft_budget(state), capacity - state.context_len)
        draft: tuple[int, ...] = ()
        if proposer is not None and width > 0:
            width = min(width, policy.width())
            if width > 0:
                context = prompt + state.generated_tokens
                draft = check_draft(state, tuple(proposer.propose(context, width))[:width], vocab)
        tokens = (state.pending_token, *draft)
        kv_len = state.kv_len
        accepted_before = state.stats.accepted_tokens
        if device_accept:
            ids, margins = backend.verify_argmax(tokens, kv_len)
            state, commits, rewind_to = step_ids(state, ids, draft, margins=margins)
        elif draft:
            rows = backend.decode_verify(tokens, kv_len)
            state, commits, rewind_to = step(state, rows[0], rows[1:], draft)
        else:
            state, commits, rewind_to = step(state, backend.decode(tokens, kv_len), None, draft)
        backend.rewind(rewind_to)
        policy = policy.observe(len(draft), state.stats.accepted_tokens - accepted_before)
        if commits and t_first is None:
            t_first = time.perf_counter()
        if callback is not None:
            for i, commit in enumerate(commits):
                try:
                    callback(commit)
                except Exception as exc:
                    raise GenerationAborted(result(_streamed_upto(state, commits, i + 1))) from exc
    return result(state)


def _streamed_upto(state: DecodeState, commits: tuple[Commit, ...], delivered: int) -> DecodeState:
    """The state as the stream saw it after ``delivered`` of this step's ``commits`` (for an aborted run)."""
    dropped = len(commits) - delivered
    tokens = state.generated_tokens[: len(state.generated_tokens) - dropped]
    text = "".join(c.text for c in commits[delivered:])
    streamed = state.streamed_chars - len(text)
    return attrs.evolve(
        state,
        generated_tokens=tokens,
        logprobs=state.logprobs[: len(tokens)] if state.logprobs else (),
        streamed_chars=streamed,
        finish_reason=None,
    )
