"""What a generation gives back: its result and timings, the errors it raises, and the callbacks it calls. Values
only; the loop that produces them is ``ortspec.batch_driver`` (``ortspec.driver.generate`` runs it for one
sequence)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import attrs

from ortspec.core.state import Commit, DecodeState, FinishReason, Stats, TokenLogprob, delivered


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


FinishCallback = Callable[[DecodeState], object]
"""``on_finish(state)``: what a generation calls once with its finished state (its ``context_tokens`` are the prompt
and every committed token), e.g. to record the output; it must not raise."""

StreamCallback = Callable[[str, int, "FinishReason | None"], object]
"""``callback(text, token_id, finish_reason)``, called for every generated token in order: the text it releases
(often '' while text is held back), its id, and the finish reason on the last token (None before). The one
callback shape of ``generate``, ``Generation.run`` and ``Engine.generate_stream`` (onnx_genai's)."""
