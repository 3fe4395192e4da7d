"""The pick at one position: the arithmetic of processors, filters and seeded sampling, for ``core.state``.

``state.py`` decides which picks are committed; this module computes a pick from one logits row, as a pure
function of (the row, the options, the seed, the index of the token being picked, the tokens before it). Plain
and speculative decoding call it on the same inputs for every committed token, so they emit the same tokens.

The rules, in order (every step is deterministic; float32 for the processors, float64 after):

1. **Processors** on the logits row ``x`` (float32), giving ``z``:
   ``repetition_penalty`` (Hugging Face / CTRL): for every id in prompt + generated tokens before this position,
   ``z = z / rp`` where ``z > 0`` else ``z * rp``; then ``presence_penalty`` and ``frequency_penalty`` (OpenAI):
   for every id generated before this position (the prompt does not count), ``z -= count * frequency_penalty +
   presence_penalty``; then ``logit_bias``: ``z[id] += bias``.
2. **Greedy** (``temperature == 0``): the pick is the argmax of ``z``, the lowest id on ties. Filters do not matter
   (they always keep the argmax).
3. **Sampling** (``temperature = T > 0``): the distribution is ``p ∝ exp((z - z_max) / T)`` (float64) over the
   tokens that survive, in this order: tokens with ``(z_max - z) / T > 40`` (less likely than ``e**-40`` times the
   most likely: below the resolution of the sampler) are never sampled; ``top_k > 0`` keeps the ``k`` largest
   ``z`` (the lowest ids among equals); ``top_p < 1`` keeps the smallest set of the most likely tokens (the lowest
   ids first among equals) whose probability reaches ``top_p``; ``min_p > 0`` keeps tokens with
   ``p >= min_p * p_max``. The pick is an inverse-CDF draw over the surviving tokens in id order: with ``u`` the
   uniform of (seed, index) below, the first token whose cumulative mass exceeds ``u`` times the total.
4. **The uniform** ``u(seed, index)`` in [0, 1) is the top 53 bits of SplitMix64 applied to
   ``seed XOR (index * 0x9E3779B97F4A7C15)`` (64-bit arithmetic); ``index`` is the position of the token among the
   generated tokens (0 for the first). No RNG object, no state: the same seed replays the same tokens.

A row that is not finite where the pick is made (a NaN anywhere, or a top that is +inf or -inf) is refused.

**Margins** (for the core's tie guard): how far the raw logits may all drift, at most ``d`` each, before the pick
could change, stated as a gap ``M`` with the guarantee that the pick is unchanged whenever ``2 d < M``. Greedy:
the gap between the two largest ``z``. Sampling: the smallest of the gaps at every boundary the draw depends on
(the CDF boundaries around ``u``, the ``top_k``, ``top_p`` and ``min_p`` cut-offs). Divided by
``max(rp, 1 / rp)``, since the repetition penalty can scale a drift by that much.

**Logprobs** report the picked token's log-probability under the distribution it was picked from: greedy, the
log-softmax of ``z`` over the whole vocabulary; sampling, ``p`` above over the surviving tokens, renormalized. The
alternatives are the most likely tokens of that same distribution.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import attrs
import numpy as np

UNLIKELY = 40.0  # in units of (z_max - z) / T: tokens beyond it are never sampled
_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15


def splitmix64(x: int) -> int:
    """One SplitMix64 output for the 64-bit state ``x``."""
    x = (x + _GOLDEN) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def uniform(seed: int, index: int) -> float:
    """The sampler's uniform in [0, 1) for the token at ``index`` (see the module docstring)."""
    return (splitmix64((seed ^ (index * _GOLDEN)) & _MASK64) >> 11) * 2.0**-53


class NonFiniteRow(ValueError):
    """A logits row is not finite where its pick is made."""


@attrs.frozen
class Sampling:
    """The options that shape a pick (a view of ``core.state.Options``, validated there)."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()

    @property
    def processes(self) -> bool:
        """True when the row is changed before the pick (a penalty or a bias)."""
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or bool(self.logit_bias)
        )

    @property
    def is_plain_greedy(self) -> bool:
        """Greedy on the raw row: the pick is the row's argmax (what device picks compute)."""
        return self.temperature == 0.0 and not self.processes


