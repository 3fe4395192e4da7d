"""A prompt and its options made ready for the Engine's scheduler: ``Request`` and ``make_request``, the one path every
surface takes (``Engine.generate`` and the rest, the server, ``ortspec batch``).

    ids, options  = engine.prepare(prompt, generation_options)      checked; a seed drawn when sampling without one
    proposer, width = core.speculative.speculation(name, draft_width, sources, prices)   the one factory
    proposer = core.forced.forcing(proposer, ...)                   a grammar's forced tokens in front

The prices (the verify cost curve, the drafter's step) are measured once per model on this machine and kept on disk;
``make_request`` asks for them only when ``core.speculative.needs_prices`` says the options need them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import attrs

from ortspec.adapters.engine.options import GenerationOptions, Prompt
from ortspec.core import MAX_DRAFT, LookupOrDraft, PricedWidth, Proposer, WidthPolicy
from ortspec.core.forced import forcing
from ortspec.core.speculative import (
    DRAFT_MODEL_NAMES,
    DRAFTER_NAMES,
    SUFFIX_NAMES,
    Sources,
    check_sources,
    needs_prices,
    speculation,
)
from ortspec.core.state import Options
from ortspec.results import FinishCallback

if TYPE_CHECKING:
    from ortspec.adapters.engine.engine import Engine


class Request(NamedTuple):
    """One prompt made ready for the scheduler: what ``BatchScheduler.submit`` takes for it. ``reads_pass_price``:
    its speculation reads the price of a plain step in the pass it joins (a ``PricedWidth`` policy, or ``"auto"``'s
    sources, each priced by its own); ``reads_target_state``: its proposer drafts with the Engine's drafter, which
    reads the target's state in the sequence's slot."""

    ids: list[int]
    options: Options
    proposer: Proposer | None
    draft_width: int | WidthPolicy
    on_finish: FinishCallback  # records the finished output in the Engine's suffix cache (``Engine.record_output``)
    reads_pass_price: bool = False
    reads_target_state: bool = False


def make_request(engine: Engine, prompt: Prompt, options: GenerationOptions) -> Request:
    """``prompt`` with ``options`` made ready for ``engine`` (``ValueError`` naming a bad prompt or option, before
    anything runs). A speculative request is priced on the Engine's measured prices when its options need them, and
    warns (once per Engine) when speculative output may differ from plain output on this model."""
    name = options.speculative
    drafter = engine.drafter if name in DRAFTER_NAMES else None
    snapshot = engine.suffix_cache.snapshot() if name in SUFFIX_NAMES else None
    max_draft = drafter.max_draft if drafter is not None else MAX_DRAFT
    draft_model = engine.draft_model if name in DRAFT_MODEL_NAMES else None
    sources = Sources(
        snapshot=snapshot, rule=engine.suffix_rule, drafter=drafter, drafter_max_draft=max_draft,
        draft_model=draft_model, draft_model_max_draft=draft_model.max_draft if draft_model is not None else MAX_DRAFT,
    )  # fmt: skip
    check_sources(name, sources)
    ids, core_options = engine.prepare(prompt, options)
    sources = attrs.evolve(sources, context_tokens=len(ids))
    if name is not None:
        engine.measurements.warn_if_inexact()
    priced = needs_prices(name, options.draft_width)
    prices = engine.measurements.prices() if priced else None
    proposer, width = speculation(name, options.draft_width, sources, prices)
    reads_price = priced or isinstance(width, PricedWidth)
    reads_target = drafter is not None and drafts_with(proposer, drafter)
    forced = forcing(proposer, core_options, len(ids))
    return Request(ids, core_options, forced, width, engine.record_output, reads_price, reads_target)


def drafts_with(proposer: Proposer | None, drafter: Proposer) -> bool:
    """Whether ``proposer`` is ``drafter`` or ``"auto"``'s pair holding it."""
    return proposer is drafter or (isinstance(proposer, LookupOrDraft) and proposer.drafter is drafter)
