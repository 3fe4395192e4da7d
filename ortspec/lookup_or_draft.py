"""``speculative="auto"``: prompt lookup where it matches strongly, a draft model (the shared-KV drafter) otherwise.

This proposer keeps state (what each source's drafts have earned so far), so it lives here, beside the driver, and
not in the pure core: one instance per generation (``Engine`` makes it). It only chooses which draft to verify;
the core checks every draft token against the target, so the output never depends on this object, only the speed.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from ortspec.core import CostAwareWidth, PromptLookup, Proposer
from ortspec.core.checks import int_at_least


@attrs.define
class LookupOrDraft:
    """Two proposers in one: prompt lookup where it matches strongly, a draft model otherwise, each with its own
    cost-aware width policy.

    Per call: the lookup's draft is taken when its match is at least ``strong_ngram`` tokens long and its policy
    expects at least as many committed tokens per unit of target time as the drafter's (``expected_rate`` at each
    policy's best width); otherwise the drafter drafts ``drafter_policy.width()`` tokens. Each policy prices its
    source (``draft_cost``: 0 for lookup, the head's step for the drafter) and learns only from its source's drafts:
    what was committed of the previous draft is read off the next context (it extends the previous one by the
    accepted tokens, then the target's own pick). Widths are capped by the driver's ``width``, so the driver's own
    policy should only cap (a ``FixedWidth`` of the largest width). Until :meth:`price` gives the policies, each
    source drafts up to the driver's width.
    """

    lookup: PromptLookup
    drafter: Proposer
    lookup_policy: CostAwareWidth | None = None
    drafter_policy: CostAwareWidth | None = None
    strong_ngram: int = attrs.field(default=3, validator=int_at_least(1))
    lookup_drafts: int = 0  # calls answered by each source (statistics)
    drafter_drafts: int = 0
    _last: tuple[int, tuple[int, ...], bool] | None = None  # (context length, draft, from lookup)

    def price(self, lookup_policy: CostAwareWidth, drafter_policy: CostAwareWidth) -> None:
        """Set each source's width policy (made from the backend's measured costs)."""
        self.lookup_policy, self.drafter_policy = lookup_policy, drafter_policy

    def propose(self, context_tokens: Sequence[int], width: int) -> tuple[int, ...]:
        self._observe(context_tokens)
        draft, matched = self.lookup.match(context_tokens, width)
        use_lookup = (
            bool(draft) and matched >= self.strong_ngram and _rate(self.lookup_policy) >= _rate(self.drafter_policy)
        )
        if use_lookup:
            draft = draft[: _width(self.lookup_policy, width)]
            self.lookup_drafts += 1
        else:
            k = _width(self.drafter_policy, width)
            draft = tuple(self.drafter.propose(context_tokens, k))[:k] if k > 0 else ()
            self.drafter_drafts += 1
        self._last = (len(context_tokens), draft, use_lookup)
        return draft

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
        if from_lookup and self.lookup_policy is not None:
            self.lookup_policy = self.lookup_policy.observe(len(draft), accepted)
        elif not from_lookup and self.drafter_policy is not None:
            self.drafter_policy = self.drafter_policy.observe(len(draft), accepted)


def _rate(policy: CostAwareWidth | None) -> float:
    return policy.expected_rate(policy.best_width()) if policy is not None else 0.0


def _width(policy: CostAwareWidth | None, cap: int) -> int:
    return min(cap, policy.width()) if policy is not None else cap
