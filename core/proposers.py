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
from .width import CostAwareWidth


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
        return self.match(context_tokens, width)[0]

    def match(self, context_tokens: Sequence[int], width: int) -> tuple[tuple[int, ...], int]:
        """``propose``'s draft and the length of the context suffix it matched (0 with no draft)."""
        n_ctx = len(context_tokens)
        limit = min(width, self.max_draft)
        if limit < 1 or n_ctx < 2:
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


def _copy_forward(context: Sequence[int], first: int, count: int) -> tuple[int, ...]:
    """``count`` tokens copied from ``context[first:]``, continuing into the copied tokens themselves."""
    n_ctx = len(context)
    out = list(context[first : first + count])
    period = n_ctx - first
    while len(out) < count:
        out.append(out[len(out) - period])
    return tuple(out)


@attrs.define
class LookupOrDraft:
    """Two proposers in one: prompt lookup where it matches strongly, a draft model (any proposer, e.g. a shared-KV
    draft head) otherwise, each with its own cost-aware width policy.

    Per call: the lookup's draft is taken when its match is at least ``strong_ngram`` tokens long and its policy
    expects at least as many committed tokens per unit of time as the drafter's (``expected_rate`` at each
    policy's best width); otherwise the drafter drafts ``drafter_policy.width()`` tokens. Each policy prices its
    source (``draft_cost``: 0 for lookup, the head's step for the drafter) and learns only from its source's
    drafts: what was committed of the previous draft is read off the next context (it extends the previous one by
    the accepted tokens, then the target's own pick). Widths are capped by the driver's ``width``, so the driver's
    own policy should only cap by the budget (a ``FixedWidth`` of the largest width). Stateful (the policies and
    the last draft): one instance per generation. The output never depends on it; only the speed does.
    """

    lookup: PromptLookup
    drafter: Proposer
    lookup_policy: CostAwareWidth
    drafter_policy: CostAwareWidth
    strong_ngram: int = attrs.field(default=3, validator=int_at_least(1))
    lookup_drafts: int = 0  # calls answered by each source (statistics)
    drafter_drafts: int = 0
    _last: tuple[int, tuple[int, ...], bool] | None = None  # (context length, draft, from lookup)

    def propose(self, context_tokens: Sequence[int], width: int) -> tuple[int, ...]:
        self._observe(context_tokens)
        draft, matched = self.lookup.match(context_tokens, width)
        use_lookup = (
            bool(draft)
            and matched >= self.strong_ngram
            and self._rate(self.lookup_policy) >= self._rate(self.drafter_policy)
        )
        if use_lookup:
            draft = draft[: min(width, self.lookup_policy.width())]
            self.lookup_drafts += 1
        else:
            k = min(width, self.drafter_policy.width())
            draft = tuple(self.drafter.propose(context_tokens, k))[:k] if k > 0 else ()
            self.drafter_drafts += 1
        self._last = (len(context_tokens), draft, use_lookup)
        return draft

    @staticmethod
    def _rate(policy: CostAwareWidth) -> float:
        return policy.expected_rate(policy.best_width())

    def _observe(self, context_tokens: Sequence[int]) -> None:
        """Tell the previous draft's policy how many of its tokens the context now shows committed."""
        if self._last is None:
            return
        length, draft, from_lookup = self._last
        self._last = None
        if len(context_tokens) <= length:
            return  # not a continuation of the previous call's context
        new = context_tokens[length : length + len(draft)]
        accepted = next(
            (i for i, (a, b) in enumerate(zip(draft, new, strict=False)) if a != b), min(len(draft), len(new))
        )
        if from_lookup:
            self.lookup_policy = self.lookup_policy.observe(len(draft), accepted)
        else:
            self.drafter_policy = self.drafter_policy.observe(len(draft), accepted)
