"""What ``speculative`` means: the one table of names, the one default, and the one factory that maps a name (or a
proposer) and ``draft_width`` to a proposer and a width policy. Every surface (the library, the command line, the
server, batch, Ray) resolves ``speculative`` here, so a name drafts the same way wherever it is typed.

    proposer, width = speculation(speculative, draft_width, sources, prices)

``sources`` are what a name may draft from (the suffix cache's snapshot and its rule, the drafter); ``prices`` the
pass prices a cost-aware width policy needs (``needs_prices`` says when: measuring them is the caller's). Pure: no
I/O, no measuring, no process state.
"""

from __future__ import annotations

from typing import Any

import attrs

from .checks import ArgumentError
from .lookup_or_draft import LookupOrDraft
from .proposers import MAX_DRAFT, PromptLookup, Proposer
from .suffix import DraftRule, SuffixProposer, SuffixSnapshot
from .width import CostAwareWidth, FixedWidth, TreeBudget, WidthPolicy

# Every name ``speculative`` takes and what it drafts with.
SPECULATIVE_NAMES = {
    "prompt-lookup": "what followed the context's last 3 tokens earlier in the context",
    "suffix": "the most frequent continuation of the context's longest suffix match, in the context and in the "
    "Engine's recent outputs (its suffix cache)",
    "shared-kv": "the Engine's drafter",
    "draft-model": "the Engine's draft model (a smaller model of the same vocabulary, with its own KV)",
    "auto": "per draft, the suffix lookup, the drafter or the draft model, whichever has earned more (without a "
    "drafter or a draft model: the suffix lookup alone)",
}
SPECULATIVE_CHOICES = tuple(SPECULATIVE_NAMES)
# The names that draft with the drafter, and those that draft from the suffix cache.
DRAFTER_NAMES = ("shared-kv", "auto")
SUFFIX_NAMES = ("suffix", "auto")
# The names that draft with the draft model (when the Engine has one).
DRAFT_MODEL_NAMES = ("draft-model", "auto")
# What every surface drafts with unless told otherwise (chosen by measurement, alone and many at once:
# docs/bench/default-speculation.md). Exact output makes speculating by default safe: it changes only how fast
# the same tokens arrive.
DEFAULT_SPECULATIVE = "auto"
# The lookup "auto" drafts with: alone without a drafter, beside it with one (chosen by measurement:
# docs/suffix-cache.md).
AUTO_LOOKUP = "suffix"


def speculative_value(value: Any) -> Any:
    """``speculative`` as given: ``"none"`` (what a command line or a JSON record says) is ``None``, plain decoding;
    anything else is itself."""
    return None if value == "none" else value


def check_speculative(value: Any) -> None:
    """``ArgumentError`` naming ``speculative`` unless ``value`` is None, a name of ``SPECULATIVE_NAMES`` or a
    proposer (an object with ``propose(context)``: ``core.proposers.Proposer``)."""
    if value is None or value in SPECULATIVE_NAMES:
        return
    if isinstance(value, str):
        raise ArgumentError(
            "speculative", f"speculative={value!r}: expected None, 'none', one of {SPECULATIVE_CHOICES} or a proposer"
        )
    if not callable(getattr(value, "propose", None)):
        raise ArgumentError("speculative", f"speculative={value!r} has no propose(context) method")


@attrs.frozen
class Sources:
    """What a name drafts from: ``snapshot``, the suffix cache as the request starts (``"suffix"``, ``"auto"``'s
    lookup), by ``rule``; ``drafter``, a draft model reading the target (``"shared-kv"``, ``"auto"``; None when there
    is none), drafting at most ``drafter_max_draft`` tokens per pass; ``draft_model``, a separate draft model with
    its own KV (``"draft-model"``; ``backends/draft_model.py``; None when there is none), drafting at most
    ``draft_model_max_draft`` tokens per pass; ``context_tokens``, the request's context as it starts (its prompt),
    which a draft model reads before its first draft."""

    snapshot: SuffixSnapshot | None = None
    rule: DraftRule = attrs.field(factory=DraftRule)
    drafter: Proposer | None = None
    drafter_max_draft: int = MAX_DRAFT
    draft_model: Proposer | None = None
    draft_model_max_draft: int = MAX_DRAFT
    context_tokens: int = 0


