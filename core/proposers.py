"""Draft proposers: pure functions of the context that guess the next tokens.

A proposer is any object with ``propose(context_tokens, width) -> tuple[int, ...]``: ``context_tokens`` is the
prompt followed by every committed token, ``width`` the most tokens the step can use (the driver has already
capped it by the remaining token budget and context). A proposer may return fewer tokens, or none; the driver
truncates anything longer and rejects ids outside the vocabulary, so a wrong guess costs speed, never
correctness.
"""

from __future__ import annotations

import threading
from array import array
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import attrs

from .checks import int_at_least
from .tokens import Shared

_CACHE_LOCK = threading.Lock()


@runtime_checkable
class Proposer(Protocol):
    def propose(self, context_tokens: Sequence[int], width: int) -> tuple[int, ...]:
        """Up to ``width`` token ids that probably follow ``context_tokens``."""
        ...


@attrs.frozen
class PromptLookup:
    """Prompt-lookup (n-gram) drafting: find the context's last ``n`` tokens earlier in the context and propose
    what followed them there.

    ``ngram`` is the longest suffix tried; shorter ones are tried down to ``min_ngram``. Among the earlier
    occurrences of a suffix the most recent wins. At most ``max_draft`` tokens (and at most ``width``) are
    proposed; the empty tuple means no match. The copy runs on past the end of the context the way an LZ77
    back-reference does (a match 2 tokens back proposes the 2-token period repeated), so runs and short cycles
    fill the whole width.

    Cost. A ``Shared`` context (what the driver passes; core/tokens.py) only grows between calls, so the proposer
    keeps an index of its n-grams (for each length, the most recent position after each n-gram) and adds only
    the n-grams the new tokens complete: a step costs O(new tokens), whatever the length of the history. The index
    holds one entry per distinct n-gram of the last context seen (about 100 bytes each) until another context
    replaces it. Any other sequence is searched as bytes (``bytes.rfind``, in C), O(context) per call.
    """

    ngram: int = attrs.field(default=3, validator=int_at_least(1))
    max_draft: int = attrs.field(default=8, validator=int_at_least(1))
    min_ngram: int = attrs.field(default=1, validator=int_at_least(1))
    # [(head, store, indexed, tables)] for the last Shared context seen: see _indexed.
    _index: list[tuple[Any, ...]] = attrs.field(factory=list, init=False, eq=False, repr=False)

    def __attrs_post_init__(self) -> None:
        if self.min_ngram > self.ngram:
            raise ValueError(f"min_ngram ({self.min_ngram}) must not exceed ngram ({self.ngram})")

    def propose(self, context_tokens: Sequence[int], width: int) -> tuple[int, ...]:
        return self.match(context_tokens, width)[0]

    def match(self, context_tokens: Sequence[int], width: int) -> tuple[tuple[int, ...], int]:
        """``propose``'s draft and the length of the context suffix it matched (0 with no draft)."""
        n_ctx = len(context_tokens)
        limit = min(width, self.max_draft)
        if limit < 1 or n_ctx < 2:
            return (), 0
        if isinstance(context_tokens, Shared):
            with _CACHE_LOCK:
                tables = self._indexed(context_tokens)
                if tables is not None:
                    for n in range(min(self.ngram, n_ctx - 1), self.min_ngram - 1, -1):
                        after = tables[n].get(_ngram_key(context_tokens[n_ctx - n :]))
                        if after is not None:
                            return _copy_forward(context_tokens, after, limit), n
                    return (), 0
        # Search the context as bytes (4 per token): bytes.rfind runs in C. A hit must be token-aligned and must
        # end before the last token, so that at least one token follows it.
        data = array("I", context_tokens).tobytes()
        body_end = (n_ctx - 1) * 4
        for n in range(min(self.ngram, n_ctx - 1), self.min_ngram - 1, -1):
            needle = data[-4 * n :]
            end = body_end
            while (at := data.rfind(needle, 0, end)) >= 0:
                if at % 4 == 0:
                    return _copy_forward(context_tokens, at // 4 + n, limit), n
                end = at + 4 * n - 1
        return (), 0

    def _indexed(self, context: Shared[int]) -> dict[int, dict[int, int]] | None:
        """For each n-gram length, ``{n-gram key: the position right after its most recent occurrence}`` over the
        n-grams of ``context`` that end before its last token; None when the index cannot serve ``context`` (a
        shorter view of storage already indexed further: the caller searches bytes). The caller holds the lock.

        A ``Shared`` context is ``head + store[:n]``, and ``store`` only grows and never changes, so the index of
        the last context seen stays true and is extended by the n-grams the newer tokens complete."""
        head, store, n = context.parts()
        usable = len(head) + n - 1  # n-grams must end before the last token
        cached = self._index[0] if self._index else None
        if cached is not None and cached[0] is head and cached[1] is store:
            if cached[2] > usable:
                return None
            done, tables = cached[2], cached[3]
        else:
            done, tables = 0, {k: {} for k in range(self.min_ngram, self.ngram + 1)}
        if done < usable:
            low = max(0, done - self.ngram + 1)
            tokens = context[low:usable]  # the new n-grams and the tokens before them that they span
            for end in range(done, usable):  # an n-gram of tokens [end - k + 1, end]
                for k, table in tables.items():
                    first = end - k + 1
                    if first >= 0:
                        table[_ngram_key(tokens[first - low : end + 1 - low])] = end + 1
            self._index[:] = [(head, store, usable, tables)]
        return tables


def _ngram_key(ids: Sequence[int]) -> int:
    """One int for a run of ids (each < 2**32), as a dict key smaller than a tuple."""
    key = 0
    for t in ids:
        key = (key << 32) | int(t)
    return key


def _copy_forward(context: Sequence[int], first: int, count: int) -> tuple[int, ...]:
    """``count`` tokens copied from ``context[first:]``, continuing into the copied tokens themselves."""
    n_ctx = len(context)
    out = list(context[first : first + count])
    period = n_ctx - first
    while len(out) < count:
        out.append(out[len(out) - period])
    return tuple(out)
