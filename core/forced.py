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
from .proposers import DraftContext, Learner, Proposer
from .tree import DraftTree


def forcing(proposer: Proposer | None, options: Options, prompt_len: int) -> Proposer | None:
    """The proposer of a speculative generation with ``options``: ``proposer`` with the grammar's forced tokens in
    front (``ForcedTokens``) when the options hold a grammar; unchanged otherwise, and None (plain decoding) stays
    None."""
    if proposer is None or options.grammar is None:
        return proposer
    return ForcedTokens(options.grammar, prompt_len, proposer)


@attrs.frozen
class ForcedTokens:
    """Drafts the tokens ``grammar`` forces after the generated tokens (``context.tokens[prompt_len:]``), then what
    ``inner`` (None: nothing) proposes after them (``DraftContext.after``: a context the target holds no state for,
    where a draft head drafts nothing), up to the width. A frozen ``Learner``: ``observe`` passes the inner
    proposer's share of a verified draft to it, when it learns.

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

    def propose(self, context: DraftContext) -> tuple[int, ...] | DraftTree:
        """The forced tokens, then the inner proposer's draft after them (its tree hung from the last forced
        token: ``DraftTree.after``)."""
        forced = self.forced(context.tokens)[: context.width]
        if len(forced) >= context.width or self.inner is None:
            return forced
        inner = self.inner.propose(context.after(forced) if forced else context)
        if isinstance(inner, DraftTree):
            return inner.after(forced)
        return forced + tuple(inner)

    def observe(self, context: DraftContext, draft: Sequence[int] | DraftTree, accepted: int) -> ForcedTokens:
        if not isinstance(self.inner, Learner):
            return self
        n = len(self.forced(context.tokens)[: context.width])
        if n >= context.width or accepted < n:
            return self  # nothing of the inner one's, or a stop rule ended the step before its draft was verified
        head, rest = (draft.tokens[:n], draft.below(n)) if isinstance(draft, DraftTree) else (draft[:n], draft[n:])
        inner = self.inner.observe(context.after(head) if n else context, rest, max(0, accepted - n))
        return attrs.evolve(self, inner=inner)
