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

    Cost: the search runs over the context as bytes. For a ``Shared`` context (what the driver passes) the bytes
    are kept between calls and only the new tokens are encoded, so a step costs a C-speed scan, not a Python pass
    over the whole history; any other sequence is encoded afresh.
    """

    ngram: int = attrs.field(default=3, validator=int_at_least(1))
    max_draft: int = attrs.field(default=8, validator=int_at_least(1))
    min_ngram: int = attrs.field(default=1, validator=int_at_least(1))
    # (head, store, bytes of head + store[:m], m) of the last Shared context seen: see _context_bytes.
    _encoded: list[tuple[Any, ...]] = attrs.field(factory=list, init=False, eq=False, repr=False)

    def __attrs_post_init__(self) -> None:
        if self.min_ngram > self.ngram:
            raise ValueError(f"min_ngram ({self.min_ngram}) must not exceed ngram ({self.ngram})")

    def propose(self, context_tokens: Sequence[int], width: int) -> tuple[int, ...]:
        n_ctx = len(context_tokens)
        limit = min(width, self.max_draft)
        if limit < 1 or n_ctx < 2:
            return ()
        # Search the context as bytes (4 per token): bytes.rfind runs in C. A hit must be token-aligned and must
        # end before the last token, so that at least one token follows it. `data` may run past the context.
        data = self._context_bytes(context_tokens)
        body_end = (n_ctx - 1) * 4
        for n in range(min(self.ngram, n_ctx - 1), self.min_ngram - 1, -1):
            needle = data[4 * (n_ctx - n) : 4 * n_ctx]
            end = body_end
            while (at := data.rfind(needle, 0, end)) >= 0:
                if at % 4 == 0:
                    return _copy_forward(context_tokens, at // 4 + n, limit)
                end = at + 4 * n - 1
        return ()

    def _context_bytes(self, context_tokens: Sequence[int]) -> bytes | bytearray:
        """The context as 4-byte ids; possibly followed by more (ids of a longer context on the same storage).

        A ``Shared`` context is ``head + store[:n]`` where ``store`` only grows and never changes (core/tokens.py):
        the bytes of the last one seen are kept and extended by the ids added since."""
        if not isinstance(context_tokens, Shared):
            return array("I", context_tokens).tobytes()
        head, store, n = context_tokens.parts()
        with _CACHE_LOCK:
            if self._encoded and self._encoded[0][0] is head and self._encoded[0][1] is store:
                _, _, data, m = self._encoded[0]
            else:
                data, m = bytearray(array("I", head).tobytes()), 0
            if m < n:
                data += array("I", store[m:n]).tobytes()
                m = n
            self._encoded[:] = [(head, store, data, m)]
        return data


def _copy_forward(context: Sequence[int], first: int, count: int) -> tuple[int, ...]:
    """``count`` tokens copied from ``context[first:]``, continuing into the copied tokens themselves."""
    n_ctx = len(context)
    out = list(context[first : first + count])
    period = n_ctx - first
    while len(out) < count:
        out.append(out[len(out) - period])
    return tuple(out)
