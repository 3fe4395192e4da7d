"""Forced tokens as free drafts: where a grammar allows exactly one continuation, draft it.

Under a grammar (``core/constraint.py``) some stretches of the output are not the model's choice: a JSON object's
keys after ``{"``, the punctuation between fields, the rest of an enum value once its first token is out. Those
tokens are a draft that the target always accepts (the masked row allows nothing else), unless a stop rule ends the
generation first; so one pass commits them all, plus the model's next pick. ``ForcedTokens`` drafts them first and
lets any other proposer continue after them. Like every proposer, it can make decoding faster, never different.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from .constraint import Constraint, Grammar
from .options import Options
from .proposers import Couplable, Learner, Proposer, context_part
from .sampling import DraftPicker


def forcing(proposer: Proposer | None, options: Options, prompt_len: int) -> Proposer | None:
    """The proposer of a speculative generation with ``options``: ``proposer`` with the grammar's forced tokens in
    front (``ForcedTokens``) when the options hold a grammar; unchanged otherwise, and None (plain decoding) stays
    None."""
    if proposer is None or options.grammar is None:
        return proposer
    return ForcedTokens(options.grammar, prompt_len, proposer)


@attrs.frozen
class ForcedTokens:
    """Drafts the tokens ``grammar`` forces after the generated tokens (``context_tokens[prompt_len:]``), then what
    ``inner`` (None: nothing) proposes after them, up to the width; after forced tokens only what of ``inner``
    drafts from the context alone (``core.proposers.context_part``: not a draft head, which needs the target to
    have processed the whole context). A frozen ``Learner``: ``observe`` passes the inner proposer's share of a
    verified draft to it, when it learns.

    Cost: the grammar's forced tokens after each step's new tokens (the proposer keeps its own matcher, moved
    along the context as ``Constraint`` moves one); where tokens are forced and ``inner`` drafts after them, the
    inner proposer sees the context with them as a new tuple (O(context))."""

    grammar: Grammar
    prompt_len: int
    inner: Proposer | None = None
    _constraint: Constraint | None = attrs.field(default=None, eq=False, repr=False)

    def __attrs_post_init__(self) -> None:
        if self._constraint is None:
            object.__setattr__(self, "_constraint", Constraint(self.grammar.matcher()))

    def forced(self, context_tokens: Sequence[int]) -> tuple[int, ...]:
        """The tokens the grammar forces after ``context_tokens``."""
        assert self._constraint is not None
        return self._constraint.forced(context_tokens, self.prompt_len)

    def propose(self, context_tokens: Sequence[int], width: int) -> tuple[int, ...]:
        forced = self.forced(context_tokens)[:width]
        if len(forced) >= width or self.inner is None:
            return forced
        if not forced:
            return tuple(self.inner.propose(context_tokens, width))
        inner = context_part(self.inner)  # after forced tokens the target has not processed: not a draft head
        if inner is None:
            return forced
        return forced + tuple(inner.propose((*context_tokens, *forced), width - len(forced)))

    def coupled(self, picker: DraftPicker) -> ForcedTokens:
        """This value with its inner proposer coupled to a sampled generation (``core.proposers.Couplable``): the
        inner one drafts after the forced tokens, whose indexes and penalties ``picker`` counts from the context."""
        if not isinstance(self.inner, Couplable):
            return self
        return attrs.evolve(self, inner=self.inner.coupled(picker))

    def observe(self, context_tokens: Sequence[int], width: int, draft: Sequence[int], accepted: int) -> ForcedTokens:
        if not isinstance(self.inner, Learner):
            return self
        n = len(self.forced(context_tokens)[:width])
        if n >= width or (n and context_part(self.inner) is not self.inner):
            return self  # nothing of the inner one's, or only its context part drafted (which does not learn)
        after = (*context_tokens, *draft[:n]) if n else context_tokens
        inner = self.inner.observe(after, width - n, draft[n:], max(0, accepted - n))
        return attrs.evolve(self, inner=inner)
