"""A prompt and its options made ready for the Engine's scheduler: ``Request`` and ``make_request``, the one path every
surface takes (``Engine.generate`` and the rest, the server, ``ortspec batch``).

    ids, options  = engine.prepare(prompt, generation_options)      checked; a seed drawn when sampling without one
    proposer, width = core.speculative.speculation(name, draft_width, sources, prices)   the one factory
    proposer = bound to the slot the request takes (a drafter that reads the target), forced tokens in front

The prices (the verify cost curve, the drafter's step) are measured once per model on this machine and kept on disk;
``make_request`` asks for them only when ``core.speculative.needs_prices`` says the options need them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import attrs

from ortspec.adapters.engine.options import GenerationOptions, Prompt
from ortspec.batch_driver import SlotProposer
from ortspec.core import LookupOrDraft, PricedProposer, PricedWidth, Proposer, WidthPolicy
from ortspec.core.forced import forcing
from ortspec.core.speculative import DRAFTER_NAMES, SUFFIX_NAMES, Sources, check_sources, needs_prices, speculation
from ortspec.core.state import Options
from ortspec.results import FinishCallback

if TYPE_CHECKING:
    from collections.abc import Callable

    from ortspec.adapters.engine.engine import Engine


class Request(NamedTuple):
    """One prompt made ready for the scheduler: what ``BatchScheduler.submit`` takes for it."""

    ids: list[int]
    options: Options
    proposer: Proposer | SlotProposer | None
    draft_width: int | WidthPolicy
    on_finish: FinishCallback  # records the finished output in the Engine's suffix cache (``Engine.record_output``)

    @property
    def reads_pass_price(self) -> bool:
        """Whether its speculation reads the price of a plain step in the pass it joins (a ``PricedWidth`` policy,
        or ``"auto"``'s sources, each with its own)."""
        return isinstance(self.draft_width, PricedWidth) or isinstance(self.proposer, (SlotProposer, PricedProposer))


def make_request(engine: Engine, prompt: Prompt, options: GenerationOptions) -> Request:
    """``prompt`` with ``options`` made ready for ``engine`` (``ValueError`` naming a bad prompt or option, before
    anything runs). A speculative request is priced on the Engine's measured prices when its options need them, and
    warns (once per Engine) when speculative output may differ from plain output on this model."""
    name = options.speculative
    drafter = engine.drafter if name in DRAFTER_NAMES else None
    snapshot = engine.suffix_cache.snapshot() if name in SUFFIX_NAMES else None
    sources = Sources(snapshot=snapshot, rule=engine.suffix_rule, drafter=drafter)
    check_sources(name, sources)
    ids, core_options = engine.prepare(prompt, options)
    if name is not None:
        engine.measurements.warn_if_inexact()
    prices = engine.measurements.prices() if needs_prices(name, options.draft_width) else None
    proposer, width = speculation(name, options.draft_width, sources, prices)
    slotted = bound_to_slots(proposer, drafter, engine.drafter_for_slot)
    return Request(ids, core_options, with_forced_tokens(slotted, core_options, len(ids)), width, engine.record_output)


def with_forced_tokens(
    proposer: Proposer | SlotProposer | None, options: Options, prompt_len: int
) -> Proposer | SlotProposer | None:
    """``core.forced.forcing``: the grammar's forced tokens in front of the request's proposer, or of the proposer a
    ``SlotProposer`` binds to the sequence's slot."""
    if not isinstance(proposer, SlotProposer):
        return forcing(proposer, options, prompt_len)
    bind = proposer.bind

    def bound(slot: int) -> Proposer:
        forced = forcing(bind(slot), options, prompt_len)
        assert forced is not None  # forcing keeps a proposer a proposer
        return forced

    return SlotProposer(bound)


def bound_to_slots(
    proposer: Proposer | None, drafter: Proposer | None, for_slot: Callable[[int], Proposer] | None
) -> Proposer | SlotProposer | None:
    """``proposer`` with ``drafter`` (the Engine's own, which ``proposer`` is or holds) replaced, per sequence, by the
    drafter bound to the sequence's slot (``for_slot``; None: the drafter reads the one slot there is, as it is);
    ``proposer`` itself when it holds no drafter."""
    if proposer is None or drafter is None or for_slot is None:
        return proposer
    if proposer is drafter:
        return SlotProposer(for_slot)
    if isinstance(proposer, LookupOrDraft) and proposer.drafter is drafter:
        auto = proposer
        return SlotProposer(lambda slot: attrs.evolve(auto, drafter=for_slot(slot)))
    return proposer
