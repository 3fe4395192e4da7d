"""``Speculation``: one sequence's proposer and width policy as they stand, the draft for its next step and what they
learn from the step's outcome. The batch driver asks it once per decoding row; it decides nothing about tokens
(``core.draft_width`` and ``core.take_draft`` cut the draft)."""

from __future__ import annotations

import attrs

from ortspec.core.proposers import Learner, PricedProposer, Proposer, coupling
from ortspec.core.state import DecodeState, draft_width, take_draft
from ortspec.core.width import FixedWidth, PricedWidth, WidthPolicy
from ortspec.results import ProposerError


@attrs.frozen
class Speculation:
    """One sequence's proposer and width policy as they stand (a learning proposer and a width policy are values
    that learn): the draft for its next step, and what they learn from that step's outcome. Without a proposer
    every step is plain."""

    proposer: Proposer | None
    policy: WidthPolicy

    @classmethod
    def of(cls, proposer: Proposer | None, draft_width: int | WidthPolicy, state: DecodeState) -> Speculation:
        """``proposer`` for the generation of ``state`` (``with_proposer``); ``draft_width``: the most draft tokens
        per pass, or a ``WidthPolicy`` choosing it per step."""
        policy = draft_width if isinstance(draft_width, WidthPolicy) else FixedWidth(draft_width)
        return cls(None, policy).with_proposer(proposer, state)

    def with_proposer(self, proposer: Proposer | None, state: DecodeState) -> Speculation:
        """This width policy with ``proposer`` as the generation of ``state`` uses it: a draft model coupled to its
        seeded sampling when it samples (``core.proposers.coupling``)."""
        return Speculation(coupling(proposer, state.options, len(state.prompt_tokens)), self.policy)

    def draft(self, state: DecodeState, vocab_size: int, plain_cost: float = 1.0) -> tuple[int, tuple[int, ...]]:
        """``(width, draft)`` for the next step from ``state``: the width asked for (``core.draft_width``; 0 without a
        proposer) and the proposer's answer cut to it (``core.take_draft``; ``()`` when the width is 0). Raises
        ``ProposerError`` when the proposer raises or proposes something that is not a draft. ``plain_cost``: what a
        plain step costs in the pass the step joins (1.0 alone; ``core.width.marginal_row_cost`` in a batch), asked
        of a ``PricedWidth`` policy and a ``PricedProposer``."""
        if self.proposer is None:
            return 0, ()
        policy = self.policy
        asked = policy.width_at(plain_cost) if isinstance(policy, PricedWidth) else policy.width()
        width = draft_width(state, asked)
        if width == 0:
            return 0, ()
        try:
            if isinstance(self.proposer, PricedProposer):
                proposal = self.proposer.propose_at(state.context_tokens, width, plain_cost)
            else:
                proposal = self.proposer.propose(state.context_tokens, width)
            return width, take_draft(state, proposal, width, vocab_size)
        except Exception as exc:
            raise ProposerError(f"the proposer {self.proposer!r} failed: {type(exc).__name__}: {exc}") from exc

    def observe(self, state: DecodeState, width: int, draft: tuple[int, ...], accepted: int) -> Speculation:
        """What both learn from the step from ``state`` over ``draft`` (asked at ``width``) that accepted
        ``accepted`` draft tokens: the policy always, a ``core.proposers.Learner`` when it was asked for a draft."""
        proposer = self.proposer
        if isinstance(proposer, Learner) and width > 0:
            proposer = proposer.observe(state.context_tokens, width, draft, accepted)
        return Speculation(proposer, self.policy.observe(len(draft), accepted))