@attrs.frozen
class Pick:
    """One position's pick and what the core may ask about it."""

    token: int
    margin: float  # see "Margins" in the module docstring; +inf when nothing can flip it
    logprob: float  # under the distribution the pick was made from
    top: tuple[tuple[int, float], ...]  # the most likely alternatives, (id, logprob), most likely first


class StepContext:
    """What the rows of one step share: the options and the tokens before the first row's position. Row ``i``
    sees the prompt, the generated tokens and the first ``i`` draft tokens."""

    def __init__(self, sampling: Sampling, prompt: Sequence[int], generated: Sequence[int]) -> None:
        self.sampling = sampling
        self.first_index = len(generated)
        s = sampling
        self._rep_ids: np.ndarray | None = None
        self._gen_ids = self._gen_counts = None
        if s.repetition_penalty != 1.0:
            self._rep_ids = np.unique(np.asarray([*prompt, *generated], dtype=np.int64))
        if s.presence_penalty or s.frequency_penalty:
            self._gen_ids, self._gen_counts = np.unique(np.asarray(generated, dtype=np.int64), return_counts=True)
        self._bias_ids = np.asarray([i for i, _ in s.logit_bias], dtype=np.int64)
        self._bias = np.asarray([b for _, b in s.logit_bias], dtype=np.float32)

    def processed(self, row: np.ndarray, drafted: Sequence[int]) -> np.ndarray:
        """``z`` for a row whose context ends with ``drafted`` (draft tokens before it): a float32 copy."""
        s = self.sampling
        z = np.array(row, dtype=np.float32, copy=True)
        if s.repetition_penalty != 1.0:
            assert self._rep_ids is not None
            ids = np.union1d(self._rep_ids, np.asarray(drafted, dtype=np.int64)) if drafted else self._rep_ids
            v = z[ids]
            rp = np.float32(s.repetition_penalty)
            z[ids] = np.where(v > 0, v / rp, v * rp)
        if s.presence_penalty or s.frequency_penalty:
            assert self._gen_ids is not None and self._gen_counts is not None
            ids, counts = self._gen_ids, self._gen_counts
            if drafted:
                ids, counts = np.unique(
                    np.concatenate([np.repeat(ids, counts), np.asarray(drafted, dtype=np.int64)]), return_counts=True
                )
            penalty = counts.astype(np.float32) * np.float32(s.frequency_penalty) + np.float32(s.presence_penalty)
            z[ids] -= penalty
        if len(self._bias_ids):
            z[self._bias_ids] += self._bias
        return z

    def pick(self, row: np.ndarray, i: int, drafted: Sequence[int], *, margin: bool, top_n: int) -> Pick:
        """The pick from ``row``, the ``i``-th row of the step (its context ends with ``drafted``); its
        ``margin`` is computed only when asked (else +inf), its alternatives when ``top_n`` > 0. Raises
        ``NonFiniteRow`` for a row that is not finite where the pick is made."""
        s = self.sampling
        z = self.processed(row, drafted) if s.processes else np.asarray(row)
        best = int(np.argmax(z))  # the first maximum; a NaN anywhere is picked, and refused
        if not math.isfinite(float(z[best])):
            raise NonFiniteRow(f"logits row {i} is not finite where the pick is made (value {z[best]})")
        scale = max(s.repetition_penalty, 1.0 / s.repetition_penalty)
        if s.temperature == 0.0:
            return _greedy_pick(z, best, scale, margin, top_n)
        return _sampled_pick(z, best, s, uniform(_seed(s), self.first_index + i), scale, top_n)


def _seed(s: Sampling) -> int:
    assert s.seed is not None  # validated by Options: sampling needs a seed
    return s.seed


