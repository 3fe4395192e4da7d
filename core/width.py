"""Draft-width policies: how many draft tokens to verify in the next pass.

A policy is a frozen value with ``width() -> int`` (the most draft tokens it wants next; the driver still caps
it by the step's budget) and ``observe(proposed, accepted) -> policy`` (the policy after a step that verified
``proposed`` draft tokens, of which ``accepted`` were committed; a plain step observes ``(0, 0)``). A policy
only changes how many tokens are verified, never which tokens are committed.

**Priced by the pass it joins.** Alone, a plain step costs 1 (the unit of ``pass_costs``). In a batched pass the
rows share the pass's time, so what a draft must beat is the batch's own rate: a plain row's price is its share of
the pass, ``mean_row_cost`` (a pass of ``n`` one-token rows ÷ ``n``, over the backend's measured ``decode_costs``).
A draft's price depends on the backend: where a row with a draft runs as a pass of its own (a batch backend that
cannot run multi-token rows after a past beside the others) it costs that pass, ``pass_costs[k]``; where the pass
carries it beside the others (a ragged batch backend) each draft token costs what one more row does,
``token_cost`` (``marginal_row_cost``), so a draft of ``k`` costs ``plain_cost + k * token_cost`` (``pass_cost``).
A policy that implements ``PricedWidth`` (``CostAwareWidth``) is asked ``width_at(plain_cost, token_cost)`` with
those prices, so speculation drafts in a batch exactly where it raises the batch's tokens per second.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Protocol, runtime_checkable

import attrs

from .checks import int_at_least, number_in
from .proposers import MAX_DRAFT

# The most of a sequence's time that probing a source that does not pay may take (``CostAwareWidth.probe_loss``).
PROBE_SHARE = 0.025


def acceptance_rate(accepted: int, proposed: int) -> float:
    """Accepted ÷ proposed draft tokens; 0.0 when nothing was proposed. The one definition."""
    return accepted / proposed if proposed else 0.0


@runtime_checkable
class WidthPolicy(Protocol):
    def width(self) -> int: ...

    def observe(self, proposed: int, accepted: int) -> WidthPolicy: ...


@runtime_checkable
class PricedWidth(Protocol):
    """A width policy that prices a plain step by the pass it joins (see the module docstring)."""

    def width_at(self, plain_cost: float, token_cost: float | None = None) -> int: ...


@runtime_checkable
class TreeLearner(Protocol):
    """A value that learns what a step's tree brought: ``observe_tree(chain, chain_accepted, extra_nodes,
    extra_accepted)`` is the value after a step whose draft's first branch had ``chain`` tokens, ``chain_accepted``
    of them committed, and whose other nodes (``extra_nodes``) committed ``extra_accepted`` more (a chain: 0, 0)."""

    def observe_tree(self, chain: int, chain_accepted: int, extra_nodes: int, extra_accepted: int) -> Any: ...


@runtime_checkable
class TreeWidth(Protocol):
    """A width policy that also sizes tree drafts: ``nodes_at(width, plain_cost, token_cost)``, the most nodes a tree
    ``width`` deep may have (``width`` or more) in a pass priced as ``pass_cost`` prices it, and ``observe_tree``
    (``TreeLearner``)."""

    def nodes_at(self, width: int, plain_cost: float = 1.0, token_cost: float | None = None) -> int: ...

    def observe_tree(self, chain: int, chain_accepted: int, extra_nodes: int, extra_accepted: int) -> Any: ...


def tree_nodes(policy: WidthPolicy, width: int, plain_cost: float = 1.0, token_cost: float | None = None) -> int:
    """The most nodes a tree draft ``width`` deep may have under ``policy`` in a pass where a plain step costs
    ``plain_cost`` and a draft token ``token_cost`` (as for ``pass_cost``): its ``nodes_at`` for a ``TreeWidth``,
    ``width`` otherwise (the branches share a chain's budget)."""
    if not isinstance(policy, TreeWidth) or width <= 0:
        return width
    return max(policy.nodes_at(width, plain_cost, token_cost), width)


def _check_costs(instance: object, attribute: object, value: tuple[float, ...]) -> None:
    if len(value) < 2 or any(not (c > 0) for c in value):
        raise ValueError(f"pass_costs must hold >= 2 positive costs (index = draft width), got {value!r}")


def _to_costs(value: Iterable[float]) -> tuple[float, ...]:
    return tuple(value)


@attrs.frozen
class TreeBudget:
    """How many nodes a tree draft gets beyond its first branch, priced by the pass they join.

    A tree's first branch is the chain the width policy sized (``width`` deep); its other nodes make the pass
    longer (``pass_costs[n]`` for ``n`` nodes, the curve of ``CostAwareWidth``) and add the tokens accepted past
    where the first branch stopped. Two exponentially weighted estimates (``decay``) learn both: ``chain_tokens /
    chain_passes``, the tokens a pass commits along its first branch (its accepted draft tokens + the bonus), and
    ``branch_tokens / branch_nodes``, the tokens the other branches added per node they took. ``nodes_at(width)`` is
    the node count ``n`` in ``[width, min(width * max_branches, len(pass_costs) - 1)]`` with the most expected tokens
    per cost, ``(chain + gain * (n - width)) / pass_cost(pass_costs, n, plain_cost, token_cost)``: alone, the verify
    cost curve's ``pass_costs[n]``; in a batch, the pass's price of ``n`` draft rows beside the others (a tree row
    shares the batch's run as a chain does). ``width`` (a chain) where branches do not pay. While
    at a chain it probes with twice the width every ``probe_every`` drafted steps, so that it notices when branches
    start to pay. It changes how many tokens are verified, never which are committed.
    """

    pass_costs: tuple[float, ...] = attrs.field(converter=_to_costs, validator=_check_costs)
    max_branches: int = attrs.field(default=4, validator=int_at_least(1))
    decay: float = attrs.field(default=0.85, validator=number_in(0, 1))
    chain_tokens: float = 2.0
    chain_passes: float = 1.0
    branch_tokens: float = 1.0
    branch_nodes: float = 8.0
    probe_every: int = attrs.field(default=16, validator=int_at_least(1))
    idle_steps: int = 0

    def gain(self) -> float:
        """The tokens the other branches add per node they take (estimated)."""
        return self.branch_tokens / self.branch_nodes if self.branch_nodes > 0 else 0.0

    def nodes_at(self, width: int, plain_cost: float = 1.0, token_cost: float | None = None) -> int:
        top = min(len(self.pass_costs) - 1, width * self.max_branches)
        if width < 1 or top <= width:
            return width
        chain = self.chain_tokens / self.chain_passes if self.chain_passes > 0 else 1.0
        gain = self.gain()

        def rate(n: int) -> tuple[float, int]:
            return (chain + gain * (n - width)) / pass_cost(self.pass_costs, n, plain_cost, token_cost), -n

        best = max(range(width, top + 1), key=rate)
        if best == width and self.idle_steps + 1 >= self.probe_every:
            return min(top, 2 * width)
        return best

    def observe(self, chain: int, chain_accepted: int, extra_nodes: int, extra_accepted: int) -> TreeBudget:
        """The budget after a step whose draft's first branch had ``chain`` tokens, ``chain_accepted`` of them
        committed, and whose other branches had ``extra_nodes`` nodes that committed ``extra_accepted`` tokens past
        it (a chain: 0 and 0). A plain step (``chain`` 0) changes nothing."""
        if chain == 0:
            return self
        d = self.decay
        branched = extra_nodes > 0
        return attrs.evolve(
            self,
            chain_tokens=self.chain_tokens * d + chain_accepted + 1,
            chain_passes=self.chain_passes * d + 1,
            branch_tokens=self.branch_tokens * d + extra_accepted if branched else self.branch_tokens,
            branch_nodes=self.branch_nodes * d + extra_nodes if branched else self.branch_nodes,
            idle_steps=0 if branched else self.idle_steps + 1,
        )


def width_policy(draft_width: int | WidthPolicy) -> WidthPolicy:
    """``draft_width`` as a policy: a policy as it is; an int ``k``, ``FixedWidth(k)``."""
    return draft_width if isinstance(draft_width, WidthPolicy) else FixedWidth(draft_width)


def asked_width(policy: WidthPolicy, plain_cost: float, token_cost: float | None = None) -> int:
    """The width ``policy`` asks for in a pass where a plain step costs ``plain_cost`` (1.0 alone) and a draft token
    ``token_cost`` (None: a draft row runs as a pass of its own): a ``PricedWidth`` policy's ``width_at``, any
    other's ``width()``."""
    if isinstance(policy, PricedWidth):
        return policy.width_at(plain_cost, token_cost)
    return policy.width()


def pass_cost(pass_costs: Sequence[float], k: int, plain_cost: float = 1.0, token_cost: float | None = None) -> float:
    """What a pass over the pending token and ``k`` draft tokens costs, in plain steps alone (the module docstring):
    ``pass_costs[0] * plain_cost`` for ``k = 0``; else ``pass_costs[k]`` (the row runs as a pass of its own), or,
    where the pass batches draft rows (``token_cost`` given) and a row costs less than a step alone, at most
    ``plain_cost + k * token_cost``."""
    if k == 0:
        return pass_costs[0] * plain_cost
    if token_cost is not None and plain_cost < 1.0:
        return min(pass_costs[k], plain_cost + k * token_cost)
    return pass_costs[k]


def marginal_row_cost(decode_costs: Sequence[float], rows: int) -> float:
    """What one more one-token row costs in a pass of ``rows`` one-token rows (it included), in units of a plain
    step alone: ``decode_costs[rows] - decode_costs[rows - 1]``, where ``decode_costs[n]`` is the time of a pass of
    ``n`` one-token rows ÷ the time of one alone (``decode_costs[0]`` = 0, ``decode_costs[1]`` = 1; rows past the
    curve cost its last step). 1.0 for ``rows <= 1``: alone, a plain step is the unit. Never below 0.01 (a
    measured curve is noisy; a row is never free)."""
    if rows <= 1 or len(decode_costs) < 2:
        return 1.0
    n = min(rows, len(decode_costs) - 1)
    return max(0.01, float(decode_costs[n]) - float(decode_costs[n - 1]))


def mean_row_cost(decode_costs: Sequence[float], rows: int) -> float:
    """A one-token row's share of a pass of ``rows`` one-token rows, in units of a plain step alone:
    ``decode_costs[rows] / rows`` (``decode_costs`` as for ``marginal_row_cost``; rows past the curve: the last
    point's share less the curve's last step for each row past it, which the marginal cost prices). 1.0 for
    ``rows <= 1``. Never below ``marginal_row_cost`` (a row never costs less than adding it)."""
    marginal = marginal_row_cost(decode_costs, rows)
    if rows <= 1 or len(decode_costs) < 2:
        return 1.0
    last = len(decode_costs) - 1
    n = min(rows, last)
    total = float(decode_costs[n]) + (rows - n) * marginal
    return max(marginal, total / rows)


@attrs.frozen
class FixedWidth:
    """Always the same width; trees sized by ``tree`` (None: a tree's branches share the width's budget)."""

    draft_width: int = attrs.field(validator=int_at_least(1))
    tree: TreeBudget | None = None

    def width(self) -> int:
        return self.draft_width

    def observe(self, proposed: int, accepted: int) -> FixedWidth:
        return self

    def nodes_at(self, width: int, plain_cost: float = 1.0, token_cost: float | None = None) -> int:
        return width if self.tree is None else self.tree.nodes_at(width, plain_cost, token_cost)

    def observe_tree(self, chain: int, chain_accepted: int, extra_nodes: int, extra_accepted: int) -> FixedWidth:
        if self.tree is None:
            return self
        return attrs.evolve(self, tree=self.tree.observe(chain, chain_accepted, extra_nodes, extra_accepted))


def _check_cost(instance: object, attribute: Any, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value < float("inf"):
        raise ValueError(f"{attribute.name} must be a finite number >= 0, got {value!r}")


@attrs.frozen
class CostAwareWidth:
    """Pick the width that maximises expected committed tokens per unit of target time.

    ``pass_costs[k]`` is the time of one target pass over the pending token plus ``k`` draft tokens, relative to
    a plain step (``pass_costs[0]`` = 1.0); the curve is measured on the backend
    (``ortspec.adapters.engine.measurements.measure_pass_costs``)
    and its length - 1 bounds the width. The draft-token acceptance probability ``p`` is an exponentially
    weighted estimate over recent steps: a step that verified ``k`` tokens and committed ``a`` of them counts
    ``a`` successes in ``a + (a < k)`` trials. With a geometric run length, a pass of width ``k`` commits
    ``(1 - p**(k + 1)) / (1 - p)`` tokens on average and costs ``pass_costs[k] + k * draft_cost``, where
    ``draft_cost`` is the proposer's time per draft token relative to a plain step (0 for prompt lookup; a draft
    head's step for a shared-KV drafter); the policy picks the ``k`` with the best tokens per cost, which is 0
    (plain steps) when speculation does not pay. While at 0 it probes with ``probe_width`` every
    ``probe_every`` steps so that it notices when drafts start to match again.

    **A source that reads before it drafts.** A draft model keeps its own KV, so before it drafts it must read the
    context tokens it has not read (the prompt, at its first draft; every token committed while it did not draft):
    ``read_cost`` is its time per such token relative to a plain step (0 for a source that reads nothing: lookup, a
    head reading the target's state), ``unread`` how many it has not read, as the policy counts them (one more per
    plain step, ``behind`` for tokens another source drafted; after its own draft, the bonus token, and the last
    draft token when all were accepted). The tokens a draft model feeds in drafting are priced in ``draft_cost``; the
    reading, once per return from idling, is paid by a probe (``catch_up``).

    **Probes are priced too.** A probe's expected loss (``probe_loss``: its pass, draft tokens and catch-up, less
    the plain steps that would commit its expected tokens) may take at most ``PROBE_SHARE`` of the sequence's time,
    so a source whose probe costs more is probed less often, and one whose catch-up has grown past what that share
    buys is not probed again.

    In a batched pass (``width_at(plain_cost, token_cost)``, a ``PricedWidth``) a plain step costs ``plain_cost``
    instead of 1 and a pass with a draft ``pass_cost(...) + k * draft_cost``; probes are spaced so that
    they cost the same share of the sequence's time as alone (``probe_interval``). ``tree`` sizes tree drafts
    (``TreeWidth``; None: a tree's branches share the width's budget).
    """

    pass_costs: tuple[float, ...] = attrs.field(converter=_to_costs, validator=_check_costs)
    decay: float = attrs.field(default=0.85, validator=number_in(0, 1))
    successes: float = 1.0
    trials: float = 2.0
    probe_every: int = attrs.field(default=8, validator=int_at_least(1))
    probe_width: int = attrs.field(default=2, validator=int_at_least(1))
    idle_steps: int = 0
    draft_cost: float = attrs.field(default=0.0, validator=_check_cost)
    tree: TreeBudget | None = None
    read_cost: float = attrs.field(default=0.0, validator=_check_cost)
    unread: int = attrs.field(default=0, validator=int_at_least(0))

    def acceptance(self) -> float:
        return self.successes / self.trials if self.trials > 0 else 0.0

    def expected_tokens(self, k: int) -> float:
        """Expected committed tokens of a pass of width ``k`` (its accepted drafts and its own pick), with a geometric
        run length at the acceptance estimate: ``(1 - p**(k + 1)) / (1 - p)``."""
        p = min(self.acceptance(), 0.999)
        return (1.0 - p ** (k + 1)) / (1.0 - p)

    def expected_rate(self, k: int, plain_cost: float = 1.0, token_cost: float | None = None) -> float:
        """Expected committed tokens per unit cost for a pass of width ``k`` (priced by ``pass_cost``)."""
        cost = pass_cost(self.pass_costs, k, plain_cost, token_cost)
        if k == 0:
            return 1.0 / cost
        return self.expected_tokens(k) / (cost + k * self.draft_cost)

    def best_width(self, plain_cost: float = 1.0, token_cost: float | None = None) -> int:
        rates = [self.expected_rate(k, plain_cost, token_cost) for k in range(len(self.pass_costs))]
        return max(range(len(rates)), key=lambda k: (rates[k], -k))

    def catch_up(self) -> float:
        """What reading the unread context costs before the next draft, in plain steps alone: ``read_cost`` for each
        unread token but the last (which the first draft step feeds, priced in ``draft_cost``)."""
        return self.read_cost * max(self.unread - 1, 0)

    def probe_loss(self, plain_cost: float = 1.0) -> float:
        """A probe's expected cost beyond the plain steps (at ``plain_cost`` each) that would commit the tokens it is
        expected to commit, in plain steps alone: its pass of ``probe_width`` draft tokens as a pass of its own, its
        draft tokens and its ``catch_up``; never below 0."""
        width = min(self.probe_width, len(self.pass_costs) - 1)
        cost = self.pass_costs[width] + width * self.draft_cost + self.catch_up()
        return max(cost - self.expected_tokens(width) * plain_cost, 0.0)

    def probe_interval(self, plain_cost: float = 1.0) -> float:
        """Plain steps between probes while the best width is 0: ``probe_every`` alone; with a cheaper plain step,
        longer, so that a probe's extra cost (its pass over the plain step it replaces) is the same share of the
        sequence's time as alone (the extra cost alone floored at 0.05 of a step); and never so short that the
        probes' expected loss (``probe_loss``) takes more than ``PROBE_SHARE`` of the sequence's time."""
        budgeted = self.probe_loss(plain_cost) / (PROBE_SHARE * plain_cost)
        if plain_cost >= 1.0:
            return max(float(self.probe_every), budgeted)
        probe = self.pass_costs[min(self.probe_width, len(self.pass_costs) - 1)] + self.probe_width * self.draft_cost
        extra_alone = max(probe - 1.0, 0.05)
        return max(self.probe_every * (probe - plain_cost) / (extra_alone * plain_cost), budgeted)

    def width(self) -> int:
        return self.width_at(1.0)

    def width_at(self, plain_cost: float, token_cost: float | None = None) -> int:
        """The width for a pass in which a plain step of this sequence costs ``plain_cost`` (1.0 alone) and a draft
        token ``token_cost`` (None: a draft row runs as a pass of its own; ``pass_cost``)."""
        k = self.best_width(plain_cost, token_cost)
        if k == 0 and self.idle_steps + 1 >= self.probe_interval(plain_cost):
            return min(self.probe_width, len(self.pass_costs) - 1)
        return k

    def nodes_at(self, width: int, plain_cost: float = 1.0, token_cost: float | None = None) -> int:
        """The most nodes of a tree ``width`` deep: ``tree``'s choice (None: ``width``)."""
        return width if self.tree is None else self.tree.nodes_at(width, plain_cost, token_cost)

    def observe_tree(self, chain: int, chain_accepted: int, extra_nodes: int, extra_accepted: int) -> CostAwareWidth:
        """The policy after a tree step: ``tree`` learns it (``TreeBudget.observe``); the acceptance estimate
        learns from the first branch alone (``observe(chain, chain_accepted)``, the driver's call)."""
        if self.tree is None:
            return self
        return attrs.evolve(self, tree=self.tree.observe(chain, chain_accepted, extra_nodes, extra_accepted))

    def observe(self, proposed: int, accepted: int) -> CostAwareWidth:
        if proposed == 0:
            return attrs.evolve(self, idle_steps=self.idle_steps + 1, unread=self.unread + 1)
        trials = accepted + (1 if accepted < proposed else 0)
        return attrs.evolve(
            self,
            successes=self.successes * self.decay + accepted,
            trials=self.trials * self.decay + trials,
            idle_steps=0,
            unread=2 if accepted == proposed else 1,
        )

    def behind(self, tokens: int) -> CostAwareWidth:
        """This policy after ``tokens`` were committed that its source did not read (another source drafted them)."""
        return attrs.evolve(self, unread=self.unread + tokens)


@attrs.frozen
class AdditiveWidth:
    """The +2 / -1 schedule of Hugging Face assisted generation: after a step whose draft was fully accepted the
    width grows by ``grow``, after any rejection it shrinks by ``shrink`` (never below ``minimum``)."""

    current: int = attrs.field(default=4, validator=int_at_least(1))
    maximum: int = attrs.field(default=MAX_DRAFT, validator=int_at_least(1))
    minimum: int = attrs.field(default=1, validator=int_at_least(1))
    grow: int = attrs.field(default=2, validator=int_at_least(0))
    shrink: int = attrs.field(default=1, validator=int_at_least(0))

    def width(self) -> int:
        return self.current

    def observe(self, proposed: int, accepted: int) -> AdditiveWidth:
        if proposed == 0:
            return self
        if accepted == proposed:
            return attrs.evolve(self, current=min(self.maximum, self.current + self.grow))
        return attrs.evolve(self, current=max(self.minimum, self.current - self.shrink))