def _costs(values: Any) -> tuple[float, ...]:
    return tuple(float(v) for v in values)


@attrs.frozen
class Prices:
    """A backend's measured prices: ``pass_costs[k]``, a pass over the pending token and ``k`` draft tokens ÷ a
    plain step (k = 0 .. the widest draft); ``draft_cost``, the drafter's time per draft token ÷ a plain step;
    ``draft_model_cost``, the draft model's time per draft token ÷ a plain step; ``draft_model_read_cost``, the draft
    model's time per context token it reads before drafting ÷ a plain step."""

    pass_costs: tuple[float, ...] = attrs.field(converter=_costs)
    draft_cost: float = 0.0
    draft_model_cost: float = 0.0
    draft_model_read_cost: float = 0.0


def check_sources(speculative: Any, sources: Sources) -> None:
    """``ArgumentError`` naming ``speculative`` when it is not a name or proposer (``check_speculative``), or names
    a source that is not there (``"shared-kv"`` without a drafter, ``"draft-model"`` without a draft model): what
    ``speculation`` refuses, checked before anything is measured."""
    check_speculative(speculative)
    if speculative == "shared-kv" and sources.drafter is None:
        raise ArgumentError(
            "speculative",
            "speculative='shared-kv' needs a drafter: train one with 'ortspec train-drafter' (Engine.from_dir finds "
            "it) or pass Engine.from_dir(..., drafter=DIR)",
        )
    if speculative == "draft-model" and sources.draft_model is None:
        raise ArgumentError(
            "speculative",
            "speculative='draft-model' needs a draft model: pass Engine.from_dir(..., draft_model=DIR) (--draft-model "
            "DIR), a model folder of the same vocabulary",
        )


def needs_prices(speculative: Any, draft_width: object) -> bool:
    """Whether ``speculation`` needs ``Prices`` for these options: a speculative request whose width is ``"auto"``,
    or ``"auto"`` (each of its sources is priced, whatever the width)."""
    return speculative is not None and (draft_width == "auto" or speculative == "auto")


def lookup(name: str, sources: Sources) -> PromptLookup | SuffixProposer:
    """The proposer of a name that drafts from the context alone: ``"prompt-lookup"`` (3-gram lookup, up to
    ``MAX_DRAFT`` tokens) or ``"suffix"`` (the suffix proposer over the context and ``sources.snapshot``)."""
    if name == "prompt-lookup":
        return PromptLookup(ngram=3, max_draft=MAX_DRAFT)
    assert name == "suffix", name
    return SuffixProposer(sources.rule, cache=sources.snapshot)


