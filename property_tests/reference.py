"""Plain greedy decoding, written from the README's rules and nothing else: the oracle of the property suite.

It shares no code with ``ortspec`` (no import of it): it asks the model for the logits after the whole context,
one token at a time, and applies the documented rules in the documented order. It is slow (O(n^2) model calls)
and obvious on purpose. The rules:

- The pick is the argmax of the row, the lowest id on ties; a row whose pick is NaN or infinite (a NaN anywhere,
  +inf at the top, every logit -inf) is an error.
- The context limit is the smaller of ``max_context`` and ``capacity``. An empty prompt or one longer than the
  limit is an error; a prompt that fills it ends at once (``context_full``, no token).
- After each token, in this order: EOS (kept), stop token sequences (the first listed that the tokens end with),
  stop strings (the occurrence that ends earliest in the text, the earlier start on a tie; the text is cut before
  it), ``max_new_tokens``, the context limit. The first that fires ends the generation.
- The text is the detokenizer's text of all generated tokens. While it ends in U+FFFD (a partial character) it
  waits for the next token, unless the token ends the generation (EOS, a stop sequence, a limit), which flushes
  it as it is, before stop strings are searched.
- The stream releases, after each token, all of the text but its longest suffix that is a proper prefix of some
  stop string; the last token releases everything.
- Logprobs: the log-softmax of the pick's row in float64, and the ``top_logprobs`` most likely ids (highest value
  first, lowest id on ties).

The detokenizer must be prefix-stable (the text of ``ids[:n]``, less a trailing partial character, is a prefix
of the text of ``ids``), as byte-level and SentencePiece decoders are; the library's incremental decoding
assumes the same.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np


@dataclass
class ReferenceRun:
    tokens: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    stop_matched: str | tuple[int, ...] | None = None
    logprobs: list[tuple[int, float, tuple[tuple[int, float], ...]]] = field(default_factory=list)
    deltas: list[str] = field(default_factory=list)


class ReferenceError(ValueError):
    """The reference refused the input or a logits row; ``run`` is what it had decided before."""

    def __init__(self, message: str, run: ReferenceRun | None = None) -> None:
        super().__init__(message)
        self.run = run if run is not None else ReferenceRun()


def greedy_reference(
    logits_after: Callable[[Sequence[int]], np.ndarray],
    prompt: Sequence[int],
    *,
    max_new_tokens: int,
    eos_token_ids: frozenset[int] = frozenset(),
    stop_token_sequences: Sequence[tuple[int, ...]] = (),
    stop_strings: Sequence[str] = (),
    max_context: int | None = None,
    capacity: int | None = None,
    top_logprobs: int = 0,
    detokenize: Callable[[Sequence[int]], str] | None = None,
) -> ReferenceRun:
    """Decode greedily after ``prompt``; ``logits_after(context)`` gives the next-token logits row."""
    prompt = list(prompt)
    limits = [b for b in (max_context, capacity) if b is not None]
    limit = min(limits) if limits else math.inf
    if not prompt:
        raise ReferenceError("empty prompt")
    if len(prompt) > limit:
        raise ReferenceError("prompt longer than the context")
    run = ReferenceRun()
    if len(prompt) == limit:
        run.finish_reason = "context_full"
        return run
    released = 0
    while run.finish_reason is None:
        row = np.asarray(logits_after(prompt + run.tokens), dtype=np.float64)
        token = int(np.argmax(row))
        if np.isnan(row).any() or not math.isfinite(row[token]):
            raise ReferenceError(f"row after {len(run.tokens)} tokens is not finite at the pick", run)
        run.tokens.append(token)
        if top_logprobs:
            run.logprobs.append(_logprobs(row, token, top_logprobs))

        finish, matched = None, None
        if token in eos_token_ids:
            finish = "eos_token"
        else:
            for seq in stop_token_sequences:
                if tuple(run.tokens[-len(seq) :]) == tuple(seq):
                    finish, matched = "stop_sequence", tuple(seq)
                    break
        bound = None
        if len(run.tokens) >= max_new_tokens:
            bound = "max_new_tokens"
        elif len(prompt) + len(run.tokens) >= limit:
            bound = "context_full"
        if detokenize is not None:
            full = detokenize(run.tokens)
            if finish is not None or bound is not None or not full.endswith("\ufffd"):
                run.text = full
        if finish is None:
            stop = _earliest_stop(run.text, stop_strings)
            if stop is not None:
                at, s = stop
                run.text = run.text[:at]
                finish, matched = "stop_sequence", s
        if finish is None:
            finish = bound
        run.finish_reason, run.stop_matched = finish, matched

        end = len(run.text) if finish is not None else len(run.text) - _held_back(run.text, stop_strings)
        run.deltas.append(run.text[released:end] if end > released else "")
        released = max(released, end)
    return run


def _earliest_stop(text: str, stop_strings: Sequence[str]) -> tuple[int, str] | None:
    """(start, stop string) of the occurrence that ends first (then starts first), or None."""
    best = None
    for s in stop_strings:
        at = text.find(s)
        if at >= 0 and (best is None or (at + len(s), at) < (best[0] + len(best[1]), best[0])):
            best = (at, s)
    return best


def _held_back(text: str, stop_strings: Sequence[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of some stop string."""
    return max((n for s in stop_strings for n in range(1, len(s)) if text.endswith(s[:n])), default=0)


def _logprobs(row: np.ndarray, token: int, n: int) -> tuple[int, float, tuple[tuple[int, float], ...]]:
    m = row.max()
    logz = m + math.log(np.exp(row - m).sum())
    order = sorted(range(len(row)), key=lambda i: (-row[i], i))[:n]
    return token, float(row[token] - logz), tuple((i, float(row[i] - logz)) for i in order)
