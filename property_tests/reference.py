"""Plain decoding (greedy and seeded sampling), written from the documented rules and nothing else: the oracle of
the property suite.

It shares no code with ``ortspec`` (no import of it): it asks the model for the logits after the whole context,
one token at a time, and applies the documented rules in the documented order. It is obvious on purpose, and
linear in the model and the processors: the model is a ``ModelState`` extended by one token per pick, and the
processors read a ``History`` kept as the tokens grow (only the text, decoded whole after each token, costs O(n)
per token). The rules:

- The pick at each position follows ``core/sampling.py``'s docstring, re-implemented here one token at a time:
  processors (repetition penalty over prompt + generated, presence/frequency penalties over generated, logit bias;
  float32, saturating at +-float32's largest finite value), then the argmax (lowest id on ties) at temperature 0,
  or, at temperature T, the inverse-CDF draw with SplitMix64's uniform over the tokens that survive the window
  (``(z_max - z) / T <= 40``), top-k, top-p and min-p. A row whose pick is NaN or infinite (a NaN anywhere, +inf
  at the top, every logit -inf) is an error.
- The context limit is the smaller of ``max_context`` and ``capacity``. An empty prompt or one longer than the
  limit is an error; a prompt that fills it ends at once (``context_full``, no token).
- After each token, in this order: EOS (kept), stop token sequences (the first listed that the tokens end with),
  stop strings (the occurrence that ends earliest in the text, the earlier start on a tie; the text is cut before
  it), ``max_tokens``, the context limit. The first that fires ends the generation.
- The text is the detokenizer's text of all generated tokens. While it ends in U+FFFD (a partial character) it
  waits for the next token, unless the token ends the generation (EOS, a stop sequence, a limit), which flushes
  it as it is, before stop strings are searched.
- The stream releases, after each token, all of the text but its longest suffix that is a proper prefix of some
  stop string; the last token releases everything.
- Logprobs: under the distribution the pick came from (greedy: the log-softmax of the processed row in float64;
  sampling: the surviving tokens' renormalized probabilities), with the ``top_logprobs`` most likely ids (most
  likely first, lowest id on ties; never an id at -inf: fewer when fewer are possible).

The detokenizer must be prefix-stable (the text of ``ids[:n]``, less a trailing partial character, is a prefix
of the text of ``ids``), as byte-level and SentencePiece decoders are; the library's incremental decoding
assumes the same.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np


class ModelState(Protocol):
    """A model after some context."""

    def logits(self) -> np.ndarray:
        """The next-token logits row ``[vocab]`` (a fresh array)."""
        ...

    def then(self, token: int) -> ModelState:
        """The model after the context one ``token`` longer (this state is unchanged)."""
        ...


ModelAfter = Callable[[Sequence[int]], ModelState]  # the model after a whole context


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


@dataclass(frozen=True)
class PickRules:
    """The options that shape a pick (the same names as ortspec's Options)."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()


def _splitmix64(x: int) -> int:
    mask = (1 << 64) - 1
    x = (x + 0x9E3779B97F4A7C15) & mask
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & mask
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & mask
    return x ^ (x >> 31)


@dataclass
class History:
    """What the processors read of the tokens before a pick, kept as the tokens grow (O(1) per token): the ids in
    prompt + generated, how often each id was generated, and how many were (the pick's index)."""

    seen: set[int] = field(default_factory=set)
    counts: dict[int, int] = field(default_factory=dict)
    index: int = 0

    @classmethod
    def of(cls, prompt: Sequence[int], generated: Sequence[int]) -> History:
        history = cls(seen=set(prompt))
        for t in generated:
            history.add(t)
        return history

    def add(self, token: int) -> None:
        """Record a generated ``token``."""
        self.seen.add(token)
        self.counts[token] = self.counts.get(token, 0) + 1
        self.index += 1


def reference_pick(
    row: np.ndarray, rules: PickRules, prompt: Sequence[int], generated: Sequence[int], top_n: int = 0
) -> tuple[int, tuple[float, tuple[tuple[int, float], ...]] | None]:
    """The token plain decoding picks from ``row`` after ``prompt + generated``, and (when ``top_n``) its
    logprob record. Raises ``ReferenceError`` for a row that is not finite where the pick is made."""
    return pick_after(row, rules, History.of(prompt, generated), top_n)


F32_MAX = float(np.finfo(np.float32).max)


def _f32(value: float) -> np.float32:
    """An option's value in float32, saturated at +-F32_MAX."""
    return np.float32(min(max(value, -F32_MAX), F32_MAX))


def pick_after(
    row: np.ndarray, rules: PickRules, history: History, top_n: int = 0
) -> tuple[int, tuple[float, tuple[tuple[int, float], ...]] | None]:
    """``reference_pick`` for the tokens summed up in ``history``."""
    z = np.array(row, dtype=np.float32)
    finite = np.isfinite(z)  # the processors saturate these at +-F32_MAX; the others stay as they are
    with np.errstate(over="ignore"):
        if rules.repetition_penalty != 1.0 and history.seen:
            rp = _f32(rules.repetition_penalty)
            ids = np.fromiter(history.seen, dtype=np.int64)  # each id once: the penalty applies once per id
            z[ids] = np.where(z[ids] > 0, z[ids] / rp, z[ids] * rp)
            z = np.where(finite, np.clip(z, -F32_MAX, F32_MAX), z)
        if (rules.presence_penalty or rules.frequency_penalty) and history.counts:
            ids = np.fromiter(history.counts.keys(), dtype=np.int64)
            counts = np.fromiter(history.counts.values(), dtype=np.float32)
            penalty = counts * _f32(rules.frequency_penalty) + _f32(rules.presence_penalty)
            z[ids] -= np.clip(penalty, -F32_MAX, F32_MAX)
            z = np.where(finite, np.clip(z, -F32_MAX, F32_MAX), z)
        for t, b in rules.logit_bias:
            z[t] += _f32(b)
            z = np.where(finite, np.clip(z, -F32_MAX, F32_MAX), z)
    if np.isnan(z).any() or not math.isfinite(float(z.max())):
        raise ReferenceError("not finite at the pick")
    zmax = float(z.max())
    if rules.temperature == 0:
        token = int(np.argmax(z))
        if not top_n:
            return token, None
        x = z.astype(np.float64)
        logz = float(x.max()) + math.log(float(np.sum(np.exp(x - x.max()))))
        ids = np.flatnonzero(x > -math.inf)  # a token at -inf is never an alternative
        order = ids[np.lexsort((ids, -x[ids]))][:top_n]
        return token, (float(x[token] - logz), tuple((int(i), float(x[i] - logz)) for i in order))
    t = rules.temperature
    with np.errstate(over="ignore"):  # past float32's range is -inf: outside the window
        ids = np.flatnonzero((z - np.float32(zmax)) / np.float32(t) >= -40.0)  # the window
    if rules.top_k:
        ids = np.sort(ids[np.lexsort((ids, -z[ids]))][: rules.top_k])
    p = np.exp((z[ids] - np.float32(zmax)) / np.float32(t))
    if rules.top_p < 1.0 and len(ids) > 1:
        by_p = np.lexsort((ids, -p))
        running = np.cumsum(p[by_p].astype(np.float64))
        reached = np.flatnonzero(running >= rules.top_p * _blocked_total(p))
        n = int(reached[0]) + 1 if len(reached) else len(by_p)
        keep = np.sort(by_p[:n])
        ids, p = ids[keep], p[keep]
    if rules.min_p > 0.0:
        keep = p >= rules.min_p
        ids, p = ids[keep], p[keep]
    assert rules.seed is not None
    index = history.index
    u = (_splitmix64((rules.seed ^ (index * 0x9E3779B97F4A7C15)) & ((1 << 64) - 1)) >> 11) * 2.0**-53
    mass = p.astype(np.float64)
    total = _blocked_total(p)
    target = u * total
    chosen, before = -1, 0.0
    for start in range(0, len(mass), 256):  # the blocks before the token, then a running sum inside its block
        block = mass[start : start + 256]
        end = before + float(np.sum(block))
        if end > target or start + 256 >= len(mass):
            inside = before + np.cumsum(block)
            over = np.flatnonzero(inside > target)
            chosen = start + (int(over[0]) if len(over) else len(block) - 1)
            break
        before = end
    token = int(ids[chosen])
    if not top_n:
        return token, None
    log_total = math.log(total)
    order = np.lexsort((ids, -p))[:top_n]
    record = (
        math.log(float(p[chosen])) - log_total,
        tuple((int(ids[o]), math.log(float(p[o])) - log_total) for o in order),
    )
    return token, record


def _blocked_total(p: np.ndarray) -> float:
    """The total mass: float64 sums of blocks of 256 ids, added in order."""
    mass = p.astype(np.float64)
    total = 0.0
    for start in range(0, len(mass), 256):
        total += float(np.sum(mass[start : start + 256]))
    return total


class PlainDecoder:
    """Plain decoding after ``prompt + generated`` (no stop rules), one token at a time: ``tokens`` are the tokens
    picked so far."""

    def __init__(
        self, model_after: ModelAfter, prompt: Sequence[int], rules: PickRules, generated: Sequence[int] = ()
    ) -> None:
        self.rules = rules
        self.tokens: list[int] = []
        self._state, self._history = model_after([*prompt, *generated]), History.of(prompt, generated)

    def next(self) -> int:
        """Pick the next token and append it to ``tokens``; raises ``ReferenceError`` at a row that is not
        finite (``tokens`` unchanged)."""
        token, _ = pick_after(self._state.logits(), self.rules, self._history)
        self.tokens.append(token)
        self._history.add(token)
        self._state = self._state.then(token)
        return token


def plain_continuation(
    model_after: ModelAfter, prompt: Sequence[int], n: int, rules: PickRules, generated: Sequence[int] = ()
) -> list[int]:
    """The next ``n`` tokens plain decoding emits after ``prompt + generated`` (no stop rules): an oracle. Raises
    ``ReferenceError`` at a row that is not finite, with the tokens before it in its ``run``."""
    decoder = PlainDecoder(model_after, prompt, rules, generated)
    for _ in range(n):
        try:
            decoder.next()
        except ReferenceError as exc:
            raise ReferenceError(str(exc), ReferenceRun(tokens=decoder.tokens)) from exc
    return decoder.tokens


def greedy_reference(
    model_after: ModelAfter,
    prompt: Sequence[int],
    *,
    max_tokens: int,
    rules: PickRules = PickRules(),
    eos_token_ids: frozenset[int] = frozenset(),
    stop_token_sequences: Sequence[tuple[int, ...]] = (),
    stop_strings: Sequence[str] = (),
    max_context: int | None = None,
    capacity: int | None = None,
    top_logprobs: int = 0,
    detokenize: Callable[[Sequence[int]], str] | None = None,
) -> ReferenceRun:
    """Decode after ``prompt`` with ``rules`` (greedy by default); ``model_after(prompt)`` is the model after the
    prompt, extended by each picked token."""
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
    state, history = model_after(prompt), History.of(prompt, ())
    while run.finish_reason is None:
        try:
            token, record = pick_after(state.logits(), rules, history, top_logprobs)
        except ReferenceError as exc:
            raise ReferenceError(f"row after {len(run.tokens)} tokens: {exc}", run) from exc
        run.tokens.append(token)
        history.add(token)
        state = state.then(token)
        if record is not None:
            run.logprobs.append((token, *record))

        finish, matched = None, None
        if token in eos_token_ids:
            finish = "eos_token"
        else:
            for seq in stop_token_sequences:
                if tuple(run.tokens[-len(seq) :]) == tuple(seq):
                    finish, matched = "stop_sequence", tuple(seq)
                    break
        bound = None
        if len(run.tokens) >= max_tokens:
            bound = "max_tokens"
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
