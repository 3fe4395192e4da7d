"""``speculative="auto"``: per draft, prompt lookup or a model (the shared-KV drafter, a separate draft model),
whichever has earned more.

A frozen value that learns like a width policy (``core.proposers.Learner``): ``propose`` is a pure function of the
value and the draft's context, and the driver replaces the value with ``observe(context, draft, accepted)`` after
each verified draft. It only chooses which draft to verify; the core checks every draft token against the target, so
the output never depends on this value, only the speed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs

from .checks import int_at_least
from .proposers import DraftContext, PromptLookup, Proposer
from .suffix import SuffixProposer
from .tree import DraftTree
from .width import CostAwareWidth

_POLICY = {
    "strong": "lookup_policy",
    "weak": "weak_lookup_policy",
    "drafter": "drafter_policy",
    "draft_model": "draft_model_policy",
}
# The model sources, each named as the field that holds it.
_MODELS = ("drafter", "draft_model")


def _one_model(instance: Any, attribute: Any, value: Any) -> None:
    if instance.drafter is None and value is None:
        raise ValueError("LookupOrDraft needs a drafter or a draft_model")


@attrs.frozen
class LookupOrDraft:
    """Prompt lookup or a model, chosen per draft by what each has earned, each with its own cost-aware width
    policy. The models: ``drafter`` (the shared-KV head, reading the target's state), ``draft_model`` (a separate
    draft model with its own KV), or both; at least one.

    The sources learn their acceptance apart: lookup drafts from a strong match (a context suffix of at least
    ``strong_ngram`` tokens found earlier), lookup drafts from a weak match, the drafter and the draft model. Per
    call, the model is the one whose policy expects more committed tokens per unit of target time (``expected_rate``
    at its best width; the drafter on a tie, and unpriced); then, when prompt lookup has a draft, it is taken if its
    source's policy (strong or weak, by the match's length) expects at least as much as the model's; otherwise the
    model drafts ``width()`` tokens of its policy. So on text that copies its prompt the
    lookup wins even on short matches, and on open-ended text, where short matches rarely hold, the drafter does.
    Each policy prices its source (``draft_cost``: 0 for lookup, a model's step for a model) and learns only
    from its own drafts (``observe``), so a model that has not drafted keeps its prior rate and is tried when the
    other's falls below it. Widths are capped by the driver's ``width``, so the driver's own policy should
    only cap (a ``FixedWidth`` of the largest width). Unpriced (no policies; see :meth:`priced`), lookup drafts
    whenever it has a draft and each source drafts up to the driver's width. Where the target holds no state for
    the context (``DraftContext.slot`` None: after tokens drafted in front, such as a grammar's forced ones) the
    lookup is the source whenever it has a draft (as wide as its policy allows), since a draft head could not draft
    there. Under sampling a model drafts with the context's ``picker``; lookup drafts copy the context as they are.
    ``lookup_drafts``, ``drafter_drafts`` and ``draft_model_drafts`` count the verified drafts of each source.
    Trees: a source whose policy carries a tree budget (``CostAwareWidth.tree``) drafts as many nodes as that budget
    grants at the source's width (where the backend runs trees: ``DraftContext.nodes``), and after a tree step that
    budget learns what the tree brought (``observe_tree``, routed to ``drafted_by``, the policy of the source that
    drafted).

    **Strong matches learn while a model drafts.** A source that is not chosen learns nothing from its own
    drafts, so after a few misses a strong match could lose to a model for the rest of a request while long
    copies go by. So when a model drafts over a strong match, the match's draft is kept (``shadow``: the
    context's length then and the draft, uncut by the policy) and scored at the next ``observe`` against the
    tokens that step committed: its agreeing prefix is observed by the strong policy as a draft it verified (when
    the lookup agreed with every committed token, only those count, all accepted: the rest is unknown). Weak
    matches do not shadow: they are the models' own ground, where one right token in a shadow would draw drafts
    away from a better source.
    """

    lookup: PromptLookup | SuffixProposer
    drafter: Proposer | None
    lookup_policy: CostAwareWidth | None = None  # strong matches
    weak_lookup_policy: CostAwareWidth | None = None
    drafter_policy: CostAwareWidth | None = None
    strong_ngram: int = attrs.field(default=3, validator=int_at_least(1))
    lookup_drafts: int = 0
    drafter_drafts: int = 0
    shadow: tuple[int, tuple[int, ...]] | None = None  # (context length, a strong match's draft a model beat)
    drafted_by: str | None = None  # the policy field of the source that drafted the last observed draft
    draft_model: Proposer | None = attrs.field(default=None, validator=_one_model)
    draft_model_policy: CostAwareWidth | None = None
    draft_model_drafts: int = 0

    def priced(
        self,
        lookup_policy: CostAwareWidth,
        drafter_policy: CostAwareWidth | None,
        draft_model_policy: CostAwareWidth | None = None,
    ) -> LookupOrDraft:
        """This value with the sources' width policies (made from the backend's measured costs): ``lookup_policy``
        for both kinds of lookup match, ``drafter_policy`` for the drafter, ``draft_model_policy`` for the draft
        model (each None without its model); a policy's ``tree`` sizes its source's tree drafts."""
        return attrs.evolve(
            self,
            lookup_policy=lookup_policy,
            weak_lookup_policy=lookup_policy,
            drafter_policy=drafter_policy,
            draft_model_policy=draft_model_policy,
        )

    def _model(self) -> str:
        """The model source a draft would come from: the draft model when it expects more than the drafter (or
        there is no drafter), else the drafter."""
        if self.drafter is None:
            return "draft_model"
        if self.draft_model is not None and _rate(self.draft_model_policy) > _rate(self.drafter_policy):
            return "draft_model"
        return "drafter"

    def observe_tree(self, chain: int, chain_accepted: int, extra_nodes: int, extra_accepted: int) -> LookupOrDraft:
        """This value after a step's tree outcome (``core.width.TreeLearner``), which follows ``observe``: the
        policy of the source that drafted (``drafted_by``) learns it."""
        name = self.drafted_by
        policy: CostAwareWidth | None = getattr(self, name) if name is not None else None
        if name is None or policy is None or policy.tree is None:
            return self
        changes: dict[str, Any] = {name: policy.observe_tree(chain, chain_accepted, extra_nodes, extra_accepted)}
        return attrs.evolve(self, **changes)

    def _choose(self, context: DraftContext) -> tuple[str, tuple[int, ...], str]:
        """``(source, draft, match)`` for a draft in ``context``: the chosen source; the lookup's draft (uncut;
        ``()`` without one); and its match's kind, ``strong`` or ``weak`` (``weak`` without a draft)."""
        draft, matched = self.lookup.match(context.tokens, context.width)
        match = "strong" if draft and matched >= self.strong_ngram else "weak"
        policy: CostAwareWidth | None = getattr(self, _POLICY[match])
        model = self._model()
        if draft and (context.slot is None or _rate(policy) >= _rate(getattr(self, _POLICY[model]))):
            return match, draft, match
        return model, draft, match

    def propose(self, context: DraftContext) -> tuple[int, ...] | DraftTree:
        """The chosen source's draft (the source chosen by the sources' rates, which a cheaper plain step does not
        reorder), as wide as its policy's ``width_at(context.plain_cost)`` allows, so speculation fades as a batch
        fills."""
        source, draft, _ = self._choose(context)
        policy: CostAwareWidth | None = getattr(self, _POLICY[source])
        k = _width(policy, context)
        nodes = _nodes(policy, context, k)
        if source not in _MODELS:
            if isinstance(self.lookup, SuffixProposer) and nodes is not None and nodes > k > 0:
                narrow = attrs.evolve(context, width=k, nodes=nodes)  # the lookup's tree, its first branch k deep
                return self.lookup.branched(narrow, self.lookup.scored(context.tokens, k))
            return draft[:k]
        if k <= 0:
            return ()
        drafted = getattr(self, source).propose(attrs.evolve(context, width=k, nodes=nodes))
        return drafted.cut(k if nodes is None else nodes) if isinstance(drafted, DraftTree) else tuple(drafted)[:k]

    def observe(self, context: DraftContext, draft: Sequence[int] | DraftTree, accepted: int) -> LookupOrDraft:
        """This value after ``accepted`` of ``draft`` (what ``propose(context)`` returned) were committed: the
        source that drafted it (the same choice ``propose`` made) learns it; an empty draft counts as an idle step
        of that source's policy. A strong match a model beat is kept to be scored at the next call (the class
        docstring's ``shadow``), and the one kept before is scored now. When another source drafted, the draft
        model's policy counts the step's committed tokens as unread (``CostAwareWidth.behind``)."""
        context_tokens = context.tokens
        learned = self._shadow_learned(context_tokens)
        source, lookup_draft, match = self._choose(context)
        name = _POLICY[source]
        policy: CostAwareWidth | None = getattr(learned, name)
        verified = 1 if draft else 0
        shadowed = source in _MODELS and match == "strong" and learned.lookup_policy is not None
        counter = f"{source}_drafts" if source in _MODELS else "lookup_drafts"
        changes: dict[str, Any] = {
            counter: getattr(self, counter) + verified,
            "shadow": (len(context_tokens), lookup_draft) if shadowed else None,
            "drafted_by": name,
        }
        if policy is not None:
            changes[name] = policy.observe(len(draft), accepted)
        if source != "draft_model" and learned.draft_model_policy is not None:
            changes["draft_model_policy"] = learned.draft_model_policy.behind(accepted + 1)
        return attrs.evolve(learned, **changes)

    def _shadow_learned(self, context_tokens: Sequence[int]) -> LookupOrDraft:
        """This value with its ``shadow`` (if any) scored against the tokens committed since: the strong policy
        observes the draft's agreeing prefix as verified (all of it when the lookup agreed with every committed
        token and had more: what followed is unknown)."""
        if self.shadow is None or self.lookup_policy is None:
            return self
        seen, draft = self.shadow
        committed = context_tokens[seen : seen + len(draft)]
        if not committed:
            return self
        agreed = next((i for i, (d, c) in enumerate(zip(draft, committed, strict=False)) if d != c), len(committed))
        proposed = agreed if agreed == len(committed) else len(draft)
        return attrs.evolve(self, lookup_policy=self.lookup_policy.observe(proposed, agreed))


def _rate(policy: CostAwareWidth | None) -> float:
    return policy.expected_rate(policy.best_width()) if policy is not None else 0.0


def _width(policy: CostAwareWidth | None, context: DraftContext) -> int:
    if policy is None:
        return context.width
    return min(context.width, policy.width_at(context.plain_cost, context.token_cost))


def _nodes(policy: CostAwareWidth | None, context: DraftContext, width: int) -> int | None:
    """The most nodes a source's tree ``width`` deep may have in ``context``: None where the backend runs no trees
    (``context.nodes`` None); the context's cap unpriced; else what the policy's tree budget grants, within the
    cap."""
    if context.nodes is None or policy is None:
        return context.nodes
    return min(context.nodes, max(policy.nodes_at(width, context.plain_cost, context.token_cost), width))
