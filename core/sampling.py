"""The pick at one position: the arithmetic of processors, filters and seeded sampling, for ``core.state``.

``state.py`` decides which picks are committed; this module computes a pick from one logits row, as a pure
function of (the row, the options, the seed, the index of the token being picked, the tokens before it). Plain
and speculative decoding call it on the same inputs for every committed token, so they emit the same tokens.

The rules, in order (every step is deterministic; float32 for the processors, float64 after):

1. **Processors** on the logits row ``x`` (float32), giving ``z``:
   ``repetition_penalty`` (Hugging Face / CTRL): for every id in prompt + generated tokens before this position,
   ``z = z / rp`` where ``z > 0`` else ``z * rp``; then ``presence_penalty`` and ``frequency_penalty`` (OpenAI):
   for every id generated before this position (the prompt does not count), ``z -= count * frequency_penalty +
   presence_penalty``; then ``logit_bias``: ``z[id] += bias``. The arithmetic saturates: option values, the
   penalty and every processed logit are held within float32's finite range (+-``F32_MAX``), so a processor
   never turns a finite logit into an infinite one, whatever the values; a row's own non-finite values are left
   as they are, for the check below.
2. **Greedy** (``temperature == 0``): the pick is the argmax of ``z``, the lowest id on ties. Filters do not matter
   (they always keep the argmax).
3. **Sampling** (``temperature = T > 0``, at least ``F32_TINY``, float32's smallest normal number, so that ``T``
   in float32 is not 0): with ``s = (z - z_max) / T`` (float32) the distribution is
   ``p = exp(s)`` over the tokens that survive, in this order: tokens with ``s < -40`` (less likely than
   ``e**-40`` times the most likely) are never sampled; ``top_k > 0`` keeps the ``k`` largest ``z`` (the lowest
   ids among equals); then ``p`` is numpy's float32 ``exp`` of the survivors' ``s`` (``p = 1`` at the top);
   ``top_p < 1`` keeps the smallest set of survivors, taken by ``p`` descending (the lowest id first among
   equals), whose running float64 sum reaches ``top_p`` times the total; ``min_p > 0`` keeps survivors with
   ``p >= min_p`` (float32). Totals are float64 sums over the survivors in id order, in blocks of 256 survivors
   (each block by numpy's pairwise ``sum``, then the blocks in order). The pick is an inverse-CDF draw: with
   ``u`` the uniform of (seed, index) below, the first survivor (in id order) whose cumulative mass (the blocks
   before its block plus a running sum inside it) exceeds ``u`` times the total.
4. **The uniform** ``u(seed, index)`` in [0, 1) is the top 53 bits of SplitMix64 applied to
   ``seed XOR (index * 0x9E3779B97F4A7C15)`` (64-bit arithmetic); ``index`` is the position of the token among the
   generated tokens (0 for the first). No RNG object, no state: the same seed replays the same tokens.

A row that is not finite where the pick is made (a NaN anywhere, or a top that is +inf or -inf) is refused. A
constrained generation's row is masked after the processors (``core/constraint.py``: the tokens its grammar
forbids are ``-inf``), so every rule above sees the masked row.

**Margins** (for the core's tie guard): how far the raw logits may all drift, at most ``d`` each, before the pick
could change, stated as a gap ``M`` with the guarantee that the pick is unchanged whenever ``2 d < M``. Greedy:
the gap between the two largest ``z``. Sampling: the smallest of the gaps at every boundary the draw depends on
(the CDF boundaries around ``u``, the ``top_k``, ``top_p`` and ``min_p`` cut-offs). Divided by
``max(rp, 1 / rp)``, since the repetition penalty can scale a drift by that much.

**Logprobs** report the picked token's log-probability under the distribution it was picked from: greedy, the
log-softmax of ``z`` over the whole vocabulary; sampling, ``p`` above over the surviving tokens, renormalized. The
alternatives are the most likely tokens of that same distribution.

**Coupled drafting** (``DraftPicker``): a draft model under seeded sampling picks each draft token with this same
rule, from its own row, at the index the token will have, so that where its distribution is close to the target's
its draft is the target's pick. It calls ``StepContext.pick``; nothing of the rule is restated.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence

import attrs
import numpy as np

from .checks import ArgumentError, check_number, is_int, token_ids
from .constraint import masked
from .declare import Bounds, option

UNLIKELY = 40.0  # in units of (z_max - z) / T: tokens beyond it are never sampled
F32_MAX = float(np.finfo(np.float32).max)  # the processors saturate at +-F32_MAX
F32_TINY = float(np.finfo(np.float32).tiny)  # the least temperature and repetition penalty (float32's smallest normal)
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


def _to_logit_bias(value: object) -> tuple[tuple[int, float], ...]:
    """``{token id: bias}`` (a mapping or pairs) as sorted ``(id, bias)`` pairs; ``ValueError`` names
    ``logit_bias``."""
    if value is None:
        return ()
    items = value.items() if isinstance(value, Mapping) else value
    if isinstance(items, (str, bytes)) or not isinstance(items, Iterable):
        raise ArgumentError("logit_bias", f"logit_bias: expected a mapping of token id -> bias, got {value!r}")
    out: dict[int, float] = {}
    for item in items:
        if not isinstance(item, tuple) or len(item) != 2:
            raise ArgumentError("logit_bias", f"logit_bias: expected (token id, bias) pairs, got {item!r}")
        token, bias = item
        token = token_ids("logit_bias", [token])[0]
        out[token] = check_number(f"logit_bias[{token}]", bias, argument="logit_bias")
    return tuple(sorted(out.items()))


def _to_float(value: object) -> object:
    """Ints as floats (the pick's arithmetic is float); anything else is left for the bounds check to refuse."""
    return float(value) if is_int(value) else value  # type: ignore[arg-type]


def _check_temperature(instance: object, field: object, value: float) -> None:
    if 0.0 < value < F32_TINY:
        raise ArgumentError(
            "temperature", f"temperature must be 0 (greedy) or at least {F32_TINY:g} (float32), got {value!r}"
        )


def _f32(value: float) -> np.float32:
    """An option's value as the processors use it: float32, saturated at +-``F32_MAX`` (never infinite)."""
    return np.float32(min(max(value, -F32_MAX), F32_MAX))


def _saturated(new: np.ndarray, old: np.ndarray) -> np.ndarray:
    """``new`` (a processor's result for the logits ``old``) held within +-``F32_MAX`` where ``old`` is finite."""
    return np.where(np.isfinite(old), np.clip(new, -F32_MAX, F32_MAX), new)


@attrs.frozen(kw_only=True)
class Sampling:
    """The options that shape each pick, declared once: the Engine's keywords, the command line's flags, the
    server's request fields and the batch records' keys are built from these fields (``core/declare.py``).

    Every default leaves the pick greedy on the raw row. ``seed`` None is "not given": the core needs one to sample
    (``Options`` refuses ``temperature > 0`` without it); the Engine draws one and reports it."""

    temperature: float = option(
        0.0,
        "sampling temperature; 0 decodes greedily",
        bounds=Bounds(minimum=0),
        converter=_to_float,
        validator=_check_temperature,
    )
    top_k: int = option(0, "sample from the k most likely tokens only; 0 = off", bounds=Bounds("int", minimum=0))
    top_p: float = option(
        1.0,
        "nucleus sampling: the smallest set of tokens holding this much probability; 1 = off",
        bounds=Bounds(minimum=0, maximum=1, low_open=True),
        converter=_to_float,
    )
    min_p: float = option(
        0.0,
        "drop tokens less likely than min_p times the most likely one; 0 = off",
        bounds=Bounds(minimum=0, maximum=1),
        converter=_to_float,
    )
    seed: int | None = option(
        None,
        "the sampler's seed, an int in [0, 2**64); the same seed replays the same tokens (drawn when sampling "
        "without one)",
        bounds=Bounds("int", minimum=0, maximum=2**64, high_open=True, none_ok=True),
        converter=lambda v: int(v) if is_int(v) else v,
    )
    repetition_penalty: float = option(
        1.0,
        "divide the logits of tokens already in the context by this (multiply when negative); 1 = off",
        bounds=Bounds(minimum=F32_TINY),
        converter=_to_float,
    )
    presence_penalty: float = option(
        0.0,
        "subtract this from the logits of tokens already generated; 0 = off",
        bounds=Bounds(),
        converter=_to_float,
    )
    frequency_penalty: float = option(
        0.0,
        "subtract this times a token's count among the generated tokens from its logit; 0 = off",
        bounds=Bounds(),
        converter=_to_float,
    )
    logit_bias: tuple[tuple[int, float], ...] = option(
        (), "{token id: bias} added to those logits before the pick", converter=_to_logit_bias
    )

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
        self._bias = np.asarray([_f32(b) for _, b in s.logit_bias], dtype=np.float32)

    def processed(self, row: np.ndarray, drafted: Sequence[int]) -> np.ndarray:
        """``z`` for a row whose context ends with ``drafted`` (draft tokens before it): a float32 copy."""
        s = self.sampling
        z = np.array(row, dtype=np.float32, copy=True)
        with np.errstate(over="ignore"):  # what overflows is saturated (_saturated)
            if s.repetition_penalty != 1.0:
                assert self._rep_ids is not None
                ids = np.union1d(self._rep_ids, np.asarray(drafted, dtype=np.int64)) if drafted else self._rep_ids
                v = z[ids]
                rp = _f32(s.repetition_penalty)
                z[ids] = _saturated(np.where(v > 0, v / rp, v * rp), v)
            if s.presence_penalty or s.frequency_penalty:
                assert self._gen_ids is not None and self._gen_counts is not None
                ids, counts = self._gen_ids, self._gen_counts
                if drafted:
                    ids, counts = np.unique(
                        np.concatenate([np.repeat(ids, counts), np.asarray(drafted, dtype=np.int64)]),
                        return_counts=True,
                    )
                penalty = counts.astype(np.float32) * _f32(s.frequency_penalty) + _f32(s.presence_penalty)
                v = z[ids]
                z[ids] = _saturated(v - np.clip(penalty, -F32_MAX, F32_MAX), v)
            if len(self._bias_ids):
                v = z[self._bias_ids]
                z[self._bias_ids] = _saturated(v + self._bias, v)
        return z

    def pick(
        self,
        row: np.ndarray,
        i: int,
        drafted: Sequence[int],
        *,
        margin: bool,
        top_n: int,
        allowed: np.ndarray | None = None,
    ) -> Pick:
        """The pick from ``row``, the ``i``-th row of the step (its context ends with ``drafted``); its
        ``margin`` is computed only when asked (else +inf), its alternatives when ``top_n`` > 0. ``allowed``: a
        grammar's ``[vocab]`` bool mask for this row (``core/constraint.py``): the tokens it forbids are ``-inf``
        after the processors. Raises ``NonFiniteRow`` for a row that is not finite where the pick is made."""
        s = self.sampling
        z = self.processed(row, drafted) if s.processes else np.asarray(row)
        if allowed is not None:
            if not allowed.any():
                raise NonFiniteRow(f"logits row {i}: the grammar allows no token here (and no EOS: it does not accept)")
            z = masked(z, allowed)
        best = int(np.argmax(z))  # the first maximum; a NaN anywhere is picked, and refused
        if not math.isfinite(float(z[best])):
            raise NonFiniteRow(f"logits row {i} is not finite where the pick is made (value {z[best]})")
        scale = max(s.repetition_penalty, 1.0 / s.repetition_penalty)
        if s.temperature == 0.0:
            return _greedy_pick(z, best, scale, margin, top_n)
        # (z - z_max) / T past float32's range is -inf, and a -inf z over a T past float32 (inf) is NaN: both
        # outside the window, neither worth a warning
        with np.errstate(over="ignore", invalid="ignore"):
            return _sampled_pick(z, best, s, uniform(_seed(s), self.first_index + i), scale, margin, top_n)


class DraftPicks:
    """The coupled picks of one draft (made by ``DraftPicker.after``): ``pick(row, drafted)`` is the pick the
    target's verify pass will make at draft position ``len(drafted)`` (``drafted``: the draft tokens before it), by
    the same rule (``StepContext.pick``), from ``row`` instead of the target's row; None where ``row`` is not finite
    where the pick is made (the drafter stops drafting there)."""

    def __init__(self, context: StepContext) -> None:
        self._context = context

    def pick(self, row: np.ndarray, drafted: Sequence[int]) -> Pick | None:
        try:
            return self._context.pick(row, len(drafted), drafted, margin=False, top_n=0)
        except NonFiniteRow:
            return None


@attrs.frozen
class DraftPicker:
    """Coupled drafting under seeded sampling: a draft model picks each draft token by the target's own rule (the
    processors over prompt + generated + the draft so far, the filters, and the uniform of (``seed``, the index the
    token will have)) applied to its own logits row over the target's vocabulary. Where the two rows are close, the
    inverse-CDF draws coincide, so the draft is the token the target will pick; where they are not, a draft token is
    only a worse guess: drafts are proposals, and the core accepts exactly the target's picks.

    One per sampled generation (``core.proposers.DraftContext.picker``): ``sampling`` its options, ``prompt_len``
    its prompt's length, so that any context a proposer is asked about (prompt + generated, perhaps + tokens
    drafted in front, as ``ForcedTokens`` passes) splits into prompt and generated tokens, and its first draft
    token's index is ``len(context_tokens) - prompt_len``."""

    sampling: Sampling
    prompt_len: int

    def after(self, context_tokens: Sequence[int]) -> DraftPicks:
        """The picks of a draft after ``context_tokens``: those of the verify pass that will check it."""
        prompt, generated = context_tokens[: self.prompt_len], context_tokens[self.prompt_len :]
        return DraftPicks(StepContext(self.sampling, prompt, generated))


def _seed(s: Sampling) -> int:
    assert s.seed is not None  # validated by Options: sampling needs a seed
    return s.seed


def _greedy_pick(z: np.ndarray, best: int, scale: float, want_margin: bool, top_n: int) -> Pick:
    vocab = z.shape[0]
    margin = math.inf
    if want_margin and vocab > 1:
        top2 = np.partition(z, vocab - 2)[-2:]
        with np.errstate(over="ignore"):  # a gap past float32's range is inf: no drift of finite logits flips it
            margin = float(top2[1] - top2[0]) / scale
    logprob, top = (0.0, ()) if not top_n else _log_softmax_top(np.asarray(z, dtype=np.float64), best, top_n)
    return Pick(best, margin, logprob, top)


def _log_softmax_top(x: np.ndarray, token: int, top_n: int) -> tuple[float, tuple[tuple[int, float], ...]]:
    """Log-softmax of ``x`` at ``token`` and its ``top_n`` most likely ids (lowest id first on ties), never an id
    at ``-inf`` (one the row can never pick, e.g. a grammar's masked token: fewer than ``top_n`` when fewer are
    possible)."""
    m = float(np.max(x))
    lse = m + math.log(float(np.sum(np.exp(x - m))))
    n = min(top_n, x.shape[0])
    cand = np.argpartition(-x, n - 1)[:n] if n < x.shape[0] else np.arange(x.shape[0])
    # argpartition may cut a tie arbitrarily: take every id tied with the n-th value, then order exactly.
    cand = np.nonzero((x >= x[cand].min()) & (x > -math.inf))[0]
    order = np.lexsort((cand, -x[cand]))[:n]
    return float(x[token] - lse), tuple((int(cand[j]), float(x[cand[j]] - lse)) for j in order)


def _sampled_pick(z: np.ndarray, best: int, s: Sampling, u: float, scale: float, want_margin: bool, top_n: int) -> Pick:
    """Steps 3 and 4 of the module docstring. After the window and ``top_k`` everything works on the surviving
    tokens only (``ids`` ascending, their ``p``), so a ``top_k`` draw costs a few passes over the row."""
    t = float(s.temperature)
    zmax = z[best]
    gaps = [math.inf]  # the margins of every boundary the draw depends on
    if s.top_k:
        ids, gap = _top_k(z, zmax, t, s.top_k)
        gaps.append(gap)
    else:
        ids = np.flatnonzero((z - zmax) / np.float32(t) >= -UNLIKELY)
    p = np.exp((z[ids] - zmax) / np.float32(t))  # float32; the top is exp(0) = 1
    if s.top_p < 1.0 and len(ids) > 1:
        keep, gap_mass, gap_order = _top_p(z[ids], p, s.top_p)
        gaps += [4.0 * t * gap_mass, gap_order]
        ids, p = ids[keep], p[keep]
    if s.min_p > 0.0:
        if want_margin:
            threshold = float(zmax) + t * math.log(s.min_p)
            gaps.append(float(np.min(np.abs(z[ids].astype(np.float64) - threshold))))
        keep = p >= s.min_p
        ids, p = ids[keep], p[keep]
    mass = p.astype(np.float64)
    blocks = _block_cumsum(mass)
    total = float(blocks[-1])
    target = u * total
    j, low, high = _inverse_cdf(mass, blocks, target)
    gaps.append(4.0 * t * min(target - low, high - target) / total)
    logprob = math.log(float(p[j])) - math.log(total)
    top: tuple[tuple[int, float], ...] = ()
    if top_n:
        top = tuple((int(ids[o]), math.log(float(p[o])) - math.log(total)) for o in _most_likely(ids, p, top_n))
    return Pick(int(ids[j]), min(gaps) / scale, logprob, top)


CDF_BLOCK = 256  # the surviving tokens' mass is summed in blocks of this many tokens (see _block_cumsum)


def _block_cumsum(mass: np.ndarray) -> np.ndarray:
    """Running totals at the end of each block of ``CDF_BLOCK`` surviving tokens (in id order): each block's mass
    by numpy's pairwise ``sum``, then the blocks added in order."""
    whole = mass.shape[0] // CDF_BLOCK * CDF_BLOCK
    sums = mass[:whole].reshape(-1, CDF_BLOCK).sum(axis=1)
    if whole < mass.shape[0]:  # the last, shorter block
        sums = np.append(sums, mass[whole:].sum())
    return np.cumsum(sums)


def _inverse_cdf(mass: np.ndarray, blocks: np.ndarray, target: float) -> tuple[int, float, float]:
    """The first index whose running mass exceeds ``target`` (the block by ``blocks``, then the blocks before it
    plus a running sum inside it), with the running mass just before and at it. If rounding leaves nothing in the
    block above ``target``, the block's last index is taken (every surviving token has mass)."""
    j = min(int(np.searchsorted(blocks, target, side="right")), len(blocks) - 1)
    start = j * CDF_BLOCK
    before = float(blocks[j - 1]) if j else 0.0
    inside = before + np.cumsum(mass[start : start + CDF_BLOCK])
    i = min(int(np.searchsorted(inside, target, side="right")), len(inside) - 1)
    low = float(inside[i - 1]) if i else before
    return start + i, low, float(inside[i])


def _top_k(z: np.ndarray, zmax: np.float32, t: float, k: int) -> tuple[np.ndarray, float]:
    """The ids (ascending) of the ``k`` largest ``z`` within the window (the lowest ids among equals), and the gap
    between the k-th and the next. Candidates are found by widening a threshold below the top, so only they are
    sorted."""

    def count(d: float) -> int:
        return int(np.count_nonzero(z >= zmax - np.float32(d)))

    # A first guess from every 16th id: its (k / 16 + 4)-th largest value usually sits a little below the k-th
    # largest of the row. Then count(low) <= k < count(delta), by doubling, narrowed by bisection.
    sample = z[::16]
    m = min(k // 16 + 4, sample.shape[0])
    guess = float(zmax) - float(np.partition(sample, sample.shape[0] - m)[sample.shape[0] - m])
    low, delta = 0.0, max(guess, t / 64)
    # past the window's width every token of the window counts; a huge t makes that width (and delta) infinite,
    # where the doubling must stop too (an infinite delta counts every token)
    while count(delta) <= k and delta <= 2 * UNLIKELY * t and math.isfinite(delta):
        low, delta = delta, delta * 2.0
    for _ in range(12):  # so that only a few times k candidates are gathered and sorted
        if count(delta) <= 4 * k + 16:
            break
        mid = (low + delta) / 2
        low, delta = (mid, delta) if count(mid) <= k else (low, mid)
    cand = np.flatnonzero(z >= zmax - np.float32(delta))
    cand = cand[(z[cand] - zmax) / np.float32(t) >= -UNLIKELY]  # the window
    order = cand[np.lexsort((cand, -z[cand]))]
    chosen = order[:k]
    if len(order) > k:
        nxt = float(z[order[k]])
    else:  # every token of the window is a candidate: the next is outside it, or there is none
        nxt = -math.inf
    return np.sort(chosen), float(z[chosen[-1]]) - nxt


def _top_p(zs: np.ndarray, p: np.ndarray, top_p: float) -> tuple[np.ndarray, float, float]:
    """The nucleus among the surviving tokens (``zs``, ``p`` in id order): the smallest prefix, taken by ``p``
    descending (then id), whose running float64 sum reaches ``top_p`` times the total (``_block_cumsum``).
    Returns it as a mask over the survivors, the mass gap at its boundary (fractions of the total) and the
    ``z`` gap between its last token and the next."""
    total = float(_block_cumsum(p.astype(np.float64))[-1])
    goal = top_p * total
    tau = 0.5
    while True:  # widen the candidates (p >= tau) until their running sum, in order, reaches the goal
        # their mass first (a cheap pairwise sum), so that only a set that can reach the goal is sorted
        while tau > 0 and float(p[p >= np.float32(tau)].sum(dtype=np.float64)) < goal:
            tau = tau / 4 if tau > 1e-30 else 0.0
        cand = np.flatnonzero(p >= np.float32(tau)) if tau > 0 else np.arange(len(p))
        order = cand[np.lexsort((cand, -p[cand]))]
        running = np.cumsum(p[order].astype(np.float64))
        if (len(running) and running[-1] >= goal) or tau == 0:
            break
        tau = tau / 4 if tau > 1e-30 else 0.0  # the sums disagreed in the last digit: one more widening
    n = min(int(np.searchsorted(running, goal, side="left")) + 1, len(order))
    keep = np.zeros(len(p), dtype=bool)
    keep[order[:n]] = True
    before = float(running[n - 2]) / total if n >= 2 else 0.0
    through = float(running[n - 1]) / total
    if n < len(order):
        nxt = float(zs[order[n]])
    else:
        rest = ~keep
        nxt = float(zs[rest].max()) if rest.any() else -math.inf
    gap_mass = min(top_p - before, through - top_p) if nxt > -math.inf else math.inf
    return keep, gap_mass, float(zs[order[n - 1]]) - nxt


def _most_likely(ids: np.ndarray, p: np.ndarray, n: int) -> list[int]:
    """Indexes of the ``n`` survivors with the most mass, most first, the lowest id first among equals."""
    cand = np.arange(len(p))
    if len(p) > 4 * n:  # partition first; argpartition may cut a tie, so take every index tied with the n-th
        cand = np.flatnonzero(p >= p[np.argpartition(-p, n - 1)[:n]].min())
    return [int(o) for o in cand[np.lexsort((ids[cand], -p[cand]))][:n]]
