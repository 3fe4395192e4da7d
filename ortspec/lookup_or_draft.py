"""``speculative="auto"``: per draft, prompt lookup or a draft model (the shared-KV drafter), whichever has earned more.

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
    """Prompt lookup or a draft model, chosen per draft by what each has earned, each with its own cost-aware width
    policy.

    Three sources learn their acceptance apart: lookup drafts from a strong match (a context suffix of at least
    ``strong_ngram`` tokens found earlier), lookup drafts from a weak match, and the drafter. Per call: when prompt
    lookup has a draft, it is taken if its source's policy (strong or weak, by the match's length) expects at least
    as many committed tokens per unit of target time as the drafter's (``expected_rate`` at each policy's best
    width); otherwise the drafter drafts ``drafter_policy.width()`` tokens. So on text that copies its prompt the
    lookup wins even on short matches, and on open-ended text, where short matches rarely hold, the drafter does.
    Each policy prices its source (``draft_cost``: 0 for lookup, the head's step for the drafter) and learns only
    from its own drafts: what was committed of the previous draft is read off the next context (it extends the
    previous one by the accepted tokens, then the target's own pick). Widths are capped by the driver's ``width``,
    so the driver's own policy should only cap (a ``FixedWidth`` of the largest width). Until :meth:`price` gives
    the policies, lookup drafts whenever it has a draft and each source drafts up to the driver's width.
    """

    lookup: PromptLookup
    drafter: Proposer
    lookup_policy: CostAwareWidth | None = None  # strong matches
    weak_lookup_policy: CostAwareWidth | None = None
    drafter_policy: CostAwareWidth | None = None
    strong_ngram: int = attrs.field(default=3, validator=int_at_least(1))
    lookup_drafts: int = 0  # calls answered by each source (statistics)
    drafter_drafts: int = 0
    _last: tuple[int, tuple[int, ...], str] | None = None  # (context length, draft, source)

    def price(self, lookup_policy: CostAwareWidth, drafter_policy: CostAwareWidth) -> None:
        """Set the sources' width policies (made from the backend's measured costs): ``lookup_policy`` for both
        kinds of lookup match, ``drafter_policy`` for the drafter."""
        self.lookup_policy = self.weak_lookup_policy = lookup_policy
        self.drafter_policy = drafter_policy

    def propose(self, context_tokens: Sequence[int], width: int) -> tuple[int, ...]:
        self._observe(context_tokens)
        draft, matched = self.lookup.match(context_tokens, width)
        source = "strong" if matched >= self.strong_ngram else "weak"
        policy = self.lookup_policy if source == "strong" else self.weak_lookup_policy
        if draft and _rate(policy) >= _rate(self.drafter_policy):
            draft = draft[: _width(policy, width)]
            self.lookup_drafts += 1
        else:
            source = "drafter"
            k = _width(self.drafter_policy, width)
            draft = tuple(self.drafter.propose(context_tokens, k))[:k] if k > 0 else ()
            self.drafter_drafts += 1
        self._last = (len(context_tokens), draft, source)
        return draft

    def _observe(self, context_tokens: Sequence[int]) -> None:
        """Tell the previous draft's policy how many of its tokens the context now shows committed."""
        if self._last is None:
            return
        length, draft, source = self._last
        self._last = None
        if len(context_tokens) <= length:
            return  # not a continuation of the previous call's context
        new = context_tokens[length : length + len(draft)]
        accepted = next(
            (i for i, (a, b) in enumerate(zip(draft, new, strict=False)) if a != b), min(len(draft), len(new))
        )
        name = {"strong": "lookup_policy", "weak": "weak_lookup_policy", "drafter": "drafter_policy"}[source]
        policy = getattr(self, name)
        if policy is not None:
            setattr(self, name, policy.observe(len(draft), accepted))


def _rate(policy: CostAwareWidth | None) -> float:
    return policy.expected_rate(policy.best_width()) if policy is not None else 0.0


def _width(policy: CostAwareWidth | None, cap: int) -> int:
    return min(cap, policy.width()) if policy is not None else cap