def _greedy_pick(z: np.ndarray, best: int, scale: float, want_margin: bool, top_n: int) -> Pick:
    vocab = z.shape[0]
    margin = math.inf
    if want_margin and vocab > 1:
        top2 = np.partition(z, vocab - 2)[-2:]
        margin = float(top2[1] - top2[0]) / scale
    logprob, top = (0.0, ()) if not top_n else _log_softmax_top(np.asarray(z, dtype=np.float64), best, top_n)
    return Pick(best, margin, logprob, top)


def _log_softmax_top(x: np.ndarray, token: int, top_n: int) -> tuple[float, tuple[tuple[int, float], ...]]:
    """Log-softmax of ``x`` at ``token`` and its ``top_n`` most likely ids (lowest id first on ties)."""
    m = float(np.max(x))
    lse = m + math.log(float(np.sum(np.exp(x - m))))
    n = min(top_n, x.shape[0])
    cand = np.argpartition(-x, n - 1)[:n] if n < x.shape[0] else np.arange(x.shape[0])
    # argpartition may cut a tie arbitrarily: take every id tied with the n-th value, then order exactly.
    cand = np.nonzero(x >= x[cand].min())[0]
    order = np.lexsort((cand, -x[cand]))[:n]
    return float(x[token] - lse), tuple((int(cand[j]), float(x[cand[j]] - lse)) for j in order)


def _sampled_pick(z: np.ndarray, best: int, s: Sampling, u: float, scale: float, top_n: int) -> Pick:
    t = float(s.temperature)
    zmax = float(z[best])
    gaps = [math.inf]  # the margins of every boundary the draw depends on
    ids = np.flatnonzero(z >= np.float32(zmax - UNLIKELY * t))  # ascending ids
    vals = z[ids].astype(np.float64)
    if s.top_k and len(ids) > s.top_k:
        k = s.top_k
        kth = np.partition(vals, len(vals) - k)[len(vals) - k]  # the k-th largest value
        above = vals > kth
        tied = np.flatnonzero(vals == kth)[: k - int(above.sum())]  # the lowest ids among the tied
        keep = above.copy()
        keep[tied] = True
        below = vals[~keep]
        gaps.append(float(kth - below.max()) if below.size else math.inf)
        ids, vals = ids[keep], vals[keep]
    p = np.exp((vals - zmax) / t)
    if s.top_p < 1.0 and len(ids) > 1:
        order = np.lexsort((ids, -p))  # most likely first, lowest id first among equals
        cum = np.cumsum(p[order])
        total = float(cum[-1])
        n = int(np.searchsorted(cum, s.top_p * total, side="left")) + 1  # the smallest prefix reaching top_p
        n = min(n, len(order))
        before = float(cum[n - 2]) / total if n >= 2 else 0.0
        through = float(cum[n - 1]) / total
        gaps.append(4.0 * t * min(s.top_p - before, through - s.top_p) if n < len(order) else math.inf)
        if n < len(order):
            gaps.append(float(vals[order[n - 1]] - vals[order[n]]))
        kept = np.sort(order[:n])
        ids, vals, p = ids[kept], vals[kept], p[kept]
    if s.min_p > 0.0:
        threshold = zmax + t * math.log(s.min_p)
        gaps.append(float(np.min(np.abs(vals - threshold))) if len(vals) else math.inf)
        keep = vals >= threshold
        ids, vals, p = ids[keep], vals[keep], p[keep]
    cdf = np.cumsum(p)
    total = float(cdf[-1])
    target = u * total
    j = min(int(np.searchsorted(cdf, target, side="right")), len(ids) - 1)
    low = float(cdf[j - 1]) if j else 0.0
    gaps.append(4.0 * t * min(target - low, float(cdf[j]) - target) / total)
    token = int(ids[j])
    logprob = math.log(float(p[j])) - math.log(total)
    top: tuple[tuple[int, float], ...] = ()
    if top_n:
        order = np.lexsort((ids, -p))[:top_n]
        top = tuple((int(ids[o]), math.log(float(p[o])) - math.log(total)) for o in order)
    return Pick(token, min(gaps) / scale, logprob, top)
