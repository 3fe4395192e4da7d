"""``Speculation``: one sequence's proposer and width policy as they stand, the draft for its next step and what they
learn from the step's outcome. The batch driver asks it once per decoding row; it decides nothing about tokens or
widths (``core.width.asked_width``, ``core.draft_width`` and ``core.take_draft`` do)."""

from __future__ import annotations

import attrs

from ortspec.core.proposers import DraftContext, Learner, Proposer
from ortspec.core.sampling import DraftPicker
from ortspec.core.state import DecodeState, draft_budget, draft_width, take_draft
from ortspec.core.tree import Draft, DraftTree
from ortspec.core.width import TreeLearner, WidthPolicy, asked_width, tree_nodes, width_policy
from ortspec.results import ProposerError


@attrs.frozen
class Speculation:
    """One sequence's proposer and width policy as they stand (a learning proposer and a width policy are values
    that learn), and ``picker``, the target's seeded pick rule when the generation samples (what a draft model
    drafts with: ``DraftContext.picker``): the draft for its next step, and what they learn from that step's
    outcome. Without a proposer every step is plain. ``trees``: the backend runs tree rows, so a proposer's
    ``DraftTree`` is verified whole (else its first branch is: ``core.take_draft``)."""

    proposer: Proposer | None
    policy: WidthPolicy
    picker: DraftPicker | None = None
    trees: bool = False

    @classmethod
    def of(
        cls, proposer: Proposer | None, draft_width: int | WidthPolicy, state: DecodeState, *, trees: bool = False
    ) -> Speculation:
        """``proposer`` for the generation of ``state``; ``draft_width``: the most draft tokens per pass, or a
        ``WidthPolicy`` choosing it per step; ``trees``: the backend runs tree rows."""
        sampling = state.options.sampling
        picker = DraftPicker(sampling, len(state.prompt_tokens)) if sampling.temperature > 0.0 else None
        return cls(proposer, width_policy(draft_width), picker, trees)

    def draft(
        self,
        state: DecodeState,
        vocab_size: int,
        plain_cost: float = 1.0,
        slot: int | None = None,
        token_cost: float | None = None,
    ) -> tuple[DraftContext | None, Draft]:
        """``(context, draft)`` for the next step from ``state``: the context the proposer was asked with (None
        when it was not asked: no proposer, or a width of 0, ``core.draft_width``) and its answer cut to the width
        (``core.take_draft``: a tree by node count, reduced to its first branch unless ``trees``). ``plain_cost``:
        what a plain step costs in the pass the step joins (1.0 alone; ``core.width.mean_row_cost`` in a batch);
        ``token_cost``: what a draft token costs where the pass runs a draft row beside the others (None: it runs
        as a pass of its own; ``core.width.pass_cost``); ``slot``: the slot holding the sequence's target state
        (``DraftContext.slot``, and the sequence's key, ``DraftContext.sequence``, which ``after`` keeps). Raises
        ``ProposerError`` when the proposer raises or proposes something that is not a draft."""
        if self.proposer is None:
            return None, ()
        width = draft_width(state, asked_width(self.policy, plain_cost, token_cost))
        if width == 0:
            return None, ()
        nodes = min(draft_budget(state), tree_nodes(self.policy, width, plain_cost, token_cost)) if self.trees else None
        tokens = state.context_tokens
        context = DraftContext(tokens, width, plain_cost, slot, self.picker, nodes, slot, token_cost)
        try:
            proposal = self.proposer.propose(context)
            return context, take_draft(state, proposal, width, vocab_size, trees=self.trees, nodes=nodes)
        except Exception as exc:
            raise ProposerError(f"the proposer {self.proposer!r} failed: {type(exc).__name__}: {exc}") from exc

    def observe(
        self, context: DraftContext | None, draft: Draft, accepted: int, kept_nodes: tuple[int, ...] = ()
    ) -> Speculation:
        """What both learn from the step over ``draft`` (asked with ``context``, None when the proposer was not
        asked) that accepted ``accepted`` draft tokens (a tree's along ``kept_nodes``, ``StepOutcome.kept_nodes``):
        a ``core.proposers.Learner`` (when it was asked) and the policy learn what the draft's first branch alone
        would have (a chain: the draft itself); a ``core.width.TreeLearner`` (either) also learns what the other
        branches added."""
        learned, chain_accepted = draft, accepted
        if isinstance(draft, DraftTree):
            first = draft.first_branch_nodes()
            agreed = next((d for d, (a, b) in enumerate(zip(kept_nodes, first, strict=False)) if a != b), len(first))
            learned, chain_accepted = tuple(draft.tokens[j] for j in first), min(accepted, agreed)
        tree = (len(learned), chain_accepted, len(draft) - len(learned), accepted - chain_accepted)
        proposer = self.proposer
        if isinstance(proposer, Learner) and context is not None:
            proposer = proposer.observe(context, learned, chain_accepted)
            if isinstance(proposer, TreeLearner):
                proposer = proposer.observe_tree(*tree)
        policy = self.policy.observe(len(learned), chain_accepted)
        if isinstance(policy, TreeLearner):
            policy = policy.observe_tree(*tree)
        return attrs.evolve(self, proposer=proposer, policy=policy)
