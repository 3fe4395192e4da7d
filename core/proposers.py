"""Draft proposers: pure functions of the context that guess the next tokens.

A proposer is any object with ``propose(context_tokens, width) -> tuple[int, ...]``: ``context_tokens`` is the
prompt followed by every committed token, ``width`` the most tokens the step can use (the driver has already
capped it by the remaining token budget and context). A proposer may return fewer tokens, or none; the driver
truncates anything longer and rejects ids outside the vocabulary, so a wrong guess costs speed, never
correctness.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import attrs

from .checks import int_at_least


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
    """

    ngram: int = attrs.field(default=3, validator=int_at_least(1))
    max_draft: int = attrs.field(default=8, validator=int_at_least(1))
    min_ngram: int = attrs.field(default=1, validator=int_at_least(1))

    def __attrs_post_init__(self) -> None:
        if self.min_ngram > self.ngram:
            raise ValueError(f"min_ngram ({self.min_ngram}) must not exceed ngram ({self.ngram})")

    def propose(self, context_tokens: Sequence[int], width: int) -> tuple[int, ...]:
        n_ctx = len(context_tokens)
        limit = min(width, self.max_draft)
        if limit < 1 or n_ctx < 2:
            return ()
        # Search the context as bytes (4 per token): bytes.rfind runs in C. A hit must be token-aligned and must
        # end before the last token, so that at least one token follows it.
        data = array("I", context_tokens).tobytes()
        body_end = (n_ctx - 1) * 4
        for n in range(min(self.ngram, n_ctx - 1), self.min_ngram - 1, -1):
            needle = data[-4 * n :]
            end = body_end
            while (at := data.rfind(needle, 0, end)) >= 0:
                if at % 4 == 0:
                    return _copy_forward(context_tokens, at // 4 + n, limit)
                end = at + 4 * n - 1
        return ()


def _copy_forward(context: Sequence[int], first: int, count: int) -> tuple[int, ...]:
    """``count`` tokens copied from ``context[first:]``, continuing into the copied tokens themselves."""
    n_ctx = len(context)
    out = list(context[first : first + count])
    period = n_ctx - first
    while len(out) < count:
        out.append(out[len(out) - period])
    return tuple(out)