def speculation(
    speculative: Any, draft_width: int | WidthPolicy | str, sources: Sources, prices: Prices | None = None
) -> tuple[Proposer | None, int | WidthPolicy]:
    """The proposer and width policy a request starts with. ``speculative``: None (plain decoding), a name of
    ``SPECULATIVE_NAMES``, or a proposer (used as it is). ``draft_width``: ``"auto"`` (cost-aware on ``prices``), an
    int (the most draft tokens per pass; for ``"auto"``, a cap under each source's own priced policy) or a width
    policy. ``"auto"`` without a drafter or a draft model is ``AUTO_LOOKUP``; ``"shared-kv"`` without a drafter is
    refused (``ArgumentError``), as is ``"draft-model"`` without a draft model. ``prices`` must be given when
    ``needs_prices`` says so."""
    check_sources(speculative, sources)
    if speculative is None:
        return None, 1 if draft_width == "auto" else draft_width  # type: ignore[return-value]
    drafter = sources.drafter
    if speculative == "auto" and (drafter is not None or sources.draft_model is not None):
        auto = LookupOrDraft(lookup(AUTO_LOOKUP, sources), drafter, draft_model=sources.draft_model)
        return _auto(auto, draft_width, _priced(prices), sources)
    if speculative == "auto":
        speculative = AUTO_LOOKUP
    proposer = _named_source(speculative, sources)
    if isinstance(proposer, str):
        proposer = lookup(proposer, sources)
    assert proposer is not None
    if draft_width != "auto":
        return proposer, draft_width  # type: ignore[return-value]
    priced = _priced(prices)
    if proposer is drafter:
        return proposer, _drafter_policy(priced, sources)
    if proposer is sources.draft_model:
        return proposer, _draft_model_policy(priced, sources)
    return proposer, CostAwareWidth(priced.pass_costs, tree=_tree_budget(proposer, priced))


def _tree_budget(source: Any, prices: Prices) -> TreeBudget | None:
    """What sizes a source's tree drafts (``core.width.TreeBudget`` on the verify cost curve), for a source that
    drafts trees (``PromptLookup.branches``, ``DraftRule.branches`` or a drafter's ``branches`` above 1); None for
    one that drafts chains."""
    branches = source.rule.branches if isinstance(source, SuffixProposer) else getattr(source, "branches", 1)
    return TreeBudget(prices.pass_costs) if branches > 1 else None


def _named_source(speculative: Any, sources: Sources) -> Any:
    """The source a model-drafting name drafts with (``"shared-kv"``: the drafter; ``"draft-model"``: the draft
    model); any other value as it is."""
    if speculative == "shared-kv":
        return sources.drafter
    if speculative == "draft-model":
        return sources.draft_model
    return speculative


def _priced(prices: Prices | None) -> Prices:
    if prices is None:
        raise ValueError("speculation: these options need the backend's Prices (needs_prices)")
    return prices


def _drafter_policy(prices: Prices, sources: Sources) -> CostAwareWidth:
    """The drafter's cost-aware policy: the curve up to its widest draft, each draft token priced at its step; a
    tree budget on the whole curve where the drafter drafts trees."""
    return CostAwareWidth(
        prices.pass_costs[: sources.drafter_max_draft + 1],
        draft_cost=prices.draft_cost,
        tree=_tree_budget(sources.drafter, prices),
    )


def _draft_model_policy(prices: Prices, sources: Sources) -> CostAwareWidth:
    """The draft model's cost-aware policy: the curve up to its widest draft, each draft token priced at its step,
    and the request's context unread, each token priced at its read."""
    return CostAwareWidth(
        prices.pass_costs[: sources.draft_model_max_draft + 1],
        draft_cost=prices.draft_model_cost,
        read_cost=prices.draft_model_read_cost,
        unread=sources.context_tokens,
    )


def _auto(
    auto: LookupOrDraft, draft_width: int | WidthPolicy | str, prices: Prices, sources: Sources
) -> tuple[Proposer, int | WidthPolicy]:
    """``"auto"`` with a drafter or a draft model (or both): each source priced by its own policy; the request's width
    only caps them (the widest curve, or the int given)."""
    lookup = CostAwareWidth(prices.pass_costs, tree=_tree_budget(auto.lookup, prices))
    drafter = _drafter_policy(prices, sources) if auto.drafter is not None else None
    draft_model = _draft_model_policy(prices, sources) if auto.draft_model is not None else None
    priced = auto.priced(lookup, drafter, draft_model)
    if isinstance(draft_width, int):
        return priced, FixedWidth(draft_width)
    if draft_width == "auto":
        return priced, FixedWidth(len(prices.pass_costs) - 1)
    assert not isinstance(draft_width, str), draft_width
    return priced, draft_width
